"""The published cast and a receiver's wider storage (torch_deltasync/_dtypes.py), on every 16-bit
pattern: NaNs made by a cast become one pattern, other values keep torch's bits, and values held in
a wider dtype come back bit for bit, NaN payloads included."""

from __future__ import annotations

import pytest
import torch

from torch_deltasync import _native
from torch_deltasync._dtypes import canonical_nans_, cast, narrow, widen
from torch_deltasync.errors import ChecksumMismatchError
from torch_deltasync.targets._base import narrow_exactly

ALL16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)  # every 16-bit pattern


def _nan16(dtype: torch.dtype) -> torch.Tensor:
    exp = 0x7F80 if dtype == torch.bfloat16 else 0x7C00  # exponent all ones, mantissa not zero
    return ((ALL16 & 0x7FFF).to(torch.int32) > exp)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype,want", [(torch.bfloat16, 0x7FC0), (torch.float16, 0x7E00)])
def test_canonical_nans_rewrites_every_nan_and_nothing_else(dtype, want, native, request):
    prev = _native.set_enabled(native)
    request.addfinalizer(lambda: _native.set_enabled(prev))
    out = canonical_nans_(ALL16.clone().view(dtype)).view(torch.int16)
    nan = _nan16(dtype)
    assert int(nan.sum()) == (254 if dtype == torch.bfloat16 else 2046)
    assert (out[nan] == want).all() and torch.equal(out[~nan], ALL16[~nan])


def test_cast_keeps_a_tensors_own_dtype_bit_for_bit():
    v = ALL16.view(torch.bfloat16)
    out = cast(v, torch.bfloat16)
    assert out.data_ptr() != v.data_ptr() and torch.equal(out.view(torch.int16), ALL16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("storage", [torch.float32, torch.float64])
def test_every_16_bit_pattern_survives_wider_storage(dtype, storage):
    v = ALL16.view(dtype)
    held = widen(v, storage)
    nan = _nan16(dtype)
    assert torch.equal(held[~nan], v[~nan].to(storage))  # numbers: torch's (exact) widening
    assert torch.isnan(held[nan]).all()
    assert torch.equal(narrow(held, dtype).view(torch.int16), ALL16)
    assert narrow_exactly(held, dtype, "w").view(torch.int16).equal(ALL16)


def test_fp32_patterns_survive_fp64_storage():
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.randint(-(1 << 31), (1 << 31) - 1, (200_000,), generator=g),
                   torch.tensor([0x7F800001, -1, 0x7FC00000, 0x7F800000, -(1 << 31), 0x7FFFFFFF, -(1 << 22)])]
                  ).to(torch.int32)
    held = widen(v.view(torch.float32), torch.float64)
    assert torch.equal(narrow(held, torch.float32).view(torch.int32), v)


@pytest.mark.parametrize("pattern", [0x7F800001, 0x3F800001])  # a NaN -> +inf, a number -> 1.0
def test_narrow_exactly_refuses_fp32_values_that_are_no_bf16_values(pattern):
    held = torch.tensor([1.0, 2.0, 0.0]).to(torch.float32)
    held.view(torch.int32)[1] = pattern
    with pytest.raises(ChecksumMismatchError, match=r"'w' is held in torch\.float32 and 1 of these 3 elements are no "
                                                    r"torch\.bfloat16 values"):
        narrow_exactly(held, torch.bfloat16, "w")


@pytest.mark.parametrize("dtype,storage", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                           (torch.float32, torch.float64)])
def test_narrow_takes_any_layout(dtype, storage):
    wide = widen(torch.randn(4, 3).to(dtype), storage)
    for v in (wide[:, 1], wide.t(), wide[:0, 1], wide[1, 1], wide[2:, :]):  # a column, a transpose, empty, 0-d
        out = narrow(v, dtype)
        assert out.shape == v.shape and out.is_contiguous()
        assert torch.equal(out, v.to(dtype))  # numbers: torch's exact narrowing
