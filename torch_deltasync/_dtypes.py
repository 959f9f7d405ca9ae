"""Dtype names and integer bit views.

Change detection and checksums never compare floats: ``-0.0 == 0.0`` and ``NaN != NaN`` would lose
or invent changes. Instead every floating tensor is reinterpreted as a signed integer tensor of the
same width (``view(torch.int16)`` for bf16), which compares bit patterns exactly.
"""

from __future__ import annotations

import sys

import torch

from . import _native
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


# --- the published cast ------------------------------------------------------------------------

#: The one NaN each inference dtype publishes after a cast, as its signed integer view: the
#: positive quiet NaN without payload (for bf16, fp16 and fp8 also what torch's scalar cast
#: writes). torch's casts give a NaN other bits depending on the code path that meets it, so the
#: same weights would publish different bits in an anchor and in a delta: fp32 -> bf16 writes
#: 0x7FC0 in scalar code but 0xFFFF in its AVX-512 lanes
#: (``aten/src/ATen/cpu/vec/vec512/vec512_bfloat16.h``), fp16 -> fp32 keeps a payload in vector
#: lanes (0xFFFFE000) and writes 0x7FFFFFFF in the scalar tail; which path an element takes depends
#: on its place in the tensor, the tensor's strides, and where a chunk starts.
CANONICAL_NAN: dict[torch.dtype, int] = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000,
                                         torch.float64: 0x7FF8000000000000}
# (a NaN is a pattern whose magnitude bits exceed the dtype's infinity; e4m3fn has no infinity:
# above its largest finite magnitude 0x7E)
_MAGNITUDE = {torch.bfloat16: (0x7FFF, 0x7F80), torch.float16: (0x7FFF, 0x7C00),
              torch.float32: (0x7FFFFFFF, 0x7F800000), torch.float64: (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}
for _name, _nan, _limit in (("float8_e4m3fn", 0x7F, 0x7E), ("float8_e5m2", 0x7F, 0x7C)):
    if (_dt := getattr(torch, _name, None)) is not None:
        CANONICAL_NAN[_dt], _MAGNITUDE[_dt] = _nan, (0x7F, _limit)


def canonical_nans_(t: torch.Tensor) -> torch.Tensor:
    """Overwrite every NaN of ``t`` (a contiguous tensor of an inference dtype, any device) with
    :data:`CANONICAL_NAN` of its dtype, in place; returns ``t``. Other values keep their bits.

    On the CPU (with the compiled kernels) one pass reads ``t`` and writes only its NaNs; elsewhere
    three torch ops on the integer view (mask, compare, masked fill), in chunks of ``2**24``
    elements (their temporaries take 3-9 bytes per element)."""
    mask, limit = _MAGNITUDE[t.dtype]
    b = bits(t).view(-1)
    if t.device.type == "cpu" and _native.enabled():
        u = b.numpy().view(f"u{t.element_size()}")
        _native.canonical_nans(u, u.dtype.type(mask), u.dtype.type(limit), u.dtype.type(CANONICAL_NAN[t.dtype]))
    else:
        for a in range(0, b.numel(), 1 << 24):
            c = b[a : a + (1 << 24)]
            c.masked_fill_((c & mask) > limit, CANONICAL_NAN[t.dtype])
    return t


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` as a new tensor: torch's cast (round to nearest even), with each NaN it
    made written as :data:`CANONICAL_NAN` (the bits of NaNs in ``t`` are kept when ``t`` is already
    in ``dtype``). Every cast to the inference dtype the sender publishes goes through here or
    through kernels that write the same bits (change detection on the CPU and with Triton), so
    anchors, deltas and checksums agree for any layout of the source.

    Args:
        t: any floating tensor, any layout and device.
        dtype: an inference dtype (:data:`CANONICAL_NAN` has it).

    Returns:
        A new contiguous tensor of ``t``'s shape in ``dtype``.
    """
    out = t.detach().to(dtype, memory_format=torch.contiguous_format, copy=True)
    return out if t.dtype == dtype else canonical_nans_(out)


# --- a receiver's wider storage ------------------------------------------------------------------

#: Mantissa bits of the IEEE binary formats a receiver may hold in a wider one (bf16 or fp16 in
#: fp32 or fp64, fp32 in fp64): the pairs ``targets._vllm_layout._holds_exactly`` admits.
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def _moved_nans(src: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``src`` holds a NaN (bool) and, for every element, the bits of the ``dtype`` NaN with
    the same sign and the payload moved to ``dtype``'s mantissa (its top bits kept; signed integer
    view of ``dtype``). IEEE 754 (2019) §6.2.3: widening a NaN keeps its payload, and a NaN the
    narrower format holds exactly is the one whose dropped low bits are zero."""
    b = bits(src)
    mask, limit = _MAGNITUDE[src.dtype]
    nan = (b & mask) > limit
    shift = _MANTISSA[dtype] - _MANTISSA[src.dtype]
    payload = (b & ((1 << _MANTISSA[src.dtype]) - 1)).to(torch.int64)
    payload = payload << shift if shift > 0 else payload >> -shift
    sign = (b < 0).to(torch.int64) << (8 * dtype.itemsize - 1)  # (1 << 63 wraps to int64's sign bit)
    return nan, (sign | _MAGNITUDE[dtype][1] | payload).to(int_view_dtype(dtype))


def widen(values: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``values`` held in the wider floating dtype ``storage`` exactly: torch's cast for numbers
    (exact when widening) and, for a NaN, the ``storage`` NaN with its sign and payload (torch
    quiets or drops them, differently in vector and scalar code). :func:`narrow` gives the values
    back, bit for bit. bf16 in fp32 is each pattern shifted into the high half (one op).

    Args:
        values: ``(k,)`` in bf16, fp16 or fp32 (or already ``storage``).
        storage: fp32 or fp64, wider than ``values``.
    """
    if values.dtype == torch.bfloat16 and storage == torch.float32:
        return (bits(values.contiguous()).to(torch.int32) << 16).view(torch.float32)
    out = values.to(storage)
    if values.dtype != storage:
        nan, moved = _moved_nans(values, storage)
        bits(out).copy_(torch.where(nan, moved, bits(out)))
    return out


def narrow(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dtype`` values that a receiver holds in a wider floating dtype (``values``, as
    :func:`widen` writes them), back in ``dtype``, bit for bit, NaNs included (a NaN keeps its
    sign and the top bits of its payload). bf16 held in fp32 is the high half of each pattern (a
    view and one copy). A value that is no ``dtype`` value is not detected here
    (:func:`~torch_deltasync.targets._base.narrow_exactly` checks): a number comes back rounded,
    and a NaN whose payload lies only in the dropped bits as an infinity.

    Args:
        values: any of the wider dtypes of :func:`widen`.
        dtype: the inference dtype (bf16, fp16 or fp32).

    Returns:
        ``values`` when already in ``dtype``, else a new contiguous tensor of its shape.
    """
    if values.dtype == dtype:
        return values
    if not values.numel():
        return torch.empty(values.shape, dtype=dtype, device=values.device)
    if dtype == torch.bfloat16 and values.dtype == torch.float32 and sys.byteorder == "little":
        halves = bits(values.contiguous().reshape(-1)).view(torch.int16)  # (low, high) per element
        return halves[1::2].contiguous().view(torch.bfloat16).reshape(values.shape)
    out = values.to(dtype, memory_format=torch.contiguous_format)
    nan, moved = _moved_nans(values, dtype)
    bits(out).copy_(torch.where(nan, moved, bits(out)))
    return out


def index_copy_(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``flat[positions] = values`` in place; returns ``flat``.

    Values of ``flat``'s own dtype are copied through the integer views: every bit pattern as it
    is, and for dtypes without torch's float kernels too (fp8 has no ``index_copy_`` on the CPU).
    Values of a narrower dtype (bf16 into fp32 storage) are widened exactly first (:func:`widen`).

    Args:
        flat: 1-D, contiguous, any floating dtype and device.
        positions: int64 ``(k,)`` in ``[0, flat.numel())`` on ``flat``'s device (torch checks them).
        values: ``(k,)`` floating, any device.
    """
    values = values.to(flat.device)
    if values.dtype == flat.dtype:
        bits(flat).index_copy_(0, positions, bits(values))
    else:
        flat.index_copy_(0, positions, widen(values, flat.dtype))
    return flat
