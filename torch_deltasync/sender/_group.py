"""The collectives a sender runs: a protocol, and the single-process default.

A sharded sender (FSDP2, TP, HSDP) plugs in ``torch_deltasync.dtensor.default_group()``, two gloo
groups over every rank; everything else publishes from one process.
"""

from __future__ import annotations

from typing import Any, Protocol


class Group(Protocol):
    """The collectives a sender needs; single-process by default (FSDP2 plugs in torch.distributed)."""

    rank: int
    world: int

    def gather(self, obj: Any) -> list[Any] | None: ...

    def broadcast(self, obj: Any) -> Any: ...

    def any(self, flag: bool) -> bool: ...


class SingleProcess:
    """One process: gather returns ``[obj]``, broadcast and any return their input."""

    rank = 0
    world = 1

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def any(self, flag: bool) -> bool:
        return flag
