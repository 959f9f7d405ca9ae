"""``torch_deltasync.dtensor``: the torch.chunk block rule, upload flags, refusals and upload planning.

Pure-function tests (no process group). The oracle for every block is ``torch.chunk`` itself applied
to ``arange`` of the full tensor, mesh dim by mesh dim (what DTensor's ``Shard`` documents), and
torch's own ``_compute_local_shape_and_global_offset``. Live DTensors are covered in test_fsdp2.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from torch_deltasync import TensorSlice, UnsupportedLayoutError
from torch_deltasync.dtensor import _decide_uploads, block_of

R = Replicate()

# (global shape, mesh shape, placements, why)
LAYOUTS = [
    ((1001, 64), (2,), [Shard(0)], "FSDP2: 501 + 500 rows"),
    ((1001, 64), (3,), [Shard(0)], "334 + 334 + 333"),
    ((1001, 64), (4,), [Shard(0)], "251 x 3 + 248"),
    ((5, 64), (4,), [Shard(0)], "2, 2, 1, 0 rows: an empty shard"),
    ((3,), (4,), [Shard(0)], "1, 1, 1, 0"),
    ((1, 8), (4,), [Shard(0)], "one row: three empty shards"),
    ((0, 8), (2,), [Shard(0)], "an empty tensor"),
    ((1001, 64), (2, 2), [R, Shard(0)], "HSDP: replicate x shard"),
    ((1001, 64), (2, 2), [Shard(0), Shard(1)], "FSDP x TP (row-parallel weight)"),
    ((45, 64), (2, 2), [Shard(0), R], "FSDP x TP, a bias replicated on tp"),
    ((7, 3), (2, 2), [Shard(0), Shard(0)], "dim 0 cut twice, left to right"),
    ((4, 6, 10), (3,), [Shard(2)], "a 3-D tensor sharded on its last dim"),
    ((4, 6, 10), (2,), [Shard(-1)], "a negative shard dim"),
    ((6, 4), (3,), [R], "fully replicated: coordinate 0 uploads"),
    ((), (2,), [R], "a 0-d tensor"),
    ((9, 5), (2, 3), [Shard(1), Shard(0)], "the mesh's first dim cuts tensor dim 1"),
]


def _oracle(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """The rank's block by applying torch.chunk per mesh dim (missing trailing chunks are empty)."""
    block = full
    for n, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard):
            d = p.dim % full.dim()
            chunks = torch.chunk(block, n, dim=d) if block.shape[d] else ()
            block = chunks[c] if c < len(chunks) else block.narrow(d, 0, 0)
    return block


@pytest.mark.parametrize("shape, mesh_shape, placements, why", LAYOUTS, ids=[x[3] for x in LAYOUTS])
def test_block_matches_torch_chunk_and_dtensor(shape, mesh_shape, placements, why):
    full = torch.arange(math.prod(shape)).reshape(shape)
    covered = torch.zeros(shape, dtype=torch.int64)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        s, upload = block_of("w", shape, mesh_shape, coord, placements)
        assert isinstance(s, TensorSlice) and s.global_shape == tuple(shape)
        expected = _oracle(full, mesh_shape, coord, placements)
        assert s.shape == tuple(expected.shape), (coord, why)
        view = full[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape))]
        assert torch.equal(view, expected), (coord, why)
        # local flat position -> global flat index: the values of arange are the global indices
        local = torch.arange(s.numel)
        assert torch.equal(s.to_global(local), expected.reshape(-1)), (coord, why)
        # torch's own rule, including where it puts empty shards
        t_shape, t_offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert (s.shape, s.offsets) == (tuple(t_shape), tuple(t_offset)), (coord, why)
        want_upload = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
        assert upload == want_upload, (coord, why)
        if upload:
            covered.view(-1)[expected.reshape(-1)] += 1
    assert bool((covered == 1).all()), "uploading ranks must hold every element exactly once"


def test_worked_table_from_the_docstring():
    """The (1001, 64) rows of the module docstring's table, spelled out."""
    cases = [
        ((2,), [Shard(0)], (1,), (501, 0), (500, 64), True),
        ((4,), [Shard(0)], (3,), (753, 0), (248, 64), True),
        ((2, 2), [R, Shard(0)], (1, 0), (0, 0), (501, 64), False),
        ((2, 2), [Shard(0), Shard(1)], (0, 1), (0, 32), (501, 32), True),
        ((2, 2), [Shard(0), Shard(1)], (1, 1), (501, 32), (500, 32), True),
    ]
    for mesh_shape, placements, coord, offsets, shape, upload in cases:
        s, up = block_of("E", (1001, 64), mesh_shape, coord, placements)
        assert (s.offsets, s.shape, up) == (offsets, shape, upload)
    s, _ = block_of("b", (5,), (4,), (3,), [Shard(0)])
    assert s.shape == (0,) and s.offsets == (5,)  # empty, placed at the end as DTensor does


REFUSED = [
    ((4, 4), (2,), (0,), [Partial()], "Partial", "unreduced partial sums"),
    ((4, 4), (2,), (0,), [Partial("avg")], "Partial", "any reduce op"),
    ((8, 4), (2, 2), (0, 1), [_StridedShard(0, split_factor=2), Shard(0)], "_StridedShard", "FSDP over colwise TP"),
    ((4, 4), (2,), (0,), ["S(0)"], "'S(0)'", "not a placement"),
    ((4, 4), (2,), (0,), [Shard(2)], "Shard(dim=2)", "dim outside the tensor"),
    ((4, 4), (2, 2), (0,), [Shard(0), R], "differ in length", "coordinate of the wrong length"),
    ((4, 4), (2,), (2,), [Shard(0)], "outside mesh dim", "coordinate out of range"),
]


@pytest.mark.parametrize("shape, mesh_shape, coord, placements, needle, why", REFUSED, ids=[x[5] for x in REFUSED])
def test_unsupported_layouts_are_refused(shape, mesh_shape, coord, placements, needle, why):
    with pytest.raises(UnsupportedLayoutError) as e:
        block_of("model.layers.0.w", shape, mesh_shape, coord, placements)
    assert "'model.layers.0.w'" in str(e.value) and needle in str(e.value)
    assert isinstance(e.value, NotImplementedError)  # the builtin it refines


def _rec(shape, offsets, sshape, upload=True):
    return [list(shape), list(offsets), list(sshape), upload]


def test_decide_uploads_dedupes_replicas_and_checks_coverage():
    # 4 ranks: ranks 0/1 and 2/3 hold the same half of "a" (TP copies of a dp sub-mesh); "b" is
    # whole on every rank (a plain tensor); rank 1 may not upload "c" (a Replicate() replica).
    top, bottom = _rec((4, 2), (0, 0), (2, 2)), _rec((4, 2), (2, 0), (2, 2))
    whole = _rec((3,), (0,), (3,))
    c = [_rec((2,), (0,), (2,)), _rec((2,), (0,), (2,), False), _rec((2,), (0,), (0,)), _rec((2,), (2,), (0,))]
    gathered = [{"a": top, "b": whole, "c": c[0]}, {"a": top, "b": whole, "c": c[1]},
                {"a": bottom, "b": whole, "c": c[2]}, {"a": bottom, "b": whole, "c": c[3]}]
    owners = _decide_uploads(gathered)["owners"]
    assert owners["a"] == {"[0, 0]:[2, 2]": 0, "[2, 0]:[2, 2]": 2}
    assert owners["b"] == {"[0]:[3]": 0}
    assert owners["c"] == {"[0]:[2]": 0, "[0]:[0]": 2, "[2]:[0]": 3}


@pytest.mark.parametrize("gathered, needle", [
    ([{"a": _rec((4,), (0,), (2,))}, {"a": _rec((4,), (0,), (2,))}], "cover 2 of 4 elements"),
    ([{"a": _rec((4,), (0,), (2,))}, {"a": _rec((4,), (2,), (2,), False)}], "cover 2 of 4 elements"),
    ([{"a": _rec((4,), (0,), (4,))}, {"b": _rec((4,), (0,), (4,))}], "rank 1 and rank 0 hold different tensors"),
    ([{"a": _rec((4,), (0,), (4,))}, {"a": _rec((5,), (0,), (5,))}], "global shape (5,) on rank 1"),
    ([{"a": _rec((4,), (0,), (3,))}, {"a": _rec((4,), (1,), (3,))}], "cover 6 of 4 elements"),
], ids=["a gap (same block twice)", "the holder of the rest may not upload", "different names",
        "different shapes", "overlapping blocks"])
def test_decide_uploads_refuses_inconsistent_ranks(gathered, needle):
    out = _decide_uploads(gathered)
    assert "owners" not in out and needle in out["error"]
