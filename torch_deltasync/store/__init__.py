"""Object stores: where versions travel between trainer and rollout replicas.

``FsspecStore`` (needs ``fsspec`` and a driver) and ``HFBucketStore`` (needs ``huggingface_hub``)
are imported lazily, on first use of the name or when :func:`open_store` meets their URI, so
``import torch_deltasync`` needs neither.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .base import PrefixStore, Store, check_key
from .local import LocalStore
from .retry import RetryingStore, RetryPolicy

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
    "open_store",
    "check_key",
]

_LAZY = {"FsspecStore": "._fsspec", "HFBucketStore": "._hf"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(uri: "str | os.PathLike | Store", **options: Any) -> Store:
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

    Args:
        uri: path, URI, or an existing :class:`Store` (returned as is).
        options: passed to the store: for ``LocalStore`` ``fsync``; for ``FsspecStore`` ``retry``,
            ``part_nbytes``, ``max_parallel_parts`` and fsspec storage options (``endpoint_url``,
            ``key``, ``secret``, ``client_kwargs``, ...); for ``HFBucketStore`` ``token``,
            ``endpoint``, ``retry``, ``tmp_dir``.

    Raises:
        ValueError: an unsupported or malformed URI, or options given with an existing store.
        ImportError: the driver for the URI is not installed.

    Example:
        >>> open_store("runs/x/bucket")
        LocalStore('/.../runs/x/bucket')
        >>> open_store("s3://my-bucket/runs/x", endpoint_url="http://127.0.0.1:9000")
        FsspecStore('s3://my-bucket/runs/x')
    """
    if isinstance(uri, Store):
        if options:
            raise ValueError(f"options {sorted(options)} cannot be applied to an already opened store {uri!r}")
        return uri
    text = os.fspath(uri)
    if "://" not in text:
        return LocalStore(text, **options)
    protocol, _, rest = text.partition("://")
    if protocol == "file":
        if not rest.startswith("/") or not rest.strip("/"):
            raise ValueError(f"{text!r}: a file URI names an absolute folder, e.g. file:///data/bucket")
        return LocalStore(rest, **options)
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
