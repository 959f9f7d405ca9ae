"""``torch_deltasync.follow`` (``deltasync follow``) in one process: updates, reporting, stopping
rules, a corrupt version that is reported once while the model keeps what it held, and store
outages that are ridden out."""

from __future__ import annotations

import io

import pytest
import torch

from helpers import PassThroughStore

from torch_deltasync import DeltaSender, LocalStore
from torch_deltasync.errors import TransientStoreError, VersionNotFoundError
from torch_deltasync.cli import main
from torch_deltasync.follow import follow
from torch_deltasync.manifest import load_manifest
from torch_deltasync.testing import first_difference, state_bits


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200, 9, generator=g) * 0.02, "b": torch.randn(7, generator=g) * 0.02}


def _step(w, k):
    with torch.no_grad():
        w["w"].view(-1)[k::13] += 3e-3


def test_follow_applies_the_newest_version_and_reports_it(tmp_path):
    store = LocalStore(tmp_path)
    w = _weights()
    sender = DeltaSender(w, store, anchor_every=100)
    for k in range(3):
        if k:
            before = state_bits(w)
            _step(w, k)
        sender.publish()
    after = state_bits(w)
    changed = sum(int((after[n] != before[n]).sum()) for n in after)  # version 1 -> 2, counted here
    out = io.StringIO()
    report = follow(store, idle_timeout_s=0.2, poll_s=0.01, out=out)
    assert report.versions == [2] and report.failures == []
    row = report.rows[0]
    assert row["kind"] == "delta" and row["path"] == "anchor" and row["applied"] == 3
    assert row["density"] == changed / (200 * 9 + 7) and 0 < row["density"] < 1
    assert row["nbytes"] == sum(store.size(k) for k in store.list("objects"))
    assert first_difference(report.model, {n: t.to(torch.bfloat16) for n, t in w.items()}) is None
    assert "version       2 delta  path anchor   3 applied" in out.getvalue()
    # stopping rules
    assert follow(store, max_updates=1, idle_timeout_s=None, out=io.StringIO()).versions == [2]
    assert follow(store, until_version=2, idle_timeout_s=None, out=io.StringIO()).versions == [2]


def test_follow_waits_for_a_first_version(tmp_path):
    out = io.StringIO()
    with pytest.raises(VersionNotFoundError, match="no version appeared within 0.1 s"):
        follow(LocalStore(tmp_path), idle_timeout_s=0.1, poll_s=0.01, out=out)
    # said once, at once: a follower started before its writer looked stuck
    assert out.getvalue() == f"waiting for a first version in {LocalStore(tmp_path).describe()} (up to 0.1 s)\n"


def test_corrupt_version_is_reported_once_and_skipped(tmp_path, capsys):
    store = LocalStore(tmp_path)
    w = _weights()
    sender = DeltaSender(w, store, anchor_every=2)
    sender.publish()  # 0: anchor
    _step(w, 1)
    sender.publish()  # 1: delta
    key = load_manifest(store, 1).objects[0].key
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF
    store.put(key, bytes(data))  # sha256 no longer matches the manifest
    assert main(["follow", str(tmp_path), "--idle-timeout", "0.3", "--poll", "0.01"]) == 1
    printed = capsys.readouterr().out
    assert printed.count("FAILED") == 1 and "CorruptObjectError" in printed and "sha256" in printed
    assert "0 updates, 1 failed" in printed
    _step(w, 2)
    sender.publish()  # 2: anchor, so the corrupt delta is not needed any more
    report = follow(store, idle_timeout_s=0.3, poll_s=0.01, out=io.StringIO())
    assert report.versions == [2] and report.failures == []
    assert first_difference(report.model, {n: t.to(torch.bfloat16) for n, t in w.items()}) is None


def test_a_damaged_newest_manifest_does_not_stop_a_follower_from_starting(tmp_path):
    """The newest manifest was a 0-byte file: follow() (and `deltasync follow`) exited at start
    with its JSON error, although versions 0-2 were fine. It is reported once and the follower
    applies the newest readable version."""
    store = LocalStore(tmp_path)
    w = _weights()
    sender = DeltaSender(w, store, anchor_every=100)
    for k in range(4):
        _step(w, k)
        sender.publish()
        if k == 2:
            at_2 = {n: t.to(torch.bfloat16) for n, t in w.items()}
    store.put("versions/000000000003.json", b"")
    out = io.StringIO()
    report = follow(store, idle_timeout_s=0.3, poll_s=0.01, out=out)
    assert report.versions == [2] and len(report.failures) == 1 and "version 3: CorruptObjectError" in report.failures[0]
    assert out.getvalue().count("FAILED") == 1 and "(starting from an older version)" in out.getvalue()
    assert first_difference(report.model, at_2) is None


class _Outages(PassThroughStore):
    """A store that answers HTTP 503 (as a :class:`TransientStoreError`, the store's retries spent)
    to its next ``left`` calls; ``hook(key)`` runs before every ``get`` and may start an outage."""

    def __init__(self, inner):
        super().__init__(inner)
        self.left = 0
        self.refused = 0
        self.hook = None

    def _gate(self, key):
        if self.left > 0:
            self.left -= 1
            self.refused += 1
            raise TransientStoreError(f"{self.describe()}: cannot read {key!r}: HTTP 503 SlowDown "
                                      "(gave up after 6 attempts)")

    def get(self, key, *, start=None, end=None):
        if self.hook is not None:
            self.hook(key)
        self._gate(key)
        return super().get(key, start=start, end=end)

    def exists(self, key):
        self._gate(key)
        return super().exists(key)

    def list(self, prefix=""):
        self._gate(prefix)
        return super().list(prefix)

    def size(self, key):
        self._gate(key)
        return super().size(key)


def test_follow_rides_out_store_outages(tmp_path):
    """Bursts of 503s longer than the store's retries (``newest_version()`` used to be called
    outside any ``try``, so the first burst ended ``deltasync follow`` with exit 2): while waiting
    for the first version, between updates, and in the middle of downloading one."""
    inner = LocalStore(tmp_path)
    w = _weights()
    sender = DeltaSender(w, inner, anchor_every=100)
    sender.publish()  # 0
    _step(w, 1)
    sender.publish()  # 1
    store = _Outages(inner)
    store.left = 25  # 1. the store is down when the follower starts
    stage = []

    def hook(key):
        if key.startswith("objects/000000000001/") and not stage:
            stage.append("holding 1")
        elif key == "LATEST" and stage == ["holding 1"]:  # 2. down between updates, as version 2 lands
            stage.append("between")
            _step(w, 2)
            sender.publish()
            store.left = 30
        elif key.startswith("objects/000000000002/") and stage == ["holding 1", "between"]:
            stage.append("mid-update")  # 3. down while version 2's objects are read
            store.left = 10

    store.hook = hook
    out = io.StringIO()
    report = follow(store, idle_timeout_s=None, poll_s=0.001, until_version=2, out=out)
    assert stage == ["holding 1", "between", "mid-update"] and store.refused == 65
    assert report.versions == [1, 2] and report.failures == [] and report.outages == 3
    printed = out.getvalue()
    assert printed.count("store unavailable (TransientStoreError:") == 3 and "HTTP 503 SlowDown" in printed
    assert printed.count("store available again") == 3
    assert first_difference(report.model, {n: t.to(torch.bfloat16) for n, t in w.items()}) is None


def test_wait_for_newer_returns_what_the_receiver_does_not_hold(tmp_path):
    """The shared polling loop: a version newer than the held one is returned; a held or skipped one
    is not (``idle_timeout_s=0`` polls once); a set ``stop`` ends the wait; a read's ``None`` counts
    as nothing visible."""
    import threading

    from torch_deltasync import DeltaReceiver
    from torch_deltasync.follow import wait_for_newer

    store = LocalStore(tmp_path)
    w = _weights()
    sender = DeltaSender(w, store, anchor_every=100)
    receiver = DeltaReceiver({n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in w.items()}, store)
    assert wait_for_newer(receiver, poll_s=0.01, idle_timeout_s=0) is None  # nothing published
    sender.publish()
    assert wait_for_newer(receiver, poll_s=0.01, idle_timeout_s=0) == 0
    assert wait_for_newer(receiver, poll_s=0.01, idle_timeout_s=0, skip={0}.__contains__) is None
    assert wait_for_newer(receiver, poll_s=0.01, idle_timeout_s=0, read=lambda: None) is None
    receiver.update()
    assert wait_for_newer(receiver, poll_s=0.01, idle_timeout_s=0) is None  # version 0 is held
    stop = threading.Event()
    stop.set()
    assert wait_for_newer(receiver, poll_s=3600, stop=stop) is None  # no idle bound: only stop ends it
    _step(w, 1)
    sender.publish()
    assert wait_for_newer(receiver, poll_s=3600, stop=stop) == 1  # a newer version wins over stop
    receiver.close()


def test_follow_newer_hands_each_newer_version_and_backs_off_on_errors(tmp_path):
    """The background follower's loop: every newer version goes to ``handle`` once it is held
    (``skip`` refuses the rest); errors go to ``on_error`` with pauses that double up to
    ``max_backoff_s``; ``stop`` (with ``wake``) ends it at once."""
    import threading
    import time

    from torch_deltasync import DeltaReceiver
    from torch_deltasync.follow import follow_newer

    store = LocalStore(tmp_path)
    w = _weights()
    sender = DeltaSender(w, store, anchor_every=100)
    sender.publish()
    receiver = DeltaReceiver({n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in w.items()}, store)
    handled, errors, reads = [], [], []
    stop, wake = threading.Event(), threading.Event()
    failing = [True]

    def handle(v):
        handled.append(v)
        if failing[0]:
            raise RuntimeError(f"cannot apply {v}")
        receiver.update(v)

    def read():
        reads.append(time.monotonic())
        return receiver.newest_version()

    t = threading.Thread(target=follow_newer, args=(receiver, handle),
                         kwargs=dict(poll_s=0.01, stop=stop, wake=wake, read=read, on_error=errors.append,
                                     max_backoff_s=0.08))
    t.start()
    time.sleep(0.5)
    assert handled[0] == 0 and all(v == 0 for v in handled) and len(errors) == len(handled)
    assert 4 <= len(reads) <= 12  # pauses 0.02, 0.04, 0.08, 0.08, ...: not every 0.01 s
    failing[0] = False
    _step(w, 1)
    sender.publish()
    deadline = time.monotonic() + 5
    while receiver.version != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stop.set()
    wake.set()
    t.join(2)
    assert not t.is_alive() and handled[-1] == 1
    receiver.close()


def test_poll_until_returns_the_first_result_or_none_after_the_timeout():
    from torch_deltasync.follow import poll_until

    calls = []

    def check():
        calls.append(1)
        return "ready" if len(calls) == 3 else None

    assert poll_until(check, timeout_s=5, poll_s=0.001) == "ready" and len(calls) == 3
    assert poll_until(lambda: None, timeout_s=0, poll_s=3600) is None  # polls once


# --- durations are checked at entry: a NaN used to poll forever, a poll interval <= 0 to spin -------------

NAN, INF = float("nan"), float("inf")


class _Never:
    """A receiver whose store never shows a version; counts the reads."""

    version = None

    def __init__(self):
        self.reads = 0

    def newest_version(self):
        self.reads += 1
        return None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kw,error,message", [
    (dict(timeout_s=NAN), ValueError, r"poll_until: timeout_s must be a finite number of seconds >= 0, got nan"),
    (dict(timeout_s=INF), ValueError, r"poll_until: timeout_s must be a finite number of seconds >= 0, got inf"),
    (dict(timeout_s=-1), ValueError, r"poll_until: timeout_s must be a finite number of seconds >= 0, got -1"),
    (dict(timeout_s="1"), TypeError, r"poll_until: timeout_s must be a number of seconds >= 0, got str '1'"),
    (dict(timeout_s=None), TypeError, r"poll_until: timeout_s must be a number of seconds >= 0, got NoneType"),
    (dict(poll_s=-1), ValueError, r"poll_until: poll_s must be a finite number of seconds > 0, got -1"),
    (dict(poll_s=0), ValueError, r"poll_until: poll_s must be a finite number of seconds > 0, got 0"),
    (dict(poll_s=NAN), ValueError, r"poll_until: poll_s must be a finite number of seconds > 0, got nan"),
    (dict(poll_s=True), TypeError, r"poll_until: poll_s must be a number of seconds > 0, got bool True"),
])
def test_poll_until_refuses_durations_that_are_not_finite_seconds(kw, error, message):
    from torch_deltasync.follow import poll_until

    calls = []
    with pytest.raises(error, match=message):
        poll_until(lambda: calls.append(1), **{"timeout_s": 0.05, "poll_s": 0.01, **kw})
    assert calls == []  # refused before the first poll


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kw,error,message", [
    (dict(idle_timeout_s=NAN), ValueError, r"wait_for_newer: idle_timeout_s must be a finite number of seconds >= 0, "
                                           r"got nan; pass None to wait without a time limit"),
    (dict(idle_timeout_s=INF), ValueError, r"wait_for_newer: idle_timeout_s must be a finite .*got inf; pass None"),
    (dict(idle_timeout_s=-1), ValueError, r"wait_for_newer: idle_timeout_s must be a finite .*>= 0, got -1"),
    (dict(idle_timeout_s="1"), TypeError, r"wait_for_newer: idle_timeout_s must be a number of seconds >= 0 or None, "
                                          r"got str '1'"),
    (dict(poll_s=-1), ValueError, r"wait_for_newer: poll_s must be a finite number of seconds > 0, got -1"),
    (dict(poll_s=0), ValueError, r"wait_for_newer: poll_s must be a finite number of seconds > 0, got 0"),
    (dict(poll_s=NAN), ValueError, r"wait_for_newer: poll_s must be a finite number of seconds > 0, got nan"),
    (dict(poll_s=None), TypeError, r"wait_for_newer: poll_s must be a number of seconds > 0, got NoneType None"),
])
def test_wait_for_newer_refuses_durations_that_are_not_finite_seconds(kw, error, message):
    from torch_deltasync.follow import wait_for_newer

    receiver = _Never()
    with pytest.raises(error, match=message):
        wait_for_newer(receiver, **{"poll_s": 0.01, "idle_timeout_s": 0.05, **kw})
    assert receiver.reads == 0  # refused before the first poll
    assert wait_for_newer(receiver, poll_s=0.01, idle_timeout_s=0.05) is None  # valid values: unchanged


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kw,error,message", [
    (dict(poll_s=0), ValueError, r"follow_newer: poll_s must be a finite number of seconds > 0, got 0"),
    (dict(poll_s=-1), ValueError, r"follow_newer: poll_s must be a finite number of seconds > 0, got -1"),
    (dict(poll_s=NAN), ValueError, r"follow_newer: poll_s must be a finite number of seconds > 0, got nan"),
    (dict(poll_s="0.1"), TypeError, r"follow_newer: poll_s must be a number of seconds > 0, got str '0.1'"),
    (dict(max_backoff_s=-1), ValueError, r"follow_newer: max_backoff_s must be a finite number of seconds > 0, got -1"),
    (dict(max_backoff_s=0), ValueError, r"follow_newer: max_backoff_s must be a finite number of seconds > 0, got 0"),
    (dict(max_backoff_s=NAN), ValueError, r"follow_newer: max_backoff_s must be a finite .*got nan"),
])
def test_follow_newer_refuses_pauses_that_would_spin(kw, error, message):
    """``follow_newer`` loops until ``stop``: with a pause of 0 or less (or NaN) it used to spin."""
    import threading

    from torch_deltasync.follow import follow_newer

    receiver, handled = _Never(), []
    with pytest.raises(error, match=message):
        follow_newer(receiver, handled.append, stop=threading.Event(), **{"poll_s": 0.01, **kw})
    assert receiver.reads == 0 and handled == []


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kw,error,message", [
    (dict(poll_s=0), ValueError, r"follow: poll_s must be a finite number of seconds > 0, got 0"),
    (dict(poll_s=-1), ValueError, r"follow: poll_s must be a finite number of seconds > 0, got -1"),
    (dict(idle_timeout_s=NAN), ValueError, r"follow: idle_timeout_s must be a finite number of seconds >= 0, got nan; "
                                           r"pass None to wait without a time limit"),
    (dict(idle_timeout_s=-1), ValueError, r"follow: idle_timeout_s must be a finite .*got -1"),
])
def test_follow_refuses_durations_that_are_not_finite_seconds(tmp_path, kw, error, message):
    with pytest.raises(error, match=message):
        follow(LocalStore(tmp_path), out=io.StringIO(), **{"poll_s": 0.01, "idle_timeout_s": 0.05, **kw})


def test_the_cli_keeps_inf_as_never_and_refuses_an_infinite_poll(tmp_path, capsys, monkeypatch):
    """``--idle-timeout inf`` meant "never" (as ``<= 0`` does) before ``follow`` refused infinite
    timeouts: it still does; ``--poll inf`` is refused by the parser, as ``--poll -1`` is."""
    import torch_deltasync.follow as follow_module

    seen = []

    def fake_follow(store, **kw):
        seen.append(kw["idle_timeout_s"])
        return follow_module.FollowReport()

    monkeypatch.setattr(follow_module, "follow", fake_follow)
    for value, expected in (("inf", None), ("0", None), ("-1", None), ("2.5", 2.5)):
        assert main(["follow", str(tmp_path), "--idle-timeout", value]) == 0
        assert seen.pop() == expected
    for bad in ("inf", "nan", "0"):
        with pytest.raises(SystemExit) as e:
            main(["follow", str(tmp_path), "--poll", bad])
        assert e.value.code == 2 and "--poll: must be a positive finite number" in capsys.readouterr().err
