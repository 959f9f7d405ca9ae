"""TensorSlice: local <-> global flat index maps for rectangular blocks."""

from __future__ import annotations

import math

import pytest
import torch

from torch_deltasync.errors import CorruptObjectError
from torch_deltasync.layout import TensorSlice

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


# --- TensorBlock: per-dim runs of global indices ---------------------------------------------------

from torch_deltasync.layout import TensorBlock  # noqa: E402

BLOCKS = [
    # (global shape, per-dim index lists, why)
    ((8, 3), ([0, 1, 4, 5], [0, 1, 2]), "rows 0-1 and 4-5: the class docstring's example"),
    ((8, 4), ([0, 2], [1, 2, 3]), "two single rows, three columns"),
    ((5, 6, 7), ([1, 3, 4], [0, 5], [2, 3, 6]), "gaps in every dim of a 3-D tensor"),
    ((6, 4), ([2, 3, 4], [0, 1, 2, 3]), "a box"),
    ((4, 4), ([], [1, 2]), "empty"),
    ((), (), "0-d"),
]


def _runs(ix):
    out = []
    for i in ix:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return tuple(tuple(r) for r in out)


@pytest.mark.parametrize("gshape, ix, why", BLOCKS, ids=[b[2] for b in BLOCKS])
def test_block_maps_and_boxes_against_indexing(gshape, ix, why):
    full = torch.arange(torch.Size(gshape).numel()).reshape(gshape)
    b = TensorBlock(gshape, tuple(_runs(i) for i in ix))
    local = full[torch.meshgrid(*(torch.tensor(i, dtype=torch.int64) for i in ix), indexing="ij")] if ix else full
    assert b.shape == tuple(local.shape) and b.numel == local.numel(), why
    assert torch.equal(b.to_global(torch.arange(b.numel)), local.reshape(-1)), why
    covered = []
    for box, where in b.boxes():
        assert torch.equal(full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.shape))], local[where]), why
        covered.append(local[where].reshape(-1))
    assert torch.equal(torch.cat(covered).sort().values, local.reshape(-1).sort().values), why
    is_box = all(len(_runs(i)) <= 1 for i in ix) or b.numel == 0
    assert (b.box is not None) == is_box and len(b.boxes()) == max(1, math.prod(len(_runs(i)) for i in ix) if b.numel else 1)
    assert TensorBlock.from_json(b.to_json(), gshape) == b


def test_block_normalises_and_compares_by_value():
    a = TensorBlock((8,), (((0, 2), (2, 2), (5, 0)),))
    assert a.runs == (((0, 4),),) and a == TensorBlock.from_slice(TensorSlice((8,), (0,), (4,)))
    a.to_global(torch.arange(4))  # fills the index cache: still equal, still hashable
    assert a == TensorBlock((8,), (((0, 4),),)) and hash(a) == hash(TensorBlock((8,), (((0, 4),),)))
    assert TensorBlock.full((3, 2)).is_full and TensorBlock.full((3, 2)).box == TensorSlice.full((3, 2))


@pytest.mark.parametrize("runs, needle", [
    ((((2, 2), (1, 1)),), "not increasing"),
    ((((0, 3), (2, 1)),), "overlap"),
    ((((6, 3),),), "end past its size 8"),
    ((((0, 1),), ((0, 1),)), "rank mismatch"),
])
def test_bad_runs_are_refused(runs, needle):
    with pytest.raises(ValueError, match=needle):
        TensorBlock((8,), runs)
    with pytest.raises(ValueError, match="bad block runs"):
        TensorBlock.from_json([[["x", 1]]], (8,))
