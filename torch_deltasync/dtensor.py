r"""DTensor (FSDP2, HSDP, FSDP x TP) shards as blocks of the global tensor, and the sender's collectives.

A sharded sender never gathers a parameter. Each rank reads only its local shard
(``DTensor.to_local()``), and :func:`local_source` says where that shard sits in the full tensor in
Hugging Face layout: a rectangular :class:`~torch_deltasync.layout.TensorSlice`, computed from the
DTensor's global shape, its mesh shape, this rank's mesh coordinate and its placements. The sender
then turns local positions into global flat indices with ``TensorSlice.to_global``.

**The rule** (``Shard`` follows ``torch.chunk`` semantics; see ``torch.distributed.tensor.Shard`` and
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``). Mesh dims are applied
left to right. For every mesh dim ``m`` with placement ``Shard(d)``, the part of tensor dim ``d`` held
so far (``size`` elements starting at ``offset``) is cut into ``n = mesh_shape[m]`` chunks of
``ceil(size / n)`` elements, the last ones shorter or empty, and the rank keeps chunk
``c = coordinate[m]``::

    chunk = ceil(size / n)
    start = min(c * chunk, size)
    size' = min(size, start + chunk) - start          # may be 0
    offset' = offset + start                          # global_shape[d] when size' == 0, as DTensor does

``Replicate()`` mesh dims leave the block unchanged; every replica holds the same block, so only
the replica at coordinate 0 of every replicated mesh dim uploads it (``upload=True``) and the others
only keep their snapshot (HSDP). ``Partial`` (pending reductions: the local values are not the
weights), ``_StridedShard`` (FSDP over a TP-sharded dim: the local rows are not contiguous in the
global tensor), a non-default shard order and anything else are refused with
:class:`~torch_deltasync.errors.UnsupportedLayoutError`.

Worked example: the global ``(1001, 64)`` embedding ``E``.

============================  =======  ============  ==============  ==============  ======
mesh / placements             rank     coordinate    local shape     offsets         upload
============================  =======  ============  ==============  ==============  ======
``(2,)`` ``[S(0)]``           0        ``(0,)``      ``(501, 64)``   ``(0, 0)``      yes
\                             1        ``(1,)``      ``(500, 64)``   ``(501, 0)``    yes
``(4,)`` ``[S(0)]``           0..2     ``(c,)``      ``(251, 64)``   ``(251c, 0)``   yes
\                             3        ``(3,)``      ``(248, 64)``   ``(753, 0)``    yes
``(2,2)`` ``[R, S(0)]``       0, 1     ``(0, c)``    as ``(2,)``     as ``(2,)``     yes
(HSDP)                        2, 3     ``(1, c)``    as ``(2,)``     as ``(2,)``     no
``(2,2)`` ``[S(0), S(1)]``    0        ``(0, 0)``    ``(501, 32)``   ``(0, 0)``      yes
(FSDP x TP)                   1        ``(0, 1)``    ``(501, 32)``   ``(0, 32)``     yes
\                             2        ``(1, 0)``    ``(500, 32)``   ``(501, 0)``    yes
\                             3        ``(1, 1)``    ``(500, 32)``   ``(501, 32)``   yes
============================  =======  ============  ==============  ==============  ======

Uneven splits leave empty shards: 5 rows over 4 ranks give chunks of ``ceil(5/4) = 2`` rows, i.e.
``2, 2, 1, 0`` rows at offsets ``0, 2, 4, 5``; 3 rows over 4 ranks give ``1, 1, 1, 0``.

:func:`default_group` provides the collectives a sharded :class:`~torch_deltasync.DeltaSender` needs
(gather per-rank metadata to rank 0, broadcast the outcome, agree on a flag) over dedicated gloo
process groups, so they never interleave with the training's collectives, even when the publish
finishes on a background thread.
"""

from __future__ import annotations

import datetime
import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .errors import UnsupportedLayoutError
from .layout import TensorSlice

if TYPE_CHECKING:  # pragma: no cover
    from .sender import _Source

__all__ = ["block_of", "local_source", "plan_uploads", "default_group", "DistributedGroup"]


def _placement_kind(p: Any) -> str:
    """``"shard"``, ``"replicate"`` or ``"unsupported"`` (checked by exact type: subclasses such as
    ``_StridedShard`` or ``_MaskPartial`` change the meaning and are not understood)."""
    from torch.distributed.tensor import Replicate, Shard

    if type(p) is Shard:
        return "shard"
    if type(p) is Replicate:
        return "replicate"
    return "unsupported"


def block_of(
    name: str,
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> tuple[TensorSlice, bool]:
    """The block of ``global_shape`` held by the rank at ``coordinate``, and whether it uploads it.

    A pure function of the layout (no process group needed); :func:`local_source` calls it with a
    live DTensor's values. The rule and a worked table are in the module docstring.

    Args:
        name: the tensor's name (for error messages).
        global_shape: shape of the full tensor (HF layout), elements per dim.
        mesh_shape: size of every mesh dim.
        coordinate: this rank's coordinate in the mesh, one entry per mesh dim.
        placements: one ``Shard(d)`` or ``Replicate()`` per mesh dim (``torch.distributed.tensor``).

    Returns:
        ``(slice, upload)``: ``slice.offsets`` / ``slice.shape`` give the block (``shape`` entries
        may be 0: an empty ``torch.chunk`` shard); ``upload`` is ``False`` when this rank is not
        the first replica on some ``Replicate`` mesh dim.

    Raises:
        UnsupportedLayoutError: a ``Partial``, ``_StridedShard`` or unknown placement, a shard dim
            outside the tensor, or mesh/coordinate/placements of different lengths.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> block_of("w", (5, 3), (4,), (2,), [Shard(0)])
        (TensorSlice(global_shape=(5, 3), offsets=(4, 0), shape=(1, 3)), True)
    """
    global_shape = tuple(int(s) for s in global_shape)
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise UnsupportedLayoutError(
            f"tensor {name!r}: mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and placements "
            f"{tuple(placements)} differ in length"
        )
    offsets = [0] * len(global_shape)
    shape = list(global_shape)
    upload = True
    for m, p in enumerate(placements):
        kind = _placement_kind(p)
        n, c = int(mesh_shape[m]), int(coordinate[m])
        if not 0 <= c < n:
            raise UnsupportedLayoutError(f"tensor {name!r}: coordinate {c} outside mesh dim {m} of size {n}")
        if kind == "replicate":
            upload = upload and c == 0
            continue
        if kind != "shard":
            raise UnsupportedLayoutError(
                f"tensor {name!r}: placement {p!r} on mesh dim {m} is not supported; only Shard(d) and "
                "Replicate() are (FSDP2, HSDP, FSDP x TP with Shard(1)). Partial tensors hold unreduced "
                "values: publish after the reduction (e.g. redistribute to Replicate()). _StridedShard "
                "(fully_shard over a TP-sharded dim 0) makes non-contiguous local rows: shard TP on "
                "another dim or publish a resharded copy."
            )
        d = p.dim + len(global_shape) if p.dim < 0 else p.dim
        if not 0 <= d < len(global_shape):
            raise UnsupportedLayoutError(f"tensor {name!r}: {p!r} on a tensor of {len(global_shape)} dims")
        size = shape[d]
        chunk = math.ceil(size / n) if size else 0
        start = min(c * chunk, size)
        new = min(size, start + chunk) - start
        # DTensor reports an empty shard at offset global_shape[d]; doing the same keeps our blocks
        # comparable with compute_local_shape_and_global_offset (an empty block's offset is moot).
        offsets[d] = offsets[d] + start if new else global_shape[d]
        shape[d] = new
    return TensorSlice(global_shape, tuple(offsets), tuple(shape)), upload


def local_source(name: str, dtensor: Any) -> "_Source":
    """This rank's view of one DTensor parameter, for :class:`~torch_deltasync.DeltaSender`.

    Args:
        name: the tensor's HF name.
        dtensor: a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter), detached.

    Returns:
        A ``_Source`` whose ``local`` is ``dtensor.to_local()`` (no copy, no communication), whose
        ``slice`` is the local block's place in the full tensor (:func:`block_of`), with
        ``upload=False`` on non-first replicas and ``distributed=True``.

    Raises:
        UnsupportedLayoutError: the placements are not understood (see :func:`block_of`), the shard
            order is not left to right, or the local tensor's shape disagrees with the
            ``torch.chunk`` rule (e.g. a padded local tensor).

    A rank outside the DTensor's mesh gets an empty block with ``upload=False``.

    Example:
        On rank 1 of 2, for an FSDP2 (``fully_shard``) embedding of shape ``(1001, 64)``:

        >>> src = local_source("model.embed_tokens.weight", model.model.embed_tokens.weight.detach())
        >>> src.slice.offsets, src.slice.shape, src.upload
        ((501, 0), (500, 64), True)
        >>> src.slice.to_global(torch.tensor([0, 64]))  # local rows 0 and 1, column 0
        tensor([32064, 32128])
    """
    from .sender import _Source

    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        # A DTensor on a sub-mesh that excludes this rank: it holds nothing and ships nothing; the
        # ranks of the mesh cover the tensor (plan_uploads checks that they do).
        local = dtensor.to_local()
        shape = tuple(int(s) for s in dtensor.shape)
        if local.numel() != 0 or not shape:
            raise UnsupportedLayoutError(f"tensor {name!r}: this rank is outside its mesh {mesh} but holds data")
        return _Source(name, local, TensorSlice(shape, shape, (0,) * len(shape)), upload=False, distributed=True)
    spec = getattr(dtensor, "_spec", None)
    order = getattr(spec, "shard_order", ())
    if order is not None and any(list(e.mesh_dims) != sorted(e.mesh_dims) for e in order):
        raise UnsupportedLayoutError(
            f"tensor {name!r}: shard order {order} is not left to right over the mesh dims; redistribute "
            "it to the default order before publishing"
        )
    block, upload = block_of(name, tuple(dtensor.shape), tuple(mesh.shape), tuple(coordinate), dtensor.placements)
    local = dtensor.to_local()
    if tuple(local.shape) != block.shape:
        raise UnsupportedLayoutError(
            f"tensor {name!r}: local shard has shape {tuple(local.shape)} but placements {dtensor.placements} on "
            f"mesh {tuple(mesh.shape)} at coordinate {tuple(coordinate)} give {block.shape} (torch.chunk rule)"
        )
    return _Source(name, local, block, upload=upload, distributed=True)


def plan_uploads(group: Any, sources: Sequence["_Source"]) -> dict[str, bool]:
    """Decide, once for all ranks, which rank uploads which block of every tensor.

    Placements only describe replication *inside* a DTensor's mesh. Copies outside it are invisible
    to :func:`local_source`: with FSDP x TP, ``fully_shard(model, mesh=mesh["dp"])`` puts the non-TP
    parameters (embeddings, norms) on the ``dp`` sub-mesh, so every TP rank holds an identical
    ``Shard(0)`` block on its own copy of that sub-mesh; plain (non-DTensor) tensors are whole on
    every rank. So rank 0 gathers every rank's blocks and, for each distinct block of a tensor
    (same offsets and shape), picks the lowest rank that may upload it (``upload=True`` from
    :func:`local_source`). It checks that the chosen blocks add up to the whole tensor (a pipeline
    stage that holds no copy would leave a gap) and broadcasts the decision. One ``gather`` and one
    ``broadcast`` of ``O(ranks x tensors)`` small records, when a sender is created.

    Args:
        group: the sender's collectives (``rank``, ``world``, ``gather``, ``broadcast``).
        sources: this rank's sources (``collect_sources``), in any order.

    Returns:
        ``{name: upload}`` for this rank's sources.

    Raises:
        UnsupportedLayoutError: the ranks list different tensors or global shapes, or the blocks
            chosen for a tensor do not add up to its element count. Raised on every rank.

    Example:
        FSDP x TP on a ``(dp=2, tp=2)`` mesh: ``embed.weight`` sits on the ``dp`` sub-mesh, so ranks
        0 and 1 hold rows ``0..500`` and ranks 2 and 3 rows ``501..1000``:

        >>> plan_uploads(group, sources)["embed.weight"]    # on ranks 0, 1, 2, 3
        True, False, True, False
    """
    mine = {s.name: (list(s.slice.global_shape), list(s.slice.offsets), list(s.slice.shape), bool(s.upload))
            for s in sources}
    gathered = group.gather(mine)
    decision: dict[str, Any] | None = None
    if group.rank == 0:
        decision = _decide_uploads(gathered)
    decision = group.broadcast(decision)
    if "error" in decision:
        raise UnsupportedLayoutError(decision["error"])
    owners = decision["owners"]
    return {name: owners[name].get(_block_key(off, shp)) == group.rank for name, (_, off, shp, _) in mine.items()}


def _block_key(offsets: Sequence[int], shape: Sequence[int]) -> str:
    return f"{list(offsets)}:{list(shape)}"


def _decide_uploads(gathered: list[dict[str, list]]) -> dict[str, Any]:
    """Rank 0's part of :func:`plan_uploads`: ``{"owners": {name: {block key: rank}}}`` or ``{"error": ...}``."""
    names = gathered[0].keys()
    for r, rec in enumerate(gathered):
        if rec.keys() != names:
            diff = sorted(rec.keys() ^ names)
            return {"error": f"rank {r} and rank 0 hold different tensors (e.g. {diff[:3]}); every rank must "
                             "publish the same model"}
    owners: dict[str, dict[str, int]] = {}
    for name in names:
        shape = gathered[0][name][0]
        chosen: dict[str, int] = {}
        numel = 0
        for r, rec in enumerate(gathered):
            gshape, off, shp, may_upload = rec[name]
            if gshape != shape:
                return {"error": f"tensor {name!r} has global shape {tuple(gshape)} on rank {r} but "
                                 f"{tuple(shape)} on rank 0"}
            key = _block_key(off, shp)
            if may_upload and key not in chosen:
                chosen[key] = r
                numel += math.prod(shp)
        if numel != math.prod(shape):
            return {"error": f"tensor {name!r} of shape {tuple(shape)}: the blocks held by the ranks cover "
                             f"{numel} of {math.prod(shape)} elements; every element must be held by some rank "
                             "(exactly once after removing replicas)"}
        owners[name] = chosen
    return {"owners": owners}


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
        timeout: timeout of the sender's collectives (default: the process group default, 30 min).

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
