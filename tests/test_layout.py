"""TensorSlice: local <-> global flat index maps for rectangular blocks."""

from __future__ import annotations

import pytest
import torch

from torch_deltasync import CorruptObjectError, TensorSlice

CASES = [
    # (global shape, offsets, shape, why)
    ((1001, 64), (0, 0), (501, 64), "FSDP2 Shard(0) rank 0 of 2, ceil chunk"),
    ((1001, 64), (501, 0), (500, 64), "FSDP2 Shard(0) rank 1 of 2"),
    ((1001, 64), (0, 32), (501, 32), "FSDP x TP block"),
    ((7, 5, 3), (2, 1, 1), (3, 4, 2), "3-D block"),
    ((10,), (10,), (0,), "empty trailing torch.chunk shard"),
    ((4, 4), (0, 0), (4, 4), "full"),
]


@pytest.mark.parametrize("gshape,offsets,shape,why", CASES)
def test_round_trip_against_slicing(gshape, offsets, shape, why):
    full = torch.arange(torch.Size(gshape).numel()).reshape(gshape)
    s = TensorSlice(gshape, offsets, shape)
    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].reshape(-1)
    local = torch.arange(block.numel())
    assert torch.equal(s.to_global(local), block), why
    mask, back = s.to_local(torch.arange(full.numel()))
    assert torch.equal(full.reshape(-1)[mask], block), why
    assert torch.equal(back, local), why


@pytest.mark.parametrize("offsets,shape", [((0, 0), (5, 2)), ((3, 0), (2, 1)), ((-1, 0), (1, 1))])
def test_out_of_bounds_is_refused(offsets, shape):
    with pytest.raises(ValueError):
        TensorSlice((4, 1), offsets, shape)


@pytest.mark.parametrize("obj", [{}, {"offsets": [0], "shape": [1, 2]}, {"offsets": ["0"], "shape": [1]},
                                 {"offsets": [9], "shape": [1]}, None, [1, 2]])
def test_from_json_rejects_bad_input(obj):
    with pytest.raises(CorruptObjectError):
        TensorSlice.from_json(obj, (4,))
