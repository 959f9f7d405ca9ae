"""Core additions for partial holders: combining per-holder partial checksums, and
``DeltaReceiver.assume`` (start from a version the target already holds)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.errors import ChecksumMismatchError
from torch_deltasync.checksum import check_partials, checksum, combine_partials, tensor_checksum
from torch_deltasync.testing import first_difference


def _mlp(seed: int, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8)).to(dtype)


@pytest.mark.parametrize("cuts", [(0,), (0, 100), (0, 1, 2, 300), (0, 37, 37, 200)])
def test_partials_of_any_partition_combine_to_the_full_checksum(cuts):
    t = torch.randn(40, 10, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    flat = t.reshape(-1)
    bounds = list(cuts) + [flat.numel()]
    parts = [{"w": checksum(flat[a:b], start=a)} for a, b in zip(bounds[:-1], bounds[1:])]
    assert combine_partials(parts) == {"w": tensor_checksum(t)}
    check_partials({"w": tensor_checksum(t)}, parts)


def test_check_partials_names_the_bad_tensor():
    t = torch.randn(64).to(torch.bfloat16)
    good = {"a": checksum(t[:32], start=0), "b": tensor_checksum(t)}
    rest = {"a": checksum(t[32:], start=32)}
    check_partials({"a": tensor_checksum(t), "b": tensor_checksum(t)}, [good, rest])
    with pytest.raises(ChecksumMismatchError, match="'a'"):
        check_partials({"a": tensor_checksum(t), "b": tensor_checksum(t)}, [good])  # half of 'a' missing


def test_assume_takes_the_delta_path_from_a_held_version(tmp_path):
    trainer = _mlp(0)
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(trainer, store, anchor_every=100)
    v0 = sender.publish()
    receiver_model = _mlp(0, torch.bfloat16)  # loaded the same starting checkpoint
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    v1 = sender.publish()
    rec = DeltaReceiver(receiver_model, store)
    rec.assume(v0)
    assert rec.update() == v1 and rec.last_stats.path == "delta"
    assert first_difference(receiver_model, trainer) is None
    rec.verify()


def test_assume_refuses_a_version_the_target_does_not_hold(tmp_path):
    store = LocalStore(tmp_path / "bucket")
    v0 = DeltaSender(_mlp(0), store).publish()
    other = _mlp(1, torch.bfloat16)
    rec = DeltaReceiver(other, store)
    with pytest.raises(ChecksumMismatchError):
        rec.assume(v0)
    assert rec.version is None
