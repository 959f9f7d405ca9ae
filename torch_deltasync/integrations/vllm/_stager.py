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

log = logging.getLogger("torch_deltasync.integrations.vllm._backend")


class Stager(threading.Thread):
    """Stages the newest visible version of a run while the engine generates (daemon thread).

    Holds at most one :class:`~torch_deltasync.receiver.StagedUpdate`; :meth:`take` hands it to the
    committing RPC (waiting if that very version is being staged right now).
    """

    def __init__(self, receiver: Any, poll_s: float, status: Status) -> None:
        super().__init__(name="deltasync-stager", daemon=True)
        self.receiver, self.poll_s, self.status = receiver, poll_s, status
        self._cond = threading.Condition()
        self._staged: Any = None
        self._busy: int | None = None
        self._failed: int | None = None  # a version whose staging failed: not retried by itself
        self._halt = False
        self._wake = threading.Event()

    def run(self) -> None:
        backoff = self.poll_s
        while not self._halt:
            try:
                newest = self.receiver.newest_version()
                self.status.update(newest=newest)
                held = self.receiver.version
                with self._cond:
                    have = self._staged.version if self._staged is not None else None
                    todo = (newest is not None and newest not in (held, have, self._failed)
                            and (held is None or newest > held))
                    if todo:
                        self._busy = newest
                if todo:
                    try:
                        staged = self.receiver.prepare(newest)
                    except StaleUpdateError:
                        staged = None  # a commit came in between: look again
                    except Exception:
                        self._failed = newest  # the commit RPC tries again and reports the reason
                        raise
                    finally:
                        with self._cond:
                            self._busy = None
                            self._cond.notify_all()
                    if staged is not None:
                        with self._cond:
                            self._staged = staged
                            self._cond.notify_all()
                        self.status.update(staged=staged.version, error=None)
                backoff = self.poll_s
            except Exception as e:  # noqa: BLE001 (reported; the commit path raises it to the caller)
                log.warning("deltasync stager: %s", e)
                self.status.update(error=f"{type(e).__name__}: {e}")
                backoff = min(backoff * 2, 5.0)
            self._wake.wait(backoff)
            self._wake.clear()

    def take(self, version: int) -> Any:
        """The staged update of ``version`` (waiting while it is being staged), or ``None``."""
        with self._cond:
            while self._busy == version:
                self._cond.wait()
            staged, self._staged = self._staged, None
        if staged is not None and staged.version == version:
            return staged
        return None

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._halt = True
        self._wake.set()


class Status:
    """This worker's readiness file (``<dir>/rank-<r>.json``), rewritten atomically on change."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self.path = Path(directory) / f"rank-{rank}.json" if directory else None
        self.state: dict[str, Any] = {"held": None, "staged": None, "newest": None, "error": None}
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write()

    def update(self, **kw: Any) -> None:
        with self._lock:
            if all(self.state.get(k) == v for k, v in kw.items()):
                return
            self.state.update(kw)
            if self.path is not None:
                self._write()

    def _write(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".rank-")
        with os.fdopen(fd, "w") as f:
            json.dump({**self.state, "time": time.time()}, f)
        os.replace(tmp, self.path)
