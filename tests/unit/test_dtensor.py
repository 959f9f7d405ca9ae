"""``torch_deltasync.dtensor``: DTensor's layout rule (Shard, _StridedShard, Replicate), refusals, upload
planning and anchor parts.

Pure-function tests (no process group). The oracle for every block is DTensor's own splitting code
(``Shard._split_tensor`` / ``_StridedShard._split_tensor``, what ``distribute_tensor`` scatters)
applied to ``arange`` of the full tensor mesh dim by mesh dim, ``torch.chunk`` for plain ``Shard``,
and torch's ``_compute_local_shape_and_global_offset`` for shapes and first offsets. Live DTensors
are covered in test_fsdp2.py and test_fsdp2_tp.py.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from torch_deltasync.errors import UnsupportedLayoutError
from torch_deltasync.layout import TensorSlice
from torch_deltasync.dtensor import _decide_uploads, anchor_parts, block_of
from torch_deltasync.layout import TensorBlock

R = Replicate()


def SS(d: int, sf: int) -> _StridedShard:
    return _StridedShard(d, split_factor=sf)


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
    ((6, 4), (3,), [R], "fully replicated"),
    ((), (2,), [R], "a 0-d tensor"),
    ((9, 5), (2, 3), [Shard(1), Shard(0)], "the mesh's first dim cuts tensor dim 1"),
    ((8, 4), (2, 2), [SS(0, 2), Shard(0)], "torchtitan 2D colwise, the _StridedShard docstring's example"),
    ((1001, 64), (2, 2), [SS(0, 2), Shard(0)], "FSDP x vocab-parallel embedding, uneven"),
    ((45, 64), (2, 2), [SS(0, 2), Shard(0)], "FSDP x colwise linear, 45 rows"),
    ((37, 5), (2, 4), [SS(0, 4), Shard(0)], "dp 2 x tp 4, uneven"),
    ((45, 64), (2, 2, 2), [R, SS(0, 2), Shard(0)], "HSDP x TP (3D)"),
    ((4, 16, 8), (2, 2), [SS(0, 2), Shard(0)], "MoE experts: FSDP on dp_mod_ep x EP"),
    ((8, 6, 4), (2, 2, 2), [SS(0, 2), Shard(0), Shard(2)], "MoE experts: dp_mod_ep x EP x TP"),
    ((8, 4), (2, 2), [Shard(0), SS(0, 2)], "strided after shard: rows [0, 2], ... (not a box)"),
    ((13, 3), (3, 2), [SS(0, 2), Shard(0)], "uneven dp 3 x tp 2: runs with gaps"),
    ((10, 6), (2, 2), [SS(1, 3), Shard(0)], "a strided split of dim 1 next to a Shard of dim 0"),
]


def _oracle(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """The rank's local tensor as DTensor computes it: each placement's own ``_split_tensor``
    (``torch.chunk`` for Shard; pieces, chunks, concatenation for _StridedShard), mesh dim by mesh dim."""
    block = full
    for n, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Replicate):
            continue
        d = p.dim % full.dim()
        p = SS(d, p.split_factor) if isinstance(p, _StridedShard) else Shard(d)
        shards, _ = p._split_tensor(block, n, with_padding=False, contiguous=True)
        block = shards[c]
    return block


def _chunk_oracle(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """``torch.chunk`` per ``Shard`` mesh dim (missing trailing chunks are empty)."""
    block = full
    for n, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard) and not isinstance(p, _StridedShard):
            d = p.dim % full.dim()
            chunks = torch.chunk(block, n, dim=d) if block.shape[d] else ()
            block = chunks[c] if c < len(chunks) else block.narrow(d, 0, 0)
    return block


def _check_block(b: TensorBlock, full: torch.Tensor, mesh_shape, coord, placements, why) -> torch.Tensor:
    expected = _oracle(full, mesh_shape, coord, placements)
    assert isinstance(b, TensorBlock) and b.global_shape == tuple(full.shape)
    assert b.shape == tuple(expected.shape), (coord, why)
    # local flat position -> global flat index: the values of arange are the global indices
    assert torch.equal(b.to_global(torch.arange(b.numel)), expected.reshape(-1)), (coord, why)
    # the boxes hold exactly the local elements, in place
    seen = []
    for box, where in b.boxes():
        view = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.shape))]
        assert torch.equal(view, expected[where]), (coord, why)
        seen.append(view.reshape(-1))
    assert torch.equal(torch.cat(seen).sort().values, expected.reshape(-1).sort().values), (coord, why)
    # torch's own rule, including where it puts empty shards (it reports the first offset only)
    t_shape, t_offset = _compute_local_shape_and_global_offset(tuple(full.shape), mesh_shape, list(coord), placements)
    assert (b.shape, b.offsets) == (tuple(t_shape), tuple(t_offset)), (coord, why)
    return expected


@pytest.mark.parametrize("shape, mesh_shape, placements, why", LAYOUTS, ids=[x[3] for x in LAYOUTS])
def test_block_matches_dtensor(shape, mesh_shape, placements, why):
    full = torch.arange(math.prod(shape)).reshape(shape)
    covered = torch.zeros(shape, dtype=torch.int64)
    replicated = [m for m, p in enumerate(placements) if isinstance(p, Replicate)]
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        b = block_of("w", shape, mesh_shape, coord, placements)
        expected = _check_block(b, full, mesh_shape, coord, placements, why)
        if not any(isinstance(p, _StridedShard) for p in placements):
            assert torch.equal(expected, _chunk_oracle(full, mesh_shape, coord, placements)), why
            assert b.box is not None, why  # Shard alone always gives a box
        if all(coord[m] == 0 for m in replicated):
            covered.view(-1)[expected.reshape(-1)] += 1
    assert bool((covered == 1).all()), "one replica of the ranks holds every element exactly once"


def test_random_layouts_match_dtensor():
    """300 random mixes of Shard / _StridedShard / Replicate on 1-3 mesh dims and 1-3 tensor dims."""
    rng = random.Random(17)
    checked = 0
    for _ in range(300):
        shape = tuple(rng.randint(0, 11) for _ in range(rng.randint(1, 3)))
        mesh_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        placements = []
        for _ in mesh_shape:
            d, k = rng.randrange(len(shape)), rng.random()
            placements.append(R if k < 0.2 else Shard(d) if k < 0.6 else SS(d, rng.randint(1, 4)))
        full = torch.arange(math.prod(shape)).reshape(shape)
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            _check_block(block_of("w", shape, mesh_shape, coord, placements), full, mesh_shape, coord, placements,
                         (shape, mesh_shape, placements))
            checked += 1
    assert checked > 1000


def test_worked_tables_from_the_docstring():
    """The rows of the module docstring's tables, spelled out."""
    rows = lambda b: [(a, a + n - 1) for a, n in b.runs[0]]  # noqa: E731
    cases = [  # mesh, placements, coordinate, row ranges, local shape
        ((2,), [Shard(0)], (1,), [(501, 1000)], (500, 64)),
        ((4,), [Shard(0)], (3,), [(753, 1000)], (248, 64)),
        ((2, 2), [R, Shard(0)], (1, 0), [(0, 500)], (501, 64)),
        ((2, 2), [Shard(0), Shard(1)], (0, 1), [(0, 500)], (501, 32)),
        ((2, 2), [Shard(0), Shard(1)], (1, 1), [(501, 1000)], (500, 32)),
        ((2, 2), [SS(0, 2), Shard(0)], (0, 0), [(0, 250)], (251, 64)),
        ((2, 2), [SS(0, 2), Shard(0)], (0, 1), [(501, 750)], (250, 64)),
        ((2, 2), [SS(0, 2), Shard(0)], (1, 0), [(251, 500)], (250, 64)),
        ((2, 2), [SS(0, 2), Shard(0)], (1, 1), [(751, 1000)], (250, 64)),
        ((2, 2, 2), [R, SS(0, 2), Shard(0)], (1, 1, 0), [(251, 500)], (250, 64)),
    ]
    for mesh_shape, placements, coord, want_rows, shape in cases:
        b = block_of("E", (1001, 64), mesh_shape, coord, placements)
        assert (rows(b), b.shape) == (want_rows, shape), (mesh_shape, placements, coord)
    b = block_of("E", (1001, 64), (2, 2), (0, 1), [Shard(0), Shard(1)])
    assert b.box == TensorSlice((1001, 64), (0, 32), (501, 32))
    experts = [block_of("x", (4, 16, 8), (2, 2), c, [SS(0, 2), Shard(0)]).runs[0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert experts == [((0, 1),), ((2, 1),), ((1, 1),), ((3, 1),)]
    strided = [block_of("r", (8, 4), (2, 2), c, [Shard(0), SS(0, 2)]) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert [b.runs[0] for b in strided] == [((0, 1), (2, 1)), ((1, 1), (3, 1)), ((4, 1), (6, 1)), ((5, 1), (7, 1))]
    assert [len(b.boxes()) for b in strided] == [2] * 4 and all(b.box is None for b in strided)
    s = block_of("b", (5,), (4,), (3,), [Shard(0)])
    assert s.shape == (0,) and s.box.offsets == (5,)  # empty, placed at the end as DTensor does


def _fsdp2_storage(n_rows: int, dp: int, tp: int, d: int, t: int) -> list[int]:
    """Rows ``fully_shard`` stores on rank (d, t) for a TP ``Shard(0)`` weight: torch.chunk over dp of
    the TP shard, itself torch.chunk over tp (torch/distributed/fsdp/_fully_shard/_fsdp_param.py:
    ``_chunk_with_empty(param_data, shard_world_size)`` of the TP-local tensor)."""
    tp_shards = torch.arange(n_rows).chunk(tp) if n_rows else ()
    mine = tp_shards[t] if t < len(tp_shards) else torch.arange(0)
    dp_shards = mine.chunk(dp) if mine.numel() else ()
    return dp_shards[d].tolist() if d < len(dp_shards) else []


def test_uneven_fsdp_x_tp_is_placed_right_or_refused():
    """FSDP2 over a TP-sharded dim describes its shards with _StridedShard. For every row count up
    to 100 on dp 2-4 x tp 2-4, either the placements give every rank exactly the rows fully_shard
    stores there, or some rank's local shape disagrees (the sender then refuses the tensor on every
    rank): never rows that merely have the right count but sit elsewhere. Over dp = 2 they always agree,
    and where they agree every block is a box (one anchor object per rank)."""
    for n_rows, dp, tp in itertools.product(range(1, 101), (2, 3, 4), (2, 3, 4)):
        agree, shapes_agree, boxes = True, True, True
        for d, t in itertools.product(range(dp), range(tp)):
            stored = _fsdp2_storage(n_rows, dp, tp, d, t)
            b = block_of("w", (n_rows,), (dp, tp), (d, t), [SS(0, tp), Shard(0)])
            described = b.to_global(torch.arange(b.numel)).tolist()
            agree &= stored == described
            shapes_agree &= len(stored) == len(described)
            boxes &= b.box is not None
        assert agree or not shapes_agree, (n_rows, dp, tp)
        assert agree or dp > 2, (n_rows, dp, tp)
        assert boxes or not agree, (n_rows, dp, tp)


REFUSED = [
    ((4, 4), (2,), (0,), [Partial()], "Partial", "unreduced partial sums"),
    ((4, 4), (2,), (0,), [Partial("avg")], "Partial", "any reduce op"),
    ((8, 4), (2, 2), (0, 1), [SS(0, 2), Partial()], "Partial", "Partial next to a _StridedShard"),
    ((8, 4), (2,), (0,), [SS(3, 2)], "_StridedShard(dim=3, sf=2)", "strided dim outside the tensor"),
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
    """One rank's record of one tensor, as plan_uploads gathers it: [global shape, runs, may upload]."""
    return [list(shape), TensorBlock.from_slice(TensorSlice(tuple(shape), tuple(offsets), tuple(sshape))).to_json(), upload]


def _gathered(*ranks, problems=None):
    return [{"blocks": r, "problems": (problems or {}).get(i, [])} for i, r in enumerate(ranks)]


def _key(shape, offsets, sshape):
    from torch_deltasync.dtensor import _block_key

    return _block_key(_rec(shape, offsets, sshape)[1])


def test_decide_uploads_dedupes_and_balances():
    # 4 ranks: ranks 0/1 and 2/3 hold the same half of "a" (TP copies of a dp sub-mesh); "b" is
    # whole on every rank (a plain tensor); rank 1 is outside c's mesh (may not upload) and ranks
    # 2, 3 hold empty shards of it.
    top, bottom = _rec((4, 2), (0, 0), (2, 2)), _rec((4, 2), (2, 0), (2, 2))
    whole = _rec((3,), (0,), (3,))
    c = [_rec((2,), (0,), (2,)), _rec((2,), (0,), (2,), False), _rec((2,), (2,), (0,)), _rec((2,), (2,), (0,))]
    out = _decide_uploads(_gathered(*({"a": a, "b": whole, "c": cc} for a, cc in zip([top, top, bottom, bottom], c))))
    owners = out["owners"]
    # largest first, each to the least loaded holder: a's halves (4 elements) to ranks 0 and 2,
    # then b (3) to rank 1 (load 0), then c (2) to its only holder; empty blocks ship nowhere
    assert owners["a"] == {_key((4, 2), (0, 0), (2, 2)): 0, _key((4, 2), (2, 0), (2, 2)): 2}
    assert owners["b"] == {_key((3,), (0,), (3,)): 1}
    assert owners["c"] == {_key((2,), (0,), (2,)): 0}
    assert out["slots"] == 1


def test_hsdp_replicas_share_the_uploads():
    """[Replicate(), Shard(0)] on (2, 2): ranks 0, 2 hold the first halves, 1, 3 the second. Each
    block goes to exactly one replica, and the two replicas take turns: every rank ships one."""
    first, second = _rec((8,), (0,), (4,)), _rec((8,), (4,), (4,))
    ranks = [{"x": h, "y": h} for h in (first, second, first, second)]
    owners = _decide_uploads(_gathered(*ranks))["owners"]
    assert owners["x"] == {_key((8,), (0,), (4,)): 0, _key((8,), (4,), (4,)): 1}
    assert owners["y"] == {_key((8,), (0,), (4,)): 2, _key((8,), (4,), (4,)): 3}


def test_empty_tensor_is_shipped_once_and_strided_blocks_need_slots():
    z = _rec((0, 8), (0, 0), (0, 8))
    two_boxes = [[8, 4], [[0, 1], [2, 1]], [[0, 4]]]  # rows 0 and 2 of an (8, 4) tensor
    rest = [[8, 4], [[1, 1], [3, 5]], [[0, 4]]]
    out = _decide_uploads(_gathered({"z": z, "r": [*two_boxes[:1], two_boxes[1:], True]},
                                    {"z": z, "r": [*rest[:1], rest[1:], True]}))
    assert len(out["owners"]["z"]) == 1  # a 0-element tensor still appears in one anchor object
    assert out["slots"] == 2
    # 50000 ranks with 2 boxes each would need object keys past r99999
    empty = {"r": [[8, 4], [[], [[0, 4]]], True]}
    many = _decide_uploads(_gathered({"r": [*two_boxes[:1], two_boxes[1:], True]}, {"r": [*rest[:1], rest[1:], True]},
                                     *([empty] * 49998)))
    assert "100000 object slots" in many["error"]


@pytest.mark.parametrize("gathered, needle", [
    (_gathered({"a": _rec((4,), (0,), (2,))}, {"a": _rec((4,), (0,), (2,))}), "cover 2 of 4 elements"),
    (_gathered({"a": _rec((4,), (0,), (2,))}, {"a": _rec((4,), (2,), (2,), False)}), "cover 2 of 4 elements"),
    (_gathered({"a": _rec((4,), (0,), (4,))}, {"b": _rec((4,), (0,), (4,))}), "rank 1 and rank 0 hold different tensors"),
    (_gathered({"a": _rec((4,), (0,), (4,))}, {"a": _rec((5,), (0,), (5,))}), "global shape (5,) on rank 1"),
    (_gathered({"a": _rec((4,), (0,), (3,))}, {"a": _rec((4,), (1,), (3,))}), "cover 6 of 4 elements"),
    (_gathered({"a": _rec((4,), (0,), (2,))}, {"a": _rec((4,), (2,), (2,))}, problems={1: ["tensor 'a': the local shard"]}),
     "rank 1: tensor 'a': the local shard"),
], ids=["a gap (same block twice)", "the holder of the rest may not upload", "different names",
        "different shapes", "overlapping blocks", "a local shard that disagrees with its placements"])
def test_decide_uploads_refuses_inconsistent_ranks(gathered, needle):
    out = _decide_uploads(gathered)
    assert "owners" not in out and needle in out["error"]


def test_anchor_parts_cut_blocks_into_boxes():
    full = torch.arange(32).reshape(8, 4)
    strided = block_of("r", (8, 4), (2, 2), (0, 1), [Shard(0), SS(0, 2)])  # rows 1 and 3
    plain = TensorBlock.full((3,))
    parts = anchor_parts({"r": (full[[1, 3]], strided), "p": (torch.arange(3), plain)})
    assert [sorted(p) for p in parts] == [["p", "r"], ["r"]]
    (d0, b0), (d1, b1) = parts[0]["r"], parts[1]["r"]
    assert (b0.offsets, b0.shape, b1.offsets, b1.shape) == ((1, 0), (1, 4), (3, 0), (1, 4))
    assert torch.equal(d0, full[1:2]) and torch.equal(d1, full[3:4])
    assert parts[0]["p"][1] == TensorSlice.full((3,)) and anchor_parts({}) == []


def _gather_with_a_silent_peer(rank: int, world: int, folder: str) -> dict:
    """Rank 1 builds the sender's group but never gathers (it skipped a publish, or hangs):
    rank 0's gather must fail after the job's own timeout, not torch's 30-minute default."""
    import datetime
    import os
    import time

    import torch.distributed as dist

    from torch_deltasync.dtensor import DistributedGroup

    dist.destroy_process_group()  # the job's own group, with its own timeout
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=3))
    g = DistributedGroup()
    done = os.path.join(folder, "done")
    if rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {}
    t = time.monotonic()
    try:
        g.gather({"rank": rank})
        error = None
    except Exception as e:  # noqa: BLE001 - the outcome is checked by the test
        error = f"{type(e).__name__}: {e}"
    open(done, "w").close()
    return {"error": error, "waited_s": time.monotonic() - t}


def test_the_senders_collectives_time_out_with_the_jobs_process_group(tmp_path):
    """dist.new_group(timeout=None) takes torch's 30-minute default: a rank that skipped a publish
    left the others waiting half an hour although the job set a 3-second timeout."""
    from torch_deltasync._ranks import run_ranks

    results = run_ranks(_gather_with_a_silent_peer, 2, str(tmp_path), timeout_s=180)
    assert results[0]["error"] is not None and "Timed out" in results[0]["error"]
    assert results[0]["waited_s"] < 60
