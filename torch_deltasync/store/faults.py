"""``FaultyStore``: a store wrapper that injects the failures remote stores have.

For tests and drills: run a writer and many receivers through it (wrapped in
:class:`~torch_deltasync.store.RetryingStore`, as remote stores retry on their own) and check that
every receiver still ends bit-exact. Faults are drawn from a seeded generator, so a failing run can
be replayed.

==================  =====================================================================================
fault               what the caller sees
==================  =====================================================================================
``error_rate``      the call raises :class:`~torch_deltasync.errors.TransientStoreError` before doing
                    anything (a refused connection, HTTP 503)
``lost_ack_rate``   a ``put``/``delete`` takes effect, then raises ``TransientStoreError`` (the reply
                    was lost; the retry repeats an operation that already happened)
``latency_s``       every call first sleeps a uniform random time in ``[lo, hi]`` seconds
``stall_rate``      the call sleeps ``stall_s`` seconds first (longer than a deadline: a hung socket)
``truncate_rate``   a ``get`` (whole or ranged) silently returns a random strict prefix of its bytes (a
                    transfer cut short that the driver did not notice; only size/sha256 checks catch it)
==================  =====================================================================================
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import TypeVar

from ..errors import TransientStoreError
from ._base import Store

__all__ = ["FaultyStore"]

T = TypeVar("T")


class FaultyStore(Store):
    """Wraps ``inner`` and injects faults at the given rates (probabilities per call, in ``[0, 1]``).

    Args:
        inner: the store that holds the data.
        error_rate: probability that a call fails before it runs.
        lost_ack_rate: probability that a ``put``/``delete`` runs and then reports a failure.
        latency_s: ``(lo, hi)`` seconds of uniform random latency added to every call.
        stall_rate: probability that a call first stalls for ``stall_s`` seconds.
        stall_s: length of a stall, in seconds.
        truncate_rate: probability that a ``get`` (whole or ranged) returns a strict prefix.
        ops: the operations faults apply to (default all of ``put``, ``get``, ``exists``, ``size``,
            ``list``, ``delete``).
        seed: seed of the fault generator.

    Attributes:
        injected: ``Counter`` of injected faults by kind (``"error"``, ``"lost_ack"``, ``"stall"``,
            ``"truncate"``), so tests can check that faults really happened.
        calls: ``Counter`` of calls by operation.
    """

    def __init__(self, inner: Store, *, error_rate: float = 0.0, lost_ack_rate: float = 0.0,
                 latency_s: tuple[float, float] = (0.0, 0.0), stall_rate: float = 0.0, stall_s: float = 0.0,
                 truncate_rate: float = 0.0, ops: tuple[str, ...] | None = None, seed: int = 0) -> None:
        for name, p in (("error_rate", error_rate), ("lost_ack_rate", lost_ack_rate),
                        ("stall_rate", stall_rate), ("truncate_rate", truncate_rate)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
        if not 0 <= latency_s[0] <= latency_s[1]:
            raise ValueError(f"latency_s must be (lo, hi) with 0 <= lo <= hi, got {latency_s}")
        self.inner = inner
        self.error_rate = error_rate
        self.lost_ack_rate = lost_ack_rate
        self.latency_s = latency_s
        self.stall_rate = stall_rate
        self.stall_s = stall_s
        self.truncate_rate = truncate_rate
        self.ops = set(ops or ("put", "get", "exists", "size", "list", "delete"))
        self.enabled = True
        self.injected: Counter = Counter()
        self.calls: Counter = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _draw(self) -> float:
        with self._lock:
            return self._rng.random()

    def _before(self, op: str, key: str) -> None:
        with self._lock:
            self.calls[op] += 1
        if not self.enabled or op not in self.ops:
            return
        lo, hi = self.latency_s
        if hi > 0:
            time.sleep(lo + (hi - lo) * self._draw())
        if self.stall_rate and self._draw() < self.stall_rate:
            self._count("stall")
            time.sleep(self.stall_s)
        if self.error_rate and self._draw() < self.error_rate:
            self._count("error")
            raise TransientStoreError(f"{self.describe()}: injected failure of {op} {key!r}")

    def _after_write(self, op: str, key: str) -> None:
        if self.enabled and op in self.ops and self.lost_ack_rate and self._draw() < self.lost_ack_rate:
            self._count("lost_ack")
            raise TransientStoreError(f"{self.describe()}: injected lost reply of {op} {key!r} (it took effect)")

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    # --- Store -----------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        self._before("put", key)
        self.inner.put(key, data)
        self._after_write("put", key)

    def get(self, key: str, *, start: int | None = None, end: int | None = None) -> bytes:
        self._before("get", key)
        data = self.inner.get(key, start=start, end=end)
        if (self.enabled and "get" in self.ops and len(data) > 1
                and self.truncate_rate and self._draw() < self.truncate_rate):
            self._count("truncate")
            with self._lock:
                cut = self._rng.randrange(0, len(data))
            return data[:cut]
        return data

    def exists(self, key: str) -> bool:
        self._before("exists", key)
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        self._before("size", key)
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[str]:
        self._before("list", prefix)
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._before("delete", key)
        self.inner.delete(key)
        self._after_write("delete", key)

    def delete_many(self, keys: list[str]) -> None:
        keys = list(keys)
        if keys:
            self._before("delete", keys[0])
            self.inner.delete_many(keys)
            self._after_write("delete", keys[0])

    def describe(self) -> str:
        return f"faulty({self.inner.describe()})"

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"
