"""``ReceiverConfig``: a :class:`~torch_deltasync.receiver.DeltaReceiver`'s options, declared,
documented and checked in one place.

The receiver's runtime objects (the target, the store and the run prefix) are constructor
arguments, not fields. The options of the publishing side are in
:class:`~torch_deltasync.sender.SenderConfig`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._metrics import check_metrics_path
from .._pool import check_threads


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """How a :class:`~torch_deltasync.receiver.DeltaReceiver` downloads and reports updates.

    Pass it as ``DeltaReceiver(target, store, config=ReceiverConfig(...))``, or give the fields as
    keyword arguments (``DeltaReceiver(target, store, max_workers=4)``); keyword arguments override
    the config's fields. It pickles.

    Raises:
        TypeError: a field of the wrong type (the message names the field and what it takes).
        ValueError: ``max_workers`` below 1, ``threads`` outside ``[1, 256]``.

    Example:
        >>> receiver = DeltaReceiver(model, "runs/x/bucket", config=ReceiverConfig(max_workers=16))
        >>> receiver.receiver_config.max_workers
        16
    """

    max_workers: int = 8
    """Parallel downloads (threads), an int ``>= 1``: the objects of one update are fetched this
    many at a time."""

    threads: int | None = None
    """Tensors decoded, staged (old values read, steps resolved), verified and written at once, on the
    library's helper threads and the calling one: an int in ``[1, 256]``, or ``None`` for one per CPU
    core available to the process (within its cgroup CPU quota), at most 8, shared out among a
    launcher's ranks on the host
    (:func:`torch_deltasync._pool.default_threads`). ``1`` keeps it all on the calling thread, in order.
    Old values are read on these threads only from targets that declare ``concurrent_reads``
    (:class:`~torch_deltasync.targets.Target`; the library's do), and a commit writes tensors on
    them only into targets that declare ``concurrent_writes`` (``ModuleTarget`` in host memory);
    other writes run on the calling thread."""

    recover: bool = True
    """Whether an update whose path fails (a corrupt or missing object, a checksum mismatch) is
    staged again along a path that avoids what failed: a failed delta path from the anchor on the
    chain, a failed anchor along the delta path from the version held or from an older anchor
    (crossing the failed one by its delta part); a damaged delta part that every path needs ends
    it at once; at most twice, then the error is raised. ``False``: the first failure is raised
    (checking tools, which must report every object they were asked to read, set it)."""

    metrics_path: str | os.PathLike | None = None
    """File to append one JSON line of :class:`~torch_deltasync.receiver.UpdateStats` to per
    update. ``None`` (or ``""``): none."""

    def __post_init__(self) -> None:
        if type(self.max_workers) is not int:
            raise TypeError(f"ReceiverConfig.max_workers must be an int >= 1, got {self.max_workers!r}")
        if self.max_workers < 1:
            raise ValueError(f"ReceiverConfig.max_workers must be an int >= 1, got {self.max_workers}")
        check_threads(self.threads, "ReceiverConfig.threads")
        if type(self.recover) is not bool:
            raise TypeError(f"ReceiverConfig.recover must be a bool, got {self.recover!r}")
        check_metrics_path("ReceiverConfig.metrics_path", self.metrics_path)
