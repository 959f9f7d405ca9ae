"""``torch_deltasync.follow`` (``deltasync follow``) in one process: updates, reporting, stopping
rules, and a corrupt version that is reported once while the model keeps what it held."""

from __future__ import annotations

import io

import pytest
import torch

from torch_deltasync import DeltaSender, LocalStore, VersionNotFoundError
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
    with pytest.raises(VersionNotFoundError, match="no version appeared within 0.1 s"):
        follow(LocalStore(tmp_path), idle_timeout_s=0.1, poll_s=0.01, out=io.StringIO())


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
