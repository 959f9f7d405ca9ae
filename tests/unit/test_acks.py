"""``torch_deltasync.acks``: receivers' acknowledgements through the store (golden key and JSON), the
sender's wait (success, timeout naming the workers and the version, reported errors, dead
processes, skipping), and malformed acknowledgements, which are ignored (JSON only, never unpickled)."""

from __future__ import annotations

import json
import logging
import pickle
from types import SimpleNamespace

import pytest

from torch_deltasync import LocalStore
from torch_deltasync.acks import AckBook, StoreAcks, ack_message, parse_ack
from torch_deltasync.errors import SyncTimeoutError, WorkerError
from torch_deltasync.keys import MAX_VERSION, ack_key


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "bucket")


def _book(store_acks, n=2, **kw):
    return AckBook(store_acks, range(n), who="test sender", **kw)


def test_the_ack_key_and_json_are_pinned(store):
    """The wire layout other processes (older and newer) read: key and JSON fields."""
    assert ack_key("policy", 3) == "acks/policy/worker-00003.json"
    acks = StoreAcks("policy")
    assert acks.key(12) == "acks/policy/worker-00012.json"
    msg = ack_message(1, 7, None)
    assert set(msg) == {"worker", "version", "error", "time"} and isinstance(msg["time"], float)
    acks.post(store, msg)
    assert json.loads(store.get("acks/policy/worker-00001.json")) == msg


def test_post_then_poll_returns_the_newest_ack_of_each_worker(store):
    acks = StoreAcks("m")
    assert acks.poll(store, {0, 1}, 0.0) == []  # nothing written yet: no acknowledgement, no error
    acks.post(store, ack_message(0, 1, None))
    acks.post(store, ack_message(0, 2, None))  # overwrites worker 0's
    acks.post(store, ack_message(1, 2, "ChecksumMismatchError: x"))
    got = acks.poll(store, {0, 1}, 0.0)
    assert [(m["worker"], m["version"], m["error"]) for m in got] == [(0, 2, None), (1, 2, "ChecksumMismatchError: x")]
    assert acks.poll(store, {1}, 0.0)[0]["worker"] == 1  # only the workers asked for


def test_an_oversized_ack_is_garbage_and_never_read_whole(store):
    from torch_deltasync.acks import MAX_ACK_BYTES

    acks = StoreAcks("m")
    store.put(acks.key(0), json.dumps(ack_message(0, 3, None)).encode() + b" " * (1 << 20))
    acks.post(store, ack_message(1, 3, None))
    reads = []
    get = store.get
    store.get = lambda key, start=None, end=None: reads.append((start, end)) or get(key, start=start, end=end)
    assert [m["worker"] for m in acks.poll(store, {0, 1}, 0.0)] == [1]
    assert reads == [(0, MAX_ACK_BYTES + 1)] * 2


def test_a_failing_store_is_raised_not_waited_out(tmp_path):
    """A store that fails (here its bucket is gone) is no missing acknowledgement: the wait raises
    the store's error, naming it, instead of timing out."""
    from torch_deltasync.errors import StoreNotFoundError

    class Gone(LocalStore):
        def get(self, key, *, start=None, end=None):
            raise StoreNotFoundError(f"{self.describe()}: the bucket does not exist")

    gone = Gone(tmp_path / "b")
    with pytest.raises(StoreNotFoundError, match=f"{gone.describe()}: the bucket does not exist"):
        _book(StoreAcks("m")).wait(3, gone, timeout_s=30, poll_s=0.01)


def test_wait_returns_once_every_worker_acknowledged(store):
    acks = StoreAcks("m")
    book = _book(acks)
    acks.post(store, ack_message(0, 3, None))
    acks.post(store, ack_message(1, 4, None))  # a newer version also confirms 3
    book.wait(3, store, timeout_s=5, poll_s=0.01)
    assert book.acked == {0: 3, 1: 4}
    book.wait(4, store, workers=[1], timeout_s=5, poll_s=0.01)  # only worker 1 is waited for
    book.wait(4, store, workers=[7], timeout_s=0, poll_s=0.01)  # not an expected worker: ignored


def test_timeout_names_the_missing_workers_and_the_version(store):
    acks = StoreAcks("m")
    book = _book(acks, 3, skip_hint="Pass on_failure='skip' to carry on.")
    acks.post(store, ack_message(0, 5, None))
    acks.post(store, ack_message(2, 4, None))
    with pytest.raises(SyncTimeoutError) as err:
        book.wait(5, store, timeout_s=0.2, poll_s=0.01)
    text = str(err.value)
    assert text == ("test sender: worker 1 did not confirm version 5 within 0.2 s (it holds version None); "
                    "worker 2 did not confirm version 5 within 0.2 s (it holds version 4). "
                    "Pass on_failure='skip' to carry on.")
    assert "worker 0" not in text


def test_a_reported_error_raises_a_worker_error_at_once(store):
    acks = StoreAcks("m")
    book = _book(acks)
    acks.post(store, ack_message(1, 6, "CorruptObjectError: bad object"))
    with pytest.raises(WorkerError, match=r"test sender: worker 1 could not apply version 6: CorruptObjectError: "
                                          r"bad object"):
        book.wait(6, store, timeout_s=3600, poll_s=0.01)  # fails fast: no waiting for worker 0
    assert book.errors == {}  # reported once


def test_an_error_the_worker_recovered_from_is_not_raised_later(store):
    """A worker that could not connect (an error naming no version) and then acknowledged a version
    recovered: a later wait waits for it instead of raising the old error. So does one that
    acknowledges the version its error named (a retry that worked)."""
    acks = StoreAcks("m")
    book = _book(acks, 1)
    acks.post(store, ack_message(0, None, "RuntimeError: could not connect"))
    book.read(store, 0.0)
    acks.post(store, ack_message(0, 3, None))
    book.wait(3, store, timeout_s=5, poll_s=0.01)
    with pytest.raises(SyncTimeoutError, match=r"worker 0 did not confirm version 4 within 0.05 s \(it holds "
                                               r"version 3\)"):
        book.wait(4, store, timeout_s=0.05, poll_s=0.01)
    acks.post(store, ack_message(0, 6, "CorruptObjectError: bad object"))
    book.read(store, 0.0)
    acks.post(store, ack_message(0, 6, None))
    book.wait(6, store, timeout_s=5, poll_s=0.01)
    assert book.errors == {} and book.acked == {0: 6}


def test_a_dead_worker_process_is_noticed_within_one_poll(store):
    book = _book(StoreAcks("m"), 1)
    dead = SimpleNamespace(is_alive=lambda: False, pid=4242, exitcode=-9)
    with pytest.raises(WorkerError, match=r"worker 0 \(pid 4242\) exited with code -9 before applying version 1"):
        book.wait(1, store, timeout_s=3600, poll_s=0.01, process_of=lambda w: dead)


def test_a_worker_process_its_collector_closed_counts_as_dead(store):
    """torchrl closes its worker processes after a collector failed; a closed
    ``multiprocessing.Process`` raises ValueError on every question: a dead worker, not a crash."""
    import multiprocessing as mp

    proc = mp.get_context("spawn").Process(target=int)
    proc.start()
    proc.join()
    proc.close()
    book = _book(StoreAcks("m"), 1)
    with pytest.raises(WorkerError, match=r"worker 0 \(its process was closed by the collector after a failure\) "
                                          r"before applying version 1"):
        book.wait(1, store, timeout_s=3600, poll_s=0.01, process_of=lambda w: proc)


def test_many_silent_workers_are_counted_not_listed(store):
    book = _book(StoreAcks("m"), 1000)
    with pytest.raises(SyncTimeoutError) as err:
        book.wait(1, store, timeout_s=0.0, poll_s=0.01)
    text = str(err.value)
    assert "worker 7 did not confirm version 1" in text and "worker 8 did not" not in text
    assert "and 992 more workers, 8 to 999 (992 did not confirm in time, 0 failed)" in text and len(text) < 2000


def test_skip_carries_on_and_waits_again_once_the_worker_is_back(store, caplog):
    acks = StoreAcks("m")
    book = _book(acks, on_failure="skip")
    acks.post(store, ack_message(0, 1, None))
    with caplog.at_level(logging.WARNING, logger="torch_deltasync.acks"):
        book.wait(1, store, timeout_s=0.1, poll_s=0.01)  # worker 1 is silent: skipped, no error
    assert book.lost == {1} and "carrying on without worker(s) [1]" in caplog.text
    acks.post(store, ack_message(0, 2, None))
    book.wait(2, store, timeout_s=0, poll_s=0.01)  # the lost worker is not waited for
    acks.post(store, ack_message(1, 2, None))
    book.wait(2, store, timeout_s=0, poll_s=0.01)  # it acknowledged: back
    assert book.lost == set() and book.acked == {0: 2, 1: 2}


def test_on_failure_is_checked():
    with pytest.raises(ValueError, match="on_failure must be 'raise' or 'skip', got 'ignore'"):
        AckBook(StoreAcks("m"), [0], who="x", on_failure="ignore")


# (object, why it is refused)
MALFORMED = [
    (b"not json", "garbage bytes"),
    (b"\xff\xfe", "not UTF-8"),
    (pickle.dumps({"worker": 0, "version": 9}), "a pickle of a valid ack: never unpickled"),
    (json.dumps([0, 9]).encode(), "JSON, not an object"),
    (json.dumps({"worker": "0", "version": 9}).encode(), "worker not an int"),
    (json.dumps({"worker": True, "version": 9}).encode(), "worker a bool"),
    (json.dumps({"worker": 0, "version": "9"}).encode(), "version not an int"),
    (json.dumps({"worker": 0, "version": 9.0}).encode(), "version a float"),
    (json.dumps({"worker": 0, "version": 99999999999999999999999}).encode(), "version past MAX_VERSION"),
    (json.dumps({"worker": 0, "version": 10**12}).encode(), "version one past MAX_VERSION"),
    (json.dumps({"worker": 0, "version": -1}).encode(), "version negative"),
    (json.dumps({"worker": 1, "version": 9}).encode(), "worker 1 under worker 0's key"),
    (json.dumps({"worker": -1, "version": 9}).encode(), "worker negative"),
    (b"[" * 2000 + b"]" * 2000, "arrays nested past the parser's recursion limit"),
]


@pytest.mark.parametrize("raw,why", MALFORMED, ids=[w for _, w in MALFORMED])
def test_malformed_acks_are_ignored(store, raw, why):
    acks = StoreAcks("m")
    store.put(acks.key(0), raw)
    book = _book(acks, 1)
    with pytest.raises(SyncTimeoutError, match=r"worker 0 did not confirm version 9 within 0.05 s \(it holds "
                                               r"version None\)"):
        book.wait(9, store, timeout_s=0.05, poll_s=0.01)
    assert book.acked == {} and book.errors == {}


def test_parse_ack():
    assert parse_ack({"worker": 2, "version": 7, "error": None, "time": 1.0}) == (2, 7, None)
    assert parse_ack({"worker": 2, "version": None, "error": "E: x"}) == (2, None, "E: x")
    assert parse_ack({"worker": 2, "version": 7, "error": 5}) == (2, 7, None)  # a non-string error is no error
    assert parse_ack({"worker": 2}) == (2, None, None)
    assert parse_ack({"worker": 0, "version": MAX_VERSION}) == (0, MAX_VERSION, None)
    for bad in (None, [2, 7], {"version": 7}, {"worker": 1.0, "version": 7}, {"worker": 1, "version": False},
                {"worker": -1, "version": 7}, {"worker": 1, "version": -1}, {"worker": 1, "version": MAX_VERSION + 1},
                {"worker": 0, "version": 99999999999999999999999, "error": "E: x"}):
        assert parse_ack(bad) is None, bad


def test_an_ack_under_another_workers_key_does_not_confirm_that_worker(store, caplog):
    """Worker 0's object claiming to be worker 1's acknowledgement credits nobody (any process that
    may write one worker's key could otherwise confirm versions for every other worker)."""
    acks = StoreAcks("m")
    store.put(acks.key(0), json.dumps({"worker": 1, "version": 5}).encode())
    book = _book(acks, 2)
    with caplog.at_level(logging.DEBUG, logger="torch_deltasync.acks"):
        with pytest.raises(SyncTimeoutError, match=r"worker 1 did not confirm version 5 within 0.05 s \(it holds "
                                                   r"version None\)"):
            book.wait(5, store, workers=[1], timeout_s=0.05, poll_s=0.01)
    assert book.acked == {} and book.errors == {}
    assert "'acks/m/worker-00000.json': its worker field 1 is not 0" in caplog.text
    assert acks.poll(store, {0, 1}, 0.0) == []
    acks.post(store, ack_message(1, 5, None))  # worker 1's own: counts
    book.wait(5, store, workers=[1], timeout_s=5, poll_s=0.01)
    assert book.acked == {1: 5}


def test_a_version_no_run_could_have_never_counts_as_caught_up(store):
    acks = StoreAcks("m")
    store.put(acks.key(0), json.dumps({"worker": 0, "version": 99999999999999999999999}).encode())
    book = _book(acks, 1)
    with pytest.raises(SyncTimeoutError, match="worker 0 did not confirm version 5"):
        book.wait(5, store, timeout_s=0.05, poll_s=0.01)
    acks.post(store, ack_message(0, 5, None))
    book.wait(5, store, timeout_s=5, poll_s=0.01)
    with pytest.raises(SyncTimeoutError, match="worker 0 did not confirm version 6"):  # 5 was not "forever"
        book.wait(6, store, timeout_s=0.05, poll_s=0.01)


@pytest.mark.parametrize("model,error,message", [
    ("a/b", ValueError, r"StoreAcks\(model_key=...\): model name 'a/b' contains '/'; pass the model's name as a "
                        r"single key segment"),
    ("", ValueError, r"model name '' is not one key segment"),
    ("..", ValueError, r"model name '..' is not one key segment"),
    ("a b", ValueError, r"model name 'a b' is not one key segment"),
    (5, TypeError, r"StoreAcks\(model_key=...\): the model name must be a str, got int 5"),
    ("p" * 256, ValueError, r"model name 'p+' is 256 characters long \(a folder name takes 255 at most\)"),
])
def test_store_acks_refuses_a_model_name_that_is_not_one_key_segment(model, error, message):
    with pytest.raises(error, match=message):
        StoreAcks(model)
    with pytest.raises(error, match=message.replace(r"StoreAcks\(model_key=...\)", "ack_key")):
        ack_key(model, 0)


@pytest.mark.parametrize("worker,error,message", [
    (-1, ValueError, r"ack_message: worker must be >= 0 \(the receiver's index\), got -1"),
    (True, TypeError, r"ack_message: worker must be an int >= 0 \(the receiver's index\), got bool True"),
    ("0", TypeError, r"ack_message: worker must be an int >= 0 .*got str '0'"),
    (1.0, TypeError, r"ack_message: worker must be an int >= 0 .*got float 1.0"),
    (None, TypeError, r"ack_message: worker must be an int >= 0 .*got NoneType None"),
])
def test_ack_message_refuses_a_worker_that_is_not_an_index(store, worker, error, message):
    with pytest.raises(error, match=message):
        ack_message(worker, 1, None)
    with pytest.raises(error, match=message.replace("ack_message", "ack_key")):
        ack_key("m", worker)
    with pytest.raises(error, match=message.replace("ack_message", "ack_key")):  # a hand-made message
        StoreAcks("m").post(store, {"worker": worker, "version": 1, "error": None})
    assert store.list("acks") == []  # nothing like worker--0001.json was written


@pytest.mark.parametrize("version,error,message", [
    (-1, ValueError, r"ack_message: version must be an int in 0 ... 999999999999 or None, got -1"),
    (MAX_VERSION + 1, ValueError, r"ack_message: version must be an int in 0 ... 999999999999 or None, got "
                                  r"1000000000000"),
    (True, TypeError, r"ack_message: version must be .*, got bool True"),
    ("3", TypeError, r"ack_message: version must be .*, got str '3'"),
])
def test_ack_message_refuses_a_version_no_run_could_have(version, error, message):
    with pytest.raises(error, match=message):
        ack_message(0, version, None)


def test_ack_message_refuses_an_error_that_is_not_a_string():
    with pytest.raises(TypeError, match=r"ack_message: error must be a str \('TypeName: message'\) or None, got "
                                        r"int 5"):
        ack_message(0, 1, 5)
    assert ack_message(0, None, "E: x")["error"] == "E: x" and ack_message(0, MAX_VERSION, None)["version"] == MAX_VERSION


class _CountingChannel:
    def __init__(self):
        self.polls = 0

    def post(self, store, msg):
        pass

    def poll(self, store, workers, wait_s):
        self.polls += 1
        return []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kw,error,message", [
    (dict(timeout_s=float("nan")), ValueError, r"AckBook.wait: timeout_s must be a finite number of seconds >= 0, "
                                               r"got nan"),
    (dict(timeout_s=float("inf")), ValueError, r"AckBook.wait: timeout_s must be a finite .*got inf"),
    (dict(timeout_s=-1), ValueError, r"AckBook.wait: timeout_s must be a finite number of seconds >= 0, got -1"),
    (dict(timeout_s=10**400), ValueError, r"AckBook.wait: timeout_s must be a finite .*got inf"),  # was OverflowError
    (dict(timeout_s="5"), TypeError, r"AckBook.wait: timeout_s must be a number of seconds >= 0, got str '5'"),
    (dict(timeout_s=None), TypeError, r"AckBook.wait: timeout_s must be a number of seconds >= 0, got NoneType"),
    (dict(poll_s=-1), ValueError, r"AckBook.wait: poll_s must be a finite number of seconds > 0, got -1"),
    (dict(poll_s=0), ValueError, r"AckBook.wait: poll_s must be a finite number of seconds > 0, got 0"),
    (dict(poll_s=float("nan")), ValueError, r"AckBook.wait: poll_s must be a finite .*got nan"),
    (dict(poll_s=True), TypeError, r"AckBook.wait: poll_s must be a number of seconds > 0, got bool True"),
])
def test_wait_refuses_timeouts_and_poll_intervals_that_are_not_finite_seconds(kw, error, message):
    """A NaN timeout used to wait forever (every comparison with NaN is false), a negative poll
    interval to fail in ``time.sleep`` without naming ``poll_s``: both are refused before anything
    is read."""
    channel = _CountingChannel()
    book = AckBook(channel, [0], who="x")
    with pytest.raises(error, match=message):
        book.wait(5, None, **{"timeout_s": 0.05, "poll_s": 0.05, **kw})
    assert channel.polls == 0
    with pytest.raises(SyncTimeoutError):  # valid values: unchanged
        book.wait(5, None, timeout_s=0, poll_s=0.05)
