"""``AnchorPolicy``: fixed cadence and adaptive anchors, checked against the bytes actually stored."""

from __future__ import annotations

import math

import pytest
import torch

from torch_deltasync import AnchorPolicy, DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.keys import list_versions
from torch_deltasync.manifest import load_manifest

from helpers import delta_payloads
from remote_helpers import StepModel


def stored_kinds_and_bytes(store):
    """``[(version, kind, bytes)]`` read back from the store: for an anchor the bytes of its anchor
    objects, for a delta the bytes of its delta objects (the quantities the policy compares; an
    anchor's own delta against the previous version is for followers and does not count)."""
    out = []
    for v in list_versions(store):
        m = load_manifest(store, v)
        objs = m.anchor_objects if m.kind == "anchor" else m.delta_objects
        out.append((v, m.kind, sum(store.size(o.key) for o in objs)))
    return out


def expected_kinds(rows, *, every, ratio):
    """The kinds the policy's rules give for the stored bytes (written from the rule, not the code):
    anchor first; then anchor when ``v - last_anchor >= every`` or when the bytes of the deltas
    since the last anchor reach ``ratio`` x that anchor's bytes."""
    kinds, last, anchor_nbytes, chain = [], None, 0, 0
    for v, _, nbytes in rows:
        anchor = (last is None or (every and v - last >= every)
                  or (ratio is not None and chain >= ratio * anchor_nbytes))
        kinds.append("anchor" if anchor else "delta")
        if anchor:
            last, anchor_nbytes, chain = v, nbytes, 0
        else:
            chain += nbytes
    return kinds


def run(tmp_path, policy, steps=30, changes=40):
    """Publish ``steps`` versions; ``changes`` is elements per tensor and step, or a function of the step."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=11)
    sender = DeltaSender(model.tensors, store, anchor_policy=policy)
    for step in range(steps):
        model.changes = changes(step) if callable(changes) else changes
        model.set_step(step)
        sender.publish()
    return stored_kinds_and_bytes(store)


@pytest.mark.parametrize("every", [1, 3, 7])
def test_fixed_cadence(tmp_path, every):
    rows = run(tmp_path, AnchorPolicy(every=every), steps=15)
    assert [k for _, k, _ in rows] == ["anchor" if v % every == 0 else "delta" for v in range(15)]


@pytest.mark.parametrize("every", [None, 0])
def test_cadence_off_means_one_anchor(tmp_path, every):
    rows = run(tmp_path, AnchorPolicy(every=every), steps=8)
    assert [k for _, k, _ in rows] == ["anchor"] + ["delta"] * 7


@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_adaptive_anchor_when_chain_bytes_reach_a_fraction_of_the_anchor(tmp_path, ratio):
    rows = run(tmp_path, AnchorPolicy(every=None, chain_ratio=ratio))
    kinds = [k for _, k, _ in rows]
    assert kinds == expected_kinds(rows, every=None, ratio=ratio)
    anchors = [v for v, k, _ in rows if k == "anchor"]
    assert len(anchors) >= 3  # the rule fired, not only the first publish
    # a fresh receiver never downloads more than about (1 + ratio) anchors' worth
    anchor_nbytes = rows[0][2]
    for v, _, _ in rows:
        a = max(x for x in anchors if x <= v)
        chain = sum(b for x, _, b in rows if a < x <= v)
        assert chain < (ratio * anchor_nbytes) + max(b for _, k, b in rows if k == "delta")


def test_both_rules_whichever_fires_first(tmp_path):
    # small deltas first (the cadence fires), then large ones (the ratio fires earlier)
    rows = run(tmp_path, AnchorPolicy(every=4, chain_ratio=0.3), changes=lambda s: 5 if s < 15 else 150)
    kinds = [k for _, k, _ in rows]
    assert kinds == expected_kinds(rows, every=4, ratio=0.3)
    anchors = [v for v, k, _ in rows if k == "anchor"]
    assert anchors[:4] == [0, 4, 8, 12]  # cadence
    later_gaps = [b - a for a, b in zip(anchors[4:], anchors[5:])]
    assert later_gaps and max(later_gaps) < 4  # the ratio cut the chains short


@pytest.mark.parametrize("codec, ratio", [("raw", 1.0), ("packed", 0.5)])  # packed: dense steps ~0.8x full
def test_max_delta_ratio_ships_dense_versions_as_anchors_without_a_delta(tmp_path, codec, ratio):
    """Per version, after detection: a delta whose encoded size reaches the full bf16 size ships as an
    anchor with no delta; smaller ones stay deltas. A receiver following every version and one that
    jumps stay bit-exact through both kinds."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=13)
    dense_steps = {3, 4, 7}
    sender = DeltaSender(model.tensors, store, codec=codec, anchor_policy=AnchorPolicy(every=None, max_delta_ratio=ratio))
    follower = DeltaReceiver({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in model.shapes.items()}, store)
    jumper = DeltaReceiver({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in model.shapes.items()}, store)
    paths, states = {}, {}
    for step in range(10):
        model.changes = 10_000 if step in dense_steps else 20  # 10_000 > every tensor's numel
        model.set_step(step)
        assert sender.publish() == step
        follower.update()
        paths[step] = follower.last_stats.path
        want = states[step] = model.bits_at(step)  # bits_at reads the current ``changes``
        assert all(torch.equal(follower.target.tensors[n].view(torch.int16), want[n]) for n in want)
        if step in (5, 9):
            jumper.update()
            assert all(torch.equal(jumper.target.tensors[n].view(torch.int16), want[n]) for n in want)
    numel = sum(math.prod(s) for s in model.shapes.values())
    # What each delta takes, read from a reference run that stores every version as a delta.
    sizes = delta_payloads(codec, states, tmp_path / "reference")
    kinds = {}
    for v in range(10):
        m = load_manifest(store, v)
        if codec == "raw" and v:  # the raw codec's size is known in closed form: 4 + 2 bytes per change
            changed = sum(int((states[v][n] != states[v - 1][n]).sum()) for n in model.shapes)
            assert sizes[v] == 6 * changed
        expect_anchor = v == 0 or sizes[v] >= ratio * numel * 2
        assert (m.kind == "anchor") is expect_anchor, v
        if expect_anchor:
            assert m.base_version is None and not m.delta_objects
        else:
            assert m.base_version == v - 1 and not m.anchor_objects
        assert paths[v] == ("anchor" if expect_anchor else "delta")  # no delta to take
        kinds[v] = m.kind
    assert all(kinds[v] == "anchor" for v in dense_steps)  # (and the sparse step after each: it reverts them)
    assert sum(k == "delta" for k in kinds.values()) >= 3


def test_cadence_anchor_drops_a_delta_larger_than_the_weights(tmp_path):
    """An anchor due by cadence carries a delta against the previous version, unless that delta would
    be at least ``max_delta_ratio`` x the weights (raw: 6 bytes per change vs 2)."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=14)
    sender = DeltaSender(model.tensors, store, codec="raw", anchor_policy=AnchorPolicy(every=2, max_delta_ratio=1.0))
    receiver = DeltaReceiver({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in model.shapes.items()}, store)
    for step, changes in enumerate([20, 20, 20, 20, 10_000]):  # versions 2 and 4 are anchors by cadence
        model.changes = changes
        model.set_step(step)
        sender.publish()
        receiver.update()
        want = model.bits_at(step)
        assert all(torch.equal(receiver.target.tensors[n].view(torch.int16), want[n]) for n in want)
    m2, m3, m4 = (load_manifest(store, v) for v in (2, 3, 4))
    assert (m2.kind, m2.base_version, bool(m2.delta_objects)) == ("anchor", 1, True)  # small delta: carried
    assert (m3.kind, m3.base_version) == ("delta", 2)
    assert (m4.kind, m4.base_version, bool(m4.delta_objects)) == ("anchor", None, False)  # dense: dropped
    assert all(t.changed == t.numel for t in m4.tensors)


def test_max_delta_ratio_off_keeps_dense_versions_as_deltas(tmp_path):
    rows = run(tmp_path, AnchorPolicy(every=None), steps=4, changes=10_000)
    assert [k for _, k, _ in rows] == ["anchor", "delta", "delta", "delta"]


@pytest.mark.parametrize("kwargs, reason", [
    (dict(max_delta_ratio=0), "a zero ratio would anchor every version; use every=1"),
    (dict(max_delta_ratio=-1.0), "negative ratio"),
    (dict(every=-1), "negative cadence"),
    (dict(chain_ratio=0), "a zero ratio would anchor every version; use every=1"),
    (dict(chain_ratio=-0.5), "negative ratio"),
])
def test_policy_rejects_bad_values(kwargs, reason):
    with pytest.raises(ValueError):
        AnchorPolicy(**kwargs)


@pytest.mark.parametrize("policy, args, want, reason", [
    (AnchorPolicy(every=10), (19, 10, 0, 100), False, "9 versions since the anchor"),
    (AnchorPolicy(every=10), (20, 10, 0, 100), True, "10 versions since the anchor"),
    (AnchorPolicy(every=None, chain_ratio=0.5), (5, 0, 49, 100), False, "chain below half an anchor"),
    (AnchorPolicy(every=None, chain_ratio=0.5), (5, 0, 50, 100), True, "chain at half an anchor"),
    (AnchorPolicy(every=None, chain_ratio=0.5), (5, 0, 50, 0), False, "anchor size unknown: ratio off"),
])
def test_wants_anchor_table(policy, args, want, reason):
    assert policy.wants_anchor(*args) is want


def test_new_sender_on_an_existing_prefix_starts_with_an_anchor(tmp_path):
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=12)
    first = DeltaSender(model.tensors, store, anchor_every=100)
    for step in range(3):
        model.set_step(step)
        first.publish()
    first.close()  # a restart after a clean stop (a crashed writer's lease is taken over: test_lease.py)
    model.set_step(3)
    second = DeltaSender(model.tensors, store, anchor_every=100)
    assert second.publish() == 3 and load_manifest(store, 3).kind == "anchor"
    assert load_manifest(store, 3).run_id != load_manifest(store, 2).run_id
