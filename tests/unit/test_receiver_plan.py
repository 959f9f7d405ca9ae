"""``DeltaReceiver.plan``: the cheapest path across anchors, and never across runs without an anchor.

Expected costs are computed here from the objects in the store (their listed sizes) and the
``base_version`` links of the manifests, by trying every start a receiver could take; the planner's
own walk is not consulted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.errors import CorruptObjectError
from torch_deltasync.keys import list_versions, manifest_key
from torch_deltasync.manifest import Manifest, load_manifest

from remote_helpers import StepModel, assert_holds, bits_of, empty_target


def part_nbytes(store, version: int, kind: str) -> int:
    """Bytes of the ``kind`` objects (``anchor`` / ``delta``) stored for ``version``, from the listing."""
    return sum(store.size(k) for k in store.list(f"objects/{version:012d}") if f"/{kind}-r" in k)


def cheapest(store, held: int | None, target: int) -> tuple[int, str]:
    """``(bytes, path)`` of the cheapest way from ``held`` to ``target``, by trying every start:
    the held version (deltas after it) and every anchor on the target's chain (its anchor objects,
    then the deltas after it). Ties go to the delta path."""
    chain = [load_manifest(store, target)]
    while chain[-1].base_version is not None:
        chain.append(load_manifest(store, chain[-1].base_version))
    options = []
    for i, m in enumerate(chain):
        after = sum(part_nbytes(store, x.version, "delta") for x in chain[:i])  # versions after m
        if m.kind == "anchor":
            options.append((after + part_nbytes(store, m.version, "anchor"), "anchor"))
        if held is not None and m.version == held:
            options.append((after, "delta"))
    best = min(n for n, _ in options)
    return best, ("delta" if (best, "delta") in options else "anchor")


def publish(store, model: StepModel, steps, sender: DeltaSender, changes=lambda s: 12) -> dict[int, dict]:
    """Publish ``steps``; returns ``{version: bf16 bits}`` as published (``StepModel.bits_at`` reads
    the current ``changes``, so the bits are taken at each step)."""
    states = {}
    for step in steps:
        model.changes = changes(step)
        model.set_step(step)
        assert sender.publish() == step
        states[step] = model.bits_at(step)
    return states


def holds(target: dict[str, torch.Tensor], bits: dict[str, torch.Tensor]) -> bool:
    got = bits_of(target)
    return got.keys() == bits.keys() and all(torch.equal(got[n], bits[n]) for n in bits)


def receiver_at(store, bits: dict[str, torch.Tensor], version: int) -> DeltaReceiver:
    """A receiver that holds ``version`` (``bits`` written into its tensors, declared with ``assume``)."""
    target = empty_target({n: tuple(b.shape) for n, b in bits.items()})
    for n, b in bits.items():
        target[n].view(torch.int16).copy_(b)
    r = DeltaReceiver(target, store)
    r.assume(version)
    return r


def test_one_version_behind_an_anchor_crosses_it_by_its_delta_part(tmp_path):
    """v8 -> v11 across the anchor v10 (which carries a delta from v9): deltas 9, 10, 11, not the
    anchor (issue 15: the planner stopped at any anchor and downloaded it, 12x the bytes)."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=3)
    sender = DeltaSender(model.tensors, store, anchor_every=10)
    target = empty_target(model.shapes)
    receiver = DeltaReceiver(target, store)
    publish(store, model, range(9), sender)
    assert receiver.update() == 8
    publish(store, model, range(9, 12), sender)
    assert load_manifest(store, 10).kind == "anchor" and load_manifest(store, 10).base_version == 9

    plan = receiver.plan()
    want = sum(part_nbytes(store, v, "delta") for v in (9, 10, 11))
    assert (plan.path, [s.version for s in plan.steps], [s.kind for s in plan.steps]) == (
        "delta", [9, 10, 11], ["delta", "delta", "delta"])
    assert plan.nbytes == want < part_nbytes(store, 10, "anchor")
    assert receiver.update() == 11
    assert receiver.last_stats.nbytes == want and receiver.last_stats.path == "delta"
    assert_holds(target, model, 11)
    receiver.verify()


def test_a_receiver_at_v_minus_1_never_downloads_the_anchor_v(tmp_path):
    """docs/stores.md: a replica that follows every version reads only delta parts, anchors included."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=4)
    sender = DeltaSender(model.tensors, store, anchor_every=3)
    target = empty_target(model.shapes)
    receiver = DeltaReceiver(target, store)
    for step in range(8):
        publish(store, model, [step], sender)
        assert receiver.update() == step
        st = receiver.last_stats
        if step == 0:
            assert st.path == "anchor"
            continue
        assert (st.path, st.nbytes) == ("delta", part_nbytes(store, step, "delta"))
        assert_holds(target, model, step)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_held_version_takes_the_cheapest_path(tmp_path, seed):
    """Anchors every 4 versions (each with a delta part), and dense steps (deltas larger than the
    anchor) in between: from every held version (and from nothing) to every later target the
    planner's bytes equal the cheapest start, and the update is bit-exact."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=20 + seed)
    sender = DeltaSender(model.tensors, store, anchor_every=4, codec="raw")
    dense = {2, 5, 6} if seed == 0 else {1, 9, 10}
    states = publish(store, model, range(12), sender, changes=lambda s: 3000 if s in dense else 5)
    assert [load_manifest(store, v).kind for v in range(12)] == ["anchor", "delta", "delta", "delta"] * 3
    paths = set()
    for held in [None, *range(11)]:
        for target in range(held + 1 if held is not None else 0, 12):
            r = receiver_at(store, states[held], held) if held is not None else DeltaReceiver(empty_target(model.shapes), store)
            nbytes, path = cheapest(store, held, target)
            plan = r.plan(target)
            assert (plan.nbytes, plan.path) == (nbytes, path), (held, target, str(plan))
            paths.add(path)
            if held is not None and target in (held + 1, 11):
                assert r.update(target) == target and r.last_stats.nbytes == nbytes
                assert holds(r.target.tensors, states[target])
    assert paths == {"delta", "anchor"}  # both kinds of start were the cheapest somewhere


def test_a_reused_version_number_of_another_run_is_not_a_delta_base(tmp_path):
    """The prefix was wiped and a new run reused the numbers: the receiver's held v5 (run A) is not
    run B's v5, so it takes B's anchor instead of B's deltas on top of A's weights."""
    store = LocalStore(tmp_path / "b", fsync=False)
    a = StepModel(seed=30)
    target = empty_target(a.shapes)
    receiver = DeltaReceiver(target, store)
    sender_a = DeltaSender(a.tensors, store, anchor_every=100)
    publish(store, a, range(6), sender_a)
    assert receiver.update() == 5
    sender_a.close()
    store.delete_many(store.list(""))
    b = StepModel(seed=31)
    publish(store, b, range(8), DeltaSender(b.tensors, store, anchor_every=100))
    plan = receiver.plan()
    assert plan.path == "anchor" and [s.version for s in plan.steps] == list(range(8))
    assert "belongs to run" in plan.steps[0].reason
    assert receiver.update() == 7
    assert receiver.last_stats.recovered is False  # planned right, not repaired after a checksum failure
    assert_holds(target, b, 7)


def test_an_assumed_version_of_another_run_is_not_a_delta_base(tmp_path):
    """``assume()`` records the run of the version it assumes, as an update does: after the prefix
    was wiped and a new run reused the number, the assumed state is crossed by an anchor."""
    store = LocalStore(tmp_path / "b", fsync=False)
    a = StepModel(seed=32)
    sender_a = DeltaSender(a.tensors, store, anchor_every=100)
    publish(store, a, range(4), sender_a)
    target = empty_target(a.shapes)
    DeltaReceiver(target, store).update(3)  # the target now holds run A's v3 ...
    receiver = DeltaReceiver(target, store)
    receiver.assume(3)  # ... and a fresh receiver is told so
    sender_a.close()
    store.delete_many(store.list(""))
    b = StepModel(seed=33)
    publish(store, b, range(6), DeltaSender(b.tensors, store, anchor_every=100))
    plan = receiver.plan()
    assert plan.path == "anchor" and "belongs to run" in plan.steps[0].reason
    assert receiver.update() == 5 and receiver.last_stats.recovered is False
    assert_holds(target, b, 5)


def rewrite_run_id(store, version: int, run_id: str) -> None:
    m = Manifest.from_json(store.get(manifest_key(version)), expected_version=version)
    store.put(manifest_key(version), dataclasses.replace(m, run_id=run_id).to_json())


@pytest.mark.parametrize("held", [None, 1])
def test_a_chain_that_crosses_runs_before_any_anchor_is_refused(tmp_path, held):
    """Version 3 (run A) is a delta on version 2, which belongs to another run: no anchor of run A
    leads to 3, so the receiver refuses (and keeps its weights) instead of switching models."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=40)
    states = publish(store, model, range(4), DeltaSender(model.tensors, store, anchor_every=100))
    r = receiver_at(store, states[held], held) if held is not None else DeltaReceiver(empty_target(model.shapes), store)
    rewrite_run_id(store, 2, "someone-else")
    before = bits_of(r.target.tensors)
    with pytest.raises(CorruptObjectError, match=r"version 3 \(run '[0-9a-f]+'\) is a delta on version 2 of "
                                                 r"another run \('someone-else'\).*two writers shared this prefix"):
        r.update(3)
    after = bits_of(r.target.tensors)
    assert all(torch.equal(before[n], after[n]) for n in before) and r.version == held


def test_a_chain_that_crosses_runs_after_an_anchor_uses_the_anchor(tmp_path):
    """The crossing lies below the anchor v4 of the target's run: the anchor path from v4 is used."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=41)
    states = publish(store, model, range(7), DeltaSender(model.tensors, store, anchor_every=4))
    rewrite_run_id(store, 2, "someone-else")
    r = receiver_at(store, states[1], 1)
    plan = r.plan(6)
    assert plan.path == "anchor" and [s.version for s in plan.steps] == [4, 5, 6]
    assert r.update(6) == 6
    assert holds(r.target.tensors, states[6])
    assert list_versions(store) == list(range(7))


def test_a_corrupt_manifest_below_an_anchor_is_passed_by_the_anchor(tmp_path):
    """The manifest of v2 (between the held v1 and the anchor v4) is garbage: the receiver at v1
    reaches v6 through the anchor v4, as a fresh receiver does; v3 (whose chain needs v2) is refused
    with the manifest named, and the held weights stay."""
    store = LocalStore(tmp_path / "b", fsync=False)
    model = StepModel(seed=42)
    states = publish(store, model, range(7), DeltaSender(model.tensors, store, anchor_every=4))
    store.put(manifest_key(2), b'{"format": 1')  # truncated
    r = receiver_at(store, states[1], 1)
    with pytest.raises(CorruptObjectError, match=r"versions/000000000002\.json \(manifest of version 2\) is not valid JSON"):
        r.update(3)
    assert holds(r.target.tensors, states[1]) and r.version == 1
    plan = r.plan(6)
    assert plan.path == "anchor" and [s.version for s in plan.steps] == [4, 5, 6]
    assert "manifest of version 2" in plan.steps[0].reason
    assert r.update(6) == 6
    assert holds(r.target.tensors, states[6])


def test_a_version_argument_outside_the_range_is_a_caller_error(tmp_path):
    # Refused before the store is read, as the vLLM and HTTP helpers refuse it: not an int is a
    # TypeError, outside [0, MAX_VERSION] a ValueError (not "version not found"); nothing changes.
    store = LocalStore(tmp_path)
    sender = DeltaSender({"w": torch.arange(8, dtype=torch.float32)}, store)
    sender.publish()
    held = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(held, store)
    for bad, error, match in ((-1, ValueError, r"version must be a published version \(int in 0 \.\.\. 999999999999\), got -1"),
                              (10**12, ValueError, "got 1000000000000"),
                              (1.5, TypeError, "a version is an int, got float 1.5"),
                              (True, TypeError, "a version is an int, got bool True")):
        for call in (receiver.update, receiver.prepare, receiver.plan):
            with pytest.raises(error, match=match):
                call(bad)
    assert receiver.version is None and bool((held["w"].view(torch.int16) == 0).all())
    assert receiver.update(0) == 0
    assert torch.equal(held["w"].view(torch.int16), torch.arange(8, dtype=torch.float32).to(torch.bfloat16).view(torch.int16))
