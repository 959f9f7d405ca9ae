"""The error hierarchy (``errors.py``): every error is a :class:`DeltaSyncError` and the builtin it
refines, so ``except ValueError`` / ``except FileNotFoundError`` / ``except OSError`` keep working,
and ``errors.__all__`` lists every one of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from torch_deltasync import errors
from torch_deltasync.errors import DeltaSyncError

#: error -> its direct bases, in order (the builtin each one refines is part of its contract).
BASES = {
    "CorruptObjectError": ("DeltaSyncError", "ValueError"),
    "ChecksumMismatchError": ("CorruptObjectError",),
    "VersionNotFoundError": ("DeltaSyncError", "FileNotFoundError"),
    "IncompatibleTargetError": ("DeltaSyncError", "ValueError"),
    "UnsupportedLayoutError": ("DeltaSyncError", "NotImplementedError"),
    "StaleUpdateError": ("DeltaSyncError", "RuntimeError"),
    "StoreError": ("DeltaSyncError", "OSError"),
    "PublishError": ("DeltaSyncError", "RuntimeError"),
    "PrefixInUseError": ("PublishError",),
    "ObjectNotFoundError": ("StoreError", "FileNotFoundError"),
    "StoreNotFoundError": ("StoreError", "FileNotFoundError"),
    "ObjectExistsError": ("StoreError", "FileExistsError"),
    "TransientStoreError": ("StoreError",),
    "EpisodeError": ("DeltaSyncError", "ValueError"),
    "RolloutServiceError": ("DeltaSyncError", "RuntimeError"),
    "ServiceClosedError": ("RolloutServiceError",),
    "WorkerError": ("DeltaSyncError", "RuntimeError"),
    "SyncTimeoutError": ("DeltaSyncError", "TimeoutError"),
}


def _defined_here() -> dict[str, type]:
    """The classes ``errors.py`` defines (read from its source: the root re-exports
    :class:`DeltaSyncError` under its own path, so ``__module__`` cannot tell)."""
    tree = ast.parse(Path(errors.__file__).read_text())
    return {node.name: getattr(errors, node.name) for node in tree.body if isinstance(node, ast.ClassDef)}


def test_all_lists_every_error_defined_here_once():
    defined = _defined_here()
    assert all(issubclass(c, BaseException) for c in defined.values())
    assert sorted(errors.__all__) == sorted(defined)
    assert len(set(errors.__all__)) == len(errors.__all__)
    assert errors.__all__[0] == "DeltaSyncError"


def test_the_table_covers_every_error():
    assert set(BASES) | {"DeltaSyncError"} == set(_defined_here())


def test_the_base_is_a_plain_exception():
    assert DeltaSyncError.__bases__ == (Exception,)


@pytest.mark.parametrize("name", sorted(BASES))
def test_each_error_has_its_documented_bases(name):
    cls = getattr(errors, name)
    assert tuple(b.__name__ for b in cls.__bases__) == BASES[name]
    assert issubclass(cls, DeltaSyncError)
    assert cls.__doc__ and cls.__doc__.strip()  # each says when it is raised


CAUGHT_AS = [
    ("CorruptObjectError", ValueError, "a malformed object is bad input"),
    ("ChecksumMismatchError", ValueError, "a checksum mismatch is a corrupt object"),
    ("IncompatibleTargetError", ValueError, "a model that does not match"),
    ("EpisodeError", ValueError, "a malformed episode"),
    ("VersionNotFoundError", FileNotFoundError, "no such version"),
    ("ObjectNotFoundError", FileNotFoundError, "no such key"),
    ("StoreNotFoundError", FileNotFoundError, "no such bucket"),
    ("ObjectExistsError", FileExistsError, "put_new on a taken key"),
    ("TransientStoreError", OSError, "a store failure is an I/O error"),
    ("UnsupportedLayoutError", NotImplementedError, "a layout not implemented"),
    ("SyncTimeoutError", TimeoutError, "waiting timed out"),
    ("PrefixInUseError", RuntimeError, "a publish refused"),
    ("ServiceClosedError", RuntimeError, "the service refused"),
]


@pytest.mark.parametrize("name, builtin, reason", CAUGHT_AS, ids=[r for *_, r in CAUGHT_AS])
def test_callers_catching_the_builtin_still_catch_it(name, builtin, reason):
    cls = getattr(errors, name)
    with pytest.raises(builtin) as caught:
        raise cls("versions/000000000007.json: bad")
    assert type(caught.value) is cls and str(caught.value) == "versions/000000000007.json: bad"
    with pytest.raises(DeltaSyncError):
        raise cls("x")


def test_errors_that_are_not_value_errors():
    # Catching ValueError must not swallow store failures or timeouts (they may succeed later).
    for name in ("StoreError", "TransientStoreError", "VersionNotFoundError", "SyncTimeoutError", "PublishError"):
        assert not issubclass(getattr(errors, name), ValueError), name


def test_oserror_subclasses_keep_errno_arguments():
    e = errors.ObjectNotFoundError(2, "No such file", "versions/000000000001.json")
    assert (e.errno, e.strerror, e.filename) == (2, "No such file", "versions/000000000001.json")


def test_errors_pickle_to_the_same_class_and_message():
    import pickle

    for name in errors.__all__:
        cls = getattr(errors, name)
        back = pickle.loads(pickle.dumps(cls("version 3: msg")))
        assert type(back) is cls and str(back) == "version 3: msg", name


def test_interrupted_tells_a_ctrl_c_in_disguise():
    def raised(outer, inner):
        try:
            try:
                raise inner
            except BaseException as e:
                raise outer from e
        except BaseException as e:
            return e

    assert errors.interrupted(KeyboardInterrupt())
    assert errors.interrupted(raised(SystemError("returned a result with an exception set"), KeyboardInterrupt()))
    assert not errors.interrupted(raised(SystemError("x"), ValueError()))
    assert not errors.interrupted(raised(RuntimeError("x"), KeyboardInterrupt()))  # only numba's SystemError
    loop = ValueError("a")
    loop.__context__ = loop  # a chain that loops back ends
    assert list(errors.exception_chain(loop)) == [loop] and not errors.interrupted(loop)
