"""Acknowledgements from the scheme's workers: which version each one applied, or why it could not.

Two channels carry them (:class:`QueueAcks` between a MultiCollector and its worker processes,
:class:`StoreAcks` through the store for receivers elsewhere); :class:`AckBook` is the sender's
record of what arrived and the wait of ``send(sync=True)``, which never hangs: a dead worker
process is noticed within one poll, a silent one after the timeout.
"""

from __future__ import annotations

import json
import queue
import time
from typing import Any, Callable, Literal

from torchrl._utils import logger as torchrl_logger

from ...errors import SyncTimeoutError, WorkerError
from ...store import Store

OnWorkerFailure = Literal["raise", "skip"]


class QueueAcks:
    """Acknowledgements over multiprocessing queues, one per worker (a MultiCollector's workers).

    The queues are created by the sender with the collector's multiprocessing context and travel to
    the workers inside the pickled scheme, at process start (the only time multiprocessing allows).
    One queue per worker, not one shared queue: a queue's writers share a lock that its feeder
    thread holds while writing, and a worker killed in that moment (right after its last
    acknowledgement, say) would keep it forever and silence every other worker.
    """

    def __init__(self, ctx: Any, num_workers: int) -> None:
        self.queues = [ctx.Queue() for _ in range(num_workers)]

    def post(self, store: Store | None, msg: dict[str, Any]) -> None:
        worker = msg["worker"]
        if not 0 <= worker < len(self.queues):
            raise ValueError(f"worker index {worker} outside the {len(self.queues)} acknowledgement queues")
        self.queues[worker].put(msg)

    def poll(self, store: Store | None, workers: set[int], wait_s: float) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait_s
        while True:
            for w in sorted(workers):
                if 0 <= w < len(self.queues):
                    try:
                        while True:
                            out.append(self.queues[w].get_nowait())
                    except queue.Empty:
                        pass
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(0.005, wait_s))


class StoreAcks:
    """Acknowledgements as small JSON objects ``<prefix>/acks/<model>/worker-<i>.json`` (receivers
    that share no process tree with the sender: standalone collectors, other hosts). Receivers need
    write access to the store; the objects are read as untrusted JSON."""

    def __init__(self, model_key: str) -> None:
        self.model_key = model_key

    def key(self, worker: int) -> str:
        return f"acks/{self.model_key}/worker-{worker:05d}.json"

    def post(self, store: Store | None, msg: dict[str, Any]) -> None:
        store.put(self.key(msg["worker"]), json.dumps(msg).encode())

    def poll(self, store: Store | None, workers: set[int], wait_s: float) -> list[dict[str, Any]]:
        out = []
        for w in sorted(workers):
            try:
                raw = json.loads(store.get(self.key(w)).decode())
            except Exception:  # noqa: BLE001 - not written yet, or garbage: no acknowledgement
                continue
            if isinstance(raw, dict):
                out.append(raw)
        if not out:
            time.sleep(wait_s)
        return out


def parse_ack(msg: Any) -> tuple[int, int | None, str | None] | None:
    """``(worker, version, error)`` from an acknowledgement, or ``None`` if it is malformed."""
    if not isinstance(msg, dict):
        return None
    w, v, err = msg.get("worker"), msg.get("version"), msg.get("error")
    if not isinstance(w, int) or isinstance(w, bool) or (v is not None and (not isinstance(v, int) or isinstance(v, bool))):
        return None
    return w, v, err if isinstance(err, str) else None


class AckBook:
    """The sender's record of its workers' acknowledgements, and the wait for a version.

    Args:
        channel: where acknowledgements arrive (travels to the workers inside the scheme).
        expected: the worker ids that acknowledge (``0..n-1``).
        model_id: the scheme's model id, for messages.
        on_failure: ``"raise"`` or ``"skip"`` (see :class:`~torch_deltasync.integrations.torchrl.DeltaWeightSyncScheme`).
    """

    def __init__(self, channel: QueueAcks | StoreAcks, expected: list[int], model_id: str | None,
                 on_failure: OnWorkerFailure) -> None:
        self.channel, self.expected, self.on_failure = channel, list(expected), on_failure
        self.who = f"DeltaWeightSyncScheme ({model_id!r})"
        self.acked: dict[int, int] = {}  # newest version each worker acknowledged
        self.errors: dict[int, tuple[int | None, str]] = {}  # worker -> (version, error) not reported yet
        self.lost: set[int] = set()  # skipped workers, waited for again once they acknowledge

    def targets(self, worker_ids: Any) -> list[int]:
        """The expected workers among ``worker_ids`` (torchrl's argument: an id, a list, or devices)."""
        if worker_ids is None:
            return list(self.expected)
        ids = [worker_ids] if not isinstance(worker_ids, (list, tuple)) else list(worker_ids)
        if not all(isinstance(w, int) for w in ids):  # torchrl also allows devices: wait for all
            return list(self.expected)
        return [w for w in ids if w in self.expected]

    def wait(self, version: int, worker_ids: Any, store: Store | None, *, timeout_s: float, poll_s: float,
             process_of: Callable[[int], Any]) -> None:
        """Block until the target workers acknowledged ``version``.

        Never waits forever (the failure mode of NCCL-based weight sync, research/anchors.md #18):
        a dead worker process (``process_of(worker)``, ``None`` when unknown) is noticed within
        ``poll_s``, a silent one after ``timeout_s``.

        Raises:
            WorkerError: (``on_failure="raise"``) a worker died or reported an error.
            SyncTimeoutError: (same) a worker did not confirm within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        # Read what arrived since the last send first: a skipped worker that acknowledged since is
        # waited for again, even when every target worker had been skipped.
        self.read(store, 0.0)
        pending = {w for w in self.targets(worker_ids) if w not in self.lost}
        failures: list[tuple[int, str, type]] = []
        while True:
            pending = {w for w in pending if self.acked.get(w, -1) < version}
            for w in list(pending):
                err = self.errors.get(w)
                if err is not None and (err[0] is None or err[0] >= version):
                    del self.errors[w]
                    failures.append((w, f"could not apply version {err[0]}: {err[1]}", WorkerError))
                    pending.discard(w)
                    continue
                proc = process_of(w)
                if proc is not None and not proc.is_alive():
                    failures.append((w, f"(pid {proc.pid}) exited with code {proc.exitcode} before applying "
                                        f"version {version}", WorkerError))
                    pending.discard(w)
            if not pending or (failures and self.on_failure == "raise"):
                break  # "raise" fails fast: no waiting for the other workers first
            if time.monotonic() >= deadline:
                for w in sorted(pending):
                    failures.append((w, f"did not confirm version {version} within {timeout_s:g} s "
                                        f"(it holds version {self.acked.get(w)})", SyncTimeoutError))
                break
            self.read(store, min(poll_s, 0.05))
        if failures:
            self._fail(failures)

    def read(self, store: Store | None, wait_s: float) -> None:
        """Read the acknowledgements of every expected worker (waiting up to ``wait_s`` seconds for
        one), not just the pending ones: nothing piles up unread, and a skipped worker that
        acknowledges a newer version than it had is back (waited for from then on)."""
        for msg in self.channel.poll(store, set(self.expected), wait_s):
            parsed = parse_ack(msg)
            if parsed is None:
                continue
            w, ver, err = parsed
            if err is not None:
                self.errors[w] = (ver, err)
            elif ver is not None:
                newer = ver > self.acked.get(w, -1)
                self.acked[w] = max(self.acked.get(w, -1), ver)
                if newer and w in self.lost:
                    torchrl_logger.info(f"DeltaWeightSyncScheme: worker {w} is back at version {ver}")
                    self.lost.discard(w)

    def _fail(self, failures: list[tuple[int, str, type]]) -> None:
        text = "; ".join(f"worker {w} {msg}" for w, msg, _ in failures)
        if self.on_failure == "raise":
            cls = WorkerError if any(c is WorkerError for _, _, c in failures) else SyncTimeoutError
            raise cls(f"{self.who}: {text}. Pass on_worker_failure='skip' to carry on with the other workers")
        for w, _, _ in failures:
            self.lost.add(w)
        torchrl_logger.warning(f"{self.who}: {text}; carrying on without worker(s) "
                               f"{sorted(w for w, _, _ in failures)} until they acknowledge again")
