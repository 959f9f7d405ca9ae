"""The ``deltasync`` backend's background stager and readiness file, one of each per vLLM worker."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ...errors import StaleUpdateError
from ...follow import follow_newer

log = logging.getLogger("torch_deltasync.integrations.vllm._backend")


class Stager(threading.Thread):
    """Stages the newest visible version of a run while the engine generates (daemon thread).

    Holds the newest staged :class:`~torch_deltasync.receiver.StagedUpdate` and, once a newer one
    replaced it, the previous one as ``kept``: a driver that read the readiness file just before
    may already be committing that version, and it finds it staged. ``kept`` is dropped when the
    next version starts staging, so at most two staged updates are in memory (one of them while
    being built), as with one staged update and the next being built; what the target prepared
    ahead for ``kept`` (re-packed modules) is released when it becomes ``kept``, so a commit of it
    reloads inside the pause. :meth:`take` hands the
    matching one to the committing RPC (waiting if that very version is being staged right now) and
    drops both (a commit makes them stale). The loop is the core's
    :func:`~torch_deltasync.follow.follow_newer`: one poll every ``poll_s`` seconds, a pause doubling
    up to 5 s after errors (reported in :class:`Status`); only a version newer than the held and the
    staged one is staged, none starts while a commit runs (:meth:`take` to :meth:`release`; one
    under way goes on and is dropped after it, as stale), and a
    version whose staging failed is not tried again by the stager (the commit RPC prepares it
    itself and raises the reason). The readiness file is written under the same lock as the staged
    updates change, so it never advertises one that :meth:`take` has handed out or dropped.
    """

    def __init__(self, receiver: Any, poll_s: float, status: Status) -> None:
        super().__init__(name="deltasync-stager", daemon=True)
        self.receiver, self.poll_s, self.status = receiver, poll_s, status
        self._cond = threading.Condition()
        self._staged: Any = None
        self._kept: Any = None  # the staged update that ``_staged`` replaced, for a commit on its way
        self._busy: int | None = None
        self._busy_epoch = 0  # ``_epoch`` when the staging in progress began
        self._epoch = 0  # commits taken so far: a staging that began before the last one is stale
        self._holding = False  # a commit is running (from take() to release()): nothing is staged
        self._failed: int | None = None  # a version whose staging failed: not retried by itself
        self._halt = threading.Event()
        self._wake = threading.Event()

    def run(self) -> None:
        follow_newer(self.receiver, self._stage, poll_s=self.poll_s, stop=self._halt, wake=self._wake,
                     skip=self._skip, read=self._read, on_error=self._report, max_backoff_s=5.0)

    def _read(self) -> int | None:
        newest = self.receiver.newest_version()
        self.status.update(newest=newest)
        return newest

    def _skip(self, newest: int) -> bool:
        """Whether ``newest`` (not the held version) is not to be staged: a commit is running, or it
        is not newer than the staged version, failed, or older than the held version. A version
        that is to be staged is marked busy in the same step (``follow_newer`` hands it to
        :meth:`_stage` next), so that :meth:`take` waits for it."""
        held = self.receiver.version
        with self._cond:
            have = self._staged.version if self._staged is not None else -1
            if self._holding or newest == self._failed or newest <= have or (held is not None and newest < held):
                return True
            self._busy, self._busy_epoch = newest, self._epoch
            if self._kept is not None:  # at most two staged updates: the one being built and _staged
                self._kept = None
                self.status.update(kept=None)
        return False

    def _stage(self, newest: int) -> None:
        try:
            staged = self.receiver.prepare(newest)
        except StaleUpdateError:
            staged = None  # a commit came in between: look again
        except Exception:
            with self._cond:
                if self._busy_epoch != self._epoch:
                    return  # read while a commit wrote: not the version's fault, staged again after it
                self._failed = newest  # the commit RPC tries again and reports the reason
            raise
        finally:
            with self._cond:
                self._busy = None
                self._cond.notify_all()
        with self._cond:
            if staged is None or self._busy_epoch != self._epoch:
                return  # staged on the state before a commit: stale, staged again after it
            self._kept, self._staged = self._staged, staged
            if self._kept is not None:  # rarely committed: its modules re-packed ahead are not kept
                self._kept.release_prepared()
            kept = self._kept.version if self._kept is not None else None
            self.status.update(staged=staged.version, kept=kept, error=None)
            self._cond.notify_all()

    def _report(self, e: Exception) -> None:
        log.warning("deltasync stager: %s", e)
        self.status.update(error=f"{type(e).__name__}: {e}")

    def take(self, version: int) -> Any:
        """The staged (or kept) update of ``version`` (waiting while it is being staged), or ``None``,
        for a commit that starts now. Drops both staged updates (the commit makes them stale) and
        stages nothing until :meth:`release`: staging would read the weights being written and
        take CPU from the paused engine's commit."""
        with self._cond:
            while self._busy == version:
                self._cond.wait()
            held = [u for u in (self._staged, self._kept) if u is not None]
            self._staged = self._kept = None
            self._epoch += 1
            self._holding = True
            self.status.update(staged=None, kept=None)
        return next((u for u in held if u.version == version), None)

    def release(self) -> None:
        """The commit :meth:`take` began has ended (landed or failed): stage again, polling now."""
        with self._cond:
            self._holding = False
        self._wake.set()

    def wake(self) -> None:
        """Poll the store now instead of at the end of the current pause (a commit just ended)."""
        self._wake.set()

    def stop(self) -> None:
        """End the loop; the thread exits once a ``prepare`` in progress returns (``join`` it)."""
        self._halt.set()
        self._wake.set()


class Status:
    """This worker's readiness file (``<dir>/rank-<r>.json``), rewritten atomically on change."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self.path = Path(directory) / f"rank-{rank}.json" if directory else None
        self.state: dict[str, Any] = {"held": None, "staged": None, "kept": None, "newest": None, "error": None}
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write()

    def update(self, **kw: Any) -> None:
        """Set fields and rewrite the file. A failed write (a full or removed ``status_dir``) is
        logged, not raised: the file only advises drivers (a stale one makes a commit prepare its
        version inside the pause), and the stager calls this while it changes what it holds."""
        with self._lock:
            if all(self.state.get(k) == v for k, v in kw.items()):
                return
            self.state.update(kw)
            if self.path is not None:
                try:
                    self._write()
                except OSError as e:
                    log.warning("deltasync: cannot write the readiness file %s: %s", self.path, e)

    def _write(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".rank-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**self.state, "time": time.time()}, f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
