"""The scheme's acknowledgements in torchrl's terms: a queue channel for a MultiCollector's worker
processes, torchrl's ``worker_ids`` and ``on_worker_failure``.

The protocol itself (the messages, the store channel, the sender's wait with its timeout and
failure reporting) is the core's :mod:`torch_deltasync.acks`; receivers elsewhere acknowledge
through :class:`~torch_deltasync.acks.StoreAcks`.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from torchrl._utils import logger as torchrl_logger

from ...acks import AckBook, OnFailure

#: The scheme's ``on_worker_failure`` option (the core's :data:`~torch_deltasync.acks.OnFailure`).
OnWorkerFailure = OnFailure


class QueueAcks:
    """Acknowledgements over multiprocessing queues, one per worker (a MultiCollector's workers);
    an :class:`~torch_deltasync.acks.AckChannel` that ignores the store.

    The queues are created by the sender with the collector's multiprocessing context and travel to
    the workers inside the pickled scheme, at process start (the only time multiprocessing allows).
    One queue per worker, not one shared queue: a queue's writers share a lock that its feeder
    thread holds while writing, and a worker killed in that moment (right after its last
    acknowledgement, say) would keep it forever and silence every other worker.
    """

    def __init__(self, ctx: Any, num_workers: int) -> None:
        self.queues = [ctx.Queue() for _ in range(num_workers)]

    def post(self, store: Any, msg: dict[str, Any]) -> None:
        """Put ``msg`` on its worker's queue.

        Raises:
            ValueError: ``msg["worker"]`` has no queue.
        """
        worker = msg["worker"]
        if not 0 <= worker < len(self.queues):
            raise ValueError(f"worker index {worker} outside the {len(self.queues)} acknowledgement queues")
        self.queues[worker].put(msg)

    def poll(self, store: Any, workers: set[int], wait_s: float) -> list[dict[str, Any]]:
        """Everything queued by ``workers``, waiting up to ``wait_s`` seconds for one message. A
        message on worker ``w``'s queue whose ``worker`` is not ``w`` is ignored, so no worker can
        confirm for another (as :class:`~torch_deltasync.acks.StoreAcks` does by key)."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait_s
        while True:
            for w in sorted(workers):
                if 0 <= w < len(self.queues):
                    try:
                        while True:
                            msg = self.queues[w].get_nowait()
                            if isinstance(msg, dict) and type(msg.get("worker")) is int and msg["worker"] == w:
                                out.append(msg)
                            else:
                                torchrl_logger.debug(f"ignoring an acknowledgement on worker {w}'s queue: {msg!r:.200}")
                    except queue.Empty:
                        pass
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(0.005, wait_s))


def scheme_ack_book(channel: Any, expected: list[int], model_id: str | None,
                    on_failure: OnWorkerFailure) -> AckBook:
    """The scheme's :class:`~torch_deltasync.acks.AckBook`: messages name the scheme and its
    ``on_worker_failure`` option, and go to torchrl's logger."""
    return AckBook(channel, expected, who=f"DeltaWeightSyncScheme ({model_id!r})", on_failure=on_failure,
                   skip_hint="Pass on_worker_failure='skip' to carry on with the other workers",
                   logger=torchrl_logger)


def target_workers(worker_ids: Any) -> list[int] | None:
    """The worker ids named by torchrl's ``worker_ids`` argument (an id, a list of ids, or devices);
    ``None`` (every worker) for ``None`` or devices."""
    if worker_ids is None:
        return None
    ids = [worker_ids] if not isinstance(worker_ids, (list, tuple)) else list(worker_ids)
    if not all(isinstance(w, int) for w in ids):  # torchrl also allows devices: wait for all
        return None
    return ids
