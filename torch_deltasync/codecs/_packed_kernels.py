"""Compiled encoding kernels of the ``packed`` codec (numba, via :func:`torch_deltasync._native.jit`).

Each kernel is one pass over one tensor's change set that :mod:`._packed` otherwise does in several
vectorised numpy passes (the executable specification); ``tests/unit/test_native.py`` checks them
against it bit for bit. They write only into buffers the caller sized from exact counts or upper
bounds, and never raise on data.
"""

from __future__ import annotations

import numpy as np

from .._native import _BLOCK, _U0, _U1, _U7, _U7F, _U8, _U80, _u64, checksum_at, jit, trailing_zeros
from .._native_zstd import compress, compress_bound
from ._bits import METHOD_STORED, METHOD_ZSTD, MIN_ZSTD_BYTES
from ._packed_header import HEADER_FIXED, LAYOUT_VERSION, POS_GAPS, POS_LOW, VAL_RAW, VAL_STEPS
from ._packed_estimates import (
    STEP_CAP, SAMPLE_EVERY, SAMPLE_FROM, best_gap_shift, best_step_code, gap_shift_window, wide_steps,
)


@jit
def gap_histogram(pos, numel, r_lo, span, every):
    """Histogram of ``min(g >> r_lo, span)`` over the gaps ``g`` of ``pos`` (int64, the encoder's
    positions) in every ``every``-th block of ``BLOCK`` gaps (the first, then every ``every``-th),
    int64 ``(span + 1,)``, and whether all of ``pos`` is strictly increasing in ``[0, numel)``
    (checked on every block: a vectorised minimum of the gaps and the positions, where the
    histogram's increments are not)."""
    n_sampled = 0
    for a in range(0, pos.size, _BLOCK * every):
        n_sampled += min(_BLOCK, pos.size - a)
    # Four interleaved histograms for long inputs: most gaps fall in a few bins, and one histogram
    # would make every increment wait for the previous one to the same bin.
    ways = 4 if n_sampled >= 8 * (span + 1) else 1  # zeroing and adding 4 histograms costs too
    h4 = np.zeros((ways, span + 1), np.int64)
    v = np.empty(_BLOCK, np.int64)
    low = 0
    for a in range(0, pos.size, _BLOCK):
        p = pos[a : a + _BLOCK]
        m = p.size
        first = p[0] - (pos[a - 1] if a else -1) - 1
        # A negative position could wrap its gap past 2**63 to a positive int64: every gap and
        # every position counts (then the gaps are exact, and the last position is the largest).
        if (a // _BLOCK) % every:  # not sampled: only the check
            low = min(low, min(first, p[0]))
            for j in range(1, m):  # vectorises
                low = min(low, min(p[j] - p[j - 1] - 1, p[j]))
            continue
        v[0] = first
        for j in range(1, m):
            v[j] = p[j] - p[j - 1] - 1
        for j in range(m):  # vectorises
            low = min(low, min(v[j], p[j]))
            v[j] = min(max(v[j], 0) >> r_lo, span)
        for j in range(m):
            h4[j & (ways - 1), v[j]] += 1
    return h4.sum(axis=0), low >= 0 and (pos.size == 0 or pos[pos.size - 1] < numel)


@jit
def _put_varint(out, at, v):
    """Unsigned LEB128 of ``v`` (uint64) at ``out[at:]``; returns the next offset."""
    while v >= _U80:
        out[at] = np.uint8((v & _U7F) | _U80)
        v >>= _U7
        at += 1
    out[at] = np.uint8(v)
    return at + 1


@jit
def _pack_low_bits(g, m, r, low, at, c8):
    """Append the low ``r`` bits (``1 <= r <= 8``) of ``g[:m]`` (``m`` a multiple of 8) to the
    bit stream ``low`` at byte ``at``: every 8 fields fill exactly ``r`` bytes. Returns the next
    byte offset. ``c8``: uint8 scratch of at least ``m`` bytes, 8-byte aligned (numpy's are).

    For ``r`` in 1, 2, 4 and 8 (the shifts of 0.5-10% density, where the mean gap is 10-200)
    each output byte holds whole fields (``r = 8``: one, copied): the fields go to one byte each
    (``c8``, vectorised), and each output byte gathers its ``8 // r`` bytes from one 64-, 32- or
    16-bit word (for ``r = 1``
    by a multiply that moves bit 0 of each of 8 bytes to the top byte, and a shift). Other widths
    gather 8 fields into ``r`` bytes of a 64-bit word."""
    mask = (_U1 << _u64(r)) - _U1
    if r == 8:
        for j in range(m):  # vectorises
            low[at + j] = np.uint8(g[j] & mask)
        return at + m
    if r == 1 or r == 2 or r == 4:
        for j in range(m):  # vectorises
            c8[j] = np.uint8(g[j] & mask)
        n_out = m * r // 8
        if r == 4:
            c16 = c8.view(np.uint16)
            for o in range(n_out):
                w = c16[o]
                low[at + o] = np.uint8((w | (w >> 4)) & 0xFF)
        elif r == 2:
            c32 = c8.view(np.uint32)
            for o in range(n_out):
                w = c32[o]
                low[at + o] = np.uint8((w | (w >> 6) | (w >> 12) | (w >> 18)) & 0xFF)
        else:
            c64 = c8.view(np.uint64)
            for o in range(n_out):  # bit 0 of byte q lands on bit 56 + q
                low[at + o] = np.uint8((c64[o] * _u64(0x0102040810204080)) >> _u64(56))
        return at + n_out
    for o in range(m // 8):
        acc = _U0
        for q in range(8):
            acc |= (g[8 * o + q] & mask) << _u64(q * r)
        for j in range(r):
            low[at + j] = np.uint8((acc >> _u64(8 * j)) & _u64(0xFF))
        at += r
    return at


@jit
def encode_gaps(pos, r, high, ext, low):
    """The three position streams of gap mode (format "Positions, mode 0"): ``high`` (uint8
    ``(k,)``) gets ``min(g >> r, 255)``, ``ext`` one varint ``(g >> r) - 255`` per 255 (sized by
    the caller: 9 bytes per escape), ``low`` the ``r``-bit low parts as a little-endian bit stream
    (``ceil(k r / 8)`` bytes). Returns the bytes written to ``ext`` (-1, writing nothing past it,
    when it is too small)."""
    k = pos.size
    rr = _u64(r)
    lmask = (_U1 << rr) - _U1
    g = np.empty(_BLOCK, np.uint64)
    c8 = np.empty(_BLOCK, np.uint8)  # scratch of _pack_low_bits
    e = 0
    at = 0  # bytes of ``low`` written
    acc = _U0  # bits not yet written (fields of the general r > 8 path and the tail)
    nbits = 0
    for a in range(0, k, _BLOCK):
        p = pos[a : a + _BLOCK]
        hb = high[a : a + _BLOCK]
        m = p.size
        g[0] = _u64(p[0] - (pos[a - 1] if a else -1) - 1)
        for j in range(1, m):
            g[j] = _u64(p[j] - p[j - 1] - 1)
        n_esc = 0
        for j in range(m):
            h = g[j] >> rr
            n_esc += h >= _u64(255)
            hb[j] = np.uint8(min(h, _u64(255)))
        if n_esc:
            if e + 9 * n_esc > ext.size:
                return -1  # the caller sized ext too small
            for j in range(m):
                if hb[j] == 255:
                    e = _put_varint(ext, e, (g[j] >> rr) - _u64(255))
        if r == 0:
            continue
        j0 = 0
        if r <= 8 and nbits == 0:  # whole groups of 8 fields fill whole bytes
            j0 = m // 8 * 8
            at = _pack_low_bits(g, j0, r, low, at, c8)
        for j in range(j0, m):
            acc |= (g[j] & lmask) << _u64(nbits)
            nbits += r
            while nbits >= 8:
                low[at] = np.uint8(acc & _u64(0xFF))
                acc >>= _U8
                nbits -= 8
                at += 1
    if nbits > 0:
        low[at] = np.uint8(acc & _u64(0xFF))
    return e


@jit
def _zigzag_step(n, o, full, half):
    """Zigzag of ``n - o`` wrapped to the width (``full = 2**W``, ``half = 2**(W-1)``), int64."""
    d = (((np.int64(n) - np.int64(o)) & (full - 1)) ^ half) - half  # sign-extended from W bits
    return (d << 1) ^ (d >> 63)


@jit
def step_histogram(new, old, width, cap, every):
    """Histogram of ``min(z, cap)`` over the zigzag steps ``z`` of ``new - old`` (unsigned bit
    patterns of ``width`` bytes: 1, 2 or 4) in every ``every``-th block of ``BLOCK`` changes
    (the first, then every ``every``-th), int64 ``(cap + 1,)``, and the ``every`` it used: 1 when
    the first block has more than 1 in 64 steps of 256 or more (``wide_steps``: a sample
    underestimates the entropy of steps spread that wide, and chose 2-bit codes 9% larger than
    16-bit codes or raw values). ``cap`` is at least 256."""
    full = np.int64(1) << (8 * width)
    half = full >> 1
    h = np.zeros(cap + 1, np.int64)
    hot = np.zeros((4, 64), np.int64)  # four copies of the small bins, where almost every step falls:
    zc = np.empty(_BLOCK, np.int32)    # one would make each increment wait for the previous one
    n = new.size
    a = 0
    while a < n:
        nb = new[a : a + _BLOCK]
        ob = old[a : a + _BLOCK]
        m = nb.size
        if width == 2:  # 32-bit lanes: twice as many per vector
            for j in range(m):
                d = np.int32(np.int16(np.int32(nb[j]) - np.int32(ob[j])))
                zc[j] = min(np.uint32((d << 1) ^ (d >> 31)), np.uint32(cap))
        else:
            for j in range(m):  # vectorises
                zc[j] = min(_zigzag_step(nb[j], ob[j], full, half), cap)
        n_wide = 0
        for j in range(m):
            z = zc[j]
            n_wide += z >= 256
            if z < 64:
                hot[j & 3, z] += 1
            else:
                h[z] += 1
        if a == 0 and wide_steps(n_wide, m):
            every = 1
        a += _BLOCK * every
    h[:64] += hot.sum(axis=0)
    return h, every


@jit
def byte_histograms(v, width):
    """Histograms of every byte of ``v`` (unsigned, ``width`` bytes), int64 ``(width, 256)``."""
    h = np.zeros((width, 4, 256), np.int64)
    for i in range(v.size):
        x = np.int64(v[i])
        for j in range(width):
            h[j, i & 3, (x >> (8 * j)) & 0xFF] += 1
    return h.sum(axis=1)


@jit
def code16_histograms(new, old, width):
    """Histograms of the low and high bytes of 16-bit codes (``b = 16``), int64 ``(2, 256)``, and
    the number of escapes (code ``2**16 - 1``)."""
    full = np.int64(1) << (8 * width)
    half = full >> 1
    h = np.zeros((2, 256), np.int64)
    n_esc = 0
    for i in range(new.size):
        z = _zigzag_step(new[i], old[i], full, half)
        c = 65535 if z == 0 else min(z - 1, 65535)
        h[0, c & 0xFF] += 1
        h[1, c >> 8] += 1
        n_esc += c == 65535
    return h, n_esc


@jit
def _varint_len(v):
    n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


@jit(inline=True)
def equal_bits(a, g0, m, v):
    """Bit ``q`` set where ``a[g0 + q] == v``, for the entries ``g0 .. min(g0 + 64, m) - 1`` (uint64):
    escapes are rare but fall at random, so the kernels mark them without a branch and walk the set
    bits (``trailing_zeros``) instead of branching on every entry."""
    w = _U0
    if g0 + 64 <= m:
        for q in range(64):  # vectorises
            w |= _u64(a[g0 + q] == v) << _u64(q)
    else:
        for q in range(m - g0):
            w |= _u64(a[g0 + q] == v) << _u64(q)
    return w


@jit
def encode_steps(new, old, width, b, codes, ext, raw):
    """The value streams of steps mode (format "Values, mode 1") for code width ``b``: packed codes
    into ``codes`` (``ceil(k b / 8)`` bytes; ``b = 16`` as two byte planes), escape varints into
    ``ext`` (sized by the caller), and the new bit patterns of raw escapes, in order, into ``raw``
    (same dtype as ``new``, ``(k,)``). Returns ``(ext bytes, raw escapes)`` (-1, -1 when ``ext``
    is too small; nothing is written past it)."""
    full = np.int64(1) << (8 * width)
    half = full >> 1
    M = (1 << b) - 1
    k = new.size
    e_at = 0
    n_raw = 0
    c = np.zeros(_BLOCK, np.uint16)  # codes of one block, one per element
    zb = np.empty(_BLOCK, np.uint32)  # zigzag steps of one block (< 2**32 for widths up to 4)
    c8 = np.zeros(_BLOCK, np.uint8)
    c16 = c8.view(np.uint16)
    c32 = c8.view(np.uint32)
    for a in range(0, k, _BLOCK):
        nb = new[a : a + _BLOCK]
        ob = old[a : a + _BLOCK]
        m = nb.size
        n_esc = 0
        if width == 2:  # 32-bit lanes; z = 0 wraps to the largest unsigned value, code M
            for j in range(m):
                d = np.int32(np.int16(np.int32(nb[j]) - np.int32(ob[j])))
                z = np.uint32((d << 1) ^ (d >> 31))
                cj = np.uint16(min(z - np.uint32(1), np.uint32(M)))
                n_esc += cj == M
                zb[j] = z
                c[j] = cj
        else:
            for j in range(m):
                z = _zigzag_step(nb[j], ob[j], full, half)
                cj = np.uint16(min(np.uint32(z - 1), np.uint32(M)))
                n_esc += cj == M
                zb[j] = np.uint32(z)
                c[j] = cj
        if n_esc:
            if e_at + width * n_esc > ext.size:
                return -1, -1  # the caller sized ext too small
            # Escapes are rare but placed at random: a bit per element marks them (no branch),
            # then each 64 elements' escapes are coded in order by walking the set bits.
            for g0 in range(0, m, 64):
                w = equal_bits(c, g0, m, M)
                while w:
                    j = g0 + trailing_zeros(w)
                    w &= w - _U1
                    z = np.int64(zb[j])
                    if 0 < z - M < 0x80:  # the common escape: a one-byte varint
                        ext[e_at] = np.uint8(z - M)
                        e_at += 1
                    elif z != 0 and _varint_len(z - M) <= width:
                        e_at = _put_varint(ext, e_at, _u64(z - M))
                    else:  # no step, or a varint longer than the value: the raw value
                        ext[e_at] = 0
                        e_at += 1
                        raw[n_raw] = nb[j]
                        n_raw += 1
        if b == 16:
            for j in range(m):
                codes[a + j] = np.uint8(c[j] & 0xFF)
                codes[k + a + j] = np.uint8(c[j] >> 8)
            continue
        for j in range(m):
            c8[j] = np.uint8(c[j])
        if b == 8:
            codes[a : a + m] = c8[:m]
            continue
        c8[m : (m + 7) // 8 * 8] = 0
        o0 = a * b // 8  # a is a multiple of _BLOCK, so whole bytes precede the block
        if b == 2:  # four codes, one per byte of a uint32, into one byte
            for o in range((m + 3) // 4):
                w = c32[o]
                codes[o0 + o] = np.uint8((w | (w >> 6) | (w >> 12) | (w >> 18)) & 0xFF)
        else:  # b == 4: two codes, one per byte of a uint16
            for o in range((m + 1) // 2):
                w = c16[o]
                codes[o0 + o] = np.uint8((w | (w >> 4)) & 0xFF)
    return e_at, n_raw


@jit
def encode_plan(pos, new, old, width, numel, max_shift, force_r, force_b):
    """The packed encoder's choices for one tensor in one call (what :mod:`._packed` does step by
    step in its numpy path, with the same shared estimates, so both choose alike):

    Args:
        pos: int64 ``(k,)`` positions; ``new``, ``old``: unsigned bit patterns of ``width`` bytes.
        numel: elements of the tensor; ``max_shift``: the largest gap shift the format allows.
        force_r, force_b: a gap shift / code width to use instead of choosing one (-1: choose).

    Returns:
        ``(ok, r, b, best, try16, n_costed, n_gap_esc, n_val_esc, base)``: whether ``pos`` is
        strictly increasing in ``[0, numel)``; the gap shift; the best code width among 2, 4 and 8
        (0 for 8-byte values) with its estimate in bits and whether 16-bit codes could do better
        (the caller then costs 16-bit codes and raw values, :meth:`PackedCodec._refine_code_bits`)
        and the number of steps the estimate counted;
        upper bounds on the gap and step escapes at ``r`` and ``b`` (the buffer sizes
        :func:`encode_streams` needs; exact from the histograms where they count every step);
        and the base checksum of ``old`` at ``pos`` (uint64).
    """
    k = pos.size
    r_lo, r_hi = gap_shift_window(k, pos[k - 1] if k else 0, max_shift)
    every = SAMPLE_EVERY if k >= SAMPLE_FROM else 1
    hist, ok = gap_histogram(pos, numel, r_lo, 255 << (r_hi - r_lo), every)
    r = force_r
    if r < 0:
        r = best_gap_shift(hist.sum(), r_lo, r_hi, hist) if k else 0
    b, best, try16, step_every = 0, 0.0, False, every
    if width <= 4:
        hz, step_every = step_histogram(new, old, width, STEP_CAP, every)
        if k:
            b, best, try16 = best_step_code(hz.sum(), width, hz)
        else:
            b = 2
    else:
        hz = np.zeros(0, np.int64)
    if force_b >= 0 and width <= 4:
        b, best, try16 = force_b, 0.0, False
    gap_sum = pos[k - 1] - (k - 1) if k else 0  # the gaps add up to this
    n_gap, n_val = escape_bounds(k, gap_sum, hist, r, r_lo, r_hi, every, hz, b, step_every)
    return ok, r, b, best, try16, hz.sum(), n_gap, n_val, checksum_at(pos, old)


@jit
def escape_bounds(k, gap_sum, hist, r, r_lo, r_hi, every, hz, b, step_every):
    """Upper bounds on the gap escapes at shift ``r`` and the step escapes at code width ``b``
    (the buffer sizes :func:`encode_streams` needs): exact from the histograms of
    :func:`encode_plan` where they count every entry; else, for gaps, no more than the gaps'
    sum ``gap_sum`` allows (an escaped gap's high part ``g >> r`` is at least 255, and the high
    parts add up to at most ``gap_sum >> r``), and ``k`` for steps."""
    n_gap = min(k, (max(gap_sum, 0) >> r) // 255)
    if r_lo <= r <= r_hi and every == 1:
        n_gap = hist[255 << (r - r_lo) :].sum()
    n_val = k
    if 0 < b <= 8 and step_every == 1:
        n_val = hz[0] + hz[(1 << b) :].sum()  # z = 0 or z > M = 2**b - 1
    return n_gap, n_val


@jit
def encode_streams(pos, new, old, width, r, n_gap_esc, b, n_val_esc):
    """The six uncompressed streams of a packed blob in gap mode: positions, pos_ext, pos_low
    (:func:`encode_gaps`, at most ``n_gap_esc`` gap escapes) and, for ``b`` > 0, codes, ext and raw
    (:func:`encode_steps`, at most ``n_val_esc`` escapes; raw as byte planes), for ``b = 0`` the
    new bit patterns as byte planes in raw. ``None`` when an escape bound was too small."""
    k = pos.size
    high = np.empty(k, np.uint8)
    ext = np.empty(9 * n_gap_esc, np.uint8)
    low = np.empty((k * r + 7) // 8, np.uint8)
    n_ext = encode_gaps(pos, r, high, ext, low)
    if n_ext < 0:
        return None
    if b == 0:
        planes = np.empty(k * width, np.uint8)
        to_planes(new, width, planes)
        return high, ext[:n_ext], low, np.empty(0, np.uint8), np.empty(0, np.uint8), planes
    codes = np.empty(k * b // 8 if b >= 8 else (k * b + 7) // 8, np.uint8)
    vext = np.empty(n_val_esc * width, np.uint8)
    raw = np.empty(k, new.dtype)
    n_vext, n_raw = encode_steps(new, old, width, b, codes, vext, raw)
    if n_vext < 0:
        return None
    planes = np.empty(n_raw * width, np.uint8)
    to_planes(raw[:n_raw], width, planes)
    return high, ext[:n_ext], low, codes, vext[:n_vext], planes


#: What :func:`encode_tensor` did: encoded the tensor; refused its positions; planned it and left
#: the code width to the caller (:meth:`PackedCodec._refine_code_bits`); planned it only (no
#: compression context); or found an escape buffer too small (a bug).
ENCODED, INVALID, REFINE, PLANNED, OVERFLOW = 0, 1, 2, 3, 4


@jit
def encode_tensor(pos, new, old, width, numel, max_shift, force_r, force_b, raw_floor_bits, cctx):
    """One tensor's :func:`encode_plan` and, when the plan settles the code width and ``cctx`` is a
    compression context, its :func:`encode_compressed` in the same call (one release of the GIL
    per tensor).

    The plan leaves the code width to the caller (``REFINE``) when 16-bit codes could beat it or
    its estimate is not below raw values' floor, ``k * width * raw_floor_bits`` bits (the caller
    then costs both from full histograms, :meth:`PackedCodec._refine_code_bits`), unless
    ``force_b`` sets it.

    Args:
        pos, new, old, width, numel, max_shift, force_r, force_b: as :func:`encode_plan`.
        raw_floor_bits: the least bits per byte an estimate of raw values can be.
        cctx: the address of a compression context, or 0 to plan only.

    Returns:
        ``(status, r, b, best, try16, n_costed, n_gap_esc, n_val_esc, base, blob, gap_nbytes)``:
        ``ENCODED``, ``INVALID``, ``REFINE``, ``PLANNED`` or ``OVERFLOW``; the plan
        (:func:`encode_plan`); and when ``ENCODED``, :func:`encode_compressed`'s result (else
        an empty blob and 0).
    """
    ok, r, b, best, try16, n_costed, n_gap_esc, n_val_esc, base = encode_plan(
        pos, new, old, width, numel, max_shift, force_r, force_b)
    status = PLANNED
    blob, gap_nbytes = np.empty(0, np.uint8), 0
    if not ok:
        status = INVALID
    elif width <= 4 and pos.size and force_b < 0 and (try16 or best >= n_costed * width * raw_floor_bits):
        status = REFINE
    elif cctx != 0:
        out = encode_compressed(pos, new, old, width, r, n_gap_esc, b, n_val_esc, base, cctx)
        if out is None:
            status = OVERFLOW
        else:
            blob, gap_nbytes = out
            status = ENCODED
    return status, r, b, best, try16, n_costed, n_gap_esc, n_val_esc, base, blob, gap_nbytes


@jit
def encode_compressed(pos, new, old, width, r, n_gap_esc, b, n_val_esc, base, cctx):
    """The blob of one tensor in gap mode: :func:`encode_streams`, each stream but the gaps' low
    bits (stored, :func:`~._packed._pack_streams`) compressed with zstd when its frame is shorter
    (what :func:`~._bits.pack_stream` does in Python; the same frames,
    :mod:`torch_deltasync._native_zstd`), and the header (what
    :func:`~._packed_header.write_header` writes), in one call: one release of the GIL per tensor
    instead of one per stream.

    Args:
        pos, new, old, width, r, n_gap_esc, b, n_val_esc: as :func:`encode_streams`.
        base: the base checksum (uint64) the header carries.
        cctx: the address of this thread's compression context
            (:func:`torch_deltasync._native_zstd.compression_context`).

    Returns:
        ``(blob, gap_nbytes)``: the blob (uint8, ``docs/format.md`` "Codec packed") and the stored
        bytes of its three position streams (the caller weighs the bitmap fallback with them);
        ``None`` when an escape bound was too small.
    """
    streams = encode_streams(pos, new, old, width, r, n_gap_esc, b, n_val_esc)
    if streams is None:
        return None
    room = 0
    for x in streams:
        room += compress_bound(x.size)
    payload = np.empty(room, np.uint8)
    methods, stored = np.empty(6, np.int64), np.empty(6, np.int64)
    at, header_len = 0, HEADER_FIXED
    for i in range(6):
        x = streams[i]
        n = x.size
        m = compress(cctx, x, payload[at : at + compress_bound(n)]) if n >= MIN_ZSTD_BYTES and i != POS_LOW else -1
        if m < 0 or m >= n:  # stored: no frame shorter than the stream
            payload[at : at + n] = x
            m = n
        methods[i], stored[i] = METHOD_ZSTD if m < n else METHOD_STORED, m
        header_len += 1 + _varint_len(n) + (_varint_len(m) if m < n else 0)
        at += m
    blob = np.empty(header_len + at, np.uint8)
    fields = (LAYOUT_VERSION, POS_GAPS, r, VAL_STEPS if b else VAL_RAW, b)
    for j in range(5):
        blob[j] = fields[j]
    for j in range(8):
        blob[5 + j] = np.uint8((base >> _u64(8 * j)) & _u64(0xFF))
    h = HEADER_FIXED
    for i in range(6):
        blob[h] = methods[i]
        h = _put_varint(blob, h + 1, _u64(streams[i].size))
        if methods[i] != METHOD_STORED:
            h = _put_varint(blob, h, _u64(stored[i]))
    blob[h:] = payload[:at]
    return blob, stored[0] + stored[1] + stored[2]


@jit
def to_planes(v, width, out):
    """``v`` (unsigned, ``(n,)``) as ``width`` little-endian byte planes into ``out`` (``n w``)."""
    n = v.size
    for i in range(n):
        x = np.int64(v[i])
        for j in range(width):
            out[j * n + i] = np.uint8((x >> (8 * j)) & 0xFF)


@jit
def from_planes(buf, n, width, out):
    """Inverse of :func:`to_planes` into ``out`` (unsigned of ``width`` bytes, ``(n,)``)."""
    for i in range(n):
        x = _U0
        for j in range(width):
            x |= _u64(buf[j * n + i]) << _u64(8 * j)
        out[i] = x


@jit
def bitmap_from_positions(pos, out):
    """Set bit ``p mod 8`` of byte ``p // 8`` of ``out`` (zeroed uint8) for every ``p`` in ``pos``
    (checked by the plan; a position outside ``out`` is skipped all the same, and counted).
    Returns how many were outside."""
    n_out = 0
    limit = np.int64(out.size) << 3
    for i in range(pos.size):
        p = pos[i]
        if p < 0 or p >= limit:
            n_out += 1
            continue
        out[p >> 3] |= np.uint8(1 << (p & 7))
    return n_out
