"""``DeltaReceiver.prepare`` / ``commit``: staging writes nothing, a commit only writes, a staged
update whose base moved is refused."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import make_mlp, train_step

from torch_deltasync import DeltaReceiver, DeltaSender
from torch_deltasync.errors import StaleUpdateError
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
