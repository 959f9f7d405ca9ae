"""``FsspecStore``: any fsspec file system (``memory://``, ``s3://``, ``gs://`` ...).

fsspec (and the protocol driver, e.g. ``s3fs``) is imported only when such a store is opened, so
installs that only use local folders never need it; a missing driver raises fsspec's own
``ImportError`` naming the package to install.
"""

from __future__ import annotations

from typing import Any

from ..errors import ObjectNotFoundError, StoreError
from .base import Store, check_key

__all__ = ["FsspecStore"]


class FsspecStore(Store):
    """Objects under ``root`` of an fsspec file system.

    Object stores (S3, GCS) make a single PUT atomic, so ``put`` writes the key directly.

    Args:
        url: ``protocol://bucket/prefix`` (e.g. ``memory://runs/x``, ``s3://my-bucket/runs/x``).
        storage_options: passed to ``fsspec.filesystem`` (e.g. ``endpoint_url``, ``key``, ``secret``).
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        import fsspec

        protocol, _, path = url.partition("://")
        if not _:
            raise ValueError(f"expected protocol://path, got {url!r}")
        self.url = url.rstrip("/")
        self.protocol = protocol
        self.fs = fsspec.filesystem(protocol, **storage_options)
        self.root = path.strip("/")

    def describe(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _full(self, path: str) -> str:
        # memory:// roots are absolute paths inside the in-process file system
        return "/" + path if self.protocol == "memory" else path

    def put(self, key: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._full(self._path(key)), bytes(data))
        except Exception as e:  # noqa: BLE001 - drivers raise many types; we name store, key, cause
            raise StoreError(f"{self.describe()}: cannot write {key!r}: {type(e).__name__}: {e}") from e

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        path = self._full(self._path(key))
        try:
            return self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.describe()}: no object {key!r}") from None
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"{self.describe()}: cannot read {key!r}: {type(e).__name__}: {e}") from e

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.isfile(self._full(self._path(key))))
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"{self.describe()}: cannot stat {key!r}: {type(e).__name__}: {e}") from e

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self._full(self._path(key))))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.describe()}: no object {key!r}") from None

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        root = self._full(self.root).rstrip("/")
        try:
            found = self.fs.find(self._full(base))
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"{self.describe()}: cannot list {prefix!r}: {type(e).__name__}: {e}") from e
        out = []
        for p in found:
            p = p if p.startswith("/") or self.protocol != "memory" else "/" + p
            rel = p[len(root):].lstrip("/") if root else p.lstrip("/")
            if rel:
                out.append(rel)
        return sorted(out)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._full(self._path(key)))
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"{self.describe()}: cannot delete {key!r}: {type(e).__name__}: {e}") from e
