"""The library's helper threads: one kept pool that maps a function over tensors, largest first.

The compiled kernels (:mod:`._native`), zstd and torch's CPU ops release the GIL, so tensors of one
version can be coded, read and resolved on several threads while the Python around each holds it
only briefly. Used by :meth:`Codec.encode_many <torch_deltasync.codecs.Codec.encode_many>` /
``decode_many``, by the sender's change detection (:mod:`torch_deltasync.sender`) and by the
receiver's staging (:mod:`torch_deltasync.receiver`).
"""

from __future__ import annotations

import os
import re
import threading
import time
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
    by a thread that does not exist either; the quotas read were another process's."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()
    _QUOTAS.clear()


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
    its parent, which is its share already. The quota is shared the same way when the parent is
    under the same quota (the same CPUs per period: one cgroup, or one ancestor's limit over
    both); a rank in a cgroup whose limit its parent does not share has the limit to itself."""
    cpus = available_cpus()
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    if local > 1 and cpus >= _parent_cpus():
        cpus = max(1, cpus // local)
    quota = cpu_quota()
    if quota is not None:
        if local > 1 and cpu_quota(os.getppid()) == quota:
            quota /= local
        cpus = min(cpus, max(1, int(quota)))
    return min(DEFAULT_MAX_THREADS, cpus)


def _parent_cpus() -> int:
    """CPUs the parent process may run on (``os.cpu_count()`` where that cannot be read)."""
    try:
        return max(1, len(os.sched_getaffinity(os.getppid())))
    except (AttributeError, OSError):  # not on Linux, or the parent is gone
        return os.cpu_count() or 1


#: Where :func:`cpu_quota` learns a process's cgroups (``{pid}``: ``self`` or a process id) and
#: where this mount namespace mounts the cgroup file systems. Tests point these at files of their own.
PROC_CGROUP = "/proc/{pid}/cgroup"
PROC_MOUNTINFO = "/proc/self/mountinfo"

#: How long a :func:`cpu_quota` result is reused, in seconds: ``default_threads`` runs a few times
#: per version, and reading the cgroup files costs ~0.1 ms; a changed limit is seen within this.
QUOTA_TTL_S = 10.0
_QUOTAS: dict[tuple, tuple[float, float | None]] = {}  # (pid, files) -> (when read, quota)


def _read_text(path: str) -> str | None:
    """A regular file's text (``None`` for anything else or an unreadable one: never a FIFO's
    wait). Bytes that are not UTF-8 (cgroup names may hold any) survive as surrogates."""
    try:
        if not os.path.isfile(path):
            return None
        with open(path, errors="surrogateescape") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _unescape(field: str) -> str:
    """A path of ``/proc/<pid>/mountinfo``, whose spaces, tabs, newlines and backslashes are octal
    escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_mounts() -> list[tuple[bool, str, str, frozenset[str]]]:
    """``(v2, root, mount point, controllers)`` of every ``cgroup`` and ``cgroup2`` mount in
    ``mountinfo`` (``proc(5)``: fields 4 and 5 are the mount's root within its file system and
    its mount point; after ``-``, the file system type, source and super options, which name a v1
    hierarchy's controllers)."""
    mounts = []
    for line in (_read_text(PROC_MOUNTINFO) or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        v2 = tail[0] == "cgroup2"
        controllers = frozenset() if v2 else frozenset(tail[2].split(","))
        mounts.append((v2, _unescape(fields[3]), _unescape(fields[4]), controllers))
    return mounts


def _read_quota(directory: str, v2: bool) -> float | None:
    """The CPU quota of one cgroup directory in CPUs; ``None`` without one, or for a file that
    does not parse (a negative, zero or absurd value included)."""
    try:
        if v2:
            quota, period = (_read_text(os.path.join(directory, "cpu.max")) or "").split()[:2]
            if quota == "max":
                return None
        else:
            quota = _read_text(os.path.join(directory, "cpu.cfs_quota_us")) or ""
            period = _read_text(os.path.join(directory, "cpu.cfs_period_us")) or ""
        q, p = int(quota), int(period)
        return q / p if q > 0 and p > 0 else None
    except (ValueError, ArithmeticError):
        return None


def cpu_quota(pid: int | str = "self") -> float | None:
    """CPUs the CPU quota of a process's cgroup allows (quota / period, the least along the cgroup
    and its ancestors that this mount namespace shows), or ``None`` without a quota or where none
    can be read (not Linux, the process gone). Results are reused for :data:`QUOTA_TTL_S`.

    Each line of ``/proc/<pid>/cgroup`` names a cgroup path (``0::<path>``: cgroup v2;
    ``<n>:cpu,cpuacct:<path>``: the v1 hierarchy of the ``cpu`` controller); ``mountinfo`` says
    where that hierarchy is mounted and which of its cgroups is the mount's root (a container
    sees its own cgroup there). The quota files are then read in the process's cgroup directory
    and each parent up to the mount point: v2 ``cpu.max`` (``"<quota> <period>"``, or ``"max
    <period>"``: none), v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none); kernel
    documentation, ``admin-guide/cgroup-v2.rst`` ("cpu.max") and ``scheduler/sched-bwc.rst``. This
    is where Kubernetes CPU limits and ``docker run --cpus`` land; the affinity mask does not show
    them.

    Args:
        pid: ``"self"`` or a process id.

    Returns:
        The quota in CPUs (``1.5``: one and a half CPUs' time per period), or ``None``.
    """
    key = (str(pid), PROC_CGROUP, PROC_MOUNTINFO)
    hit = _QUOTAS.get(key)
    now = time.monotonic()
    if hit is not None and now - hit[0] < QUOTA_TTL_S:
        return hit[1]
    quota = _cpu_quota(pid)
    _QUOTAS[key] = (now, quota)
    return quota


def _cpu_quota(pid: int | str) -> float | None:
    text = _read_text(PROC_CGROUP.format(pid=pid))
    if text is None:
        return None
    mounts = _cgroup_mounts()
    found = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        for mount_v2, root, point, mount_controllers in mounts:
            if mount_v2 != v2 or (not v2 and "cpu" not in mount_controllers):
                continue
            inside = path == root or path.startswith(root.rstrip("/") + "/")
            rel = path[len(root):].strip("/") if inside else ""  # outside the mount's root: only the root is seen
            while True:
                q = _read_quota(os.path.join(point, rel) if rel else point, v2)
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
        interrupt = None
        for h in helpers:  # a helper still queued (behind another caller's work) has nothing left to do
            while not h.cancel():
                try:  # a second Ctrl-C must not end the wait: a helper may be writing live weights
                    h.result()
                    break
                except KeyboardInterrupt as e:
                    interrupt = e
        if interrupt is not None:
            raise interrupt
    if errors:
        raise errors[min(errors)]
    return [results[i] for i in range(n)]
