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
from torch_deltasync.keys import ack_key


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


def test_a_dead_worker_process_is_noticed_within_one_poll(store):
    book = _book(StoreAcks("m"), 1)
    dead = SimpleNamespace(is_alive=lambda: False, pid=4242, exitcode=-9)
    with pytest.raises(WorkerError, match=r"worker 0 \(pid 4242\) exited with code -9 before applying version 1"):
        book.wait(1, store, timeout_s=3600, poll_s=0.01, process_of=lambda w: dead)


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
    for bad in (None, [2, 7], {"version": 7}, {"worker": 1.0, "version": 7}, {"worker": 1, "version": False}):
        assert parse_ack(bad) is None
