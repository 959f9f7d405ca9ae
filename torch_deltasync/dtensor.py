r"""DTensor (FSDP2, HSDP, FSDP x TP, expert parallel) shards as blocks of the global tensor, and the
sender's collectives.

A sharded sender never gathers a parameter. Each rank reads only its local shard
(``DTensor.to_local()``), and :func:`local_source` says which elements of the full tensor (Hugging
Face layout) that shard holds: a :class:`~torch_deltasync.layout.TensorBlock`, computed from the
DTensor's global shape, its mesh shape, this rank's mesh coordinate and its placements. The sender
then turns local positions into global flat indices with ``TensorBlock.to_global``.

**The rule** is DTensor's own (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
in torch 2.14, which tracks, per tensor dim, the list of global indices a rank holds; ``Shard``
follows ``torch.chunk``; ``_StridedShard._split_tensor`` defines the strided split). For every
tensor dim ``d`` start with the index list ``ix = [0, 1, ..., global_shape[d] - 1]``; apply the mesh
dims left to right; a mesh dim ``m`` of size ``n`` where this rank has coordinate ``c``:

* ``Shard(d)`` keeps chunk ``c`` of ``ix`` (``torch.chunk``: chunks of ``ceil(len / n)``, the last
  ones shorter or empty)::

      chunk = ceil(len(ix) / n);  ix = ix[min(c * chunk, len) : min((c + 1) * chunk, len)]

* ``_StridedShard(d, split_factor=sf)`` (FSDP2's placement when ``fully_shard`` shards a dim that
  tensor or expert parallelism already split ``sf`` ways: the TP split happened *first*, "right to
  left") cuts ``ix`` into ``sf`` ``torch.chunk`` pieces, cuts every piece into ``n`` chunks and keeps
  the concatenation of chunk ``c`` of every piece::

      ix = concat(torch.chunk(piece, n)[c] for piece in torch.chunk(ix, sf))

* ``Replicate()`` keeps ``ix``: every replica holds the same block, and :func:`plan_uploads` lets
  exactly one of them upload it.

``Partial`` (pending reductions: the local values are not the weights), a non-default explicit shard
order and anything else are refused with :class:`~torch_deltasync.errors.UnsupportedLayoutError`. The
rank's local tensor is the outer product of the per-dim lists; each list stays increasing, so it is a
set of runs and the block is a box (one :class:`~torch_deltasync.layout.TensorSlice`) unless some list
has gaps.

**Worked example 1**: FSDP2 and its relatives, the global ``(1001, 64)`` embedding ``E``.

=====================================  =====  ==========  ============  ==============
mesh / placements                      rank   coordinate  local shape   rows (offsets)
=====================================  =====  ==========  ============  ==============
``(2,)`` ``[S(0)]`` (FSDP2)            0      ``(0,)``    (501, 64)     0..500
\                                      1      ``(1,)``    (500, 64)     501..1000
``(4,)`` ``[S(0)]``                    0..2   ``(c,)``    (251, 64)     251c..251c+250
\                                      3      ``(3,)``    (248, 64)     753..1000
``(2,2)`` ``[R, S(0)]`` (HSDP)         0, 2   ``(r, 0)``  (501, 64)     0..500
\                                      1, 3   ``(r, 1)``  (500, 64)     501..1000
``(2,2)`` ``[S(0), S(1)]``             0      ``(0, 0)``  (501, 32)     0..500, cols 0..31
(FSDP x row-parallel TP)               1      ``(0, 1)``  (501, 32)     0..500, cols 32..63
\                                      2      ``(1, 0)``  (500, 32)     501..1000, cols 0..31
\                                      3      ``(1, 1)``  (500, 32)     501..1000, cols 32..63
``(2,2)`` ``[_SS(0, sf=2), S(0)]``     0      ``(0, 0)``  (251, 64)     0..250
(FSDP x vocab-parallel embedding,      1      ``(0, 1)``  (250, 64)     501..750
torchtitan's 2D layout)                2      ``(1, 0)``  (250, 64)     251..500
\                                      3      ``(1, 1)``  (250, 64)     751..1000
=====================================  =====  ==========  ============  ==============

In the last layout TP cut the rows first (``0..500`` on tp 0, ``501..1000`` on tp 1) and FSDP then cut
each TP shard over dp: ``_SS(0, sf=2)`` on dp says exactly that, and its offsets are not the
left-to-right ones of ``[S(0), S(0)]`` (which would put rows ``251..500`` on rank 1).
HSDP x TP (3D, ``[R, _SS(0, sf=2), S(0)]`` on ``(2, 2, 2)``) gives every replica the table's blocks.
Expert parallelism is the same rule on the expert dim: experts ``(4, 16, 8)`` with
``[_SS(0, sf=2), S(0)]`` on ``(dp_mod_ep=2, ep=2)`` put expert 0 on rank 0, expert 2 on rank 1,
expert 1 on rank 2 and expert 3 on rank 3.

**Worked example 2**: a strided shard that is not a box. 8 rows with ``[S(0), _SS(0, sf=2)]`` on
``(2, 2)`` (the comment in ``compute_local_shape_and_global_offset`` works the same case): ``S(0)``
leaves rows ``0..3`` on dp 0; ``_SS(0, sf=2)`` cuts them into pieces ``0..1`` and ``2..3`` and keeps
chunk ``c`` of each: rank ``(0, 0)`` holds rows ``[0, 2]``, ``(0, 1)`` rows ``[1, 3]``, ``(1, 0)``
rows ``[4, 6]``, ``(1, 1)`` rows ``[5, 7]``: two boxes each. torch itself reports only the *first*
offset of such a shard (``(0, 0)``, ``(1, 0)``, ``(4, 0)``, ``(5, 0)``); the index lists are the whole
truth. Deltas carry global indices, so they do not care; an anchor object stores one box per tensor,
so a rank whose block is several boxes writes one anchor object per box (:func:`anchor_parts`).

Uneven splits leave empty shards: 5 rows over 4 ranks give chunks of ``ceil(5/4) = 2`` rows, i.e.
``2, 2, 1, 0`` rows at offsets ``0, 2, 4, 5``; 3 rows over 4 ranks give ``1, 1, 1, 0``. An empty
block is placed as DTensor places it (offset ``global_shape[d]``).

When metadata and data disagree. ``fully_shard`` over a TP-sharded dim stores
``torch.chunk(torch.chunk(x, tp)[t], dp)[d]`` on rank ``(d, t)``, which is what ``_SS(0, sf=tp)``
describes whenever the split is even and also for uneven splits over 2 dp ranks; for some uneven
splits over 3 or more dp ranks (13 rows on dp 3 x tp 2) the two differ and some rank's local shape
disagrees with its placements. The sender then refuses the tensor on every rank (the shapes are
compared in :func:`plan_uploads`) instead of placing rows where they do not belong.

:func:`default_group` provides the collectives a sharded :class:`~torch_deltasync.DeltaSender` needs
(gather per-rank metadata to rank 0, broadcast the outcome, agree on a flag) over dedicated gloo
process groups, so they never interleave with the training's collectives, even when the publish
finishes on a background thread.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .errors import UnsupportedLayoutError
from .layout import Source, TensorBlock, TensorSlice

__all__ = ["block_of", "local_source", "plan_uploads", "UploadPlan", "anchor_parts", "default_group",
           "DistributedGroup"]


def _placement_kind(p: Any) -> str:
    """``"shard"``, ``"strided"``, ``"replicate"`` or ``"unsupported"`` (checked by exact type:
    other subclasses, such as ``_MaskPartial``, change the meaning and are not understood)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if type(p) is Shard:
        return "shard"
    if type(p) is _StridedShard:
        return "strided"
    if type(p) is Replicate:
        return "replicate"
    return "unsupported"


def _chunk(size: int, n: int, c: int) -> tuple[int, int]:
    """``[start, end)`` of chunk ``c`` when ``torch.chunk`` cuts ``size`` elements ``n`` ways."""
    chunk = -(-size // n) if size else 0
    start = min(c * chunk, size)
    return start, min(size, start + chunk)


def _take(runs: Sequence[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """The runs of positions ``[a, b)`` of the index list that ``runs`` spells out."""
    out, pos = [], 0
    for start, length in runs:
        lo, hi = max(a, pos), min(b, pos + length)
        if lo < hi:
            out.append((start + lo - pos, hi - lo))
        pos += length
    return out


def block_of(
    name: str,
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> TensorBlock:
    """The elements of ``global_shape`` held by the rank at ``coordinate``.

    A pure function of the layout (no process group needed); :func:`local_source` calls it with a
    live DTensor's values. The rule and worked tables are in the module docstring.

    Args:
        name: the tensor's name (for error messages).
        global_shape: shape of the full tensor (HF layout), elements per dim.
        mesh_shape: size of every mesh dim.
        coordinate: this rank's coordinate in the mesh, one entry per mesh dim.
        placements: one ``Shard(d)``, ``_StridedShard(d, split_factor=k)`` or ``Replicate()`` per
            mesh dim (``torch.distributed.tensor``), applied left to right.

    Returns:
        The block: per tensor dim, the increasing runs of global indices held (a dim may hold none:
        an empty ``torch.chunk`` shard).

    Raises:
        UnsupportedLayoutError: a ``Partial`` or unknown placement, a shard dim outside the tensor,
            a split factor below 1, or mesh/coordinate/placements of different lengths; the message
            names the tensor and the placement.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> from torch.distributed.tensor.placement_types import _StridedShard
        >>> block_of("w", (5, 3), (4,), (2,), [Shard(0)]).box
        TensorSlice(global_shape=(5, 3), offsets=(4, 0), shape=(1, 3))
        >>> block_of("w", (8, 4), (2, 2), (0, 0), [Shard(0), _StridedShard(0, split_factor=2)]).runs
        (((0, 1), (2, 1)), ((0, 4),))
    """
    global_shape = tuple(int(s) for s in global_shape)
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise UnsupportedLayoutError(
            f"tensor {name!r}: mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and placements "
            f"{tuple(placements)} differ in length"
        )
    runs: list[list[tuple[int, int]]] = [[(0, g)] for g in global_shape]
    for m, p in enumerate(placements):
        kind = _placement_kind(p)
        n, c = int(mesh_shape[m]), int(coordinate[m])
        if not 0 <= c < n:
            raise UnsupportedLayoutError(f"tensor {name!r}: coordinate {c} outside mesh dim {m} of size {n}")
        if kind == "replicate":
            continue
        if kind == "unsupported":
            raise UnsupportedLayoutError(
                f"tensor {name!r}: placement {p!r} on mesh dim {m} is not supported; only Shard(d), "
                "_StridedShard(d) and Replicate() are (FSDP2, HSDP, FSDP x TP, expert parallel). Partial "
                "tensors hold unreduced values: publish after the reduction (e.g. redistribute to Replicate())."
            )
        d = p.dim + len(global_shape) if p.dim < 0 else p.dim
        if not 0 <= d < len(global_shape):
            raise UnsupportedLayoutError(f"tensor {name!r}: {p!r} on a tensor of {len(global_shape)} dims")
        size = sum(k for _, k in runs[d])
        if kind == "shard":
            runs[d] = _take(runs[d], *_chunk(size, n, c))
            continue
        sf = int(p.split_factor)
        if sf < 1:
            raise UnsupportedLayoutError(f"tensor {name!r}: {p!r} has split factor {sf}")
        kept: list[tuple[int, int]] = []
        for j in range(sf):  # _StridedShard._split_tensor: sf pieces, chunk c of each, concatenated
            pa, pb = _chunk(size, sf, j)
            a, b = _chunk(pb - pa, n, c)
            kept += _take(runs[d], pa + a, pa + b)
        runs[d] = kept
    return TensorBlock(global_shape, tuple(tuple(r) for r in runs))


def _describe(dtensor: Any, coordinate: Any) -> str:
    return (f"placements {tuple(dtensor.placements)} on mesh {tuple(dtensor.device_mesh.shape)} at coordinate "
            f"{tuple(coordinate) if coordinate is not None else None}")


def local_source(name: str, dtensor: Any) -> "Source":
    """This rank's view of one DTensor parameter, for :class:`~torch_deltasync.DeltaSender`.

    Args:
        name: the tensor's HF name.
        dtensor: a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter), detached.

    Returns:
        A ``Source`` whose ``local`` is ``dtensor.to_local()`` (no copy, no communication), whose
        ``slice`` is the :class:`~torch_deltasync.layout.TensorBlock` it holds (:func:`block_of`),
        with ``distributed=True``. When the local tensor's shape disagrees with the block (the
        DTensor's metadata does not describe its data, e.g. a padded local tensor or the uneven
        FSDP x TP case of the module docstring) ``problem`` says so; :func:`plan_uploads` and every
        publish refuse such a source on every rank, so that no rank is left waiting in a collective.

    Raises:
        UnsupportedLayoutError: the placements are not understood (see :func:`block_of`) or the shard
            order is explicit and not left to right (the same on every rank).

    A rank outside the DTensor's mesh gets an empty block with ``upload=False``.

    Example:
        On rank 1 of a ``(dp=2, tp=2)`` torchtitan 2D mesh (coordinate ``(0, 1)``), for the
        vocab-parallel, FSDP-sharded embedding of shape ``(1001, 64)``:

        >>> src = local_source("model.embed_tokens.weight", model.model.embed_tokens.weight.detach())
        >>> src.slice.box.offsets, src.slice.shape
        ((501, 0), (250, 64))
        >>> src.slice.to_global(torch.tensor([0, 64]))  # local rows 0 and 1, column 0
        tensor([32064, 32128])
    """
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    shape = tuple(int(s) for s in dtensor.shape)
    local = dtensor.to_local()
    if coordinate is None:
        # A DTensor on a sub-mesh that excludes this rank: it holds nothing and ships nothing; the
        # ranks of the mesh cover the tensor (plan_uploads checks that they do).
        if local.numel() != 0 or not shape:
            raise UnsupportedLayoutError(f"tensor {name!r}: this rank is outside its mesh {mesh} but holds data")
        return Source(name, local, TensorBlock(shape, tuple(() for _ in shape)), upload=False, distributed=True)
    spec = getattr(dtensor, "_spec", None)
    # With a _StridedShard the placements encode the order themselves (shard_order is None then).
    order = getattr(spec, "shard_order", None)
    if order is not None and any(list(e.mesh_dims) != sorted(e.mesh_dims) for e in order):
        raise UnsupportedLayoutError(
            f"tensor {name!r}: shard order {order} is not left to right over the mesh dims; redistribute "
            "it to the default order before publishing"
        )
    block = block_of(name, shape, tuple(mesh.shape), tuple(coordinate), dtensor.placements)
    problem = None
    if tuple(local.shape) != block.shape:
        problem = (
            f"tensor {name!r}: the local shard has shape {tuple(local.shape)} but {_describe(dtensor, coordinate)} "
            f"give {block.shape} (DTensor's layout rule), so its elements cannot be placed in the full tensor. "
            "The DTensor's metadata does not describe its data: e.g. fully_shard over a tensor-parallel dim "
            "that dp x tp does not divide evenly; pad that dim to a multiple of dp x tp"
        )
    return Source(name, local, block, upload=True, distributed=True, problem=problem)


@dataclass(frozen=True)
class UploadPlan:
    """Which blocks this rank uploads, decided once for all ranks by :func:`plan_uploads`.

    Attributes:
        uploads: ``{name: upload}`` for this rank's sources: ``True`` when this rank ships its block
            of the tensor.
        slots: object slots per rank (>= 1): the most boxes any uploaded block has. A rank writes its
            objects as ranks ``rank * slots + part`` of ``world * slots`` (part 0 for the delta and
            the first box of every tensor, part ``k`` for the ``k``-th box of a block that is several
            boxes), so keys never collide; with ``slots == 1`` (every ``Shard`` / FSDP2 / HSDP /
            even FSDP x TP layout) the keys are the plain ``rank`` of ``world``.
    """

    uploads: dict[str, bool]
    slots: int = 1


def plan_uploads(group: Any, sources: Sequence["Source"]) -> UploadPlan:
    """Decide, once for all ranks, which rank uploads which block of every tensor.

    Several ranks may hold the same block: ``Replicate()`` mesh dims (HSDP replicas), and copies
    outside a DTensor's mesh that placements cannot show (with FSDP x TP,
    ``fully_shard(model, mesh=mesh["dp"])`` puts the non-TP parameters on the ``dp`` sub-mesh, so
    every TP rank holds an identical block; plain tensors are whole on every rank). So rank 0
    gathers every rank's blocks and gives each distinct non-empty block of a tensor (same runs) to
    exactly one of the ranks holding it: blocks from the largest down, each to the holder with
    the fewest elements assigned so far, ties to the lowest rank (a deterministic greedy balance:
    with ``R`` replicas each ships about ``1/R`` of what one replica holds, and only owners keep a
    snapshot). It checks that the chosen blocks add up to every tensor's element count (a pipeline
    stage that holds no copy would leave a gap) and that every local shard matches its placements,
    and broadcasts the decision. One ``gather`` and one ``broadcast`` of ``O(ranks x tensors)``
    small records, when a sender is created; nothing per publish.

    Args:
        group: the sender's collectives (``rank``, ``world``, ``gather``, ``broadcast``).
        sources: this rank's sources (``collect_sources``), in any order.

    Returns:
        An :class:`UploadPlan` for this rank.

    Raises:
        UnsupportedLayoutError: the ranks list different tensors or global shapes, the blocks chosen
            for a tensor do not add up to its element count, or a rank's local shard disagrees with
            its placements (``Source.problem``). Raised on every rank.

    Example:
        FSDP x TP on a ``(dp=2, tp=2)`` mesh: ``norm.weight`` sits on the ``dp`` sub-mesh, so ranks
        0 and 1 hold its first half and ranks 2 and 3 its second half; each half goes to the less
        loaded of its two holders:

        >>> plan_uploads(group, sources).uploads["norm.weight"]    # on ranks 0, 1, 2, 3
        True, False, False, True
    """
    mine = {s.name: [list(s.slice.global_shape), s.slice.to_json(), bool(s.upload)] for s in sources}
    problems = [s.problem for s in sources if getattr(s, "problem", None)]
    gathered = group.gather({"blocks": mine, "problems": problems[:3]})
    decision: dict[str, Any] | None = None
    if group.rank == 0:
        decision = _decide_uploads(gathered)
    decision = group.broadcast(decision)
    if "error" in decision:
        raise UnsupportedLayoutError(decision["error"])
    owners = decision["owners"]
    uploads = {name: owners[name].get(_block_key(runs)) == group.rank for name, (_, runs, _) in mine.items()}
    return UploadPlan(uploads, int(decision["slots"]))


def _block_key(runs: Any) -> str:
    return json.dumps(runs, separators=(",", ":"))


def _decide_uploads(gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's part of :func:`plan_uploads`: ``{"owners": {name: {block key: rank}}, "slots": k}``
    or ``{"error": ...}``. ``gathered[r]`` is ``{"blocks": {name: [global shape, runs, may upload]},
    "problems": [message, ...]}`` from rank ``r``."""
    for r, rec in enumerate(gathered):
        if rec["problems"]:
            return {"error": f"rank {r}: " + "; ".join(rec["problems"])}
    names = gathered[0]["blocks"].keys()
    for r, rec in enumerate(gathered):
        if rec["blocks"].keys() != names:
            diff = sorted(rec["blocks"].keys() ^ names)
            return {"error": f"rank {r} and rank 0 hold different tensors (e.g. {diff[:3]}); every rank must "
                             "publish the same model"}
    # (elements, tensor position, key, name, holders) of every distinct block that must be shipped
    items: list[tuple[int, int, str, str, list[int]]] = []
    slots = 1
    for i, name in enumerate(names):
        shape = gathered[0]["blocks"][name][0]
        blocks: dict[str, tuple[int, list[int]]] = {}
        for r, rec in enumerate(gathered):
            gshape, runs, may_upload = rec["blocks"][name]
            if gshape != shape:
                return {"error": f"tensor {name!r} has global shape {tuple(gshape)} on rank {r} but "
                                 f"{tuple(shape)} on rank 0"}
            if may_upload:
                numel = math.prod(sum(n for _, n in rs) for rs in runs)
                blocks.setdefault(_block_key(runs), (numel, []))[1].append(r)
                if numel:
                    slots = max(slots, math.prod(max(1, len(rs)) for rs in runs))
        total = sum(n for n, _ in blocks.values())
        if total != math.prod(shape):
            return {"error": f"tensor {name!r} of shape {tuple(shape)}: the blocks held by the ranks cover "
                             f"{total} of {math.prod(shape)} elements; every element must be held by some rank "
                             "(exactly once after removing replicas)"}
        shipped = [(k, v) for k, v in blocks.items() if v[0]] or list(blocks.items())[:1]  # 0 elements: one empty block
        items += [(numel, i, key, name, holders) for key, (numel, holders) in shipped]
    if len(gathered) * slots > 99999:  # object keys hold 5-digit ranks (docs/format.md section 2)
        return {"error": f"{len(gathered)} ranks x {slots} boxes per block need {len(gathered) * slots} object "
                         "slots, more than the 99999 object keys allow; redistribute the tensors whose blocks "
                         "are not boxes (e.g. to plain Shard placements) before publishing"}
    load = [0] * len(gathered)
    owners: dict[str, dict[str, int]] = {name: {} for name in names}
    for numel, _, key, name, holders in sorted(items, key=lambda x: (-x[0], x[1], x[2])):
        r = min(holders, key=lambda h: (load[h], h))
        load[r] += numel
        owners[name][key] = r
    return {"owners": owners, "slots": slots}


def anchor_parts(blocks: Mapping[str, tuple[torch.Tensor, TensorBlock]]) -> list[dict[str, tuple[torch.Tensor, TensorSlice]]]:
    """Cut one rank's anchor blocks into the boxes of its anchor objects.

    An anchor object stores one box per tensor (docs/format.md section 4), so a block of ``k``
    boxes (:meth:`TensorBlock.boxes`) spreads over ``k`` objects: part ``j`` holds box ``j`` of every
    block that has more than ``j`` boxes.

    Args:
        blocks: ``{name: (local, block)}``: the rank's local tensor in the inference dtype, shaped
            ``block.shape``, and its block.

    Returns:
        ``[{name: (box data, box)}]``, one dict per object, part 0 first; box data are views of
        ``local`` shaped ``box.shape``. Empty when ``blocks`` is.
    """
    parts: list[dict[str, tuple[torch.Tensor, TensorSlice]]] = []
    for name, (local, block) in blocks.items():
        local = local.reshape(block.shape)
        for j, (box, where) in enumerate(block.boxes()):
            if j == len(parts):
                parts.append({})
            parts[j][name] = (local[where], box)
    return parts


def _world_timeout(dist) -> datetime.timedelta | None:
    """The default process group's timeout, as ``init_process_group(timeout=...)`` set it
    (``new_group`` would otherwise take torch's 30-minute default, not the user's); ``None`` where
    this torch does not expose it (read from a backend's options: not public API)."""
    pg = dist.group.WORLD
    for device in getattr(pg, "_device_types", ()):
        try:
            timeout = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


class DistributedGroup:
    """The collectives of a sharded sender, over two dedicated gloo groups spanning every rank.

    ``DeltaSender`` gathers each rank's metadata (object key, size, sha256, partial checksums,
    counts) to rank 0 and broadcasts rank 0's outcome. With ``background=True`` this happens on the
    sender's worker thread while the training loop runs its own collectives on the main thread.
    Sharing the training's process group would let the two threads issue collectives in a different
    order on different ranks (a deadlock or crossed messages), so the sender uses its own groups:

    * the *publish* group carries :meth:`gather` and :meth:`broadcast`. The sender runs at most one
      publish's collectives at a time on each rank (a foreground publish first waits for a
      background one) and always in version order, so every rank issues the same sequence;
    * the *control* group carries :meth:`any`, which ``publish()`` calls on the caller's thread to
      decide, identically on every rank, whether to coalesce while an upload is in flight.

    gloo runs on CPU whatever backend the training uses (NCCL on GPUs), and metadata is a few KiB.

    Creating the groups is a collective (``torch.distributed.new_group``): construct the sender on
    every rank, in the same order relative to other ``new_group`` calls.

    Args:
        timeout: timeout of the sender's collectives; default: the default process group's
            (``init_process_group(timeout=...)``), else torch's default (30 min). A rank that does
            not call ``publish()`` (or dies) makes the others fail after this long.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized (call ``init_process_group`` first,
            e.g. under ``torchrun``).

    Example:
        >>> g = DistributedGroup()          # on every rank
        >>> g.gather({"rank": g.rank})      # rank 0: [{'rank': 0}, {'rank': 1}]; others: None
        >>> g.broadcast("ok" if g.rank == 0 else None)
        'ok'
        >>> g.any(g.rank == 1)
        True
    """

    def __init__(self, *, timeout: datetime.timedelta | None = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a sender of DTensor (FSDP2) parameters needs torch.distributed: call "
                "torch.distributed.init_process_group() on every rank first (torchrun does the rendezvous)"
            )
        self._dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        timeout = timeout if timeout is not None else _world_timeout(dist)
        self._publish = dist.new_group(backend="gloo", timeout=timeout, group_desc="deltasync_publish")
        self._control = dist.new_group(backend="gloo", timeout=timeout, group_desc="deltasync_control")

    def gather(self, obj: Any) -> list[Any] | None:
        """Rank 0 gets ``[obj of rank 0, ..., obj of rank world-1]``; the others get ``None``.

        ``obj`` holds plain Python values (dicts, lists, str, int, bool, float) produced by our own
        ranks; it is unpickled with ``weights_only=True`` (no arbitrary classes).
        """
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._dist.gather_object(obj, out, group=self._publish, group_dst=0, weights_only=True)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (plain Python values, as for :meth:`gather`)."""
        box = [obj if self.rank == 0 else None]
        self._dist.broadcast_object_list(box, group=self._publish, group_src=0, weights_only=True)
        return box[0]

    def any(self, flag: bool) -> bool:
        """``True`` on every rank when ``flag`` is ``True`` on at least one rank."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._control)
        return bool(t.item())


def default_group(*, timeout: datetime.timedelta | None = None) -> DistributedGroup:
    """A :class:`DistributedGroup` over every rank of the initialized default process group.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    return DistributedGroup(timeout=timeout)
