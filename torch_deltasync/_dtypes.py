"""Dtype names and integer bit views.

Change detection and checksums never compare floats: ``-0.0 == 0.0`` and ``NaN != NaN`` would lose
or invent changes. Instead every floating tensor is reinterpreted as a signed integer tensor of the
same width (``view(torch.int16)`` for bf16), which compares bit patterns exactly.
"""

from __future__ import annotations

import torch

from .errors import CorruptObjectError

# Inference dtypes we can ship, by their wire name (the name safetensors uses, lower-cased torch name).
_WIRE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):  # torch >= 2.1
    if (_dt := getattr(torch, _name, None)) is not None:
        _WIRE_DTYPES[_name] = _dt

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
        ValueError: ``dtype`` is not a supported inference dtype.
    """
    for name, dt in _WIRE_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(
        f"unsupported inference dtype {dtype}; supported: {sorted(_WIRE_DTYPES)}"
    )


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` for untrusted input.

    Raises:
        CorruptObjectError: ``name`` is not a supported dtype name.
    """
    if not isinstance(name, str) or name not in _WIRE_DTYPES:
        raise CorruptObjectError(
            f"unknown dtype {name!r}; expected one of {sorted(_WIRE_DTYPES)}"
        )
    return _WIRE_DTYPES[name]


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept ``torch.bfloat16`` or ``"bfloat16"`` / ``"bf16"`` and return a supported torch dtype."""
    if isinstance(dtype, str):
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                   "float": "float32", "fp64": "float64", "double": "float64"}
        key = aliases.get(dtype, dtype.removeprefix("torch."))
        if key not in _WIRE_DTYPES:
            raise ValueError(f"unsupported inference dtype {dtype!r}; supported: {sorted(_WIRE_DTYPES)}")
        return _WIRE_DTYPES[key]
    dtype_name(dtype)  # validates
    return dtype


def int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype with the same width as ``dtype`` (bf16/fp16 -> int16, fp32 -> int32)."""
    return _INT_VIEW[dtype.itemsize]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a floating tensor as signed integers of the same width, without copying.

    ``t`` must have a contiguous last dim (``Tensor.view(dtype)`` requires it for same-width views).
    """
    return t.view(int_view_dtype(t.dtype))


def unsigned_bits64(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of every element as a new non-negative int64 tensor (``0 .. 2**w - 1`` for
    width ``w`` < 64; 64-bit patterns are kept as signed int64, which is the same value modulo
    ``2**64``, all the checksum arithmetic needs). Always a fresh tensor, safe to modify in place.
    """
    b = bits(t)
    width = t.element_size() * 8
    if width == 64:
        return b.clone()
    return b.to(torch.int64).bitwise_and_((1 << width) - 1)
