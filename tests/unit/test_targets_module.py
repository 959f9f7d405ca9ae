"""``ModuleTarget`` follows the module's live tensors: parameters replaced after the receiver was built
(``module.to(dtype)``, ``load_state_dict(assign=True)``, a new submodule or dict entry) receive the
updates and are what ``verify()`` reads; replacements that no longer fit are refused before any weight
changes; non-floating tensors, which the sender never publishes, are refused instead of being
reported as verified."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import make_mlp, train_step
from torch_deltasync import AnchorPolicy, DeltaReceiver, DeltaSender, LocalStore, ModuleTarget
from torch_deltasync.errors import ChecksumMismatchError, IncompatibleTargetError


def bf16_bits(model_or_sd) -> dict[str, torch.Tensor]:
    """Every floating tensor as the int16 view of its bf16 cast (independent of the library)."""
    sd = model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd
    return {n: t.detach().to(torch.bfloat16).view(torch.int16).clone() for n, t in sd.items() if t.is_floating_point()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


class Run:
    """A trainer publishing to ``store``, one Adam step per version."""

    def __init__(self, store, **kwargs):
        self.trainer = make_mlp(0)
        self.opt = torch.optim.Adam(self.trainer.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(0)
        self.sender = DeltaSender(self.trainer, store, **kwargs)

    def step(self) -> int:
        train_step(self.trainer, self.opt, self.gen)
        return self.sender.publish()


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "b", fsync=False)


def test_a_module_cast_to_bf16_after_the_receiver_was_built_gets_the_updates(store):
    """Issue 15: an fp32 replica cast with ``replica.to(torch.bfloat16)`` kept serving its old
    weights while update() and verify() reported success."""
    run = Run(store, anchor_every=100)
    replica = make_mlp(1, torch.float32)
    receiver = DeltaReceiver(replica, store)
    assert run.step() == 0 and receiver.update() == 0
    replica.to(torch.bfloat16)  # rebinds every parameter's .data to new bf16 storage
    assert run.step() == 1
    assert receiver.update() == 1 and receiver.last_stats.path == "delta"
    assert all(p.dtype == torch.bfloat16 for p in replica.parameters())
    assert same(bf16_bits(replica), bf16_bits(run.trainer))
    receiver.verify()
    with torch.no_grad():  # verify reads what the module serves now: one flipped bit is caught
        replica[0].weight.view(torch.int16)[0, 0] ^= 1
    with pytest.raises(ChecksumMismatchError, match=r"1 tensors differ.*0\.weight"):
        receiver.verify()


@pytest.mark.parametrize("values", ["same", "other"])
def test_load_state_dict_assign_replaces_the_tensors_the_receiver_writes(store, values):
    """New tensors from ``load_state_dict(assign=True)`` receive the next update. Holding other
    values than the version the receiver applied, the delta path fails its checksum and the
    receiver rebuilds them from the anchor: never a mix."""
    run = Run(store, anchor_every=100)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert run.step() == 0 and receiver.update() == 0
    fresh = {n: (t.clone() if values == "same" else torch.zeros_like(t)) for n, t in replica.state_dict().items()}
    old = [p for p in replica.parameters()]
    replica.load_state_dict(fresh, assign=True)
    assert all(a is not b for a, b in zip(old, replica.parameters()))
    assert run.step() == 1
    assert receiver.update() == 1
    assert receiver.last_stats.recovered is (values == "other")
    assert same(bf16_bits(replica), bf16_bits(run.trainer))
    receiver.verify()


def test_a_replaced_submodule_gets_the_updates(store):
    run = Run(store, anchor_every=100)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert run.step() == 0 and receiver.update() == 0
    new = nn.Linear(32, 64).to(torch.bfloat16)
    with torch.no_grad():
        for p_new, p_old in zip(new.parameters(), replica[0].parameters()):
            p_new.copy_(p_old)
    replica[0] = new
    assert run.step() == 1
    assert receiver.update() == 1
    assert same(bf16_bits(replica), bf16_bits(run.trainer))
    receiver.verify()


def test_a_replaced_dict_entry_gets_the_updates(store):
    run = Run(store, anchor_every=100)
    sd = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in run.trainer.state_dict().items()}
    receiver = DeltaReceiver(sd, store)
    assert run.step() == 0 and receiver.update() == 0
    sd["2.weight"] = sd["2.weight"].clone()
    assert run.step() == 1
    assert receiver.update() == 1
    assert same(bf16_bits(sd), bf16_bits(run.trainer))


@pytest.mark.parametrize("path", ["delta", "anchor"])
def test_a_replacement_that_no_longer_fits_is_refused_before_any_weight_changes(store, path):
    """One parameter (the last one written) replaced by one of another dtype: the update refuses
    before its first write, on the delta path and on the anchor path (which reads nothing first)."""
    # Anchors that carry no delta (every delta counts as too large), so the anchor path is the only one.
    run = Run(store, anchor_policy=AnchorPolicy(every=1, max_delta_ratio=1e-9)) if path == "anchor" else Run(store)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert run.step() == 0 and receiver.update() == 0
    replica[2].bias = nn.Parameter(replica[2].bias.detach().to(torch.float16))
    before = {n: t.detach().view(torch.int16).clone() for n, t in replica.state_dict().items()}
    assert run.step() == 1
    plan = receiver.plan()
    assert plan.path == path
    with pytest.raises(IncompatibleTargetError, match=r"were replaced since they were checked.*tensor '2\.bias' is "
                                                      r"torch\.float16, which cannot hold every torch\.bfloat16"):
        receiver.update()
    after = {n: t.detach().view(torch.int16) for n, t in replica.state_dict().items()}
    assert same(before, after)
    assert receiver.version == 0  # nothing was written: still the version it held


def _fp16_bias_after_version_0(store):
    """A run at version 0, a receiver holding it, whose replica's ``2.bias`` was then replaced by
    an fp16 copy (no fp16 tensor holds bf16 values exactly); returns the original bias too."""
    run = Run(store, anchor_every=100)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert run.step() == 0 and receiver.update() == 0
    good = replica[2].bias
    replica[2].bias = nn.Parameter(good.detach().to(torch.float16))
    return run, replica, receiver, good


def test_after_a_refusal_the_whole_target_is_checked_again(store):
    """A refused update (a tensor replaced by one of another dtype) leaves the target refusing
    until it is checked in full again: a second wrong replacement (another shape, which a write
    would not notice) is refused too, with the version kept; once the tensor is right again, the
    next update is a delta from the version still held, bit-exact."""
    run, replica, receiver, good = _fp16_bias_after_version_0(store)
    run.step()
    with pytest.raises(IncompatibleTargetError, match=r"tensor '2\.bias' is torch\.float16"):
        receiver.update()
    replica[2].bias = nn.Parameter(torch.zeros(good.numel() + 3, dtype=torch.bfloat16))
    before = bf16_bits(replica)
    with pytest.raises(IncompatibleTargetError, match=r"tensor '2\.bias': published shape"):
        receiver.update()
    assert same(bf16_bits(replica), before) and receiver.version == 0
    replica[2].bias = good
    assert receiver.update() == 1 and receiver.last_stats.path == "delta"
    assert same(bf16_bits(replica), bf16_bits(run.trainer))
    receiver.verify()


def test_verify_after_a_refusal_sees_the_model_put_right(store):
    """A refusal is not remembered once the model is right again: verify() checks the target
    again, keeps the version, and the next update is a delta."""
    run, replica, receiver, good = _fp16_bias_after_version_0(store)
    with pytest.raises(IncompatibleTargetError, match=r"tensor '2\.bias' is torch\.float16"):
        receiver.verify()
    replica[2].bias = good
    receiver.verify()
    assert receiver.verify_or_forget() is None and receiver.version == 0
    assert run.step() == 1 and receiver.update() == 1 and receiver.last_stats.path == "delta"
    assert same(bf16_bits(replica), bf16_bits(run.trainer))


def test_a_verify_between_prepare_and_commit_does_not_change_what_the_commit_writes(store):
    """The prefix is wiped and a new run ties ``e`` to ``w`` (the receiver holds them untied): a
    version staged for the new run, then a verify() of the held (old run's) version, then the
    commit: the commit still writes ``e`` as the mirror of ``w``."""
    import shutil

    class M(nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 4))
            self.e = self.w if tied else nn.Parameter(torch.randn(8, 4))

    torch.manual_seed(0)
    old, replica = M(tied=False), M(tied=False).to(torch.bfloat16)
    with DeltaSender(old, store) as sender:
        for _ in range(4):
            sender.publish()
    receiver = DeltaReceiver(replica, store)
    assert receiver.update() == 3
    shutil.rmtree(store.root)
    new = M(tied=True)
    with DeltaSender(new, store) as sender:
        sender.publish()
        with torch.no_grad():
            new.w.add_(0.5)
        assert sender.publish() == 1
    staged = receiver.prepare(1)
    receiver.verify()  # the held version 3 of the old run: checks the target for its layout
    assert receiver.commit(staged) == 1
    assert same(bf16_bits({"w": replica.w, "e": replica.e}), bf16_bits({"w": new.w, "e": new.w}))
    receiver.verify()


@pytest.mark.parametrize("alias", [
    lambda: torch.empty(8, 4, dtype=torch.bfloat16, device="meta"),
    lambda: torch.zeros(1, 4, dtype=torch.bfloat16).expand(8, 4),
], ids=["meta", "expand"])
def test_an_untied_alias_that_cannot_be_written_is_refused(store, alias):
    """The sender ties ``e`` to ``w``; the receiver's own ``e`` (written as a copy of ``w``) has no
    data or overlapping elements: refused when checked, before anything is written."""
    w = torch.randn(8, 4)
    DeltaSender({"w": w, "e": w}, store).publish()
    held = {"w": torch.zeros(8, 4, dtype=torch.bfloat16), "e": alias()}
    with pytest.raises(IncompatibleTargetError, match=r"tensor 'e' (is on the meta device|has overlapping memory)"):
        DeltaReceiver(held, store).update()
    assert not held["w"].view(torch.int16).any()


def test_a_removed_tensor_is_named(store):
    run = Run(store, anchor_every=100)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    assert run.step() == 0 and receiver.update() == 0
    replica[2].register_parameter("bias", None)
    run.step()
    with pytest.raises(IncompatibleTargetError, match=r"tensor '2\.bias' is no longer in the receiving model"):
        receiver.update()


class WithCounter(nn.Module):
    def __init__(self, persistent: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64), persistent=persistent)


def test_a_persistent_integer_buffer_is_refused(store):
    """Issue 15: the trainer's int64 buffer changed, it was never published, and verify() passed.
    The sender publishes floating-point tensors only, so such a receiver is refused."""
    trainer, replica = WithCounter(True), WithCounter(True)
    with torch.no_grad():
        trainer.steps += 7
    sender = DeltaSender(trainer, store)
    sender.publish()
    with pytest.raises(IncompatibleTargetError, match=r"tensor 'steps' is torch\.int64: torch_deltasync publishes "
                                                      r"floating-point tensors only.*persistent=False.*strict=False"):
        DeltaReceiver(replica, store)
    # Opting out is explicit: the float weights sync, the counter is left alone.
    receiver = DeltaReceiver(ModuleTarget(replica, strict=False), store)
    assert receiver.update() == 0
    assert same(bf16_bits(replica), bf16_bits(trainer)) and int(replica.steps) == 0


def test_a_non_persistent_integer_buffer_is_not_state(store):
    trainer, replica = WithCounter(False), WithCounter(False)
    DeltaSender(trainer, store).publish()
    receiver = DeltaReceiver(replica, store)
    assert receiver.update() == 0 and same(bf16_bits(replica), bf16_bits(trainer))


class _DuckTarget:
    """A target that does not subclass ``Target``: every member delegates to a ``ModuleTarget``, and
    every write is recorded."""

    holds_all = True

    def __init__(self, module):
        self._inner = ModuleTarget(module)
        self.writes: list[str] = []

    def check(self, shapes, aliases, dtype):
        self._inner.check(shapes, aliases, dtype)

    def read(self, name, positions, dtype):
        return self._inner.read(name, positions, dtype)

    def owned(self, name, positions):
        return self._inner.owned(name, positions)

    def write(self, name, positions, values):
        self.writes.append(name)
        self._inner.write(name, positions, values)

    def assign(self, name, full):
        self.writes.append(name)
        self._inner.assign(name, full)

    def finish(self, written):
        pass

    def checksum(self, name, dtype):
        return self._inner.checksum(name, dtype)


def test_any_object_with_the_target_members_is_a_target(tmp_path):
    """``Target`` is a protocol: a duck-typed target is used as is (not wrapped as a module) and
    ends bit-identical to the trainer."""
    from torch_deltasync import Target

    run = Run(LocalStore(tmp_path / "b"), anchor_every=3)
    replica = make_mlp(1)
    duck = _DuckTarget(replica)
    assert isinstance(duck, Target) and not isinstance(replica, Target)
    receiver = DeltaReceiver(duck, run.sender.store)
    assert receiver.target is duck
    for _ in range(4):
        receiver.update(run.step())
    assert duck.writes and same(bf16_bits(replica), bf16_bits(run.trainer))
    receiver.verify()


def test_a_packed_delta_reads_each_changed_tensor_once(tmp_path):
    """Relative steps need the old values and so does the checksum check: one read serves both."""
    run = Run(LocalStore(tmp_path / "b"), anchor_every=10)  # packed: steps on the old values
    replica = make_mlp(1)
    duck = _DuckTarget(replica)
    reads: list[str] = []
    inner_read = duck.read
    duck.read = lambda name, positions, dtype: reads.append(name) or inner_read(name, positions, dtype)
    receiver = DeltaReceiver(duck, run.sender.store)
    receiver.update(run.step())  # the anchor
    reads.clear()
    v = run.step()
    changed = [t.name for t in receiver.manifest(v).tensors if t.changed]
    receiver.update(v)
    assert changed and sorted(reads) == sorted(changed)
    assert same(bf16_bits(replica), bf16_bits(run.trainer))


def test_a_target_missing_members_is_told_which(tmp_path):
    duck = _DuckTarget(make_mlp(1))

    class Partial:
        holds_all = True
        check, read, write, assign, checksum = duck.check, duck.read, duck.write, duck.assign, duck.checksum

    with pytest.raises(TypeError, match=r"as a Target it lacks \['owned', 'finish'\].*subclass torch_deltasync.Target"):
        DeltaReceiver(Partial(), LocalStore(tmp_path / "b"))
    with pytest.raises(TypeError, match=r"expected an nn.Module, a state dict or a Target, got int$"):
        DeltaReceiver(3, LocalStore(tmp_path / "b"))


def test_an_untied_copy_of_a_tied_tensor_is_verified(store):
    """A trainer ties ``emb`` and ``head``; the replica holds them untied, so ``head`` is written as
    a mirror of ``emb``. ``assume()`` and ``verify()`` checked ``emb`` only: a stale or overwritten
    ``head`` passed both while the model served it."""
    torch.manual_seed(0)
    e = torch.randn(5, 6)
    sender = DeltaSender({"emb": e, "head": e}, store)
    sender.publish()
    replica = {"emb": e.to(torch.bfloat16), "head": torch.zeros(5, 6, dtype=torch.bfloat16)}
    receiver = DeltaReceiver(replica, store)
    with pytest.raises(ChecksumMismatchError, match=r"'head', written as an untied copy of 'emb', differs from it "
                                                    r"at 30 of 30 elements"):
        receiver.assume(0)
    assert receiver.version is None
    receiver.update()
    receiver.verify()
    e[0, :2] += 1
    sender.publish()
    assert receiver.update() == 1
    want = e.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(replica["head"].view(torch.int16), want) and torch.equal(replica["emb"].view(torch.int16), want)
    replica["head"][4, 5] = 3.0  # something else writes the copy
    with pytest.raises(ChecksumMismatchError, match=r"'head', .* differs from it at 1 of 30 elements"):
        receiver.verify()
    assert isinstance(receiver.verify_or_forget(), ChecksumMismatchError) and receiver.version is None
    assert receiver.update() == 1 and receiver.last_stats.path == "anchor"
    assert torch.equal(replica["head"].view(torch.int16), want)


def test_fp32_storage_holding_values_that_are_no_bf16_values_fails_verification(store):
    """A bf16 version held in fp32 reads the high 16 bits: fp32 values whose low bits are set
    (loaded from another checkpoint, nudged by an in-place op) passed ``assume()`` and ``verify()``
    while the model computed with other numbers."""
    torch.manual_seed(0)
    w = torch.randn(64)
    DeltaSender({"w": w}, store).publish()
    exact = w.to(torch.bfloat16).float()
    receiver = DeltaReceiver({"w": exact.clone()}, store)
    receiver.assume(0)
    receiver.verify()  # bf16 values in fp32: fine
    nudged = exact.clone()
    nudged.view(torch.int32)[[3, 9]] += 1
    receiver = DeltaReceiver({"w": nudged}, store)
    with pytest.raises(ChecksumMismatchError, match=r"tensor 'w' is held in torch\.float32 and 2 of its 64 elements "
                                                    r"are no torch\.bfloat16 values"):
        receiver.assume(0)
    assert receiver.update() == 0  # rebuilt from the anchor
    assert torch.equal(nudged.view(torch.int32), exact.view(torch.int32))


def test_a_state_dict_hook_that_returns_copies_is_refused(store):
    """A module whose ``state_dict()`` returns cast copies: the receiver wrote the copies and
    ``verify()`` read them, while the module kept its own weights."""
    trainer = make_mlp(0)
    DeltaSender(trainer, store).publish()
    replica = make_mlp(1)

    def to_bf16(module, sd, prefix, meta):
        for k in list(sd):
            sd[k] = sd[k].detach().to(torch.bfloat16)

    replica._register_state_dict_hook(to_bf16)
    before = {n: p.detach().clone() for n, p in replica.named_parameters()}
    receiver = DeltaReceiver(replica, store)
    with pytest.raises(IncompatibleTargetError, match=r"state_dict\(\) returns '.*' in memory that is none of its "
                                                      r"parameters or buffers"):
        receiver.update()
    assert receiver.version is None and all(torch.equal(p.detach(), before[n]) for n, p in replica.named_parameters())

    class WithDerived(nn.Linear):  # an extra entry the sender never publishes: left alone with strict=False
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            destination[prefix + "absmax"] = self.weight.detach().abs().max().reshape(1)

    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    other = LocalStore(store.root.parent / "derived", fsync=False)
    DeltaSender(linear, other).publish()
    derived = WithDerived(3, 2)
    assert DeltaReceiver(ModuleTarget(derived, strict=False), other).update() == 0
    assert same(bf16_bits({n: t for n, t in derived.state_dict().items() if n != "absmax"}), bf16_bits(linear))

    class Renamed(nn.Module):  # a hook that renames (views of the module's memory) stays fine
        def __init__(self):
            super().__init__()
            self.inner = make_mlp(0)
            self._register_state_dict_hook(self._rename)

        @staticmethod
        def _rename(module, sd, prefix, meta):
            for k in list(sd):
                sd[k[len("inner."):]] = sd.pop(k)

    renamed = Renamed()
    with torch.no_grad():
        for p in renamed.parameters():
            p.zero_()
    assert DeltaReceiver(renamed, store).update() == 0
    assert same(bf16_bits(renamed.inner), bf16_bits(trainer))


def test_an_alias_that_names_another_tensor_is_published_as_an_anchor(store):
    """``b`` was tied to ``a`` and is now tied to ``c`` (same shape): a delta of ``c``'s changes
    would leave the replica's untied copy of ``b`` holding ``a``'s values, reported as updated."""
    a, c = torch.full((6,), 1.0), torch.full((6,), 2.0)
    state = {"a": a, "c": c, "b": a}
    sender = DeltaSender(state, store, anchor_every=0)
    replica = {k: torch.zeros(6, dtype=torch.bfloat16) for k in "abc"}  # untied copies
    receiver = DeltaReceiver(replica, store)
    assert sender.publish() == 0 and receiver.update() == 0
    state["b"] = c
    c[0] = 3.0
    assert sender.publish() == 1
    m = receiver.manifest(1)
    assert (m.kind, m.base_version, m.aliases) == ("anchor", None, {"b": "c"})
    assert receiver.update() == 1
    assert same(bf16_bits(replica), bf16_bits(state))
    receiver.verify()
