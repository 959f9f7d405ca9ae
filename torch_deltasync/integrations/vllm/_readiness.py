"""Readiness files of the ``deltasync`` backend's workers, and what a driver remembers about an
engine it attached (the run, the readiness directory, how many workers write there).

Every worker keeps ``<status_dir>/rank-<r>.json`` = ``{"held", "staged", "kept", "newest", "error",
"time"}`` current (written atomically by the backend), so a driver on the same host can pause an
engine only once every worker has staged the version it is about to commit: the pause then covers
the commit alone. ``staged`` is the newest staged version, ``kept`` the one it replaced (still
committable without staging, until the next version starts staging).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._units import check_seconds
from ...errors import DeltaSyncError, SyncTimeoutError, VersionNotFoundError

log = logging.getLogger(__name__)

#: Default bound on :func:`wait_staged` inside ``update_*`` (seconds). Past it the update goes on
#: and the workers prepare the version inside the pause (correct, only slower).
DEFAULT_STAGE_TIMEOUT_S = 60.0


def read_readiness(status_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every worker's readiness file in ``status_dir``: ``{"rank-<r>": {"held", "staged", "kept",
    "newest", "error", "time"}}`` (format: the ``deltasync`` backend's module docstring; workers replace
    their file atomically, so a read never sees half of one).

    Raises:
        DeltaSyncError: a readiness file that is not a JSON object.
    """
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(status_dir).glob("rank-*.json")):
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise DeltaSyncError(f"{path}: unreadable readiness file ({e}); is {status_dir} shared with "
                                 "something other than one engine's deltasync workers?") from e
        if not isinstance(state, dict):
            raise DeltaSyncError(f"{path}: a readiness file holds a JSON object, got {type(state).__name__}")
        out[path.stem] = state
    return out


def _version_field(state: dict[str, Any], key: str) -> int | None:
    """A version field of a readiness file: an int, else ``None`` (a float, a string or ``true`` is
    not a version the backend writes)."""
    v = state.get(key)
    return v if type(v) is int else None


def _staged(state: dict[str, Any], version: int) -> bool:
    """Whether a worker's readiness says ``version`` is staged there (the newest staged or the kept one)."""
    return version in (_version_field(state, "staged"), _version_field(state, "kept"))


def _ready(state: dict[str, Any], version: int) -> bool:
    """A worker is ready for ``version`` when it staged (or kept) or holds it; when it staged a newer one (its
    stager stages only the newest version, so waiting would not make it stage this one: the commit
    prepares it inside the pause); or when it has seen the version and reports a staging error
    (then the commit prepares it again and raises the reason)."""
    held, staged, newest = (_version_field(state, k) for k in ("held", "staged", "newest"))
    if _staged(state, version) or (held is not None and held >= version):
        return True
    if staged is not None and staged > version:
        return True
    return bool(state.get("error")) and newest is not None and newest >= version


def wait_staged(status_dir: str | os.PathLike, version: int, timeout_s: float = DEFAULT_STAGE_TIMEOUT_S, *,
                workers: int | None = None, poll_s: float = 0.005) -> dict[str, dict[str, Any]]:
    """Block until every worker's readiness file reports ``version`` staged (or kept, or held), so
    that a pause that follows covers only the commit.

    Drivers on the same host as the engine's workers read the files the ``deltasync`` backend keeps
    in ``init_info["status_dir"]`` (one per worker, ``rank-<r>.json``). A worker that has seen
    ``version`` but failed to stage it (its ``error`` is set) counts as ready: the commit then
    prepares the version again and raises the reason. So does a worker that staged a newer version:
    it will not stage an older one, and the commit prepares ``version`` inside the pause (waiting
    would only run into the timeout).

    Args:
        status_dir: the backend's ``status_dir``.
        version: the version about to be committed.
        timeout_s: give up after this many seconds.
        workers: how many readiness files to expect (``None``: whatever is there, at least one).
        poll_s: seconds between reads of the files.

    Returns:
        The readiness of every worker when the wait ended (:func:`read_readiness`).

    Raises:
        SyncTimeoutError: not every worker was ready within ``timeout_s``; the message names the
            workers that were not and what they reported.
        ValueError: a negative version, a negative, NaN or infinite timeout, a poll interval not
            ``> 0``, or fewer than one expected worker.
        TypeError: a timeout, poll interval or worker count that is not a number.
        DeltaSyncError: ``status_dir`` is not a directory, or holds a readiness file that is not
            a JSON object.
    """
    if type(version) is not int or version < 0:
        raise ValueError(f"version must be a published version (int >= 0), got {version!r}")
    check_seconds(timeout_s, "timeout_s", "wait_staged", positive=False)
    check_seconds(poll_s, "poll_s", "wait_staged", positive=True)
    if workers is not None and (type(workers) is not int or workers < 1):
        raise (TypeError if type(workers) is not int else ValueError)(
            f"wait_staged: workers must be an int >= 1 (or None), got {workers!r}")
    if not Path(status_dir).is_dir():
        raise DeltaSyncError(f"{status_dir}: no such directory of readiness files; pass the status_dir that "
                             "attach_* returned (init_info['status_dir'])")
    deadline = time.monotonic() + timeout_s
    while True:
        states = read_readiness(status_dir)
        pending = {w: s for w, s in states.items() if not _ready(s, version)}
        if states and not pending and (workers is None or len(states) >= workers):
            return states
        if time.monotonic() >= deadline:
            missing = "" if workers is None or len(states) >= workers else \
                f"; {len(states)} of {workers} readiness files present"
            if not states:
                missing += ("; no readiness files there (each worker writes rank-<r>.json once the deltasync "
                            "backend is initialised: was the engine attached with this status_dir?)")
            detail = ", ".join(f"{w}: staged {s.get('staged')!r}"
                               + (f", kept {s['kept']!r}" if s.get("kept") is not None else "")
                               + f", held {s.get('held')!r}, newest {s.get('newest')!r}"
                               + (f", error {s['error']}" if s.get("error") else "") for w, s in pending.items())
            raise SyncTimeoutError(f"{status_dir}: workers did not stage version {version} within {timeout_s} s"
                                   f"{missing}" + (f" ({detail})" if detail else ""))
        time.sleep(poll_s)


@dataclass
class Attachment:
    store: str
    prefix: str
    status_dir: str | None  # None: no readiness files here
    workers: int  # readiness files present right after init
    owned: bool = False  # status_dir is a temporary directory attach_* created

    def __post_init__(self) -> None:
        # A directory attach_* created goes with this record (engine gone, re-attached, or exit).
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.status_dir, ignore_errors=True) \
            if self.owned and self.status_dir is not None else None

    def discard(self) -> None:
        """Remove the readiness directory if attach_* created it."""
        if self._cleanup is not None:
            self._cleanup()

    def _store(self):
        from ...store import open_store

        return open_store(self.store).sub(self.prefix)

    def newest(self) -> int:
        """The newest version published in the run (the store's listing)."""
        from ...keys import list_versions

        versions = list_versions(self._store())
        if not versions:
            raise VersionNotFoundError(f"{self.store} (prefix {self.prefix!r}): no version has been published yet")
        return versions[-1]

    def _published(self, version: int) -> bool:
        """Whether ``version``'s manifest is in the store (``True`` when the store cannot be read
        from here: the workers will tell)."""
        from ...keys import manifest_key

        try:
            return self._store().exists(manifest_key(version))
        except Exception:  # noqa: BLE001 (a driver may not reach the workers' store URI)
            return True

    def wait(self, version: int, timeout_s: float | None) -> bool | None:
        """:func:`wait_staged` for ``version``; ``None`` without readiness files, ``False`` when some
        worker is not ready at the timeout (the update then goes on: the commit prepares it) or the
        version is not published (no wait: the commit raises the workers' reason)."""
        if self.status_dir is None:
            return None
        if not self._published(version):
            return False
        if not Path(self.status_dir).is_dir():  # removed under us: the files only advise
            log.warning("%s: the readiness directory is gone; committing version %d without waiting (the workers "
                        "prepare it inside the pause if it is not staged)", self.status_dir, version)
            return False
        try:
            states = wait_staged(self.status_dir, version, DEFAULT_STAGE_TIMEOUT_S if timeout_s is None else timeout_s,
                                 workers=self.workers)
        except SyncTimeoutError as e:
            log.warning("%s; committing anyway (the workers prepare it inside the pause)", e)
            return False
        return all(_staged(s, version) or _version_field(s, "held") == version for s in states.values())

    def check_held(self, version: int) -> None:
        """After a commit: every worker's readiness file says it holds ``version``."""
        if self.status_dir is None:
            return
        held = {w: s.get("held") for w, s in read_readiness(self.status_dir).items()}
        if len(held) < self.workers or set(held.values()) != {version}:
            raise DeltaSyncError(f"after committing version {version} the workers report holding {held} "
                                 f"({len(held)} of {self.workers} readiness files)")
