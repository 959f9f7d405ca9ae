"""The vLLM backend's background stager (``integrations/vllm/_stager.py``) against a fake receiver:
it stages only the newest version newer than the held and the staged one, never retries a failed
version by itself, reports errors to its ``Status`` and backs off while they last, and stops and
wakes at once. No vLLM needed."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from torch_deltasync.errors import CorruptObjectError, StaleUpdateError, TransientStoreError
from torch_deltasync.integrations.vllm._stager import Stager, Status


class FakeReceiver:
    """``newest_version`` / ``version`` / ``prepare`` of a ``DeltaReceiver``, scripted."""

    def __init__(self, newest=None, version=None):
        self.newest, self.version = newest, version
        self.reads = 0
        self.prepared: list[int] = []
        self.released: list[int] = []  # versions whose prepared commit was released
        self.fail: dict[int, Exception] = {}  # version -> error its prepare raises
        self.hold: dict[int, threading.Event] = {}  # version -> gate its next prepare waits for
        self.entered = threading.Event()  # a prepare is waiting at its gate
        self.read_error: Exception | None = None

    def newest_version(self):
        self.reads += 1
        if self.read_error is not None:
            raise self.read_error
        return self.newest

    def prepare(self, version):
        gate = self.hold.pop(version, None)
        if gate is not None:
            self.entered.set()
            gate.wait(5)
        self.prepared.append(version)
        if version in self.fail:
            raise self.fail[version]
        return SimpleNamespace(version=version, release_prepared=lambda: self.released.append(version))


def _until(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def start():
    stagers = []

    def make(receiver, poll_s=0.01):
        s = Stager(receiver, poll_s, Status(None, 0))
        stagers.append(s)
        s.start()
        return s

    yield make
    for s in stagers:
        s.stop()
        s.join(5)


def test_stages_only_the_newest_version_newer_than_held_and_staged(start):
    r = FakeReceiver(newest=3, version=0)  # versions 1 and 2 were never seen: skipped
    s = start(r)
    _until(lambda: s.status.state["staged"] == 3)
    reads = r.reads
    _until(lambda: r.reads > reads + 3)  # polls go on; the staged version is not staged again
    assert r.prepared == [3] and s.status.state["newest"] == 3
    assert s.take(3).version == 3
    r.version = 3  # the commit lands
    s.release()
    assert s.take(3) is None  # handed over once
    s.release()
    r.newest = 2  # older than the held version (e.g. a stale LATEST): never staged
    reads = r.reads
    _until(lambda: r.reads > reads + 3)
    r.newest = 4
    _until(lambda: r.prepared == [3, 4])


def test_a_failed_version_is_not_retried_by_the_stager(start):
    r = FakeReceiver(newest=5, version=4)
    r.fail[5] = CorruptObjectError("bad object")
    s = start(r)
    _until(lambda: s.status.state["error"] == "CorruptObjectError: bad object")
    time.sleep(0.3)  # many poll periods
    assert r.prepared == [5]
    assert s.take(5) is None  # the commit RPC prepares it itself and raises the reason
    s.release()  # the commit failed: the engine keeps version 4
    r.newest = 6
    _until(lambda: s.status.state["staged"] == 6)
    assert r.prepared == [5, 6] and s.status.state["error"] is None


def test_a_stale_update_is_looked_at_again(start):
    r = FakeReceiver(newest=1)
    r.fail[1] = StaleUpdateError("a commit came in between")
    s = start(r)
    _until(lambda: len(r.prepared) >= 2)  # not a failure: tried again on the next poll
    del r.fail[1]
    _until(lambda: s.status.state["staged"] == 1)
    assert s.status.state["error"] is None


def test_store_errors_are_reported_and_backed_off(start):
    r = FakeReceiver(newest=None)
    r.read_error = TransientStoreError("HTTP 503 SlowDown")
    s = start(r, poll_s=0.01)
    _until(lambda: s.status.state["error"] == "TransientStoreError: HTTP 503 SlowDown")
    time.sleep(0.6)
    # pauses of 0.02, 0.04, 0.08, 0.16, 0.32 s: about 6 reads, where 0.01 s polls would make ~60
    assert r.reads <= 10
    r.read_error, r.newest = None, 2
    s.wake()  # the back-off pause ends at once
    _until(lambda: s.status.state["staged"] == 2, timeout_s=2.0)


def test_stop_and_wake_act_at_once(start):
    r = FakeReceiver(newest=None)
    s = start(r, poll_s=3600)
    _until(lambda: r.reads == 1)
    r.newest = 1
    t0 = time.monotonic()
    s.wake()
    _until(lambda: s.status.state["staged"] == 1, timeout_s=2.0)
    s.stop()
    s.join(2.0)
    assert not s.is_alive() and time.monotonic() - t0 < 2.0 and r.reads == 2


def test_take_waits_while_that_version_is_being_staged(start):
    r = FakeReceiver(newest=1)
    release = r.hold[1] = threading.Event()
    s = start(r)
    _until(lambda: s._busy == 1)
    got = []
    taker = threading.Thread(target=lambda: got.append(s.take(1)))
    taker.start()
    time.sleep(0.1)
    assert taker.is_alive()  # waits for the stage in progress
    release.set()
    taker.join(5)
    assert got[0].version == 1


def test_the_replaced_staged_version_is_kept_for_a_commit_on_its_way(start):
    """A driver reads ``staged == 5`` and commits 5; meanwhile the stager staged 6. The commit still
    finds 5 staged (``kept``), until the next version starts staging: at most two staged updates.
    One poll per ``wake`` (``poll_s`` of an hour), so every round is the test's."""
    r = FakeReceiver(newest=5, version=4)
    release = r.hold[7] = threading.Event()
    s = start(r, poll_s=3600)
    _until(lambda: s.status.state["staged"] == 5)
    r.newest = 6
    s.wake()
    _until(lambda: s.status.state["staged"] == 6)
    assert s.status.state["kept"] == 5 and r.prepared == [5, 6]
    assert r.released == [5]  # kept: its modules re-packed ahead are not held too
    five = s.take(5)
    assert five is not None and five.version == 5
    # the commit of 5 makes 6 (staged on 4) stale: both were dropped, and the file says so
    assert s._staged is None and s._kept is None
    assert s.status.state["staged"] is None and s.status.state["kept"] is None
    r.version = 5  # committed
    s.release()  # 6 is staged again, on 5
    _until(lambda: s.status.state["staged"] == 6)
    assert r.prepared == [5, 6, 6] and s.status.state["kept"] is None
    r.newest = 7
    s.wake()
    _until(lambda: s._busy == 7)
    assert s.status.state["kept"] is None and s._kept is None and s._staged.version == 6  # 7 being built
    release.set()
    _until(lambda: s.status.state["staged"] == 7)
    assert s.status.state["kept"] == 6
    r.newest = 8
    s.wake()
    _until(lambda: s.status.state["staged"] == 8)
    assert s.status.state["kept"] == 7 and r.prepared == [5, 6, 6, 7, 8]
    assert r.released == [5, 6, 7]
    assert s.take(6) is None  # 6 was dropped when 8 started staging
    s.release()


def test_nothing_is_staged_while_a_commit_runs_and_what_was_staged_before_it_is_dropped(start):
    """Between ``take`` and ``release`` (the commit RPC) the stager stages nothing: it would read the
    weights being written and compete with the paused engine's commit for the CPU. A staging that
    began before the commit and ends during it was read from the old state: dropped, staged again
    after ``release``; an error it raised is not the version's fault (not marked failed)."""
    r = FakeReceiver(newest=5, version=4)
    gate = r.hold[6] = threading.Event()
    r.fail[6] = CorruptObjectError("read while the commit wrote")  # e.g. a torn old value
    s = start(r, poll_s=0.01)
    _until(lambda: s.status.state["staged"] == 5)
    r.newest = 6
    assert r.entered.wait(5)  # 6 is being staged, on 4
    assert s.take(5).version == 5  # the commit of 5 begins while 6 is being staged
    r.version = 5
    gate.set()  # 6's staging ends (badly) during the commit
    reads = r.reads
    _until(lambda: r.reads > reads + 5)  # polls go on during the commit ...
    assert r.prepared == [5, 6] and s._staged is None and s._failed is None  # ... but nothing is staged
    assert s.status.state["staged"] is None and s.status.state["error"] is None  # not reported either
    del r.fail[6]  # read from a consistent state now
    s.release()
    _until(lambda: s.status.state["staged"] == 6)  # staged again, on 5
    assert r.prepared == [5, 6, 6] and s.status.state["kept"] is None


def test_a_staging_that_began_before_a_commit_is_not_kept(start):
    r = FakeReceiver(newest=5, version=4)
    gate = r.hold[6] = threading.Event()
    s = start(r, poll_s=3600)
    _until(lambda: s.status.state["staged"] == 5)
    r.newest = 6
    s.wake()
    assert r.entered.wait(5)
    assert s.take(5).version == 5
    r.version = 5
    gate.set()  # 6, read from version 4's weights, is done during the commit
    _until(lambda: s._busy is None)
    assert s._staged is None and s.status.state["staged"] is None and r.prepared == [5, 6]
    s.release()  # and staged again on 5
    _until(lambda: s.status.state["staged"] == 6)
    assert r.prepared == [5, 6, 6]


def test_a_version_not_newer_than_the_staged_one_is_not_staged(start):
    r = FakeReceiver(newest=6, version=4)
    s = start(r)
    _until(lambda: s.status.state["staged"] == 6)
    r.newest = 5  # a listing that went back (e.g. a stale LATEST): 6 stays staged, 5 is not staged
    reads = r.reads
    _until(lambda: r.reads > reads + 5)
    assert r.prepared == [6] and s._staged.version == 6 and s.status.state["staged"] == 6


def test_a_readiness_file_that_cannot_be_written_does_not_stop_staging(start, tmp_path, monkeypatch, caplog):
    """A full or removed ``status_dir`` is logged; the stager and the commit go on (before, an
    ``OSError`` inside ``take`` could leave the stager holding for good)."""
    r = FakeReceiver(newest=5, version=4)
    s = Stager(r, 0.01, Status(str(tmp_path), 0))
    s.start()
    try:
        _until(lambda: s.status.state["staged"] == 5)
        def full(src, dst):  # the temporary file was written; putting it in place fails
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", full)
        assert s.take(5).version == 5  # no error: the file is only advice
        r.version = 5
        s.release()
        r.newest = 6
        _until(lambda: s.status.state["staged"] == 6)  # staging goes on
        assert "cannot write the readiness file" in caplog.text and "No space left" in caplog.text
        assert not list(tmp_path.glob(".rank-*"))  # no temporary file left behind
        monkeypatch.undo()
        r.newest = 7
        _until(lambda: json.loads((tmp_path / "rank-0.json").read_text())["staged"] == 7)
    finally:
        s.stop()
        s.join(5)
