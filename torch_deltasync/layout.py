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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import CorruptObjectError

__all__ = ["TensorSlice"]


@dataclass(frozen=True)
class TensorSlice:
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
