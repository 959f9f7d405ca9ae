"""The ``packed`` codec's streams, one tensor at a time: the numpy reference that builds and reads
them (``docs/format.md``, "Codec packed"), and the calls of the compiled kernels that do the same
(:mod:`._packed_kernels`, :mod:`._packed_decode`) where one stream at a time is what the codec
needs (zstd from Python, a blob a kernel refused). :class:`~._packed.PackedCodec` composes them.

Readers take ``stream(i, lo, hi)``, which checks stream ``i``'s declared length against ``[lo, hi]``
before decompressing it, and raise :class:`~torch_deltasync.errors.CorruptObjectError` naming
``what`` on any violation.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _native
from ..errors import CorruptObjectError
from . import _packed_decode as _decode_kernels
from . import _packed_kernels as _kernels
from ._bits import (
    MAX_VARINT_BYTES, from_planes, leb128_decode, leb128_encode, pack_bits, pack_codes, to_planes, unpack_bits,
    unpack_codes, unzigzag, varint_lengths,
)

# --- encoder stream builders (numpy reference and compiled kernels) ------------------------------


def _code16_histograms_native(new_u: np.ndarray, old_u: np.ndarray, width: int) -> tuple[np.ndarray, int]:
    """The histograms of the bytes of 16-bit codes and their escapes, by the kernel."""
    h16, n_esc16 = _kernels.code16_histograms(new_u, old_u, width)
    return h16, int(n_esc16)


def _gap_streams(gaps: np.ndarray, r: int) -> list[np.ndarray]:
    """The positions, pos_ext and pos_low streams of gap mode with shift ``r`` (uncompressed)."""
    high = gaps >> np.uint64(r)
    return [np.minimum(high, 255).astype(np.uint8), leb128_encode(high[high >= 255] - np.uint64(255)), pack_bits(gaps, r)]


def _from_planes_any(buf: np.ndarray, n: int, w: int, native: bool) -> np.ndarray:
    """:func:`from_planes` (by the kernel when ``native``)."""
    if not native:
        return from_planes(buf, n, w)
    out = np.empty(n, f"u{w}")
    _kernels.from_planes(buf, n, w, out)
    return out


def _step_streams(new_u: np.ndarray, width: int, b: int, z: np.ndarray) -> list[np.ndarray]:
    """The codes, ext and raw streams of steps mode with code width ``b`` (uncompressed)."""
    M = (1 << b) - 1
    # z == 0 (an entry whose bits did not change) has no code: it is sent as a raw escape.
    codes = np.where(z == 0, M, np.minimum(z - 1, M))
    esc = codes == M
    e = z[esc] - M  # >= 1 except for z == 0
    raw_esc = (e <= 0) | (varint_lengths(np.maximum(e, 0).astype(np.uint64)) > width)
    ext = np.where(raw_esc, 0, e).astype(np.uint64)
    return [pack_codes(codes, b), leb128_encode(ext), to_planes(new_u[esc][raw_esc])]


# --- decoder stream readers (numpy reference and compiled kernels) -------------------------------
# ``stream(i, lo, hi)`` checks stream i's declared length against [lo, hi] before decompressing it.


def _gap_ext_limits(r: int, numel: int) -> tuple[int, int, int]:
    """``(max_gap, max_ext, ext_len)``: the largest gap of the tensor, the largest escape varint
    value (negative when no gap can need one) and the longest escape varint in bytes."""
    max_gap = max(numel - 1, 0)
    max_ext = (max_gap >> r) - 255  # largest high part the tensor allows, minus 255
    ext_len = max(1, math.ceil(max(max_ext, 0).bit_length() / 7))
    return max_gap, max_ext, ext_len


def _gap_positions(stream, r: int, numel: int, count: int, what: str) -> np.ndarray:
    """Positions of gap mode, int64 ``(count,)`` (numpy reference)."""
    max_gap, max_ext, ext_len = _gap_ext_limits(r, numel)
    high_b = stream(0, count, count)
    esc = high_b == 255
    n_esc = int(esc.sum())
    if n_esc and max_ext < 0:
        raise CorruptObjectError(f"{what}: gap escapes, but no gap of this tensor needs one")
    high = high_b.astype(np.uint64)
    if n_esc:
        ext = leb128_decode(stream(1, n_esc, n_esc * ext_len), n_esc, max_ext, f"{what}: gap escapes")
        high[esc] += ext
    else:
        stream(1, 0, 0)
    n_low = -(-count * r // 8)
    gaps = (high << np.uint64(r)) | unpack_bits(stream(2, n_low, n_low), count, r, f"{what}: gap low bits")
    if count and int(gaps.max()) > max_gap:
        raise CorruptObjectError(f"{what}: gap {int(gaps.max())} in a {numel}-element tensor")
    # Every gap < numel <= 2**63, so the running sum cannot wrap around 2**64 before some
    # position reaches numel; that position is exact and the max below sees it. (Checking
    # only the last position would miss a sum that wrapped back into range.)
    pos = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)
    if count and int(pos.max()) >= numel:
        raise CorruptObjectError(f"{what}: position {int(pos.max())} outside [0, {numel})")
    return pos.astype(np.int64)


def _gap_positions_native(stream, r: int, numel: int, count: int, what: str) -> np.ndarray | None:
    """:func:`_gap_positions` by the kernel; ``None`` when the kernel finds the streams invalid
    (the caller then decodes them with the reference to raise the specific error)."""
    max_gap, max_ext, ext_len = _gap_ext_limits(r, numel)
    high_b = stream(0, count, count)
    n_esc = int(np.count_nonzero(high_b == 255))
    if n_esc and max_ext < 0:
        return None
    ext = stream(1, n_esc, n_esc * ext_len)
    n_low = -(-count * r // 8)
    try:
        low = stream(2, n_low, n_low)
    except CorruptObjectError:  # the reference reads the escapes first: its error names them if they are bad too
        return None
    pos = np.empty(count, np.int64)
    limit = min(MAX_VARINT_BYTES, max(1, math.ceil(max(max_ext, 1).bit_length() / 7)))
    if _decode_kernels.decode_gaps(high_b, ext, low, r, numel, max(max_ext, 0), limit, pos) != _native.OK:
        return None
    return pos


def _bitmap_positions(bm: np.ndarray, numel: int, count: int, what: str) -> np.ndarray:
    """Positions of bitmap mode, int64 ``(count,)`` (numpy reference)."""
    mask = np.unpackbits(bm, bitorder="little")
    if bool(mask[numel:].any()):
        raise CorruptObjectError(f"{what}: bitmap bits set past the end of the tensor")
    pos = np.flatnonzero(mask).astype(np.int64)
    if pos.size != count:
        raise CorruptObjectError(f"{what}: bitmap marks {pos.size} positions, the object declares {count}")
    return pos


def _step_limits(b: int, width: int, count: int) -> tuple[int, int, int, int]:
    """``(M, code bytes, e_max, e_len)``: the escape code, the codes stream's length, the largest
    escape varint value and the longest escape varint in bytes."""
    M = (1 << b) - 1
    n_code_bytes = count * b // 8 if b >= 8 else -(-count * b // 8)
    e_max = (1 << (8 * width)) - 1 - M  # largest zigzag step of the width, minus M
    return M, n_code_bytes, e_max, max(1, math.ceil(e_max.bit_length() / 7))


def _steps(stream, count: int, b: int, width: int, what: str):
    """``(steps, values, relative)`` of steps mode (numpy reference): signed steps of the width
    (0 at raw escapes), the raw escapes' new bit patterns at their entries (``None`` without raw
    escapes) and which entries are relative (``None``: all)."""
    M, n_code_bytes, e_max, e_len = _step_limits(b, width, count)
    work = np.int32 if width <= 2 else np.int64  # holds any zigzag step of the width
    codes = unpack_codes(stream(3, n_code_bytes, n_code_bytes), count, b, f"{what}: codes", work)
    esc = codes == M
    n_esc = int(esc.sum())
    ext = leb128_decode(stream(4, n_esc, n_esc * e_len), n_esc, e_max, f"{what}: escapes").astype(work)
    raw_esc = ext == 0
    n_raw = int(raw_esc.sum())
    raw_u = from_planes(stream(5, n_raw * width, n_raw * width), n_raw, width)
    z = codes + 1
    z[esc] = M + ext  # raw escapes get z = M; their step is ignored (relative is False)
    steps = unzigzag(z).astype(f"i{width}")
    if not n_raw:
        return steps, None, None
    raw_at = np.flatnonzero(esc)[raw_esc]
    steps[raw_at] = 0
    rel = np.ones(count, dtype=bool)
    rel[raw_at] = False
    vals = np.zeros(count, dtype=f"u{width}")
    vals[raw_at] = raw_u
    return steps, vals, rel


def _steps_native(stream, count: int, b: int, width: int, what: str):
    """:func:`_steps` by the kernels; ``None`` when they find the streams invalid."""
    M, n_code_bytes, e_max, e_len = _step_limits(b, width, count)
    codes = stream(3, n_code_bytes, n_code_bytes)
    n_esc = _decode_kernels.count_code16(codes, count) if b == 16 else _decode_kernels.count_code(codes, count, b)
    if n_esc < 0:
        return None
    ext = stream(4, n_esc, n_esc * e_len)
    n_raw = _decode_kernels.scan_escapes(ext, n_esc, min(MAX_VARINT_BYTES, e_len), e_max)
    if n_raw < 0:
        return None
    raw = stream(5, n_raw * width, n_raw * width)
    steps = np.empty(count, f"i{width}")
    values = np.empty(count if n_raw else 0, f"u{width}")
    relative = np.empty(count if n_raw else 0, np.bool_)
    _decode_kernels.decode_steps(codes, count, b, width, ext, raw, n_raw, steps, values, relative)
    return (steps, values, relative) if n_raw else (steps, None, None)
