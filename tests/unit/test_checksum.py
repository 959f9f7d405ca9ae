"""Per-tensor checksums: exact modular arithmetic, additivity over partitions, sensitivity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_deltasync.checksum import (
    _K0, _K1, _K2, _K3, checksum, combine, format_checksum, parse_checksum, tensor_checksum,
)

M64 = (1 << 64) - 1


def reference(t: torch.Tensor) -> int:
    """Python big-int reference of the documented formula (independent of the torch code)."""
    width = t.element_size() * 8
    ints = t.reshape(-1).view({16: torch.int16, 32: torch.int32, 64: torch.int64}[width]).tolist()
    total = 0
    for i, b in enumerate(ints):
        h = (i + _K0) & M64
        h = ((h ^ (h >> 30)) * _K1) & M64
        h = ((h ^ (h >> 27)) * _K2) & M64
        h ^= h >> 31
        total += h * ((b & ((1 << width) - 1)) + _K3)
    return total & M64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_matches_python_reference(dtype):
    torch.manual_seed(0)
    x = torch.randn(777).to(dtype)
    x[3], x[4], x[5] = float("nan"), float("-inf"), -0.0
    assert checksum(x) == reference(x)
    assert tensor_checksum(x, chunk=100) == reference(x)


def test_does_not_modify_input():
    x = torch.randn(100, dtype=torch.float64)
    before = x.clone()
    checksum(x)
    assert torch.equal(x.view(torch.int64), before.view(torch.int64))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 500), st.integers(0, 2**31), st.lists(st.integers(0, 10), min_size=1, max_size=6))
def test_additive_over_any_partition(n, seed, cuts):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(torch.bfloat16)
    perm = torch.randperm(n, generator=g)
    parts = torch.tensor_split(perm, sorted(c % (n + 1) for c in cuts))
    partials = [checksum(x[p], p) for p in parts]
    assert combine(*partials) == checksum(x)


def test_incremental_update_equals_recompute():
    x = torch.randn(1000).to(torch.bfloat16)
    c = checksum(x)
    pos = torch.tensor([0, 17, 999])
    new = torch.tensor([1.5, -0.0, float("nan")], dtype=torch.bfloat16)
    c2 = combine(c, -checksum(x[pos], pos) & M64, checksum(new, pos))
    x[pos] = new
    assert c2 == checksum(x)


def test_sensitive_to_sign_of_zero_and_position():
    z = torch.zeros(4, dtype=torch.bfloat16)
    nz = z.clone()
    nz[2] = -0.0
    assert checksum(z) != checksum(nz)
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert checksum(a) != checksum(a.flip(0))


@pytest.mark.parametrize("bad", ["", "xyz", "0" * 15, "g" * 16, 5, None])
def test_parse_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse_checksum(bad)


def test_format_round_trip():
    for v in (0, 1, M64, 0x0123456789ABCDEF):
        assert parse_checksum(format_checksum(v)) == v


def test_checksum_change_equals_the_difference_of_two_checksums():
    torch.manual_seed(1)
    pos = torch.randperm(1000)[:100]
    old = torch.randn(100).to(torch.bfloat16)
    new = torch.randn(100).to(torch.bfloat16)
    from torch_deltasync.checksum import checksum_change

    assert checksum_change(pos, old, new) == (checksum(new, pos) - checksum(old, pos)) & M64
    assert checksum_change(pos[:0], old[:0], new[:0]) == 0
