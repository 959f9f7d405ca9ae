"""Object stores: where versions travel between trainer and rollout replicas."""

from __future__ import annotations

import os
from typing import Any

from .base import PrefixStore, Store, check_key
from .local import LocalStore

__all__ = ["Store", "LocalStore", "PrefixStore", "open_store", "check_key"]


def open_store(uri: "str | os.PathLike | Store", **storage_options: Any) -> Store:
    """Open a store from a path or URI.

    ========================================  ===========================================
    ``uri``                                   store
    ========================================  ===========================================
    ``runs/x/bucket``, ``/abs/path``          :class:`LocalStore` (a folder)
    ``file:///abs/path``                      :class:`LocalStore`
    ``memory://name``                         in-process fsspec memory file system (tests)
    ``s3://bucket/prefix`` and other fsspec   ``FsspecStore`` (needs ``fsspec`` + driver)
    ========================================  ===========================================

    Args:
        uri: path, URI, or an existing :class:`Store` (returned as is).
        storage_options: passed to the fsspec file system (e.g. ``endpoint_url=...``).

    Raises:
        ValueError: an unsupported or malformed URI.
    """
    if isinstance(uri, Store):
        return uri
    text = os.fspath(uri)
    if "://" not in text:
        return LocalStore(text, **storage_options)
    protocol, _, rest = text.partition("://")
    if protocol == "file":
        return LocalStore(rest or "/", **storage_options)
    from ._fsspec import FsspecStore

    return FsspecStore(text, **storage_options)
