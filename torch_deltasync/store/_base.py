"""The ``Store`` interface: a flat key -> bytes object store with atomic puts.

Keys are relative POSIX paths (``objects/000000000007/delta-r00000-of00001.safetensors``). Store
contents are untrusted, so every key is validated before use (:func:`check_key`): no absolute paths,
no ``..``, no empty segments, no backslashes or control characters. Nothing outside a store's root
(and a run's prefix, see :meth:`Store.sub`) is ever read or written.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from abc import abstractmethod
from typing import Protocol, runtime_checkable

from ..errors import CorruptObjectError, exception_chain

__all__ = ["Store", "PrefixStore", "check_key", "check_prefix", "join_key", "driver_import_error", "exception_chain", "root_cause"]

_SEGMENT = re.compile(r"[A-Za-z0-9._=+@,-]+")


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of :func:`exception_chain`."""
    *_, last = exception_chain(error)
    return last


def driver_import_error(uri: str, package: str, error: ImportError, fix: str = "pip install 'torch-deltasync[remote]'") -> ImportError:
    """The ``ImportError`` to raise when the package a store needs (``package``: ``s3fs``,
    ``fsspec``, ``huggingface_hub``, ...) failed to import while opening ``uri``.

    It names the store, the package, this interpreter (``sys.executable``: a vLLM engine's workers
    may run another environment than the trainer) and what to do: install it (``fix``), or, when the
    package is installed but one of its own imports fails (a broken install, which fsspec reports as
    "Install s3fs to access S3"), the module that failed.
    """
    cause = root_cause(error)
    try:
        installed = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
        installed = False
    where = f"this environment ({sys.executable})"
    if installed:
        return ImportError(f"store {uri!r} needs {package}, which is installed in {where} but fails to import: "
                           f"{type(cause).__name__}: {cause}; repair that environment ({fix} there)")
    return ImportError(f"store {uri!r} needs {package}, which is not installed in {where}: {fix} there")


def _key_problem(key: str) -> str | None:
    """What makes ``key`` (a non-empty string) no plain relative path, or ``None``."""
    if len(key) > 1024:
        return f"{len(key)} characters, at most 1024"
    if key.startswith("/"):
        return "absolute (keys are relative to the store root)"
    if key.endswith("/"):
        return "ends with '/' (keys name objects, not folders)"
    for seg in key.split("/"):
        if seg in ("", ".", "..") or not _SEGMENT.fullmatch(seg):
            return (f"segment {seg[:40]!r} is not allowed (no '..', '.', empty segments, absolute paths or "
                    "special characters: letters, digits and ._=+@,- only)")
    return None


def check_key(key: object, *, allow_empty: bool = False) -> str:
    """Validate an untrusted store key and return it.

    Raises:
        CorruptObjectError: the key is not a plain relative path (absolute, ``..``, ``.``, empty
            segments, backslashes, characters outside ``[A-Za-z0-9._=+@,-]``, or longer than 1024).
    """
    if not isinstance(key, str):
        raise CorruptObjectError(f"store key must be a string, got {type(key).__name__}")
    if key == "" and allow_empty:
        return key
    if not key:
        raise CorruptObjectError("invalid store key '': empty (keys are non-empty relative paths)")
    problem = _key_problem(key)
    if problem is not None:
        shown = repr(key) if len(key) <= 1024 else f"{key[:40]!r}..."
        raise CorruptObjectError(f"invalid store key {shown}: {problem}")
    return key


def check_prefix(prefix: str, what: str) -> str:
    """A path inside a store that a user gave (a store URI's bucket and prefix, a run's
    ``prefix=``), checked like a key (:func:`check_key`; empty is allowed).

    Raises:
        TypeError: ``prefix`` is not a string (naming ``what``).
        ValueError: naming ``what`` (e.g. ``"store 's3://b/../x'"``), when it is not a plain
            relative path: bad user input, not a corrupt store (:func:`check_key` raises
            :class:`~torch_deltasync.errors.CorruptObjectError` for keys read from a store).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"{what}: a path inside a store is a string, got {type(prefix).__name__} {prefix!r}")
    problem = _key_problem(prefix) if prefix else None
    if problem is not None:
        raise ValueError(f"{what}: {prefix[:80]!r} is not a valid path inside a store: {problem}")
    return prefix


def check_range(key: str, start: object, end: object) -> None:
    """The byte range ``[start, end)`` of a :meth:`Store.get` of ``key``: ``None`` or ints >= 0.

    Raises:
        TypeError: a bound that is neither ``None`` nor an int.
        ValueError: a negative bound.
    """
    for what, v in (("start", start), ("end", end)):
        if v is not None and (isinstance(v, bool) or not hasattr(type(v), "__index__")):
            raise TypeError(f"get({key!r}): {what} must be an int >= 0 or None, got {type(v).__name__} {v!r}")
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ValueError(f"get({key!r}): the byte range must be non-negative, got [{start}, {end})")


def _sub_prefix(store: "Store", prefix: object) -> str:
    """The checked ``prefix`` of :meth:`Store.sub` (a trailing ``/`` dropped; ``""``: the store itself).

    Raises:
        TypeError, ValueError: as :meth:`Store.sub`.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"a store prefix is a string, got {type(prefix).__name__} {prefix!r}")
    prefix = prefix.rstrip("/") if prefix.strip("/") else ""
    return check_prefix(prefix, f"prefix of {store.describe()}") if prefix else ""


def join_key(prefix: str, key: str) -> str:
    """``prefix/key`` with an empty prefix allowed; both parts are validated."""
    check_key(prefix, allow_empty=True)
    check_key(key)
    return f"{prefix}/{key}" if prefix else key


@runtime_checkable
class Store(Protocol):
    """A flat object store.

    A protocol: any object with these members is a store (``isinstance`` checks them); subclass it
    to inherit the defaults (``put_new``, ``size``, ``delete_many``, ``sub``, ``describe``, ...) and to
    have the abstract members enforced.

    Implementations: :class:`~torch_deltasync.LocalStore` (a folder, the default),
    ``FsspecStore`` (``memory://``, ``s3://`` and other fsspec protocols) and ``HFBucketStore``
    (Hugging Face Buckets). Every method raises :class:`~torch_deltasync.errors.StoreError` (or its
    subclass :class:`~torch_deltasync.errors.ObjectNotFoundError`) naming the store, key and cause.
    """

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically: a reader sees the old object, or all of the new one.

        Raises:
            StoreError: the write failed (naming the store, key and cause).
        """

    def put_new(self, key: str, data: bytes) -> None:
        """Like :meth:`put`, but only if ``key`` does not exist yet (manifests are immutable).

        Atomic where the backend offers it (:class:`LocalStore`: ``link``; S3: a conditional PUT
        with ``If-None-Match: *``); elsewhere an existence check followed by a put (a race between
        two writers can then go unnoticed).

        Raises:
            ObjectExistsError: the key already exists.
        """
        from ..errors import ObjectExistsError

        if self.exists(key):
            raise ObjectExistsError(f"{self.describe()}: {key!r} already exists")
        self.put(key, data)

    @abstractmethod
    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        """Read the object, or the byte range ``[start, end)`` of it (clipped to the object).

        Raises:
            TypeError, ValueError: ``start`` or ``end`` is not ``None`` or an int >= 0
                (:func:`check_range`).
            ObjectNotFoundError: the key does not exist.
            StoreError: the read failed (naming the store, key and cause).
        """

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists.

        Raises:
            StoreError: the store could not tell (naming the store, key and cause).
        """

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys under ``prefix`` (recursive), relative to the store root, sorted; objects only
        (no folders or folder markers).

        Raises:
            StoreError: the listing failed (naming the store, prefix and cause); a remote bucket
                that does not exist: its subclass ``StoreNotFoundError`` (a missing local folder
                lists as empty).
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error.

        Raises:
            StoreError: the delete failed (naming the store, key and cause).
        """

    def size(self, key: str) -> int:
        """Size of the object in bytes (default: reads it)."""
        return len(self.get(key))

    def delete_many(self, keys: list[str]) -> None:
        """Remove every key of ``keys`` (missing keys are not an error), in order.

        Stores with a batch delete (S3 ``DeleteObjects``, a Hugging Face bucket batch) override this
        with fewer round trips; the order is then only guaranteed between calls, so callers that
        need one key gone before another (retention: manifests before objects) use two calls.
        """
        for key in keys:
            self.delete(key)

    def sweep_temporaries(self, older_than_s: float = 3600.0, prefix: str = "") -> int:
        """Delete leftovers of crashed writers older than ``older_than_s`` seconds; returns how
        many. Object stores have none (a PUT is all or nothing): the default does nothing."""
        return 0

    def sub(self, prefix: str) -> "Store":
        """A view of this store rooted at ``prefix`` (several runs can share one store): a relative
        path (``"runs/grpo-7"``; a trailing ``/`` is dropped; ``""``: this store).

        Raises:
            TypeError: ``prefix`` is not a string.
            ValueError: ``prefix`` is not a plain relative path (absolute, ``..``, ...).
        """
        prefix = _sub_prefix(self, prefix)
        return PrefixStore(self, prefix) if prefix else self

    def describe(self) -> str:
        """Short human-readable name used in error messages (e.g. ``file:///data/bucket``)."""
        return repr(self)

    def absent(self) -> str | None:
        """Why this store holds nothing at all, when its root itself is missing (``"the folder
        /data/bucket does not exist"``), else ``None``. Readers that find no version add it to
        their message, so a mistyped path reads differently from a run that has not started.

        The default is ``None``; stores whose every call fails when the root is missing (an S3
        bucket: :class:`~torch_deltasync.errors.StoreNotFoundError`) need not override it.
        """
        return None

    #: Whether :func:`~torch_deltasync.open_store` must wrap this store in a
    #: :class:`~torch_deltasync.store._retry.DeadlineStore` so that no call can block forever. The
    #: built-in stores set it to ``False``: remote ones run every call under a
    #: :class:`~torch_deltasync.store.RetryPolicy` deadline, and ``LocalStore`` makes plain file
    #: system calls (give it one with ``open_store(path, timeout_s=...)``).
    needs_deadline: bool = True


class PrefixStore(Store):
    """Every key of ``inner`` under ``prefix/``, seen as a store of its own."""

    def __init__(self, inner: Store, prefix: str) -> None:
        self.inner = inner
        self.prefix = check_key(prefix)

    def _k(self, key: str) -> str:
        return join_key(self.prefix, key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(self._k(key), data)

    def put_new(self, key: str, data: bytes) -> None:
        self.inner.put_new(self._k(key), data)

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get(self._k(key), start=start, end=end)

    def exists(self, key: str) -> bool:
        return self.inner.exists(self._k(key))

    def list(self, prefix: str = "") -> list[str]:
        full = join_key(self.prefix, prefix) if prefix else self.prefix
        n = len(self.prefix) + 1
        return [k[n:] for k in self.inner.list(full) if k.startswith(self.prefix + "/")]

    def delete(self, key: str) -> None:
        self.inner.delete(self._k(key))

    def delete_many(self, keys: list[str]) -> None:
        self.inner.delete_many([self._k(k) for k in keys])

    def size(self, key: str) -> int:
        return self.inner.size(self._k(key))

    def sweep_temporaries(self, older_than_s: float = 3600.0, prefix: str = "") -> int:
        full = join_key(self.prefix, prefix) if prefix else self.prefix
        return self.inner.sweep_temporaries(older_than_s, full)

    def sub(self, prefix: str) -> Store:
        prefix = _sub_prefix(self, prefix)
        return PrefixStore(self.inner, join_key(self.prefix, prefix)) if prefix else self

    def describe(self) -> str:
        return f"{self.inner.describe().rstrip('/')}/{self.prefix}"

    def absent(self) -> str | None:
        return self.inner.absent()

    @property
    def needs_deadline(self) -> bool:  # type: ignore[override]
        return self.inner.needs_deadline

    def __repr__(self) -> str:
        return f"PrefixStore({self.inner!r}, {self.prefix!r})"
