"""The retry and deadline layer (``store/_retry.py``): which failures are retried (the classifier),
backoff and deadlines of :func:`call_with_retry`, :class:`RetryPolicy`'s checks, and the two
wrappers over a fault-injecting store: :class:`RetryingStore` (retries) and :class:`DeadlineStore`
(a deadline and nothing else). Many receivers through faults: ``test_store_faults.py``."""

from __future__ import annotations

import errno
import threading

import pytest

from torch_deltasync import LocalStore
from torch_deltasync.errors import CorruptObjectError, ObjectNotFoundError, StoreError, TransientStoreError
from torch_deltasync.store import DeadlineStore, RetryingStore, RetryPolicy
from torch_deltasync.store import _retry as retry_mod
from torch_deltasync.store.faults import FaultyStore
from torch_deltasync.store._retry import call_with_retry, classify_error

FAST = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.002, jitter=0.0, timeout_s=5.0)


# --- classifying failures ------------------------------------------------------------------------


class _Err(Exception):
    def __init__(self, response):
        super().__init__("boom")
        self.response = response


class _Resp:
    def __init__(self, status_code):
        self.status_code = status_code


CLASSIFY_TABLE = [
    (FileNotFoundError("k"), "missing", "a missing key"),
    (ObjectNotFoundError("k"), "missing", "our own missing-key error"),
    (PermissionError("denied"), "fatal", "credentials will not fix themselves"),
    (TimeoutError(), "transient", "timeout"),
    (ConnectionResetError(), "transient", "dropped connection"),
    (OSError(errno.EBUSY, "SlowDown"), "transient", "s3fs maps SlowDown/503 to EBUSY"),
    (OSError(errno.EIO, "weird"), "fatal", "unknown I/O error"),
    (_Err({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}), "transient", "botocore 503"),
    (_Err({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}), "fatal", "botocore 403"),
    (_Err(_Resp(429)), "transient", "HTTP 429 throttling"),
    (_Err(_Resp(502)), "transient", "HTTP 5xx"),
    (_Err(_Resp(400)), "fatal", "HTTP 400 bad request"),
    (TransientStoreError("x"), "transient", "a store that already classified it"),
    (StoreError("x"), "fatal", "a store error that is not transient"),
    (CorruptObjectError("bad key"), "reraise", "not a store failure"),
    (_Err({"Error": {"Code": "NoSuchBucket"}, "ResponseMetadata": {"HTTPStatusCode": 404}}), "no_store",
     "a missing bucket is not a missing key"),
    (ValueError("x"), "fatal", "anything else"),
]


@pytest.mark.parametrize("exc, verdict, reason", CLASSIFY_TABLE, ids=[r for *_, r in CLASSIFY_TABLE])
def test_classify_error(exc, verdict, reason):
    assert classify_error(exc) == verdict


def test_classify_looks_at_the_cause_chain():
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as inner:
            raise OSError(errno.EIO, "wrapped") from inner
    except OSError as e:
        assert classify_error(e) == "transient"


def test_transient_failures_are_retried_until_success(monkeypatch):
    calls, slept = [], []
    monkeypatch.setattr(retry_mod, "_sleep", slept.append)  # record the backoff instead of waiting

    def fn():
        calls.append(len(slept))  # how many sleeps came before this attempt
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    policy = RetryPolicy(attempts=5, base_delay_s=0.02, max_delay_s=1.0, jitter=0.0, timeout_s=None)
    assert call_with_retry(fn, policy=policy, store="s://x", op="read", key="k") == "ok"
    assert calls == [0, 1, 2]  # one sleep between consecutive attempts
    assert slept == [0.02, 0.04]  # exponential backoff: 0.02 s, then 0.04 s


def test_fatal_and_missing_are_not_retried():
    calls = []

    def denied():
        calls.append(1)
        raise PermissionError("AccessDenied")

    with pytest.raises(StoreError) as e:
        call_with_retry(denied, policy=FAST, store="s3://b/run", op="write", key="versions/1.json")
    assert len(calls) == 1 and not isinstance(e.value, TransientStoreError)
    assert str(e.value) == "s3://b/run: cannot write 'versions/1.json': PermissionError: AccessDenied"

    def missing():
        calls.append(1)
        raise FileNotFoundError("nope")

    with pytest.raises(ObjectNotFoundError, match=r"s3://b/run: no object 'k'"):
        call_with_retry(missing, policy=FAST, store="s3://b/run", op="read", key="k")
    assert len(calls) == 2


def test_giving_up_names_store_key_cause_and_attempts():
    with pytest.raises(TransientStoreError) as e:
        call_with_retry(lambda: (_ for _ in ()).throw(TimeoutError("read timed out")), policy=FAST,
                        store="hf://buckets/o/b", op="read", key="LATEST")
    assert str(e.value) == ("hf://buckets/o/b: cannot read 'LATEST': TimeoutError: read timed out "
                            "(gave up after 4 attempts)")


@pytest.mark.timeout(60)
def test_deadline_abandons_a_hung_call_and_retries():
    release = threading.Event()  # a hung socket: blocks until the test ends
    calls = []

    def hangs_once():
        calls.append(1)
        if len(calls) == 1:
            release.wait()
        return b"data"

    policy = RetryPolicy(attempts=3, base_delay_s=0.0, timeout_s=0.1)
    try:
        assert call_with_retry(hangs_once, policy=policy, store="s", op="read", key="k") == b"data"
        assert len(calls) == 2 and not release.is_set()  # answered by the retry while the first still hangs
        with pytest.raises(TransientStoreError, match=r"timed out after 0\.1 s \(gave up after 2 attempts\)"):
            call_with_retry(release.wait, policy=RetryPolicy(attempts=2, base_delay_s=0, timeout_s=0.1),
                            store="s", op="read", key="k")
    finally:
        release.set()


def test_a_failure_after_an_abandoned_attempt_is_transient():
    """An attempt left running past its deadline may still land (a manifest written late): a later
    attempt's permanent error must not tell the caller that nothing was written."""
    release = threading.Event()
    calls = []

    def hangs_then_denied():
        calls.append(1)
        if len(calls) == 1:
            release.wait()
        raise PermissionError("AccessDenied")

    try:
        with pytest.raises(TransientStoreError, match=r"AccessDenied, after an attempt that ran past its deadline"):
            call_with_retry(hangs_then_denied, policy=RetryPolicy(attempts=3, base_delay_s=0, timeout_s=0.1),
                            store="s", op="write", key="versions/000000000002.json")
        assert len(calls) == 2
    finally:
        release.set()


def test_deadline_grows_with_known_bytes():
    p = RetryPolicy(timeout_s=10.0, min_bytes_per_s=1e6)
    assert p.deadline_s() == 10.0 and p.deadline_s(5_000_000) == 15.0
    assert RetryPolicy(timeout_s=None).deadline_s(10**9) is None


def test_backoff_is_exponential_capped_and_jittered():
    p = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0, jitter=0.0)
    assert [p.delay_s(i) for i in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    j = RetryPolicy(base_delay_s=1.0, max_delay_s=1.0, jitter=0.5)
    import random

    rng = random.Random(0)
    delays = [j.delay_s(0, rng) for _ in range(200)]
    assert 0.5 <= min(delays) < 0.6 and 0.9 < max(delays) <= 1.0


@pytest.mark.parametrize("kwargs, match, reason", [
    (dict(attempts=0), "attempts must be an integer >= 1, got 0", "at least one attempt"),
    (dict(attempts=1.5), "attempts must be an integer >= 1, got 1.5", "attempts is an integer"),
    (dict(jitter=1.5), r"jitter must be in \[0, 1\], got 1.5", "jitter is a fraction"),
    (dict(timeout_s=0), "timeout_s must be > 0 or None, got 0", "a zero deadline never succeeds"),
    (dict(base_delay_s=-1), "base_delay_s and max_delay_s must be >= 0", "negative sleep"),
    (dict(min_bytes_per_s=0), "min_bytes_per_s must be > 0, got 0", "division by zero"),
])
def test_retry_policy_rejects_bad_values(kwargs, match, reason):
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**kwargs)


def test_retrying_store_over_faults(tmp_path):
    faulty = FaultyStore(LocalStore(tmp_path, fsync=False), error_rate=0.3, lost_ack_rate=0.2, seed=3)
    store = RetryingStore(faulty, RetryPolicy(attempts=30, base_delay_s=0, timeout_s=None))
    for i in range(50):
        store.put(f"k/{i}", str(i).encode())
    assert [store.get(f"k/{i}") for i in range(50)] == [str(i).encode() for i in range(50)]
    assert store.list("k") == sorted(f"k/{i}" for i in range(50))
    store.delete_many([f"k/{i}" for i in range(25)])
    assert len(store.list()) == 25
    assert faulty.injected["error"] > 10 and faulty.injected["lost_ack"] > 5


# --- RetryingStore and DeadlineStore over injected faults -----------------------------------------

NO_WAIT = RetryPolicy(attempts=3, base_delay_s=0.0, jitter=0.0, timeout_s=None)


@pytest.fixture
def local(tmp_path):
    return LocalStore(tmp_path / "bucket", fsync=False)


def test_retrying_store_gives_up_after_its_attempts_and_names_the_store(local):
    faulty = FaultyStore(local, error_rate=1.0)
    store = RetryingStore(faulty, NO_WAIT)
    with pytest.raises(TransientStoreError) as e:
        store.put("versions/000000000001.json", b"{}")
    where = f"faulty({local.describe()})"
    assert str(e.value) == (f"{where}: cannot write 'versions/000000000001.json': TransientStoreError: {where}: "
                            "injected failure of put 'versions/000000000001.json' (gave up after 3 attempts)")
    assert faulty.calls["put"] == 3 and faulty.injected["error"] == 3
    assert local.list() == []  # each attempt failed before it ran


def test_retrying_store_sleeps_the_policy_backoff_between_attempts(local, monkeypatch):
    slept = []
    monkeypatch.setattr(retry_mod, "_sleep", slept.append)
    store = RetryingStore(FaultyStore(local, error_rate=1.0),
                          RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.03, jitter=0.0, timeout_s=None))
    with pytest.raises(TransientStoreError, match=r"gave up after 4 attempts"):
        store.list("versions")
    assert slept == pytest.approx([0.01, 0.02, 0.03])  # doubling, capped at max_delay_s; none after the last


def test_retrying_store_does_not_retry_a_missing_key(local):
    faulty = FaultyStore(local)
    store = RetryingStore(faulty, NO_WAIT)
    with pytest.raises(ObjectNotFoundError):
        store.get("versions/000000000009.json")
    assert faulty.calls["get"] == 1


def test_a_lost_reply_is_retried_and_the_write_stays_whole(local):
    # The put took effect every time, but each reply was lost: the retry repeats a put that already
    # happened (harmless: the same bytes), and after the last attempt the caller is told.
    faulty = FaultyStore(local, lost_ack_rate=1.0, ops=("put",))
    store = RetryingStore(faulty, NO_WAIT)
    with pytest.raises(TransientStoreError, match=r"injected lost reply of put 'k' \(it took effect\)"):
        store.put("k", b"payload")
    assert faulty.calls["put"] == 3 and local.get("k") == b"payload"


def test_retrying_store_forwards_ranges_and_skips_empty_batches(local):
    faulty = FaultyStore(local)
    store = RetryingStore(faulty, NO_WAIT)
    store.put("k", b"0123456789")
    assert store.get("k", start=2, end=5) == b"234" and store.size("k") == 10 and store.exists("k")
    store.delete_many([])
    assert faulty.calls["delete"] == 0
    assert store.describe() == faulty.describe() and store.needs_deadline is False
    assert repr(store) == f"RetryingStore({faulty!r}, {NO_WAIT!r})"


def test_deadline_store_neither_retries_nor_rewrites_errors(local):
    faulty = FaultyStore(local, error_rate=1.0)
    store = DeadlineStore(faulty, timeout_s=5)
    with pytest.raises(TransientStoreError) as e:
        store.get("LATEST")
    assert str(e.value) == f"faulty({local.describe()}): injected failure of get 'LATEST'"  # the store's own
    assert faulty.calls["get"] == 1


@pytest.mark.timeout(60)
def test_deadline_store_abandons_a_stalled_call(local):
    local.put("LATEST", b"7")
    faulty = FaultyStore(local, stall_rate=1.0, stall_s=0.5)
    store = DeadlineStore(faulty, timeout_s=0.1)
    with pytest.raises(TransientStoreError, match=r"cannot read 'LATEST': no answer within 0\.1 s \(the store call "
                                                  r"deadline: raise it with open_store\(store, timeout_s=\.\.\.\)"):
        store.get("LATEST")
    assert faulty.calls["get"] == 1 and faulty.injected["stall"] == 1


@pytest.mark.timeout(60)
def test_deadline_store_allows_more_time_for_more_bytes(local):
    # 0.1 s + 5 bytes at 10 bytes/s = 0.6 s: a 0.3 s stall passes for the put, not for a stat.
    faulty = FaultyStore(local, stall_rate=1.0, stall_s=0.3)
    store = DeadlineStore(faulty, timeout_s=0.1, min_bytes_per_s=10)
    store.put("k", b"12345")
    assert local.get("k") == b"12345"
    with pytest.raises(TransientStoreError, match=r"no answer within 0\.1 s"):
        store.exists("k")


def test_deadline_store_needs_a_deadline(local):
    with pytest.raises(ValueError, match="DeadlineStore needs a deadline"):
        DeadlineStore(local, timeout_s=None)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        DeadlineStore(local, timeout_s=0)
    store = DeadlineStore(local, timeout_s=30)
    assert repr(store) == f"DeadlineStore({local!r}, timeout_s=30)" and store.needs_deadline is False
    assert store.policy.attempts == 1 and store.describe() == local.describe()


def test_a_deadline_beyond_what_a_thread_can_wait_is_none(tmp_path):
    """``timeout_s=float('inf')`` (or ``1e12``, ``deltasync ls --timeout inf``) raised
    ``OverflowError: timestamp out of range`` from every store call."""
    from torch_deltasync import open_store as open_

    store = open_(tmp_path, timeout_s=float("inf"))
    store.put("a", b"x")
    assert store.get("a") == b"x"
    mem = open_("memory://deadline-inf", retry=RetryPolicy(timeout_s=1e12))
    mem.put("k", b"y")
    assert mem.list("") == ["k"] and mem.get("k") == b"y"
