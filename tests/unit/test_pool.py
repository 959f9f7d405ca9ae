"""The helper threads (``torch_deltasync/_pool.py``): which thread runs what, results in order, the
first error raised, a kept pool that survives nesting, growth and forks."""

import os
import signal
import threading
import time

import pytest

from torch_deltasync import _pool


def test_many_runs_small_items_inline_and_shares_out_the_large_ones():
    """Items below ``min_size`` run on the calling thread, large ones on up to ``threads``
    threads (the caller included); results keep the items' order, the first error in that order is
    raised, and no more than ``threads`` items run at once."""
    sizes = [5, 300, 99, 100, 7, 1000, 400, 150]
    main = threading.main_thread()
    where, running, peak = {}, [0], [0]
    lock = threading.Lock()

    def fn(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        where[i] = threading.current_thread() is main
        time.sleep(0.01)  # long enough for the threads to overlap
        with lock:
            running[0] -= 1
        if sizes[i] in (7, 1000):
            raise ValueError(f"item {i}")
        return i * 10

    for threads in (2, 3):
        peak[0] = 0
        with pytest.raises(ValueError, match="item 4"):  # item 5 (large) fails too; item 4 comes first
            _pool.map_largest_first(fn, list(range(8)), sizes, threads, min_size=100)
        assert all(where[i] for i in (0, 2, 4)), where  # the small ones, on the calling thread
        assert 1 < peak[0] <= threads
    ok = [0, 1, 2, 3, 6, 7]
    assert _pool.map_largest_first(fn, ok, [sizes[i] for i in ok], 2, min_size=100) == [i * 10 for i in ok]
    # Nothing large, or one thread: everything on the calling thread, in order.
    on_main = lambda i: (i, threading.current_thread() is main)  # noqa: E731
    assert _pool.map_largest_first(on_main, [0, 2, 4], [5, 99, 7], 4, min_size=100) == [(0, True), (2, True), (4, True)]
    assert _pool.map_largest_first(on_main, [1, 5], [300, 1000], 1, min_size=100) == [(1, True), (5, True)]
    # The default threshold is PARALLEL_MIN_CHANGES: just below it stays on the calling thread,
    # at it a helper takes part (the two items wait for each other).
    below = _pool.PARALLEL_MIN_CHANGES - 1
    assert _pool.map_largest_first(on_main, [0, 1, 2], [below] * 3, 4) == [(0, True), (1, True), (2, True)]
    barrier = threading.Barrier(2, timeout=10)

    def meet(i):
        barrier.wait()
        return threading.current_thread() is main

    assert sorted(_pool.map_largest_first(meet, [0, 1], [_pool.PARALLEL_MIN_CHANGES] * 2, 2)) == [False, True]
    with pytest.raises(ValueError, match="threads must be at least 1"):
        _pool.map_largest_first(fn, [0], sizes, 0)


@pytest.mark.parametrize("value,error", [(0, ValueError), (257, ValueError), (-1, ValueError), (2.0, TypeError),
                                         (True, TypeError), ("4", TypeError)])
def test_check_threads_names_the_field(value, error):
    _pool.check_threads(None, "X.threads")
    _pool.check_threads(_pool.MAX_THREADS, "X.threads")
    with pytest.raises(error, match=rf"X.threads must be an int in \[1, 256\] or None \(one per CPU core, at most 8, shared among local ranks\), "
                                    rf"got {value!r}"):
        _pool.check_threads(value, "X.threads")


def test_an_interrupted_caller_leaves_no_helper_working():
    """A ``KeyboardInterrupt`` on the calling thread: the helpers take no further item, and the
    call returns (raising it) only once the one they hold is done."""
    started, done = [], []
    lock = threading.Lock()

    def fn(i):
        with lock:
            started.append(i)
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        time.sleep(0.05)
        with lock:
            done.append(i)
        return i

    with pytest.raises(KeyboardInterrupt):
        _pool.map_largest_first(fn, list(range(20)), [1 << 20] * 20, 2)
    snapshot = (list(started), list(done))
    time.sleep(0.2)  # nothing runs on after the call returned
    assert (started, done) == snapshot and len(started) < 20
    assert len(done) == len(started) - 1  # every helper item finished; the caller's was interrupted


def test_helper_threads_are_kept_between_calls_and_nested_or_forked_calls_run(monkeypatch):
    """The helper threads outlive a call (starting a pool cost as much as a small change set), a
    map inside a helper's item does not wait for itself, and a forked child makes its own pool."""
    monkeypatch.setattr(_pool, "_POOL", None)
    seen = []  # the threads (kept alive, so their ids stay distinct)

    def fn(i):
        seen.append(threading.current_thread())
        time.sleep(0.005)
        return i

    big = [1 << 20] * 4
    for _ in range(3):
        assert _pool.map_largest_first(fn, [0, 1, 2, 3], big, 2) == [0, 1, 2, 3]
    assert len({id(t) for t in seen}) == 2, seen  # the caller and the same helper every time

    def outer(i):  # every helper busy with an item that maps again
        return sum(_pool.map_largest_first(fn, [i, i, i], big[:3], 2))

    assert _pool.map_largest_first(outer, [0, 1, 2, 3], big, 2) == [0, 3, 6, 9]
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool object, without its threads
        signal.alarm(20)  # a deadlock ends the child with SIGALRM
        ok = _pool.map_largest_first(fn, [0, 1, 2, 3], big, 2) == [0, 1, 2, 3]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_pool_replaced_by_a_larger_one_never_refuses_a_callers_work(monkeypatch):
    """Callers asking for more threads replace the pool while others submit to it: no call may
    find its pool shut down ("cannot schedule new futures after shutdown")."""
    monkeypatch.setattr(_pool, "_POOL", None)
    errors, stop = [], threading.Event()

    def caller():
        while not stop.is_set():
            try:
                assert _pool.map_largest_first(lambda i: i, [0, 1, 2], [1 << 20] * 3, 2) == [0, 1, 2]
            except Exception as e:  # noqa: BLE001 - collected for the assertion below
                errors.append(repr(e))

    callers = [threading.Thread(target=caller) for _ in range(3)]
    for t in callers:
        t.start()
    try:
        for workers in range(3, 120):  # every call grows the pool
            assert _pool.map_largest_first(lambda i: i, [0, 1], [1 << 20] * 2, workers) == [0, 1]
    finally:
        stop.set()
        for t in callers:
            t.join()
    assert not errors, errors[:3]


def test_an_interrupted_call_returns_only_after_its_helpers():
    """Ctrl-C on the calling thread, and again while it waits for a helper: the call still returns
    only once the helper finished its item (a commit's helper may be writing live weights)."""
    main = threading.main_thread()
    started, done = threading.Event(), []

    def fn(i):
        if threading.current_thread() is main:
            assert started.wait(10)  # a helper has an item
            threading.Timer(0.1, lambda: signal.pthread_kill(main.ident, signal.SIGINT)).start()
            raise KeyboardInterrupt  # the first Ctrl-C; the timer's is the second, during the wait
        started.set()
        time.sleep(0.5)
        done.append(i)

    with pytest.raises(KeyboardInterrupt):
        _pool.map_largest_first(fn, [0, 1], [1 << 20] * 2, 2)
    assert len(done) == 1  # the helper's item had finished


def test_a_child_forked_while_the_pool_lock_is_held_still_codes():
    """Another thread held the pool's lock at the fork: the child has its own lock and pool."""
    with _pool._POOL_LOCK:  # as if another thread were inside _submit at the fork
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a deadlock ends the child with SIGALRM
            ok = _pool.map_largest_first(lambda i: i * 2, [0, 1, 2], [1 << 20] * 3, 2) == [0, 2, 4]
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture(autouse=True)
def _no_cgroups(tmp_path, monkeypatch):
    """No CPU quota unless a test writes one: the machine running the tests may have its own."""
    monkeypatch.setattr(_pool, "PROC_CGROUP", str(tmp_path / "proc-{pid}-cgroup"))
    monkeypatch.setattr(_pool, "PROC_MOUNTINFO", str(tmp_path / "mountinfo"))
    monkeypatch.setattr(_pool, "_QUOTAS", {})


V2 = "30 25 0:26 {root} {point} rw,nosuid - cgroup2 cgroup2 rw\n"
V1 = "31 25 0:27 {root} {point} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
V1_MEMORY = "32 25 0:28 / {point} rw,nosuid - cgroup cgroup rw,memory\n"


def _cgroups(tmp_path, membership: dict, mounts: list[tuple[str, str, str]], files: dict) -> None:
    """Write ``/proc/<pid>/cgroup`` texts (``membership``: pid -> text), a ``mountinfo`` of
    ``mounts`` (line template, mount root, mount point under ``tmp_path / "fs"``) and cgroup files
    (``files``: path under ``tmp_path / "fs"`` -> content), where :func:`_pool.cpu_quota` reads them."""
    for pid, text in membership.items():  # (surrogates stand for bytes that are not UTF-8)
        (tmp_path / f"proc-{pid}-cgroup").write_bytes(text.encode("utf-8", "surrogateescape"))
    fs = tmp_path / "fs"
    (tmp_path / "mountinfo").write_text("".join(
        line.format(root=root, point=str(fs / point).replace(" ", "\\040")) for line, root, point in mounts))
    for rel, content in files.items():
        f = fs / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(content)


@pytest.mark.parametrize("membership, mounts, files, want", [
    # v2 with a cgroup namespace: the container's own cgroup is the mount's root
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max": "200000 100000\n"}, 2.0),
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max": "max 100000\n"}, None),  # no limit
    # v2 nested: the least along the cgroup and its ancestors (a pod's limit above a container's)
    ("0::/kubepods/pod1/c1\n", [(V2, "/", "cg")], {"cg/kubepods/cpu.max": "max 100000", "cg/kubepods/pod1/cpu.max":
                                                   "150000 100000", "cg/kubepods/pod1/c1/cpu.max": "400000 100000"}, 1.5),
    # v1 (hybrid, as on this project's machines) bind-mounted without a namespace: /proc names the
    # host's path, which is the mount's root; a sibling directory on the way is not an ancestor
    ("12:cpu,cpuacct:/docker/abc\n0::/\n", [(V1, "/docker/abc", "cpu,cpuacct"), (V2, "/", "unified")],
     {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("12:cpu,cpuacct:/docker/outer\n", [(V1, "/docker/outer", "cpu,cpuacct")],
     {"cpu,cpuacct/docker/cpu.cfs_quota_us": "50000", "cpu,cpuacct/docker/cpu.cfs_period_us": "100000"}, None),
    ("3:cpu:/\n", [(V1, "/", "cpu")], {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("3:cpu:/a\n", [(V1, "/", "cpu"), (V1_MEMORY, "/", "memory")],
     {"cpu/a/cpu.cfs_quota_us": "50000", "cpu/a/cpu.cfs_period_us": "100000",
      "memory/a/cpu.cfs_quota_us": "10000", "memory/a/cpu.cfs_period_us": "100000"}, 0.5),  # the cpu hierarchy only
    ("0::/a b\n", [(V2, "/", "c g")], {"c g/a b/cpu.max": "100000 100000"}, 1.0),  # escaped spaces in mountinfo
    ("0::/job\udcff\n", [(V2, "/", "cg")], {"cg/job\udcff/cpu.max": "300000 100000"}, 3.0),  # a name not in UTF-8
    # files that do not parse: no quota, never an error
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max": "lots 100000"}, None),
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max": "100000 0"}, None),
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max": "-50000 100000"}, None),
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max": "9" * 400 + " 1"}, None),
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max": ""}, None),
    ("0::/\n", [(V2, "/", "cg")], {"cg/cpu.max/x": "a directory where the file should be"}, None),
    ("garbage\n\n::\n", [(V2, "/", "cg")], {}, None),
])
def test_cpu_quota_reads_cgroup_v1_and_v2(tmp_path, membership, mounts, files, want):
    _cgroups(tmp_path, {"self": membership}, mounts, files)
    assert _pool.cpu_quota() == want


def test_cpu_quota_without_cgroup_files():
    assert _pool.cpu_quota() is None  # (the fixture's paths do not exist: not Linux, or the process is gone)


def test_cpu_quota_reads_a_fifo_as_nothing(tmp_path):
    _cgroups(tmp_path, {"self": "0::/\n"}, [(V2, "/", "cg")], {})
    (tmp_path / "fs" / "cg").mkdir(parents=True)
    os.mkfifo(tmp_path / "fs" / "cg" / "cpu.max")
    assert _pool.cpu_quota() is None  # (opening a FIFO would wait for a writer)


def test_cpu_quota_is_reused_for_a_while(tmp_path, monkeypatch):
    _cgroups(tmp_path, {"self": "0::/\n"}, [(V2, "/", "cg")], {"cg/cpu.max": "200000 100000"})
    assert _pool.cpu_quota() == 2.0
    (tmp_path / "fs" / "cg" / "cpu.max").write_text("100000 100000")
    assert _pool.cpu_quota() == 2.0  # within QUOTA_TTL_S
    monkeypatch.setattr(_pool, "QUOTA_TTL_S", 0.0)
    assert _pool.cpu_quota() == 1.0


@pytest.mark.parametrize("local, quota, parent, want", [
    (None, "200000 100000", "0::/job\n", 2),  # a limit of 2 CPUs among the 16 cores of the mask
    (None, "250000 100000", "0::/job\n", 2),  # rounded down: a third thread would be throttled
    (None, "50000 100000", "0::/job\n", 1),  # below one CPU: one thread
    (None, "3200000 100000", "0::/job\n", 8),  # above 8: the cap
    ("2", "400000 100000", "0::/job\n", 2),  # two torchrun ranks in the launcher's cgroup share its limit
    ("2", "400000 100000", "0::/job/launcher\n", 2),  # the limit is the parent cgroup's, over both
    ("2", "400000 100000", "0::/\n", 4),  # a rank in a cgroup of its own has the limit to itself
    ("4", "max 100000", "0::/job\n", 4),  # no limit: the mask's 16 shared among 4
])
def test_default_threads_stay_within_the_cpu_quota(tmp_path, monkeypatch, local, quota, parent, want):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    monkeypatch.setattr(_pool.os, "sched_getaffinity", lambda pid: set(range(16)))
    _cgroups(tmp_path, {"self": "0::/job/rank0\n" if "launcher" in parent else "0::/job\n", os.getppid(): parent},
             [(V2, "/", "cg")], {"cg/job/cpu.max": quota})
    assert _pool.default_threads() == want


@pytest.mark.parametrize("local, mask, parent, want", [
    (None, 16, 16, 8),  # no launcher: one per core, at most 8
    ("1", 2, 2, 2),
    ("4", 16, 16, 4),  # 4 ranks share the 16 cores of their cpuset (on a host of 128: os.cpu_count)
    ("8", 16, 16, 2),
    ("32", 16, 16, 1),  # more ranks than cores: one each
    ("4", 3, 16, 3),  # each rank pinned to its own 3 cores: the mask is its share already
    ("x", 16, 16, 8),  # not a count: ignored
])
def test_default_threads_share_the_host_among_local_ranks(monkeypatch, local, mask, parent, want):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    ppid = os.getppid()
    monkeypatch.setattr(_pool.os, "sched_getaffinity", lambda pid: set(range(parent if pid == ppid else mask)))
    monkeypatch.setattr(_pool.os, "cpu_count", lambda: 128)  # the host: not what is shared
    assert _pool.default_threads() == want


def test_default_threads_without_a_readable_parent(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def affinity(pid):
        if pid:
            raise ProcessLookupError(3, "No such process")
        return set(range(4))

    monkeypatch.setattr(_pool.os, "sched_getaffinity", affinity)
    monkeypatch.setattr(_pool.os, "cpu_count", lambda: 4)
    assert _pool.default_threads() == 2  # compared with the host's cores instead


def test_run_ranks_tells_each_rank_how_many_share_the_host():
    from torch_deltasync._ranks import run_ranks

    assert run_ranks(_local_world_size, 2) == ["2", "2"]


def _local_world_size(rank, world):
    return os.environ.get("LOCAL_WORLD_SIZE")


def test_threads_none_uses_the_default(monkeypatch):
    monkeypatch.setattr(_pool, "default_threads", lambda: 1)
    seen = set()
    items = list(range(6))
    _pool.map_largest_first(lambda i: seen.add(threading.get_ident()), items, [1 << 20] * 6, None)
    assert seen == {threading.get_ident()}  # one thread: the caller's
