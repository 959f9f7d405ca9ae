"""The library's helper threads: one kept pool that maps a function over tensors, largest first.

The compiled kernels (:mod:`._native`), zstd and torch's CPU ops release the GIL, so tensors of one
version can be coded, read and resolved on several threads while the Python around each holds it
only briefly. Used by :meth:`Codec.encode_many <torch_deltasync.codecs.Codec.encode_many>` /
``decode_many``, by the sender's change detection (:mod:`torch_deltasync.sender`) and by the
receiver's staging (:mod:`torch_deltasync.receiver`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

__all__ = ["MAX_THREADS", "PARALLEL_MIN_CHANGES", "check_threads", "cpu_quota", "default_threads", "map_largest_first"]

#: Items with fewer changes than this run on the calling thread (see :func:`map_largest_first`).
PARALLEL_MIN_CHANGES = 1 << 14

#: Threads when a ``threads`` option is ``None``: one per CPU core the process may use (within its
#: CPU quota, shared out among torchrun's local ranks, :func:`default_threads`), at most this.
DEFAULT_MAX_THREADS = 8

#: The most threads a ``threads`` option takes (the pool keeps them all alive once asked for).
MAX_THREADS = 256

_POOL: tuple[ThreadPoolExecutor, int] | None = None  # (pool, workers)
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's pool has no threads there, and its lock may have been held
    by a thread that does not exist either."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _submit(fn: Callable[[], None], n: int, workers: int) -> list[Future]:
    """Run ``fn`` ``n`` times on the library's helper threads, which are kept between calls and
    shared by all callers: starting and stopping a pool cost ~0.2 ms on 2 cores, as much as coding
    a 1% change set of 40M elements takes on two threads, and each new thread makes its own zstd
    contexts. The pool grows when a caller asks for more ``workers`` (the old one finishes what it
    was given) and is made anew in a forked child (:func:`_forget_pool`). Submitting under the
    lock keeps a call from submitting to a pool another call has just replaced."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[1] < workers:
            if _POOL is not None:
                _POOL[0].shutdown(wait=False)
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="deltasync"), workers
        return [_POOL[0].submit(fn) for _ in range(n)]


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which TP workers and containers narrow;
    ``os.cpu_count()`` where the platform has no mask)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """Threads a ``threads`` option of ``None`` means: one per CPU core this process may use, at
    most :data:`DEFAULT_MAX_THREADS`.

    The cores it may use are its affinity mask, capped by its cgroup's CPU quota
    (:func:`cpu_quota`: Kubernetes CPU limits, ``docker run --cpus``), rounded down: a process
    with 64 cores in its mask and a limit of 2 CPUs takes 2 threads, not 8 that the kernel would
    throttle. Ranks that a launcher started on one host (``LOCAL_WORLD_SIZE`` > 1: torchrun, and
    vLLM's CPU workers) share those cores: when this process may use as many cores as its parent
    (the launcher; a container's or a job's cpuset narrows both alike), each rank takes
    ``cores // LOCAL_WORLD_SIZE`` (at least one), so that ranks reading and coding their shards at
    once do not oversubscribe the host (measured 1.4-1.6x slower with two FSDP2 ranks on 2 cores,
    ``docs/benchmarks.md``). A rank the launcher pinned to its own cores has a narrower mask than
    its parent, which is its share already. A quota is shared the same way, unless the rank's
    cgroup differs from its parent's or the parent's cannot be read (then the quota is its own)."""
    cpus = available_cpus()
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    if local > 1 and cpus >= _parent_cpus():
        cpus = max(1, cpus // local)
    quota = cpu_quota()
    if quota is not None:
        if local > 1 and _cgroup_text("self") == _cgroup_text(os.getppid()):
            quota /= local
        cpus = min(cpus, max(1, int(quota)))
    return min(DEFAULT_MAX_THREADS, cpus)


def _parent_cpus() -> int:
    """CPUs the parent process may run on (``os.cpu_count()`` where that cannot be read)."""
    try:
        return max(1, len(os.sched_getaffinity(os.getppid())))
    except (AttributeError, OSError):  # not on Linux, or the parent is gone
        return os.cpu_count() or 1


#: Where :func:`cpu_quota` reads cgroups: the cgroup file system and each process's membership
#: (``{pid}``: ``self`` or a process id). Tests point these at a directory of their own.
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/{pid}/cgroup"


def _cgroup_text(pid: int | str) -> str | None:
    """``/proc/<pid>/cgroup`` (``None`` where it cannot be read: not Linux, or the process is gone)."""
    try:
        with open(PROC_CGROUP.format(pid=pid)) as f:
            return f.read()
    except OSError:
        return None


def _read_quota(directory: str, v2: bool) -> float | None:
    """The CPU quota of one cgroup directory in CPUs; ``None`` without one or an unreadable file."""
    try:
        if v2:
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota < 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def cpu_quota(pid: int | str = "self") -> float | None:
    """CPUs the CPU quota of a process's cgroup allows (quota / period, the least along the cgroup
    and its ancestors), or ``None`` without a quota or where none can be read (not Linux).

    cgroup v2: ``cpu.max`` (``"<quota> <period>"``, or ``"max <period>"``: none) of the cgroup
    ``0::<path>`` of ``/proc/<pid>/cgroup`` names; cgroup v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    (a quota of -1: none) of its ``cpu`` controller's cgroup (kernel documentation,
    ``Documentation/admin-guide/cgroup-v2.rst`` "cpu.max" and ``scheduler/sched-bwc.rst``). The
    walk up to the mount's root also finds a container's own cgroup, which its namespace shows at
    the root while ``/proc`` still names the path on the host.

    Args:
        pid: ``"self"`` or a process id.

    Returns:
        The quota in CPUs (``1.5``: one and a half CPUs' time per period), or ``None``.
    """
    text = _cgroup_text(pid)
    if text is None:
        return None
    found = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            bases, v2 = [CGROUP_ROOT], True
        elif "cpu" in controllers.split(","):
            bases, v2 = [os.path.join(CGROUP_ROOT, controllers), os.path.join(CGROUP_ROOT, "cpu")], False
        else:
            continue
        for base in dict.fromkeys(bases):
            rel = path.strip("/")
            while True:
                q = _read_quota(os.path.join(base, rel) if rel else base, v2)
                if q is not None:
                    found.append(q)
                if not rel:
                    break
                rel = os.path.dirname(rel)
    return min(found) if found else None


def check_threads(value: object, field: str) -> None:
    """Refuse a ``threads`` option that is not ``None`` or an int in ``[1, MAX_THREADS]``.

    Args:
        value: the option's value.
        field: its qualified name for the message (``"SenderConfig.threads"``).

    Raises:
        TypeError: not an int (``bool`` included) and not ``None``.
        ValueError: an int outside ``[1, MAX_THREADS]``.
    """
    if value is None:
        return
    if type(value) is not int or not 1 <= value <= MAX_THREADS:
        kind = TypeError if type(value) is not int else ValueError
        raise kind(f"{field} must be an int in [1, {MAX_THREADS}] or None (one per CPU core, at most {DEFAULT_MAX_THREADS}, shared among local ranks), "
                   f"got {value!r}")


def map_largest_first(fn: Callable, items: Sequence, sizes: Sequence[int], threads: int | None, *,
                      min_size: int | None = None) -> list:
    """``[fn(x) for x in items]`` on up to ``threads`` threads, the calling thread included: the
    items of size at least ``min_size`` (``None``: :data:`PARALLEL_MIN_CHANGES` changes) are shared
    out largest first (so the last ones to finish are small), the smaller ones run on the calling
    thread, which then helps with the large ones. The first ``Exception`` in ``items`` order is
    raised.

    The split follows from where the time goes: a tensor costs ~30-60 us of Python (which holds the
    GIL) plus ~4-5 ns per change in the compiled kernels and zstd (which release it). Below ~16K
    changes the Python dominates, and two threads running it only take turns on the GIL (measured
    0.8x of one thread for 200 tensors of 2,000 changes); above it the kernels of one tensor run
    beside the Python of another."""
    n = len(items)
    threads = default_threads() if threads is None else threads
    min_size = PARALLEL_MIN_CHANGES if min_size is None else min_size
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    big = sorted((i for i in range(n) if sizes[i] >= min_size), key=lambda i: -sizes[i])
    if threads == 1 or not big or n < 2:
        return [fn(x) for x in items]
    results: dict[int, object] = {}
    errors: dict[int, Exception] = {}
    queue = iter(big)
    lock = threading.Lock()
    stopped = [False]  # the caller was interrupted: helpers take nothing more

    def run(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except Exception as e:  # noqa: BLE001 - re-raised below, in items order
            errors[i] = e

    def drain() -> None:  # take the next large item until none is left
        while True:
            with lock:
                i = None if stopped[0] else next(queue, None)
            if i is None:
                return
            run(i)

    helpers = _submit(drain, min(threads - 1, len(big)), threads - 1)
    try:
        for i in range(n):
            if sizes[i] < min_size:
                run(i)
        drain()
    finally:  # also on KeyboardInterrupt: no helper may still work on the items once this returns
        with lock:
            stopped[0] = True
        for h in helpers:  # a helper still queued (behind another caller's work) has nothing left to do
            if not h.cancel():
                h.result()
    if errors:
        raise errors[min(errors)]
    return [results[i] for i in range(n)]
