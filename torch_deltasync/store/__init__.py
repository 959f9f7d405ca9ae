"""Object stores: where versions travel between trainer and rollout replicas.

``FsspecStore`` (needs ``fsspec`` and a driver) and ``HFBucketStore`` (needs ``huggingface_hub``)
are imported lazily, on first use of the name or when :func:`open_store` meets their URI, so
``import torch_deltasync`` needs neither.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from .._moved import alias_moved as _alias_moved
from ._base import PrefixStore, Store, check_key, check_prefix
from ._local import LocalStore, file_in_the_way
from ._retry import DEFAULT_TIMEOUT_S, DeadlineStore, RetryingStore, RetryPolicy

if TYPE_CHECKING:  # pragma: no cover
    from ._fsspec import FsspecStore
    from ._hf import HFBucketStore

__all__ = [
    "Store",
    "LocalStore",
    "FsspecStore",
    "HFBucketStore",
    "PrefixStore",
    "RetryPolicy",
    "RetryingStore",
    "DeadlineStore",
    "open_store",
    "check_key",
    "check_prefix",
    "check_store",
    "file_in_the_way",
    "STORE_SCHEMES",
]

_LAZY = {"FsspecStore": "._fsspec", "HFBucketStore": "._hf"}

for _name in ("Store", "LocalStore", "PrefixStore", "RetryPolicy", "RetryingStore", "DeadlineStore", "check_key",
              "check_prefix", "file_in_the_way"):
    globals()[_name].__module__ = __name__
del _name


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        obj = getattr(importlib.import_module(_LAZY[name], __name__), name)
        obj.__module__ = __name__  # the public path; pickles resolve it through this function
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DEFAULT = object()


#: Schemes of object stores: ``<scheme>:/...`` without ``//`` is such a URI that lost a slash, not a
#: relative folder (``open_store`` refuses it).
_URI_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "hdfs", "webhdfs", "hf",
                          "memory", "http", "https"})
#: URI schemes of the object stores :func:`open_store` knows by name: ``file``, S3, Google Cloud
#: Storage, Azure, Alibaba OSS, HDFS, Hugging Face Buckets and ``memory`` (not http or https:
#: fsspec's HTTP file system can neither list nor write). Other fsspec protocols open too.
STORE_SCHEMES = (_URI_SCHEMES - {"http", "https"}) | {"file"}


def open_store(uri: "str | os.PathLike | Store", *, timeout_s: "float | None | object" = _DEFAULT,
               **options: Any) -> Store:
    """Open a store from a path or URI.

    ==============================================  ============================================
    ``uri``                                         store
    ==============================================  ============================================
    ``runs/x/bucket``, ``/abs/path``, ``~/b``       :class:`LocalStore` (a folder)
    ``file:///abs/path``                            :class:`LocalStore`
    ``hf://buckets/<namespace>/<bucket>/<prefix>``  ``HFBucketStore`` (needs ``huggingface_hub``)
    ``memory://name``                               ``FsspecStore``, in-process memory (tests)
    ``s3://bucket/prefix``, ``gs://...``, other     ``FsspecStore`` (needs ``fsspec`` + driver,
    fsspec protocols                                e.g. ``s3fs``, ``gcsfs``)
    ==============================================  ============================================

    S3 endpoint, region and credentials also come from the usual environment variables
    (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ...); Hugging Face tokens from
    ``HF_TOKEN``. ``docs/stores.md`` has the details.

    Every store call gets a deadline (``timeout_s``, default 120 s; more for calls that move
    many bytes): remote stores through their :class:`RetryPolicy`, other stores (a custom
    :class:`Store`, or a local folder given a ``timeout_s``) by a :class:`DeadlineStore` wrapper.
    A call past its deadline raises :class:`~torch_deltasync.errors.TransientStoreError` instead
    of blocking forever. Local folders have no deadline unless ``timeout_s`` is given.

    Args:
        uri: path, URI, or an existing :class:`Store` (returned as is, or wrapped in a
            :class:`DeadlineStore` when it has no deadline of its own: ``store.needs_deadline``).
        timeout_s: deadline of one store call in seconds; ``None``: none. Default: 120 s for
            remote and custom stores, none for local folders. For remote stores it sets
            ``RetryPolicy.timeout_s`` (give either ``timeout_s`` or ``retry``, not both).
        options: passed to the store: for ``LocalStore`` ``fsync``; for ``FsspecStore`` ``retry``,
            ``part_nbytes``, ``max_parallel_parts`` and fsspec storage options (``endpoint_url``,
            ``key``, ``secret``, ``client_kwargs``, ...); for ``HFBucketStore`` ``token``,
            ``endpoint``, ``retry``, ``tmp_dir``.

    Raises:
        ValueError: an unsupported or malformed URI (the message names it), options given with an
            existing store, or both ``timeout_s`` and ``retry``.
        ImportError: the driver for the URI is not installed.

    Example:
        >>> open_store("runs/x/bucket")
        LocalStore('/.../runs/x/bucket')
        >>> open_store("s3://my-bucket/runs/x", endpoint_url="http://127.0.0.1:9000")
        FsspecStore('s3://my-bucket/runs/x')
    """
    explicit = timeout_s is not _DEFAULT
    if explicit and timeout_s is not None and not (type(timeout_s) in (int, float) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    if isinstance(uri, Store):
        if options:
            raise ValueError(f"options {sorted(options)} cannot be applied to an already opened store {uri!r}")
        if not uri.needs_deadline:
            if explicit:
                raise ValueError(f"{uri!r} already has its deadline; give timeout_s when opening it "
                                 "(RetryPolicy(timeout_s=...) for remote stores)")
            return uri
        timeout = DEFAULT_TIMEOUT_S if not explicit else timeout_s
        return uri if timeout is None else DeadlineStore(uri, timeout)  # type: ignore[arg-type]
    if not isinstance(uri, (str, os.PathLike)):
        raise TypeError(f"a store is a folder path, a URI (str or os.PathLike) or a Store, got "
                        f"{type(uri).__name__} {uri!r}")
    text = os.fsdecode(uri)
    if not text.strip():
        raise ValueError(f"store {text!r} is empty: give a folder path or a URI such as s3://bucket/run "
                         "(an empty path would mean the current folder)")
    if "\x00" in text:
        raise ValueError(f"store {text!r} contains a NUL character")
    protocol, sep, rest = text.partition("://")
    lost = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)", text)
    if not sep and lost and lost.group(1).lower() in _URI_SCHEMES:  # pathlib.Path("s3://b/run") is s3:/b/run
        raise ValueError(f"{text!r} looks like a URI that lost a slash ({lost.group(1)}://...), e.g. through "
                         "pathlib.Path, which joins '//' into '/'; pass the URI as a str")
    if not sep and text.startswith("file:"):
        raise ValueError(f"{text!r}: a file URI names an absolute folder, e.g. file:///data/bucket (or give "
                         "the folder's path)")
    if not sep or protocol == "file":
        if sep and (not rest.startswith("/") or not rest.strip("/")):
            raise ValueError(f"{text!r}: a file URI names an absolute folder, e.g. file:///data/bucket")
        local = LocalStore(rest if sep else text, **options)
        return local if not explicit or timeout_s is None else DeadlineStore(local, timeout_s)  # type: ignore[arg-type]
    if explicit:
        if "retry" in options:
            raise ValueError("give either timeout_s or retry=RetryPolicy(timeout_s=...), not both")
        options["retry"] = RetryPolicy(timeout_s=timeout_s)  # type: ignore[arg-type]
    if protocol == "hf":
        if not rest.startswith("buckets/"):
            raise ValueError(
                f"{text!r}: only Hugging Face Buckets are supported as stores; expected "
                "hf://buckets/<namespace>/<bucket>[/<prefix>]"
            )
        from ._hf import HFBucketStore

        return HFBucketStore(text, **options)
    from ._fsspec import FsspecStore

    return FsspecStore(text, **options)

def check_store(uri: str | os.PathLike) -> None:
    """Check a store URI as a command line should before it starts anything, connecting to nothing:
    its form (:func:`open_store`'s rules), its driver's import, and for a local folder a file in its
    path. Opening ``s3://``, ``hf://`` and local stores builds nothing remote; other fsspec drivers
    may connect when their file system is built (adlfs, gcsfs), so only their URL is checked and
    their driver imported.

    Raises:
        ValueError: a malformed or unsupported URI (the message names it).
        ImportError: the driver for the URI is not installed (the message says what to install).
        StoreNotFoundError: a local path one of whose components is a file.
    """
    text = os.fsdecode(uri)
    scheme = text.partition("://")[0] if "://" in text else "file"
    if scheme in ("file", "s3", "s3a", "hf", "memory"):
        store = open_store(text)
        if scheme == "file":
            store.absent()
    else:
        from ._fsspec import check_fsspec_url

        check_fsspec_url(text)


_alias_moved(__name__, ("base", "local", "retry"))  # the 0.1 module paths, deprecated
