"""ChangeDetector: bit-view comparison, chunking, sign flips, NaN payloads, layouts, dtypes."""

from __future__ import annotations

import pytest
import torch

from torch_deltasync.detect import ChangeDetector

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def naive(old: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (old.to(dtype).reshape(-1).view(INT[dtype]) != new.to(dtype).reshape(-1).view(INT[dtype])).nonzero().squeeze(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [7, 1000, None])
def test_matches_naive_bit_compare(dtype, chunk):
    torch.manual_seed(0)
    w = torch.randn(3000) * 0.02
    det = ChangeDetector(inference_dtype=dtype, chunk_numel=chunk)
    det.reset("w", w)
    old = w.clone()
    w += torch.randn(3000) * 1e-5
    ch = det.detect("w", w)
    expected = naive(old, w, dtype)
    assert torch.equal(ch.positions, expected)
    assert torch.equal(ch.values.view(INT[dtype]), w.to(dtype)[expected].view(INT[dtype]))
    assert torch.equal(ch.old_values.view(INT[dtype]), old.to(dtype)[expected].view(INT[dtype]))


def test_sign_of_zero_and_nan_payloads_are_changes():
    w = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    det = ChangeDetector()
    det.reset("w", w)
    w2 = w.clone()
    w2[0] = -0.0  # -0.0 == 0.0 as floats, but the bits differ
    bits = w2.view(torch.int16)
    bits[2] = bits[2] ^ 1  # another NaN payload: NaN != NaN as floats, bits tell the truth
    ch = det.detect("w", w2)
    assert ch.positions.tolist() == [0, 2]
    assert torch.equal(ch.values.view(torch.int16), w2[[0, 2]].view(torch.int16))
    det.commit("w", ch)
    assert det.detect("w", w2).numel == 0  # an unchanged NaN is not a change


def test_non_contiguous_and_commit():
    base = torch.randn(64, 32)
    w = base.t()  # non-contiguous view (32, 64)
    det = ChangeDetector()
    det.reset("w", w)
    base[3, 5] += 1.0  # element (5, 3) of the transposed view
    ch = det.detect("w", w)
    assert ch.positions.tolist() == [5 * 64 + 3]
    det.commit("w", ch)
    assert torch.equal(det.snapshot("w").view(torch.int16), w.contiguous().reshape(-1).to(torch.bfloat16).view(torch.int16))


def test_size_mismatch_is_refused():
    det = ChangeDetector()
    det.reset("w", torch.zeros(10))
    with pytest.raises(ValueError, match="10"):
        det.detect("w", torch.zeros(11))


def test_cpu_snapshot_device():
    det = ChangeDetector(snapshot_device="cpu")
    w = torch.randn(100)
    det.reset("w", w)
    assert det.snapshot("w").device.type == "cpu"
    assert det.snapshot_nbytes() == 200


@pytest.mark.slow
def test_more_than_2_31_elements_use_int64_positions():
    n = 2**31 + 10
    w = torch.zeros(n, dtype=torch.bfloat16)
    det = ChangeDetector()
    det.reset("w", w)
    w[n - 3] = 1.0
    w[5] = -1.0
    ch = det.detect("w", w)
    assert ch.positions.dtype == torch.int64
    assert ch.positions.tolist() == [5, n - 3]
