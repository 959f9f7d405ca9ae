"""``ModuleTarget``: an ``nn.Module`` or state dict in Hugging Face naming (CPU generation, tests,
torchrl policies)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .._dtypes import bits, int_view_dtype
from ..checksum import tensor_checksum
from ..errors import IncompatibleTargetError
from .base import Target

__all__ = ["ModuleTarget"]


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


class _Codec:
    """How values of the inference dtype live in a tensor's storage, bit for bit.

    * same dtype: the storage holds the values; reads and writes go through the integer view of
      the width, so every bit pattern (NaN payloads, fp8) is copied as is;
    * bf16 values in fp32 storage: a bf16 number is the high half of the fp32 with the same value,
      so writing shifts the bf16 pattern left by 16 and reading shifts it back. Float casts would not
      do: torch's fp32 -> bf16 cast canonicalises NaN payloads.
    """

    def __init__(self, storage: torch.dtype, dtype: torch.dtype) -> None:
        self.storage, self.dtype = storage, dtype
        self.widened = storage != dtype

    @staticmethod
    def supported(storage: torch.dtype, dtype: torch.dtype) -> bool:
        return storage == dtype or (dtype == torch.bfloat16 and storage == torch.float32)

    def to_storage_bits(self, values: torch.Tensor) -> torch.Tensor:
        b = bits(values.to(self.dtype))
        return (b.to(torch.int32) << 16) if self.widened else b

    def from_storage_bits(self, stored: torch.Tensor) -> torch.Tensor:
        return ((stored >> 16).to(torch.int16) if self.widened else stored).view(self.dtype)


class ModuleTarget(Target):
    """Applies versions in place to the floating tensors of a module or state dict.

    Tensors are stored in the inference dtype (bit-identical copies of the sender's cast), or, for
    bf16, in fp32 (CPU generation often runs in fp32): a bf16 value is stored as the fp32 whose
    high 16 bits are its bit pattern, which is exactly its value. Every read and write goes through
    integer views, so NaN payloads, ``-0.0`` and fp8 values are copied bit for bit and checksums
    prove bit-exactness in the inference dtype. Writes use ``index_copy_`` into the existing storage
    (never rebinding ``.data``), so optimizers, CUDA graphs and other references keep seeing the
    live tensor.

    Args:
        model: an ``nn.Module`` (its ``state_dict`` names) or a ``{name: tensor}`` mapping.
        strict: require the published tensors and the target's floating tensors to match exactly
            (like ``load_state_dict(strict=True)``); with ``False`` extra target tensors are left alone.

    Raises:
        TypeError: ``model`` is neither a module nor a mapping.
    """

    def __init__(self, model: nn.Module | Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        if isinstance(model, nn.Module):
            tensors = model.state_dict(keep_vars=True)
        elif isinstance(model, Mapping):
            tensors = model
        else:
            raise TypeError(f"expected an nn.Module or a state dict, got {type(model).__name__}")
        self.tensors: dict[str, torch.Tensor] = {
            n: t.detach() for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point()
        }
        self._other = {n for n, t in tensors.items() if isinstance(t, torch.Tensor) and not t.is_floating_point()}
        self.strict = strict
        self._mirrors: dict[str, list[str]] = {}  # canonical -> untied aliases to write as well
        self._codecs: dict[str, _Codec] = {}

    def check(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype) -> None:
        self._mirrors, self._codecs = {}, {}
        missing = [n for n in shapes if n not in self.tensors]
        if missing:
            not_float = [n for n in missing if n in self._other]
            if not_float:
                raise IncompatibleTargetError(
                    f"receiving model tensor {not_float[0]!r} is not a floating-point tensor, but the sender "
                    f"publishes it as {dtype}"
                )
            raise IncompatibleTargetError(
                f"published tensors unknown to the receiving model: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all); build the receiver "
                "from the same architecture and naming as the sender"
            )
        bad = [(n, s, tuple(self.tensors[n].shape)) for n, s in shapes.items() if tuple(self.tensors[n].shape) != s]
        if bad:
            n, s, have = bad[0]
            raise IncompatibleTargetError(f"tensor {n!r}: published shape {s}, receiver has {have} ({len(bad)} mismatches)")
        owners: dict[tuple, str] = {}  # the sender shipped these separately: they must not be tied here
        for n in shapes:
            t = self.tensors[n]
            if t.device.type == "meta":
                raise IncompatibleTargetError(f"tensor {n!r} is on the meta device; materialise the model first")
            if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
                raise IncompatibleTargetError(
                    f"tensor {n!r} has overlapping memory (stride {t.stride()}, e.g. from expand()); "
                    "give it storage of its own (.contiguous())"
                )
            if t.numel() == 0:
                continue
            key = _storage_key(t)
            if key in owners:
                raise IncompatibleTargetError(
                    f"the receiver ties {owners[key]!r} and {n!r} but the sender publishes them as separate tensors"
                )
            owners[key] = n
        for alias, canon in aliases.items():
            t = self.tensors.get(alias)
            if t is not None and _storage_key(t) != _storage_key(self.tensors[canon]):
                if tuple(t.shape) != shapes[canon]:
                    raise IncompatibleTargetError(f"alias {alias!r} has shape {tuple(t.shape)}, expected {shapes[canon]}")
                self._mirrors.setdefault(canon, []).append(alias)
        if self.strict:
            covered = set(shapes) | set(aliases)
            extra = [n for n in self.tensors if n not in covered]
            if extra:
                raise IncompatibleTargetError(
                    f"receiving model tensors not published by the sender: {extra[:5]} ({len(extra)} in all); "
                    "to leave them alone, pass ModuleTarget(model, strict=False) as the receiver's target"
                )
        for n in list(shapes) + [a for m in self._mirrors.values() for a in m]:
            storage = self.tensors[n].dtype
            if not _Codec.supported(storage, dtype):
                hint = f"{dtype} or torch.float32" if dtype == torch.bfloat16 else f"{dtype}"
                raise IncompatibleTargetError(
                    f"tensor {n!r} is {storage}, which cannot hold every {dtype} bit pattern; store it as {hint}"
                )
            self._codecs[n] = _Codec(storage, dtype)

    def _targets(self, name: str) -> list[str]:
        return [name] + self._mirrors.get(name, [])

    def _stored_bits(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(int_view_dtype(t.dtype))

    def read(self, name: str, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors[name]
        stored = self._stored_bits(t)
        pos = positions.to(t.device)
        vals = stored.reshape(-1)[pos] if t.is_contiguous() else stored[torch.unravel_index(pos, t.shape)]
        return self._codec(name, dtype).from_storage_bits(vals)

    def _codec(self, name: str, dtype: torch.dtype) -> _Codec:
        c = self._codecs.get(name)
        if c is None or c.dtype != dtype:
            c = _Codec(self.tensors[name].dtype, dtype)
        return c

    @torch.no_grad()
    def write(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        for n in self._targets(name):
            t = self.tensors[n]
            stored = self._stored_bits(t)
            vals = self._codec(n, values.dtype).to_storage_bits(values).to(t.device)
            pos = positions.to(t.device)
            if t.is_contiguous():
                # index_copy_ costs ~2.3 ns per changed element; scatter_ grows with the tensor size.
                stored.view(-1).index_copy_(0, pos, vals)
            else:
                stored.index_put_(torch.unravel_index(pos, t.shape), vals)

    @torch.no_grad()
    def assign(self, name: str, full: torch.Tensor) -> None:
        for n in self._targets(name):
            t = self.tensors[n]
            stored = self._stored_bits(t)
            stored.copy_(self._codec(n, full.dtype).to_storage_bits(full).reshape(t.shape))

    def values(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The held tensor ``name`` in ``dtype``, bit-exactly (bf16 held in fp32 comes back with its
        exact bit patterns, NaN payloads included; a float cast could rewrite those). Shares memory
        with the target where ``dtype`` is the storage dtype; copy before keeping it."""
        return self._codec(name, dtype).from_storage_bits(self._stored_bits(self.tensors[name]))

    def checksum(self, name: str, dtype: torch.dtype) -> int:
        return tensor_checksum(self.values(name, dtype))

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tensors)
