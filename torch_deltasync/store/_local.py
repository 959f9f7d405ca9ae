"""``LocalStore``: a folder on the local file system (the default store; needs no set-up)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import uuid
from pathlib import Path

from ..errors import ObjectExistsError, ObjectNotFoundError, StoreError, StoreNotFoundError
from ._base import Store, check_key, check_range

__all__ = ["LocalStore"]

# Temporary files carry this marker; `list` never returns them and a crashed writer's leftovers
# are harmless (they are never named by a manifest).
_TMP_MARK = ".tmp-"
# The whole name of one (`_write`): the key's file name, the marker, a uuid4 in hex.
_TMP_NAME = re.compile(r".+\.tmp-[0-9a-f]{32}")


# Errors of opening a key that say it names no file to read (not a failing store).
_NO_OBJECT = {errno.ENXIO: "a socket or a device without a driver", errno.ELOOP: "a symbolic link in a loop"}


def _file_kind(mode: int) -> str:
    """What a non-regular file of ``st_mode`` ``mode`` is, in words."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), f"file mode {mode:o}")


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The first component of ``path``, from the top (``path`` itself last), that exists (a
    dangling link counts) and is not a folder: what keeps ``mkdir(parents=True)`` or a file write
    at ``path`` from working. ``None`` when every component there is a folder (the rest can be made).
    """
    path = Path(path)
    for p in (*reversed(path.parents), path):
        if not (p.exists() or p.is_symlink()):
            return None
        if not p.is_dir():
            return p
    return None


class LocalStore(Store):
    """Objects as files under ``root`` (created if missing).

    ``put`` writes to a temporary file in the same directory, ``fsync``\\ s it and renames it over the
    key (``os.replace``), so a reader sees the old object or the whole new one, never a torn write;
    a writer killed mid-put leaves only an unreferenced ``*.tmp-*`` file.

    The folder is created by the first write, never by readers: a receiver started before the
    trainer sees an empty store instead of creating folders, and its "no version" errors say that
    the folder does not exist (:meth:`absent`), so a mistyped path is told apart from a run that
    has not started. A path one of whose components is a file can never become a store: every call
    raises :class:`~torch_deltasync.errors.StoreNotFoundError` naming that file.

    Nothing outside ``root`` is read or written: a key whose path leads outside through a symbolic
    link (a linked folder or file under the root) is refused with a
    :class:`~torch_deltasync.errors.StoreError`, and :meth:`list` leaves such links out.

    Calls have no deadline of their own (plain file system calls); ``open_store(path,
    timeout_s=...)`` wraps the store in a :class:`~torch_deltasync.store._retry.DeadlineStore`,
    e.g. for a network mount that may hang.

    Args:
        root: folder path (``str`` or ``Path``); ``~`` is expanded.
        fsync: flush file data (and the directory entry) to disk before returning from ``put``.
            Turn off for throw-away runs on slow disks.

    Raises:
        ValueError: an empty path, or ``~user`` naming no user of this machine.

    Example:
        >>> store = LocalStore("runs/x/bucket")
        >>> store.put("a/b.json", b"{}")
        >>> store.get("a/b.json")
        b'{}'
    """

    needs_deadline = False

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True) -> None:
        if not os.fspath(root).strip():
            raise ValueError(f"LocalStore needs a folder path, got {os.fspath(root)!r} (an empty path would mean "
                             "the current folder; give '.' for that)")
        try:
            self.root = Path(root).expanduser().resolve()
        except RuntimeError as e:  # Path.expanduser: "Could not determine home directory."
            raise ValueError(f"LocalStore {os.fspath(root)!r}: {e} (no such user here); give the folder's path "
                             "without ~user") from None
        self.fsync = fsync

    def _inside(self, path: Path) -> bool:
        return path == self.root or self.root in path.parents

    def _path(self, key: str, *, follow_last: bool = True) -> Path:
        """The file of ``key``, after checking that no symbolic link on the way leads outside the
        root (``follow_last=False``: the key's own entry may be a link; only its folder is checked)."""
        path = self.root / check_key(key)
        real = Path(os.path.realpath(path if follow_last else path.parent))
        if not self._inside(real):
            raise StoreError(
                f"{self.describe()}: {key!r} leads outside the store through a symbolic link (to {real}); "
                "refusing to follow it: nothing outside the store's folder is read or written"
            )
        return path

    def _os_error(self, op: str, key: str, path: Path, e: OSError) -> StoreError:
        """A :class:`StoreError` for ``e`` that names a file standing where a folder must be."""
        blocker = file_in_the_way(path.parent) if isinstance(e, (NotADirectoryError, FileExistsError)) else None
        if blocker is not None and not (self.root in blocker.parents):
            return StoreNotFoundError(
                f"{self.describe()}: cannot {op} {key!r}: {blocker} is a file, not a folder, so no store can be "
                "there; check the path")
        if blocker is not None:
            return StoreError(f"{self.describe()}: cannot {op} {key!r}: {blocker} (inside the store) is a file, "
                              "not a folder")
        return StoreError(f"{self.describe()}: cannot {op} {key!r}: {type(e).__name__}: {e}")

    def describe(self) -> str:
        return f"file://{self.root}"

    def absent(self) -> str | None:
        """``"the folder ... does not exist"`` when the root is missing, else ``None``.

        Raises:
            StoreNotFoundError: a component of the root's path is a file.
        """
        if self.root.is_dir():
            return None
        blocker = file_in_the_way(self.root)
        if blocker is not None:
            raise StoreNotFoundError(f"{self.describe()}: {blocker} is a file, not a folder, so no store can be "
                                     "there; check the path")
        return f"the folder {self.root} does not exist"

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
            with contextlib.suppress(OSError):  # the clean-up must not hide the real error
                tmp.unlink(missing_ok=True)
            raise self._os_error("write", key, path, e) from e

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``key`` (``[start, end)`` of them, clipped to the file).

        Raises:
            ObjectNotFoundError: no such object, or ``key`` is not a regular file (a folder, a FIFO,
                a device, a socket: opened without blocking and refused, as :meth:`list` and
                :meth:`exists` leave it out).
            StoreError: the read failed.
            TypeError, ValueError: a bad byte range (:func:`~._base.check_range`).
        """
        check_range(key, start, end)
        path = self._path(key)
        try:
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):  # not an object (list and exists leave it out too)
                    raise ObjectNotFoundError(f"{self.describe()}: {key!r} is not a regular file "
                                              f"({_file_kind(st.st_mode)}), so no object; remove it")
                os.set_blocking(fd, True)
                f = open(fd, "rb")  # owns fd from here
            except BaseException:
                os.close(fd)
                raise
            with f:
                if start is None and end is None:
                    return f.read()
                start = start or 0
                f.seek(start)
                # never more than the file holds: ``end`` may come from an untrusted manifest
                return f.read(max(0, min(st.st_size if end is None else end, st.st_size) - start))
        except ObjectNotFoundError:
            raise
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.describe()}: no object {key!r}") from None
        except NotADirectoryError as e:  # a file where a folder of the key would be
            err = self._os_error("read", key, path, e)
            if isinstance(err, StoreNotFoundError):
                raise err from e
            raise ObjectNotFoundError(f"{self.describe()}: no object {key!r}") from None
        except OSError as e:
            if e.errno in _NO_OBJECT:  # a socket, a link in a loop: no object (list leaves them out)
                raise ObjectNotFoundError(f"{self.describe()}: {key!r} is {_NO_OBJECT[e.errno]}, so no object; "
                                          "remove it") from None
            raise self._os_error("read", key, path, e) from e

    def exists(self, key: str) -> bool:
        path = self._path(key)
        if not self.root.is_dir():
            self.absent()  # raises when a file stands where the folder should be
        return path.is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            return path.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            if not self.root.is_dir():
                self.absent()
            raise ObjectNotFoundError(f"{self.describe()}: no object {key!r}") from None
        except OSError as e:
            raise self._os_error("stat", key, path, e) from e

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix``, sorted; temporary files, links leading outside the root (or
        dangling, or in a loop) and what is not a regular file (FIFOs, sockets, devices) are left
        out. A missing root lists nothing (see :meth:`absent`); a folder removed while it is listed
        (retention, another process's ``delete``) lists what it held when it was read, or nothing.

        Raises:
            StoreError: a folder could not be read (naming the store, prefix and cause).
        """
        base = self.root / check_key(prefix, allow_empty=True) if prefix else self.root
        if not base.is_dir():
            if not self.root.is_dir():
                self.absent()  # raises when a file stands where the folder should be
            return []
        if not self._inside(Path(os.path.realpath(base))):
            return []  # the prefix itself is a link to elsewhere
        out = []
        stack = [base]
        while stack:
            for entry in self._entries(stack.pop(), prefix):
                # links leading outside, dangling or in a loop name nothing to read here
                if entry.is_symlink() and (not os.path.exists(entry.path)
                                           or not self._inside(Path(os.path.realpath(entry.path)))):
                    continue
                if entry.is_dir():
                    if not entry.is_symlink():  # like os.walk: linked folders are not descended
                        stack.append(Path(entry.path))
                elif entry.is_file() and _TMP_MARK not in entry.name:  # no FIFOs, sockets, devices
                    out.append(Path(entry.path).relative_to(self.root).as_posix())
        return sorted(out)

    def _entries(self, folder: Path, prefix: str) -> list[os.DirEntry]:
        """The entries of ``folder`` for :meth:`list`: none when it was removed (or replaced) since it
        was seen, here or (NFS) on another host.

        Raises:
            StoreError: it could not be read.
        """
        try:
            with os.scandir(folder) as entries:
                return list(entries)
        except OSError as e:
            if isinstance(e, (FileNotFoundError, NotADirectoryError)) or e.errno == errno.ESTALE:
                return []
            raise self._os_error("list", prefix, folder, e) from e

    def delete(self, key: str) -> None:
        """Remove ``key`` (a link itself, never what it points to), and the folders it leaves empty
        (up to the root)."""
        path = self._path(key, follow_last=False)
        try:
            path.unlink(missing_ok=True)
        except NotADirectoryError:
            return  # a file where a folder of the key would be: the key cannot exist
        except OSError as e:
            raise self._os_error("delete", key, path, e) from e
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()  # only succeeds when empty; a concurrent writer just recreates it
            except OSError:
                break
            parent = parent.parent

    def sweep_temporaries(self, older_than_s: float = 3600.0, prefix: str = "") -> int:
        """Delete temporary files of crashed writers older than ``older_than_s`` seconds (never
        named by a manifest; a live writer's temporary file is younger). Returns how many.

        Only files named as :meth:`put` names them (``<name>.tmp-<32 hex digits>``) are
        deleted; :func:`~torch_deltasync.retention.collect_garbage` calls this only on a prefix
        that holds a run."""
        import time

        base = self.root / check_key(prefix, allow_empty=True) if prefix else self.root
        if not base.is_dir():
            return 0
        cutoff, removed = time.time() - older_than_s, 0
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                p = Path(dirpath, name)
                try:
                    if _TMP_NAME.fullmatch(name) and p.stat().st_mtime < cutoff:
                        p.unlink()
                        removed += 1
                except OSError:
                    pass
        return removed
