"""Compiled decoding of one ``packed`` blob in one kernel call: the header, the zstd frames, the streams.

:func:`decode_blob`, the fast path of :meth:`PackedCodec.decode
<torch_deltasync.codecs.PackedCodec.decode>`, calls :func:`decode_compressed`: it parses the header
(:func:`parse_header`), decompresses the streams that are zstd frames (libzstd from the kernel,
:mod:`torch_deltasync._native_zstd`, after each declared length is bounded by the change count and
the tensor size, so nothing expands past what the manifest allows) and decodes positions and
values in one pass each (:func:`decode_streams`). Where the kernels cannot reach libzstd,
``zstandard`` decompresses the frames in Python between :func:`parse_header` and
:func:`decode_streams`. The kernels validate everything the numpy reference validates and return
a status instead of raising; on any failure the caller decodes the blob again with the reference,
which raises the specific :class:`~torch_deltasync.errors.CorruptObjectError`
(``tests/unit/test_native.py`` checks that both accept exactly the same blobs). One call per
tensor is also one release of the GIL for the threads of ``decode_many``.

The stream kernels (:func:`decode_gaps`, :func:`count_code`, :func:`scan_escapes`,
:func:`decode_steps`, :func:`bitmap_positions`) are also what the numpy reference calls first when
the kernels are on. Escapes (a gap's high part 255, a step's escape code) are rare but fall at
random: the kernels mark them with one bit per entry, without a branch, and walk the set bits
(``trailing_zeros``), as change detection extracts positions.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import _native_zstd
from .._native import _BLOCK, _U0, _U1, BAD, OK, _u64, jit, trailing_zeros
from .._native_zstd import decompress
from ..errors import CorruptObjectError
from ._base import _UNSIGNED, TensorDelta
from ._bits import MAX_VARINT_BYTES, METHOD_STORED, METHOD_ZSTD, unpack_stream
from ._packed_header import CODE_BITS, HEADER_FIXED, LAYOUT_VERSION, MAX_GAP_SHIFT, POS_BITMAP, POS_GAPS, VAL_RAW, VAL_STEPS
from ._packed_kernels import equal_bits, from_planes


# --- the streams (also called by the numpy reference in ._packed, which raises on BAD) ----------


@jit
def _get_varint(buf, at, limit):
    """One varint at ``buf[at:]`` of at most ``limit`` bytes, no overlong form: ``(value, next
    offset)``, or ``(0, -1)`` when it is cut off, too long or overlong."""
    v = _U0
    n = buf.size
    for j in range(limit):
        if at + j >= n:
            return _U0, -1
        byte = buf[at + j]
        v |= _u64(byte & 0x7F) << _u64(7 * j)
        if byte < 0x80:
            if j and byte == 0:
                return _U0, -1
            return v, at + j + 1
    return _U0, -1


@jit
def decode_gaps(high, ext, low, r, numel, max_ext, ext_limit, pos_out):
    """Positions of gap mode into ``pos_out`` (int64 ``(k,)``), validating what the reference
    decoder validates: exactly one varint (at most ``ext_limit`` bytes, not overlong, at most
    ``max_ext``) per 255 byte filling ``ext``, zero padding bits in ``low``, every gap at most
    ``numel - 1`` and every position below ``numel``. Returns ``OK`` or ``BAD``.

    Per block of ``BLOCK`` gaps: the high parts' largest value and escapes (one vectorised pass),
    the low bits joined in (whole groups of 8 fields fill ``r`` bytes), the escapes added in order,
    then one check of the whole block before its running sum: its gaps add up, exactly (two
    32-bit halves, which cannot wrap in ``BLOCK`` terms), to less than what is left below
    ``numel``. That bounds every gap and the block's last (largest) position at once, so the
    running sum itself carries no compare (one per position made this kernel 1.2-2.7x slower on
    the change sets of ``tools/bench_codec.py``)."""
    k = high.size
    rr = _u64(r)
    lmask = (_U1 << rr) - _U1
    max_high = _u64(max(numel - 1, 0)) >> rr
    unumel = _u64(numel)
    g = np.empty(_BLOCK, np.uint64)
    acc = _U0  # bit reader of the low parts (fields past whole groups of 8, and r > 8)
    nbits = 0
    li = 0
    e = 0
    start = _U0  # the position a gap of 0 leads to: the last position + 1
    for a in range(0, k, _BLOCK):
        hb = high[a : a + _BLOCK]
        m = hb.size
        n_esc = 0
        top = np.uint8(0)
        for j in range(m):  # vectorises
            n_esc += hb[j] == 255
            top = max(top, hb[j])
        if _u64(top) > max_high:  # every high part <= max_high (escapes: below), so no shift overflows
            return BAD
        j0 = 0
        if r == 0:
            j0 = m
            for j in range(m):  # vectorises
                g[j] = _u64(hb[j])
        elif r <= 8 and nbits == 0:  # whole groups of 8 fields fill r bytes
            j0 = m // 8 * 8
            for o in range(j0 // 8):
                w = _U0
                for q in range(r):
                    w |= _u64(low[li + q]) << _u64(8 * q)
                li += r
                for q in range(8):
                    g[8 * o + q] = (_u64(hb[8 * o + q]) << rr) | ((w >> _u64(q * r)) & lmask)
        for j in range(j0, m):
            while nbits < r:
                acc |= _u64(low[li]) << _u64(nbits)
                li += 1
                nbits += 8
            g[j] = (_u64(hb[j]) << rr) | (acc & lmask)
            acc >>= rr
            nbits -= r
        for g0 in range(0, m if n_esc else 0, 64):  # the escapes, in order, by walking set bits
            w = equal_bits(hb, g0, m, 255)
            while w:
                j = g0 + trailing_zeros(w)
                w &= w - _U1
                x, e = _get_varint(ext, e, ext_limit)
                if e < 0 or x > _u64(max_ext) or x + _u64(255) > max_high:
                    return BAD
                g[j] += x << rr  # (255 + x) << r <= max_high << r: no overflow
        s_lo = _U0
        s_hi = _U0
        for j in range(m):  # vectorises
            s_lo += g[j] & _u64(0xFFFFFFFF)
            s_hi += g[j] >> _u64(32)
        if s_hi >= _u64(1 << 31):  # the sum is at least 2**63 > numel
            return BAD
        # The last position, start + sum + m - 1, must be below numel (start <= numel: checked
        # for the block before); the sum < 2**63 + 2**44 here, so none of this wraps.
        total = (s_hi << _u64(32)) + s_lo
        if total >= unumel or total + _u64(m) > unumel - start:
            return BAD
        out = pos_out[a : a + _BLOCK]
        p = start - _U1  # wraps for the first block; p + g + 1 wraps back
        for j in range(m):
            p += g[j] + _U1
            out[j] = np.int64(p)
        start = p + _U1
    if e != ext.size or li != low.size or acc != _U0:
        return BAD
    return OK


@jit
def count_code(codes, count, b):
    """Number of codes equal to ``M = 2**b - 1`` among the ``count`` codes of ``codes``
    (``b`` = 2, 4, 8), or -1 when padding bits after the last code are set."""
    M = (1 << b) - 1
    per = 8 // b
    lut = np.zeros(256, np.int64)  # escape codes in each byte value
    for v in range(256):
        for q in range(per):
            lut[v] += ((v >> (q * b)) & M) == M
    n = 0
    for i in range(codes.size):
        n += lut[codes[i]]
    tail = count % per
    if tail:
        last = np.int64(codes[codes.size - 1])
        if last >> (tail * b):
            return -1
    return n


@jit
def count_code16(codes, count):
    """:func:`count_code` for ``b = 16`` (two byte planes)."""
    n = 0
    for i in range(count):
        n += codes[i] == 0xFF and codes[count + i] == 0xFF
    return n


@jit
def scan_escapes(ext, n_esc, limit, e_max):
    """Validate the ext stream (exactly ``n_esc`` varints filling it, each at most ``limit``
    bytes, not overlong, at most ``e_max``) and count its zeros (raw escapes); -1 when invalid."""
    at = 0
    zeros = 0
    for _ in range(n_esc):
        x, at = _get_varint(ext, at, limit)
        if at < 0 or x > _u64(e_max):
            return -1
        zeros += x == _U0
    if at != ext.size:
        return -1
    return zeros


@jit
def _decode_escape(i, M, width, ext, e_at, raw, n_raw, ri, steps, values, relative):
    """Entry ``i`` with the escape code: its varint (already validated) and, for a 0, the next raw
    value. Returns the next ext offset and raw index."""
    first = ext[e_at]
    if 0 < first < 0x80:  # the common escape: a one-byte varint, z = M + first
        z = np.int64(M) + np.int64(first)
        steps[i] = (z >> 1) ^ -(z & 1)
        return e_at + 1, ri
    x, e_at = _get_varint(ext, e_at, 9)
    if x == _U0:
        v = _U0
        for j in range(width):
            v |= _u64(raw[j * n_raw + ri]) << _u64(8 * j)
        values[i] = v
        steps[i] = 0
        relative[i] = False
        return e_at, ri + 1
    z = np.int64(M) + np.int64(x)
    steps[i] = (z >> 1) ^ -(z & 1)
    return e_at, ri


@jit
def decode_steps(codes, count, b, width, ext, raw, n_raw, steps, values, relative):
    """Steps, raw values and the relative mask from the value streams (already validated by
    :func:`count_code` and :func:`scan_escapes`): ``steps`` (signed, ``(k,)``, 0 at raw
    escapes) and, when there are raw escapes (else pass empty arrays), ``values`` (unsigned bit
    patterns: the raw escapes' new values, else 0) and ``relative`` (bool, false at raw
    escapes). ``raw`` holds the raw escapes as byte planes."""
    M = (1 << b) - 1
    if values.size:
        values[:] = 0
        relative[:] = True
    e_at = 0
    ri = 0
    if b >= 8:
        lut = np.empty(M, steps.dtype)  # code c < M is the step of zigzag z = c + 1
        for c in range(M):
            z = c + 1
            lut[c] = (z >> 1) ^ -(z & 1)
        for i in range(count):
            c = np.int64(codes[i]) | (np.int64(codes[count + i]) << 8) if b == 16 else np.int64(codes[i])
            if c == M:
                e_at, ri = _decode_escape(i, M, width, ext, e_at, raw, n_raw, ri, steps, values, relative)
            else:
                steps[i] = lut[c]
        return
    # b = 2 or 4: every byte's steps from a table, and a bit per escape code (from a second
    # table) for each 64 entries; then the escapes among them, in order, by walking the set bits
    per = 8 // b
    lut = np.zeros((256, 4), steps.dtype)
    esc = np.zeros(256, np.uint64)  # bit q: code q of the byte value is an escape
    for v in range(256):
        for q in range(per):
            c = (v >> (q * b)) & M
            if c == M:
                esc[v] |= _U1 << _u64(q)
            else:
                z = c + 1
                lut[v, q] = (z >> 1) ^ -(z & 1)
    whole = count // per
    group = 64 // per  # bytes per 64 entries
    for o0 in range(0, whole, group):
        w = _U0
        for o in range(o0, min(o0 + group, whole)):
            v = codes[o]
            i = o * per
            if per == 4:
                steps[i] = lut[v, 0]
                steps[i + 1] = lut[v, 1]
                steps[i + 2] = lut[v, 2]
                steps[i + 3] = lut[v, 3]
            else:
                steps[i] = lut[v, 0]
                steps[i + 1] = lut[v, 1]
            w |= esc[v] << _u64((o - o0) * per)
        while w:
            i = o0 * per + trailing_zeros(w)
            w &= w - _U1
            first = ext[e_at]
            if 0 < first < 0x80:  # the common escape, here rather than in the call (2-3x faster)
                z = np.int64(M) + np.int64(first)
                steps[i] = (z >> 1) ^ -(z & 1)
                e_at += 1
            else:
                e_at, ri = _decode_escape(i, M, width, ext, e_at, raw, n_raw, ri, steps, values, relative)
    for i in range(whole * per, count):
        c = (np.int64(codes[i // per]) >> ((i % per) * b)) & M
        if c == M:
            e_at, ri = _decode_escape(i, M, width, ext, e_at, raw, n_raw, ri, steps, values, relative)
        else:
            steps[i] = lut[c, 0]


@jit
def bitmap_positions(bm, numel, count, pos_out):
    """Positions of the set bits of a bitmap into ``pos_out`` (int64 ``(count,)``); ``BAD`` when
    another number of bits is set or a bit at or past ``numel`` is set."""
    k = 0
    for byte_i in range(bm.size):
        v = np.int64(bm[byte_i])
        while v:
            bit = 0
            while not (v >> bit) & 1:
                bit += 1
            p = byte_i * 8 + bit
            if p >= numel or k >= count:
                return BAD
            pos_out[k] = p
            k += 1
            v &= v - 1
    return OK if k == count else BAD



# --- one blob ----------------------------------------------------------------------------------


@jit
def _bit_length(v):
    n = 0
    while v > 0:
        v >>= 1
        n += 1
    return n


@jit
def _varint_limit(v):
    """Bytes of the longest varint of a value up to ``v`` (at least 1)."""
    return max(1, (_bit_length(max(v, 0)) + 6) // 7)


@jit
def gap_limits(r, numel):
    """``(max_ext, ext_len)`` of gap mode at shift ``r``: the largest escape varint value (negative
    when no gap can need one) and the longest escape varint in bytes (as ``_gap_ext_limits``)."""
    max_ext = (max(numel - 1, 0) >> r) - 255
    return max_ext, _varint_limit(max_ext)


@jit
def step_limits(b, width, count):
    """``(M, code bytes, e_max, e_len)`` of steps mode (as ``_step_limits``)."""
    M = (1 << b) - 1
    n_code_bytes = count * b // 8 if b >= 8 else (count * b + 7) // 8
    e_max = (np.int64(1) << (8 * width)) - 1 - M
    return M, n_code_bytes, e_max, _varint_limit(e_max)


@jit
def parse_header(data, numel, count, width):
    """The header of a packed blob (``docs/format.md``, "Codec packed"), with every stream's declared
    length checked against ``count``, ``numel`` and ``width``: exactly where the header alone
    decides it, else bounded from above (what a stream may decompress to).

    Args:
        data: the blob, uint8 ``(n,)``.
        numel, count, width: the tensor's elements, the manifest's change count and bytes per value.

    Returns:
        ``(status, pos_mode, gap_shift, val_mode, code_bits, base_checksum, streams)``: ``OK`` or
        ``BAD``; the fields; ``streams`` int64 ``(6, 4)``, per stream ``(method, raw_len, offset,
        stored_len)``.
    """
    streams = np.zeros((6, 4), np.int64)
    n = data.size
    bad = (BAD, 0, 0, 0, 0, np.uint64(0), streams)
    if n < HEADER_FIXED:
        return bad
    version, pos_mode, r = np.int64(data[0]), np.int64(data[1]), np.int64(data[2])
    val_mode, b = np.int64(data[3]), np.int64(data[4])
    if version != LAYOUT_VERSION or pos_mode > POS_BITMAP or val_mode > VAL_STEPS:
        return bad
    if r > (MAX_GAP_SHIFT if pos_mode == POS_GAPS else 0):
        return bad
    if val_mode == VAL_RAW and b != 0:
        return bad
    if val_mode == VAL_STEPS:
        known = False
        for c in CODE_BITS:
            known |= b == c
        if not known or width > 4 or b > 8 * width:
            return bad
    base = np.uint64(0)
    for j in range(8):
        base |= np.uint64(data[5 + j]) << np.uint64(8 * j)
    at = HEADER_FIXED
    for i in range(6):
        if at >= n:
            return bad
        method = np.int64(data[at])
        at += 1
        if method != METHOD_STORED and method != METHOD_ZSTD:
            return bad
        raw_len, at = _get_varint(data, at, MAX_VARINT_BYTES)
        if at < 0:
            return bad
        stored_len = raw_len
        if method != METHOD_STORED:
            stored_len, at = _get_varint(data, at, MAX_VARINT_BYTES)
            if at < 0:
                return bad
        if stored_len > np.uint64(n):  # (a 9-byte varint is below 2**63: raw_len fits int64)
            return bad
        streams[i, 0] = method
        streams[i, 1] = np.int64(raw_len)
        streams[i, 3] = np.int64(stored_len)
    for i in range(6):
        streams[i, 2] = at
        at += streams[i, 3]
        if at > n:
            return bad
    if at != n:
        return bad
    # Upper bounds on what each stream may hold, before anything is decompressed.
    if pos_mode == POS_GAPS:
        _, ext_len = gap_limits(r, numel)
        hi0, hi1, hi2 = count, count * ext_len, (count * r + 7) // 8
    else:
        hi0, hi1, hi2 = (numel + 7) // 8, 0, 0
    if val_mode == VAL_RAW:
        hi3, hi4, hi5 = 0, 0, count * width
    else:
        _, n_code_bytes, _, e_len = step_limits(b, width, count)
        hi3, hi4, hi5 = n_code_bytes, count * e_len, count * width
    his = (hi0, hi1, hi2, hi3, hi4, hi5)
    for i in range(6):
        if streams[i, 1] > his[i]:
            return bad
    # Exact where the header alone decides (the reference's ``stream(i, n, n)``), so a count the
    # blob does not hold is refused before anything is decompressed or allocated for it.
    if streams[0, 1] != hi0 or streams[2, 1] != hi2 or streams[3, 1] != hi3:
        return bad
    if val_mode == VAL_RAW and streams[5, 1] != hi5:
        return bad
    return OK, pos_mode, r, val_mode, b, base, streams


@jit
def decode_streams(pos_mode, r, val_mode, b, numel, count, width, s0, s1, s2, s3, s4, s5, pos, steps, values):
    """Positions and values from the six (decompressed) streams, with every check of the reference
    decoder (``_gap_positions``, ``_bitmap_positions``, ``_steps`` in :mod:`._packed_streams`).

    Args:
        pos_mode, r, val_mode, b: the header's fields (:func:`parse_header`).
        numel, count, width: the tensor's elements, the change count and bytes per value.
        s0 .. s5: the streams, uint8.
        pos: int64 ``(count,)``, filled with the positions.
        steps: signed of the width, ``(count,)`` in steps mode (filled with the steps, 0 at raw
            escapes), else empty.
        values: unsigned of the width, ``(count,)``: the new bit patterns in raw values mode; in
            steps mode the raw escapes' new values (0 elsewhere), written only when there are any.

    Returns:
        ``(status, n_raw, relative)``: ``OK`` or ``BAD``, the raw escapes of steps mode and, when
        there are any, which entries are relative (bool ``(count,)``; else empty).
    """
    no_mask = np.empty(0, np.bool_)
    if pos_mode == POS_GAPS:
        max_ext, ext_len = gap_limits(r, numel)
        if s0.size != count:
            return BAD, 0, no_mask
        n_esc = 0
        for i in range(count):
            n_esc += s0[i] == 255
        if n_esc and max_ext < 0:
            return BAD, 0, no_mask
        if not n_esc <= s1.size <= n_esc * ext_len or s2.size != (count * r + 7) // 8:
            return BAD, 0, no_mask
        limit = min(MAX_VARINT_BYTES, _varint_limit(max(max_ext, 1)))
        if decode_gaps(s0, s1, s2, r, numel, max(max_ext, 0), limit, pos) != OK:
            return BAD, 0, no_mask
    else:
        if s0.size != (numel + 7) // 8 or s1.size or s2.size:
            return BAD, 0, no_mask
        if bitmap_positions(s0, numel, count, pos) != OK:
            return BAD, 0, no_mask
    if val_mode == VAL_RAW:
        if s3.size or s4.size or s5.size != count * width:
            return BAD, 0, no_mask
        from_planes(s5, count, width, values)
        return OK, 0, no_mask
    M, n_code_bytes, e_max, e_len = step_limits(b, width, count)
    if s3.size != n_code_bytes:
        return BAD, 0, no_mask
    n_esc = count_code16(s3, count) if b == 16 else count_code(s3, count, b)
    if n_esc < 0 or not n_esc <= s4.size <= n_esc * e_len:
        return BAD, 0, no_mask
    n_raw = scan_escapes(s4, n_esc, min(MAX_VARINT_BYTES, e_len), e_max)
    if n_raw < 0 or s5.size != n_raw * width:
        return BAD, 0, no_mask
    relative = np.empty(count if n_raw else 0, np.bool_)
    decode_steps(s3, count, b, width, s4, s5, n_raw, steps, values if n_raw else values[:0], relative)
    return OK, n_raw, relative


_ZEROS: dict[torch.dtype, torch.Tensor] = {}


def zero(dtype: torch.dtype) -> torch.Tensor:
    """A shared one-element zero of ``dtype`` (placeholder values are it, expanded; never written)."""
    z = _ZEROS.get(dtype)
    if z is None:
        z = _ZEROS[dtype] = torch.zeros(1, dtype=dtype)
    return z


def decode_blob(blob: np.ndarray, numel: int, count: int, width: int, dtype: torch.dtype,
                what: str) -> TensorDelta | None:
    """:meth:`PackedCodec.decode` of ``blob`` (uint8, only read): in one kernel call
    (:func:`decode_compressed`) where the kernels can call libzstd, else in two with zstd from
    Python between them. ``None`` when the kernels or zstd refuse the blob (the caller then
    decodes it with the reference to raise)."""
    if _native_zstd.AVAILABLE:
        status, val_mode, base, pos, steps, values, n_raw, relative = decode_compressed(
            blob, numel, count, width, _native_zstd.decompression_context(), *_templates(width))
        if status != OK:
            return None
    else:
        blob = blob.view()
        blob.flags.writeable = False  # (this view) streams from zstandard are read-only: one kernel type
        status, pos_mode, r, val_mode, b, base, entries = parse_header(blob, numel, count, width)
        if status != OK:
            return None
        s = []
        for method, raw_len, off, stored_len in entries.tolist():  # lengths bounded by parse_header
            if method == METHOD_STORED:
                s.append(blob[off : off + raw_len])
                continue
            try:
                s.append(unpack_stream(method, memoryview(blob[off : off + stored_len]), raw_len, what))
            except CorruptObjectError:
                return None
        pos = np.empty(count, np.int64)
        steps = np.empty(count if val_mode == VAL_STEPS else 0, f"i{width}")
        values = np.empty(count, _UNSIGNED[width])
        status, n_raw, relative = decode_streams(
            pos_mode, r, val_mode, b, numel, count, width, *s, pos, steps, values)
        if status != OK:
            return None
    positions = torch.from_numpy(pos)
    if val_mode == VAL_RAW:
        return TensorDelta(positions, torch.from_numpy(values.view(f"i{width}")).view(dtype), base_checksum=int(base))
    if not n_raw:  # every entry relative: the values are placeholders (one zero, expanded)
        return TensorDelta(positions, zero(dtype).expand(count), torch.from_numpy(steps), None, int(base))
    return TensorDelta(positions, torch.from_numpy(values.view(f"i{width}")).view(dtype), torch.from_numpy(steps),
                       torch.from_numpy(relative), int(base))


@functools.cache
def _templates(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty arrays of the steps' and values' dtypes for ``width`` (the kernel allocates like them)."""
    return np.empty(0, f"i{width}"), np.empty(0, _UNSIGNED[width])


@jit
def _inflate(blob, entry, dctx):
    """``(status, bytes)`` of one stream whose ``(method, raw_len, offset, stored_len)`` ``entry``
    :func:`parse_header` has bounded: a view of ``blob`` when stored, else decompressed into a new
    array of ``raw_len`` bytes (:func:`torch_deltasync._native_zstd.decompress`)."""
    method, raw_len, off, stored_len = entry[0], entry[1], entry[2], entry[3]
    if method == METHOD_STORED:
        return OK, blob[off : off + raw_len]
    out = np.empty(raw_len, np.uint8)
    return decompress(dctx, blob[off : off + stored_len], out), out


@jit
def decode_compressed(blob, numel, count, width, dctx, step_type, value_type):
    """A packed blob decoded in one call: :func:`parse_header`, the zstd frames (libzstd from the
    kernel, each bounded by the header checks first), :func:`decode_streams`.

    Args:
        blob: uint8 ``(n,)``, only read. ``numel``, ``count``, ``width``: as :func:`parse_header`.
        dctx: the address of this thread's decompression context
            (:func:`torch_deltasync._native_zstd.decompression_context`).
        step_type, value_type: empty arrays of the signed and unsigned dtypes of ``width`` bytes.

    Returns:
        ``(status, val_mode, base, pos, steps, values, n_raw, relative)``: ``OK`` or ``BAD``; the
        values mode and base checksum; and what :func:`decode_streams` fills (``steps`` empty in
        raw values mode) and returns.
    """
    no_mask = np.empty(0, np.bool_)
    status, pos_mode, r, val_mode, b, base, entries = parse_header(blob, numel, count, width)
    if status != OK:
        return BAD, val_mode, base, np.empty(0, np.int64), step_type, value_type, 0, no_mask
    st0, s0 = _inflate(blob, entries[0], dctx)
    st1, s1 = _inflate(blob, entries[1], dctx)
    st2, s2 = _inflate(blob, entries[2], dctx)
    st3, s3 = _inflate(blob, entries[3], dctx)
    st4, s4 = _inflate(blob, entries[4], dctx)
    st5, s5 = _inflate(blob, entries[5], dctx)
    if st0 != OK or st1 != OK or st2 != OK or st3 != OK or st4 != OK or st5 != OK:
        return BAD, val_mode, base, np.empty(0, np.int64), step_type, value_type, 0, no_mask
    pos = np.empty(count, np.int64)
    steps = np.empty(count if val_mode == VAL_STEPS else 0, step_type.dtype)
    values = np.empty(count, value_type.dtype)
    status, n_raw, relative = decode_streams(pos_mode, r, val_mode, b, numel, count, width,
                                             s0, s1, s2, s3, s4, s5, pos, steps, values)
    return status, val_mode, base, pos, steps, values, n_raw, relative
