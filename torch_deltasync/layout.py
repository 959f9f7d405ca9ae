"""Rectangular slices of a global tensor, and the map between local and global flat indices.

Every position on the wire is a **global flat index**: the row-major position in the full tensor in
Hugging Face layout, i.e. an index into ``full.view(-1)``. A sender rank that holds only part of a
tensor (an FSDP2 ``Shard(0)`` chunk, or a block of an FSDP x TP mesh) sees **local flat positions**
into its own ``local.view(-1)``; :class:`TensorSlice` converts between the two frames.

Example: a ``(1001, 64)`` embedding sharded ``Shard(0)`` over 2 ranks follows ``torch.chunk``
semantics (ceil on the low ranks):

======  ============  ==============  ================================
rank    local shape   offsets         local flat ``p`` -> global flat
======  ============  ==============  ================================
0       ``(501, 64)``  ``(0, 0)``      ``p``
1       ``(500, 64)``  ``(501, 0)``    ``p + 501 * 64``
======  ============  ==============  ================================

and the same weight additionally split ``Shard(1)`` over a TP dim of size 2 gives rank (0, 1) the
block ``rows 0..500, cols 32..63``, i.e. offsets ``(0, 32)`` and local shape ``(501, 32)``, where
``global = (p // 32 + 0) * 64 + (p % 32 + 32)``.

A :class:`TensorSlice` is the wire form of a block (an anchor object stores one per tensor). What a
sender rank holds is a :class:`TensorBlock`: along every tensor dim an increasing list of global
indices, kept as runs. It is a box (one :class:`TensorSlice`) for ``Shard`` placements; FSDP over a
TP-sharded dim (``_StridedShard``) can give a rank several runs along one dim, i.e. several boxes:
8 rows with placements ``[Shard(0), _StridedShard(0, split_factor=2)]`` on a ``(2, 2)`` mesh give
the rank at coordinate ``(0, 0)`` rows ``0`` and ``2`` (runs ``((0, 1), (2, 1))``), two boxes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from .errors import CorruptObjectError

__all__ = ["TensorSlice", "TensorBlock", "Source"]


class _Extent:
    """What a box and a block share: sizes from ``shape`` (held) and ``global_shape`` (full)."""

    shape: tuple[int, ...]
    global_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the block."""
        return math.prod(self.shape)

    @property
    def global_numel(self) -> int:
        """Elements in the full tensor."""
        return math.prod(self.global_shape)

    @property
    def is_full(self) -> bool:
        return self.shape == self.global_shape


@dataclass(frozen=True)
class TensorSlice(_Extent):
    """The block ``full[o0:o0+s0, o1:o1+s1, ...]`` of a tensor of shape ``global_shape``.

    Attributes:
        global_shape: shape of the full tensor in HF layout.
        offsets: start of the block in every dim (elements).
        shape: size of the block in every dim (elements); may be 0 (an empty ``torch.chunk`` shard).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.global_shape)
        if len(self.offsets) != n or len(self.shape) != n:
            raise ValueError(
                f"slice rank mismatch: global_shape {self.global_shape}, offsets {self.offsets}, shape {self.shape}"
            )
        for d, (g, o, s) in enumerate(zip(self.global_shape, self.offsets, self.shape)):
            if not (0 <= o and 0 <= s and o + s <= g) and not (s == 0 and o <= g):
                raise ValueError(f"slice out of bounds in dim {d}: offset {o} + size {s} > {g}")

    @classmethod
    def full(cls, shape: tuple[int, ...] | torch.Size) -> "TensorSlice":
        """The whole tensor (what a single-process sender holds)."""
        shape = tuple(int(s) for s in shape)
        return cls(shape, (0,) * len(shape), shape)

    @property
    def _row_block(self) -> bool:
        """True when the block is whole rows (only dim 0 is cut), so global = local + a constant."""
        return len(self.shape) == 0 or self.shape[1:] == self.global_shape[1:]

    @property
    def flat_offset(self) -> int:
        """Global flat index of the block's first element."""
        off, stride = 0, 1
        for g, o in zip(reversed(self.global_shape), reversed(self.offsets)):
            off += o * stride
            stride *= g
        return off

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """Map local flat positions to global flat indices.

        Args:
            local: int64 tensor of positions into ``block.view(-1)``, each in ``[0, numel)``.

        Returns:
            int64 tensor of the same shape with indices into ``full.view(-1)``. Sorted input gives
            sorted output (row-major order is preserved by a block).
        """
        local = local.to(torch.int64)
        if self.is_full:
            return local
        if self._row_block:
            return local + self.flat_offset
        out = torch.zeros_like(local)
        rem = local
        gstride = 1
        for d in range(len(self.shape) - 1, -1, -1):
            coord = rem % self.shape[d] if d > 0 else rem
            rem = rem // self.shape[d] if d > 0 else rem
            out += (coord + self.offsets[d]) * gstride
            gstride *= self.global_shape[d]
        return out

    def to_local(self, global_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Select the global flat indices that fall inside the block and map them to local positions.

        Args:
            global_index: int64 tensor ``(k,)`` of indices into ``full.view(-1)``.

        Returns:
            ``(mask, local)``: ``mask`` is a bool ``(k,)`` marking indices inside the block, ``local``
            the local flat positions of the selected ones (``mask.sum()`` elements).
        """
        g = global_index.to(torch.int64)
        if self.is_full:
            return torch.ones_like(g, dtype=torch.bool), g
        mask = torch.ones_like(g, dtype=torch.bool)
        local = torch.zeros_like(g)
        rem = g
        lstride = 1
        for d in range(len(self.shape) - 1, -1, -1):
            size = self.global_shape[d]
            coord = rem % size if d > 0 else rem
            rem = rem // size if d > 0 else rem
            rel = coord - self.offsets[d]
            mask &= (rel >= 0) & (rel < self.shape[d])
            local += rel * lstride
            lstride *= self.shape[d]
        return mask, local[mask]

    # --- wire form -------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: object, global_shape: tuple[int, ...]) -> "TensorSlice":
        """Parse an untrusted slice description for a tensor of ``global_shape``.

        Raises:
            CorruptObjectError: missing fields, non-integers, or a block outside the tensor.
        """
        try:
            offsets = tuple(obj["offsets"])  # type: ignore[index]
            shape = tuple(obj["shape"])  # type: ignore[index]
            if not all(type(v) is int for v in offsets + shape):
                raise TypeError("non-integer")
            return cls(tuple(global_shape), offsets, shape)
        except (TypeError, KeyError, ValueError) as e:
            raise CorruptObjectError(f"bad slice {obj!r} for shape {global_shape}: {e}") from None


Run = tuple[int, int]
"""``(start, length)``: the global indices ``start, start + 1, ..., start + length - 1`` of one dim."""


def _merge_runs(runs) -> tuple[Run, ...]:
    """Drop empty runs and join touching ones; the runs must be increasing and disjoint."""
    out: list[list[int]] = []
    for start, length in runs:
        start, length = int(start), int(length)
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((a, n) for a, n in out)


@dataclass(frozen=True)
class TensorBlock(_Extent):
    """The elements of a tensor that one sender rank holds: ``full[ix_0][:, ix_1][:, :, ix_2]...``.

    Along every dim ``d`` the rank holds an increasing list ``ix_d`` of global indices, written as
    runs ``((start, length), ...)``; its local tensor is the outer product of those lists in
    row-major order (the local tensor of shape ``shape`` is ``full[ix_0, ix_1, ...]`` with
    ``torch.meshgrid``-style indexing). Every DTensor placement cuts one tensor dim, so any mix of
    ``Shard``, ``_StridedShard`` and ``Replicate`` mesh dims yields such a product (see
    :func:`torch_deltasync.dtensor.block_of`). A block is a box (:attr:`box`, a
    :class:`TensorSlice`) when every dim has at most one run, otherwise :meth:`boxes` cuts it into
    ``prod(runs per dim)`` boxes.

    Example: rows ``0..1`` and ``4..5`` of an ``(8, 3)`` tensor,
    ``TensorBlock((8, 3), (((0, 2), (4, 2)), ((0, 3),)))``: local shape ``(4, 3)``; local flat
    position ``p`` has local row ``p // 3`` whose global row is ``[0, 1, 4, 5][p // 3]``, so
    ``to_global([0, 5, 6, 11]) == [0, 5, 12, 17]``.

    Attributes:
        global_shape: shape of the full tensor in HF layout (elements per dim).
        runs: per dim, increasing disjoint non-empty runs (normalised: touching runs joined, a dim
            the rank holds nothing of has ``()``).

    Raises:
        ValueError: runs of another length than ``global_shape``, decreasing or overlapping runs, or
            runs past the end of a dim.
    """

    global_shape: tuple[int, ...]
    runs: tuple[tuple[Run, ...], ...]
    _index: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        gshape = tuple(int(g) for g in self.global_shape)
        if len(self.runs) != len(gshape):
            raise ValueError(f"block rank mismatch: global_shape {gshape}, runs for {len(self.runs)} dims")
        runs = []
        for d, (g, rs) in enumerate(zip(gshape, self.runs)):
            end = 0
            for start, length in rs:
                if int(start) < end or int(length) < 0:
                    raise ValueError(f"runs {tuple(rs)} of dim {d} overlap or are not increasing")
                end = int(start) + int(length)
                if end > g:
                    raise ValueError(f"runs {tuple(rs)} of dim {d} end past its size {g}")
            runs.append(_merge_runs(rs))
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "runs", tuple(runs))

    @classmethod
    def full(cls, shape: tuple[int, ...] | torch.Size) -> "TensorBlock":
        """The whole tensor (what a single-process sender holds)."""
        shape = tuple(int(s) for s in shape)
        return cls(shape, tuple(((0, g),) for g in shape))

    @classmethod
    def from_slice(cls, s: TensorSlice) -> "TensorBlock":
        """The box ``s`` as a block."""
        return cls(s.global_shape, tuple(((o, n),) for o, n in zip(s.offsets, s.shape)))

    @property
    def shape(self) -> tuple[int, ...]:
        """Local shape: elements held along every dim."""
        return tuple(sum(n for _, n in rs) for rs in self.runs)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first global index held along every dim (``global_shape[d]`` for a dim held empty):
        the ``global_offset`` of ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``,
        which for a block of several boxes is only where the first box starts."""
        return tuple(rs[0][0] if rs else g for rs, g in zip(self.runs, self.global_shape))

    @property
    def box(self) -> TensorSlice | None:
        """The block as one :class:`TensorSlice` when it is a box (at most one run per dim), else
        ``None``. An empty block is a box placed as DTensor places empty shards: at offset
        ``global_shape[d]`` on the dims it holds nothing of."""
        if self.numel and any(len(rs) > 1 for rs in self.runs):
            return None
        return TensorSlice(self.global_shape, self.offsets, self.shape)

    def boxes(self) -> list[tuple[TensorSlice, tuple[slice, ...]]]:
        """Cut the block into boxes: ``[(box, local)]`` where ``local[tensor dim]`` is the
        ``slice`` of the local tensor that holds ``box`` (so ``local_tensor[local]`` is the box's
        data, of shape ``box.shape``). One box per combination of runs, in row-major order of the
        runs; an empty block is one empty box (:attr:`box`), so that a tensor of 0 elements still
        appears in an anchor."""
        box = self.box
        if box is not None:
            return [(box, tuple(slice(0, n) for n in self.shape))]
        per_dim = []
        for rs in self.runs:
            local, opts = 0, []
            for start, length in rs:
                opts.append((start, length, slice(local, local + length)))
                local += length
            per_dim.append(opts)
        out = []
        for combo in itertools.product(*per_dim):
            out.append((TensorSlice(self.global_shape, tuple(c[0] for c in combo), tuple(c[1] for c in combo)),
                        tuple(c[2] for c in combo)))
        return out

    def _dim_index(self, d: int, device: torch.device) -> torch.Tensor:
        """int64 ``(shape[d],)``: the global index of every local index along dim ``d`` (cached)."""
        key = (d, str(device))
        idx = self._index.get(key)
        if idx is None:
            parts = [torch.arange(a, a + n, dtype=torch.int64) for a, n in self.runs[d]]
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            idx = idx.to(device)
            self._index[key] = idx
        return idx

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """Map local flat positions to global flat indices.

        Args:
            local: int64 tensor of positions into ``local_tensor.view(-1)``, each in ``[0, numel)``.

        Returns:
            int64 tensor of the same shape and device with indices into ``full.view(-1)``. Sorted
            input gives sorted output (every dim's index list is increasing).
        """
        box = self.box
        if box is not None:
            return box.to_global(local)
        local = local.to(torch.int64)
        out = torch.zeros_like(local)
        rem = local
        gstride = 1
        shape = self.shape
        for d in range(len(shape) - 1, -1, -1):
            coord = rem % shape[d] if d > 0 else rem
            rem = rem // shape[d] if d > 0 else rem
            out += self._dim_index(d, local.device)[coord] * gstride
            gstride *= self.global_shape[d]
        return out

    def to_json(self) -> list:
        """``[[[start, length], ...] per dim]`` (plain lists, for the sender's metadata gather)."""
        return [[list(r) for r in rs] for rs in self.runs]

    @classmethod
    def from_json(cls, obj: object, global_shape: tuple[int, ...]) -> "TensorBlock":
        """Inverse of :meth:`to_json` (trusted input: our own ranks' metadata).

        Raises:
            ValueError: malformed runs.
        """
        try:
            return cls(tuple(global_shape), tuple(tuple((int(a), int(n)) for a, n in rs) for rs in obj))  # type: ignore[union-attr]
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad block runs {obj!r} for shape {tuple(global_shape)}: {e}") from None


@dataclass
class Source:
    """One tensor as this rank sees it: its local block, the block's place, and whether to upload."""

    name: str
    local: torch.Tensor
    slice: TensorBlock
    upload: bool = True  # False where another rank holding the same block uploads it (plan_uploads)
    distributed: bool = False  # a DTensor: the sender needs torch.distributed collectives
    problem: str | None = None  # why the block cannot be placed (refused on every rank; see dtensor.py)
