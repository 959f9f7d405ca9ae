"""``DeltaReceiver.prepare`` / ``commit``: staging writes nothing, a commit only writes, a staged
update whose base moved is refused."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import make_mlp, train_step

from torch_deltasync import DeltaReceiver, DeltaSender, _native, _pool
from torch_deltasync.errors import CorruptObjectError, IncompatibleTargetError, StaleUpdateError
from torch_deltasync.targets import ModuleTarget
from torch_deltasync.testing import first_difference, state_bits


def _setup(store, steps=1):
    trainer, replica = make_mlp(0), make_mlp(1, torch.bfloat16)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender(trainer, store, anchor_every=100)
    receiver = DeltaReceiver(replica, store)
    sender.publish()
    receiver.update()
    for _ in range(steps):
        train_step(trainer, opt, gen)
        sender.publish()
    return trainer, replica, sender, receiver, opt, gen


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prepare_writes_nothing_and_commit_applies(store):
    trainer, replica, sender, receiver, *_ = _setup(store, steps=2)
    before = state_bits(replica)
    staged = receiver.prepare()
    assert _same_bits(state_bits(replica), before)  # the live weights are untouched
    assert receiver.version == 0 and staged.base_version == 0 and staged.version == 2
    assert staged.plan.path == "delta" and staged.stats.verify_ms >= 0
    # the staged names are exactly the tensors whose bits differ (counted independently)
    differ = {n for n, t in state_bits(trainer).items() if not torch.equal(t, before[n])}
    assert set(staged.written) == differ
    assert receiver.commit(staged) == 2 == receiver.version
    assert first_difference(trainer, replica) is None
    # every element that differs was written (plus any that changed in v1 and back in v2)
    assert receiver.last_stats.changed >= sum(int((state_bits(trainer)[n] != before[n]).sum()) for n in differ) > 0
    receiver.verify()


def test_stale_staged_update_is_refused_and_changes_nothing(store):
    trainer, replica, sender, receiver, opt, gen = _setup(store)
    staged = receiver.prepare(1)
    receiver.update(1)  # another path commits first
    train_step(trainer, opt, gen)
    sender.publish()
    receiver.update(2)
    before = state_bits(replica)
    with pytest.raises(StaleUpdateError, match="staged on version 0.*now holds 2"):
        receiver.commit(staged)
    assert _same_bits(state_bits(replica), before) and receiver.version == 2


def test_resetting_the_version_invalidates_staged_updates(store):
    *_, receiver, _, _ = _setup(store)
    staged = receiver.prepare()
    receiver.version = None  # e.g. a recovery forces the anchor path
    with pytest.raises(StaleUpdateError):
        receiver.commit(staged)


def test_noop_stage(store):
    *_, receiver, _, _ = _setup(store)
    receiver.update()
    staged = receiver.prepare()
    assert staged.plan.path == "noop" and not staged.written
    assert receiver.commit(staged) == 1


def test_prepare_in_a_thread_while_the_model_is_read(store):
    """Staging runs beside readers of the live weights (an engine generating); the commit is exact."""
    trainer, replica, sender, receiver, *_ = _setup(store, steps=3)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("staged", receiver.prepare()))
    t.start()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    while t.is_alive():
        replica(x)
    t.join()
    assert receiver.commit(out["staged"]) == 3
    assert first_difference(trainer, replica) is None


def test_an_update_staged_by_another_receiver_is_refused(store, tmp_path):
    # Two fresh receivers of different models: the one that did not prepare the update must not
    # write it (both start at "nothing held", so only the receiver's identity tells them apart).
    from torch_deltasync import LocalStore

    other_store = LocalStore(tmp_path / "other")
    other_trainer = make_mlp(7)
    DeltaSender(other_trainer, other_store).publish()
    foreign = DeltaReceiver(make_mlp(8, torch.bfloat16), other_store).prepare()
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    before = state_bits(replica)
    assert not receiver.is_current(foreign)
    with pytest.raises(StaleUpdateError, match="another receiver staged it"):
        receiver.commit(foreign)
    assert _same_bits(state_bits(replica), before) and receiver.version is None


def _record_threads(monkeypatch, owner, attr: str, threads: int) -> list[tuple[str, bool]]:
    """Wrap ``owner.attr`` (called as ``f(x, name, ...)`` once per tensor) to record which thread
    handles each tensor: ``[(name, on the main thread)]``. With more than one thread, the first two
    tensors wait for each other (a barrier), so a helper surely takes part and work that ran on one
    thread only fails instead of passing by chance. The small model's tensors count as large."""
    monkeypatch.setattr(_pool, "PARALLEL_MIN_CHANGES", 1)
    seen: list[tuple[str, bool]] = []
    barrier = threading.Barrier(2, timeout=10)
    fn = getattr(owner, attr)

    def recording(first, name, *rest):
        seen.append((name, threading.current_thread() is threading.main_thread()))
        if threads > 1 and len(seen) <= 2:
            barrier.wait()
        return fn(first, name, *rest)

    monkeypatch.setattr(owner, attr, recording)
    return seen


def _record_staging(monkeypatch, threads: int) -> list[tuple[str, bool]]:
    """Which thread stages each tensor (:func:`_record_threads` of the receiver's staging)."""
    from torch_deltasync.receiver import _stage

    return _record_threads(monkeypatch, _stage, "_stage_tensor", threads)


@pytest.mark.parametrize("work", ["staging", "writes"])
@pytest.mark.parametrize("threads", [1, 2])
def test_tensors_are_staged_and_written_on_threads_bit_exactly(store, monkeypatch, threads, work):
    """``threads=2``: the tensors of an update are staged (decoded, old values read, steps
    resolved, versions merged) and, as ``ModuleTarget`` allows concurrent writes for a model in
    host memory, written by a commit on a helper thread as well as the calling one; ``threads=1``
    does all on the calling thread. Same bits either way, for one version and for a chain of two."""
    trainer, _, sender, _, opt, gen = _setup(store, steps=1)
    for _ in range(2):
        train_step(trainer, opt, gen)
        sender.publish()
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(replica, store, threads=threads)
    receiver.update(0)  # the anchor (whole tensors, on the calling thread)
    assert receiver.target.concurrent_writes
    seen = (_record_staging(monkeypatch, threads) if work == "staging"
            else _record_threads(monkeypatch, ModuleTarget, "write", threads))  # (its own write: on threads)
    for version, n_versions in ((1, 1), (3, 2)):
        seen.clear()
        assert receiver.update(version) == version
        assert receiver.last_stats.path == "delta" and receiver.last_stats.versions_applied == n_versions
        assert sorted(n for n, _ in seen) == sorted(n for n, _ in trainer.named_parameters())  # all changed
        assert any(not main for _, main in seen) == (threads > 1), seen
        receiver.verify()  # every tensor's checksum against the version's manifest
    assert first_difference(trainer, replica) is None


def test_a_drifted_tensor_staged_on_threads_is_named_and_recovered_from_the_anchor(store, monkeypatch, caplog):
    """Drift found while the tensors are staged on two threads: the warning names the version and
    the tensor, the update recovers from the anchor (staging writes nothing), the commit is exact."""
    trainer, replica, sender, _, opt, gen = _setup(store, steps=1)
    receiver = DeltaReceiver(replica, store, threads=2)
    receiver.update(1)
    train_step(trainer, opt, gen)
    sender.publish()
    with torch.no_grad():
        replica[2].weight.view(torch.int16).add_(1)  # the held weights drift from version 1
    before = state_bits(replica)
    seen = _record_staging(monkeypatch, 2)
    with caplog.at_level("WARNING", logger="torch_deltasync.receiver"):
        staged = receiver.prepare(2)
    assert any(not main for _, main in seen)
    assert _same_bits(state_bits(replica), before)
    assert "version 2 tensor '2.weight': the old values at the" in caplog.text
    assert staged.plan.path == "anchor" and staged.stats.recovered
    assert receiver.commit(staged) == 2
    assert first_difference(trainer, replica) is None


class _ClampingTarget(ModuleTarget):
    """Overrides ``write`` (with torch state of its own: an in-place op under the caller's grad mode)."""

    def write(self, name, positions, values):
        super().write(name, positions, values)
        self._get(name).clamp_(-1, 1)


def test_targets_that_cannot_take_writes_on_threads_get_them_on_the_calling_thread(store):
    """Unchecked, moved off the host after its check, or a subclass that overrides ``write``
    (torch's grad mode is per thread: its in-place op would fail on a helper thread)."""
    trainer, _, sender, _, opt, gen = _setup(store, steps=1)
    model = make_mlp(1, torch.bfloat16)
    target = ModuleTarget(model)
    assert not target.concurrent_writes  # not checked yet
    target.check({n: tuple(t.shape) for n, t in target.tensors.items()}, {}, torch.bfloat16)
    assert target.concurrent_writes
    model.to("meta")  # (in place: the parameters stay, their data moves)
    assert not target.concurrent_writes
    clamping = _ClampingTarget(make_mlp(1, torch.bfloat16).requires_grad_(True))
    receiver = DeltaReceiver(clamping, store, threads=2)
    with torch.no_grad():
        receiver.update(0)
        assert not clamping.concurrent_writes
        assert receiver.update(1) == 1


class _Tied(torch.nn.Module):
    def __init__(self, tie: str | None):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
        self.proj = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
        self.head = getattr(self, tie) if tie else torch.nn.Parameter(torch.randn(64, 32) * 0.02)


def test_written_tensors_that_share_memory_are_refused(store):
    """The sender ties ``head`` to ``emb`` (so ``head`` is an alias), the receiver ties it to
    ``proj``: writing ``head`` as ``emb``'s mirror would overwrite ``proj``."""
    sender = DeltaSender(_Tied("emb"), store)
    sender.publish()
    with pytest.raises(IncompatibleTargetError, match="'head' and 'proj' share memory|'proj' and 'head' share memory"):
        DeltaReceiver(_Tied("proj").to(torch.bfloat16), store).update()
    flat = torch.zeros(3 * 64 * 32, dtype=torch.bfloat16)  # one flat buffer cut into three tensors: fine
    views = {n: flat[i * 2048:(i + 1) * 2048].view(64, 32) for i, n in enumerate(("emb", "proj", "head"))}
    receiver = DeltaReceiver(views, store)
    assert receiver.update() == 0


class _PartialTarget(ModuleTarget):
    """A target that holds none of ``2.weight`` (as a TP or EP rank may hold none of a tensor's
    changes): reading it is an error, as on ``VLLMTarget``."""

    holds_all = False

    def owned(self, name, positions):
        return torch.full_like(positions, name != "2.weight", dtype=torch.bool)

    def read(self, name, positions, dtype):
        if name == "2.weight":
            raise CorruptObjectError(f"{name!r}: this rank holds no element of it")
        return super().read(name, positions, dtype)


def test_a_rank_holding_none_of_a_tensors_changes_reads_nothing(store):
    trainer, _, sender, _, opt, gen = _setup(store, steps=1)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(_PartialTarget(replica), store)
    receiver.update(1)  # the anchor path: whole tensors, no reads
    held = replica[2].weight.detach().clone()
    train_step(trainer, opt, gen)
    sender.publish()
    assert receiver.update(2) == 2 and receiver.last_stats.path == "delta" and not receiver.last_stats.recovered
    assert torch.equal(replica[2].weight.view(torch.int16), held.view(torch.int16))  # not this rank's
    want = {n: t for n, t in state_bits(trainer).items() if n != "2.weight"}
    assert _same_bits({n: t for n, t in state_bits(replica).items() if n != "2.weight"}, want)


class _OneThreadTarget(ModuleTarget):
    """A target that does not declare ``concurrent_reads`` (as a third-party target written before
    it existed): records whether each read came from the main thread."""

    concurrent_reads = False

    def __init__(self, model):
        super().__init__(model)
        self.reads_on_main: list[bool] = []

    def read(self, name, positions, dtype):
        self.reads_on_main.append(threading.current_thread() is threading.main_thread())
        return super().read(name, positions, dtype)


def test_a_target_without_concurrent_reads_is_read_on_the_calling_thread_only(store, monkeypatch):
    monkeypatch.setattr(_pool, "PARALLEL_MIN_CHANGES", 1)
    trainer, _, sender, _, opt, gen = _setup(store, steps=1)
    for _ in range(2):
        train_step(trainer, opt, gen)
        sender.publish()
    replica = make_mlp(1, torch.bfloat16)
    target = _OneThreadTarget(replica)
    receiver = DeltaReceiver(target, store, threads=2)
    receiver.update(0)
    for version in (1, 3):  # one version (base reused), a chain of two (verification reads too)
        target.reads_on_main.clear()
        assert receiver.update(version) == version and receiver.last_stats.path == "delta"
        assert target.reads_on_main and all(target.reads_on_main)
    assert first_difference(trainer, replica) is None


def test_a_tensor_replaced_before_threaded_staging_is_checked_and_written(store, monkeypatch):
    """A parameter replaced by a new one (``module.weight = nn.Parameter(...)``) between updates:
    the first lookup that sees it checks the whole target again (under the target's lock, while
    other tensors are read on another thread), and the update lands in the new parameter."""
    _record_staging(monkeypatch, 2)
    trainer, replica, sender, _, opt, gen = _setup(store, steps=1)
    receiver = DeltaReceiver(replica, store, threads=2)
    receiver.update(1)
    train_step(trainer, opt, gen)
    sender.publish()
    old = replica[0].weight
    replica[0].weight = torch.nn.Parameter(old.detach().clone())
    assert receiver.update(2) == 2 and not receiver.last_stats.recovered
    assert replica[0].weight is not old and first_difference(trainer, replica) is None


def test_a_target_whose_read_returns_the_wrong_shape_is_named(store):
    class ShortRead(ModuleTarget):
        def read(self, name, positions, dtype):
            return super().read(name, positions, dtype)[:-1]

    trainer, _, sender, _, opt, gen = _setup(store, steps=1)
    replica = make_mlp(1, torch.bfloat16)
    receiver = DeltaReceiver(ShortRead(replica), store)
    receiver.update(0)
    before = state_bits(replica)
    with pytest.raises(IncompatibleTargetError, match=r"ShortRead.read\('.*', \.\.\.\) returned torch.bfloat16 \(\d+,\) "
                                                      r"for \d+ positions; a Target's read must return .* torch.bfloat16 \(\d+,\)"):
        receiver.update(1)
    assert _same_bits(state_bits(replica), before)


def test_drift_found_after_earlier_versions_of_a_chain_says_what_the_base_is(store, caplog):
    """A held element that version 1 leaves alone and version 2 changes has drifted: the mismatch
    shows at version 2, whose base is the held weights plus version 1; the message says so."""
    trainer, replica, sender, receiver, opt, gen = _setup(store, steps=0)
    v0 = state_bits(trainer)["0.weight"].view(-1).clone()
    train_step(trainer, opt, gen)
    sender.publish()
    v1 = state_bits(trainer)["0.weight"].view(-1).clone()
    train_step(trainer, opt, gen)
    sender.publish()
    v2 = state_bits(trainer)["0.weight"].view(-1)
    i = int(((v1 == v0) & (v2 != v1)).nonzero()[0])
    with torch.no_grad():
        replica[0].weight.view(-1).view(torch.int16)[i] += 1
    with caplog.at_level("WARNING", logger="torch_deltasync.receiver"):
        assert receiver.update(2) == 2
    assert "version 2 tensor '0.weight': " in caplog.text
    assert "the base is the held version with the chain's earlier versions of this tensor applied" in caplog.text
    assert receiver.last_stats.recovered and first_difference(trainer, replica) is None


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_chain_of_fp8_deltas_that_step_one_element_twice_applies(store, dtype, native, request):
    # The second delta steps an element the first one changed: its old value comes from the
    # staged state, through masks that torch's fp8 tensors do not take (masked_fill); without the
    # compiled kernels the write is torch's, which has no index_copy_ for fp8 on the CPU.
    prev = _native.set_enabled(native)
    request.addfinalizer(lambda: _native.set_enabled(prev))
    w = {"w": torch.linspace(-2, 2, 4096)}
    sender = DeltaSender(w, store, inference_dtype=dtype, codec="packed", anchor_every=0)
    held = {"w": torch.zeros(4096, dtype=dtype)}
    receiver = DeltaReceiver(held, store)
    assert sender.publish() == 0 and receiver.update() == 0

    def step(idx):  # one fp8 ULP up
        b = w["w"].to(dtype).view(torch.int8).clone()
        b[idx] += 1
        w["w"].copy_(b.view(dtype).float())

    step(torch.arange(0, 4096, 7))
    assert sender.publish() == 1
    step(torch.tensor([7]))
    assert sender.publish() == 2
    assert receiver.update() == 2 and receiver.last_stats.path == "delta"
    assert torch.equal(held["w"].view(torch.int8), w["w"].to(dtype).view(torch.int8))
    fresh = {"w": torch.zeros(4096, dtype=dtype)}  # the anchor, then both deltas
    assert DeltaReceiver(fresh, store).update() == 2
    assert torch.equal(fresh["w"].view(torch.int8), held["w"].view(torch.int8))
