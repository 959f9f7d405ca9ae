"""``LocalStore``: a folder on the local file system (the default store; needs no set-up)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ..errors import ObjectExistsError, ObjectNotFoundError, StoreError
from .base import Store, check_key

__all__ = ["LocalStore"]

# Temporary files carry this marker; `list` never returns them and a crashed writer's leftovers
# are harmless (they are never named by a manifest).
_TMP_MARK = ".tmp-"


class LocalStore(Store):
    """Objects as files under ``root`` (created if missing).

    ``put`` writes to a temporary file in the same directory, ``fsync``\\ s it and renames it over the
    key (``os.replace``), so a reader sees the old object or the whole new one, never a torn write;
    a writer killed mid-put leaves only an unreferenced ``*.tmp-*`` file.

    The folder is created by the first write, never by readers: a receiver or ``deltasync ls``
    pointed at a mistyped path sees an empty store instead of creating folders.

    Args:
        root: folder path (``str`` or ``Path``); ``~`` is expanded.
        fsync: flush file data (and the directory entry) to disk before returning from ``put``.
            Turn off for throw-away runs on slow disks.

    Example:
        >>> store = LocalStore("runs/x/bucket")
        >>> store.put("a/b.json", b"{}")
        >>> store.get("a/b.json")
        b'{}'
    """

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fsync = fsync

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def describe(self) -> str:
        return f"file://{self.root}"

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def put(self, key: str, data: bytes) -> None:
        self._write(key, data, exclusive=False)

    def put_new(self, key: str, data: bytes) -> None:
        """Atomic create-if-absent: the complete temporary file is hard-linked to the key, which
        fails if the key exists (``link`` never replaces), so of two writers exactly one wins."""
        self._write(key, data, exclusive=True)

    def _write(self, key: str, data: bytes, *, exclusive: bool) -> None:
        path = self._path(key)
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{uuid.uuid4().hex}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise ObjectExistsError(f"{self.describe()}: {key!r} already exists") from None
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                os.replace(tmp, path)
            if self.fsync:
                dfd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except ObjectExistsError:
            raise
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{self.describe()}: cannot write {key!r}: {e}") from e

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if start is None and end is None:
                    return f.read()
                start = start or 0
                f.seek(start)
                return f.read(-1 if end is None else max(0, end - start))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.describe()}: no object {key!r}") from None
        except OSError as e:
            raise StoreError(f"{self.describe()}: cannot read {key!r}: {e}") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.describe()}: no object {key!r}") from None

    def list(self, prefix: str = "") -> list[str]:
        base = self.root / check_key(prefix, allow_empty=True) if prefix else self.root
        if not base.is_dir():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if _TMP_MARK in name:
                    continue
                out.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(out)

    def delete(self, key: str) -> None:
        """Remove ``key``, and the folders it leaves empty (up to the root)."""
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise StoreError(f"{self.describe()}: cannot delete {key!r}: {e}") from e
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()  # only succeeds when empty; a concurrent writer just recreates it
            except OSError:
                break
            parent = parent.parent

    def sweep_temporaries(self, older_than_s: float = 3600.0, prefix: str = "") -> int:
        """Delete temporary files of crashed writers older than ``older_than_s`` seconds (never
        named by a manifest; a live writer's temporary file is younger). Returns how many."""
        import time

        base = self.root / check_key(prefix, allow_empty=True) if prefix else self.root
        if not base.is_dir():
            return 0
        cutoff, removed = time.time() - older_than_s, 0
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                p = Path(dirpath, name)
                try:
                    if _TMP_MARK in name and p.stat().st_mtime < cutoff:
                        p.unlink()
                        removed += 1
                except OSError:
                    pass
        return removed
