"""The ``raw`` codec (format 1, the seed format): sorted global flat indices and new values."""

from __future__ import annotations

import torch

from ..errors import CorruptObjectError
from ._base import Codec, TensorDelta, check_encoder_positions, check_parts, check_positions, register_codec


@register_codec
class RawCodec(Codec):
    """Format 1: sorted global flat indices (``idx``: int32, or int64 from ``2**31`` elements) and
    the new values in the inference dtype (``val``). 6 bytes per changed bf16 element."""

    name = "raw"

    def encode(self, positions, values, old_values, *, numel):
        """See :meth:`Codec.encode`.

        Raises:
            TypeError: positions not a 1-D integer tensor.
            ValueError: positions not strictly increasing inside ``[0, numel)``, or not as many as
                the values (checked before the narrowing to int32, which would wrap).
        """
        check_encoder_positions(positions, "raw codec")
        pos = positions.to(device="cpu", dtype=torch.int64)
        if values.shape != pos.shape:
            raise ValueError(f"raw codec: positions {tuple(pos.shape)} and values {tuple(values.shape)} "
                             "must be 1-D and of the same length")
        check_positions(pos, numel, "raw codec", ValueError)  # the caller's input, not a store object
        idx_dtype = torch.int32 if numel < 2**31 else torch.int64
        return {"idx": pos.to(idx_dtype), "val": values.to("cpu")}

    def decode(self, parts, *, numel, count, dtype):
        what = "raw codec"
        check_parts(parts, {"idx", "val"}, what)
        idx, val = parts["idx"], parts["val"]
        if numel >= 2**31 and idx.dtype != torch.int64:
            raise CorruptObjectError(f"{what}: tensors of {numel} elements need int64 positions")
        if val.dtype != dtype or val.dim() != 1:
            raise CorruptObjectError(f"{what}: values must be 1-D {dtype}, got {val.dtype} {tuple(val.shape)}")
        if idx.numel() != count or val.numel() != count:
            raise CorruptObjectError(
                f"{what}: declared {count} changes, found {idx.numel()} positions and {val.numel()} values"
            )
        return TensorDelta(check_positions(idx, numel, what), val)
