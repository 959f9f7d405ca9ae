"""Bit-stream primitives of the ``packed`` codec (``docs/format.md``, "Codec packed").

Unsigned LEB128 varints (the integer coding of Protocol Buffers,
https://protobuf.dev/programming-guides/encoding/#varints), fixed-width code and bit packing, byte
planes, zigzag mapping, and zstd-compressed streams. Every reader takes untrusted bytes and a length
its caller has already bounded, and raises :class:`~torch_deltasync.errors.CorruptObjectError`
naming ``what`` on any violation. Arrays are numpy, flat and contiguous.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import zstandard

from ..errors import CorruptObjectError

#: How a stream's payload is stored: as is, or as one zstd frame declaring its content size.
METHOD_STORED, METHOD_ZSTD = 0, 1

# Longest varint this codec reads: 9 bytes carry 63 bits, enough for any gap (< numel <= 2**63)
# and any escape (< 2**32); a 10th byte could overflow uint64 arithmetic.
MAX_VARINT_BYTES = 9
# Streams shorter than this are always stored (a zstd frame costs ~10 bytes of its own).
MIN_ZSTD_BYTES = 24


# --- LEB128 varints (vectorised) ---------------------------------------------------------------


def varint_lengths(v: np.ndarray) -> np.ndarray:
    """Bytes of the unsigned LEB128 encoding of every element of ``v`` (uint64), int64 ``(n,)``."""
    lens = np.ones(v.shape, dtype=np.int64)
    for j in range(1, MAX_VARINT_BYTES + 1):
        t = v >= np.uint64(1 << (7 * j))
        if not t.any():
            break
        lens += t
    return lens


def leb128_encode(v: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 of each element of ``v`` (uint64 ``(n,)``, all ``< 2**63``), concatenated.

    Byte ``j`` of a varint holds bits ``7j .. 7j+6`` of the value; the high bit is set on every
    byte but the last.
    """
    v = np.ascontiguousarray(v, dtype=np.uint64)
    big = np.flatnonzero(v >= np.uint64(0x80))
    low = (v & np.uint64(0x7F)).astype(np.uint8)
    if big.size == 0:
        return low  # fast path: every value is one byte
    # Only the multi-byte values (a minority at any useful density) take the slower paths.
    big_lens = varint_lengths(v[big])
    lens = np.ones(v.size, dtype=np.int64)
    lens[big] = big_lens
    starts = np.cumsum(lens)
    starts -= lens
    out = np.empty(int(starts[-1] + lens[-1]), np.uint8)
    low[big] |= np.uint8(0x80)
    out[starts] = low
    sub_starts, sub_v, sub_lens = starts[big], v[big], big_lens
    for j in range(1, int(big_lens.max())):
        keep = sub_lens > j
        sub_starts, sub_v, sub_lens = sub_starts[keep], sub_v[keep], sub_lens[keep]
        byte = ((sub_v >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        byte[sub_lens > j + 1] |= np.uint8(0x80)
        out[sub_starts + j] = byte
    return out


def leb128_decode(buf: np.ndarray, n: int, max_value: int, what: str) -> np.ndarray:
    """Exactly ``n`` unsigned LEB128 varints filling ``buf`` (uint8), each ``<= max_value``.

    Returns:
        uint64 ``(n,)``.

    Raises:
        CorruptObjectError: a different number of varints, a varint cut off at the end, one longer
            than needed for ``max_value`` or overlong (a trailing zero byte), or a value above
            ``max_value``.
    """
    if n == 0:
        if buf.size:
            raise CorruptObjectError(f"{what}: {buf.size} bytes where no varint is expected")
        return np.empty(0, np.uint64)
    if buf.size == n:  # every varint is one byte
        if bool((buf >= 0x80).any()):
            raise CorruptObjectError(f"{what}: varint cut off at the end of the stream")
        vals = buf.astype(np.uint64)
    else:
        ends = np.flatnonzero(buf < 0x80)
        if ends.size != n or int(ends[-1]) != buf.size - 1:
            raise CorruptObjectError(
                f"{what}: expected {n} varints, found {ends.size} complete ones in {buf.size} bytes"
                + ("" if ends.size == 0 or int(ends[-1]) == buf.size - 1 else " and a cut-off one")
            )
        lens = np.diff(ends, prepend=-1)
        limit = min(MAX_VARINT_BYTES, max(1, math.ceil(max(max_value, 1).bit_length() / 7)))
        multi = np.flatnonzero(lens > 1)
        multi_lens = lens[multi]
        if int(multi_lens.max()) > limit:
            raise CorruptObjectError(f"{what}: varint of {int(multi_lens.max())} bytes (at most {limit} allowed)")
        if bool((buf[ends[multi]] == 0).any()):
            raise CorruptObjectError(f"{what}: overlong varint (trailing zero byte)")
        starts = ends - lens + 1
        vals = (buf[starts] & np.uint8(0x7F)).astype(np.uint64)
        sub, sub_starts, sub_lens = multi, starts[multi], multi_lens
        for j in range(1, int(multi_lens.max())):
            keep = sub_lens > j
            sub, sub_starts, sub_lens = sub[keep], sub_starts[keep], sub_lens[keep]
            vals[sub] |= (buf[sub_starts + j] & np.uint8(0x7F)).astype(np.uint64) << np.uint64(7 * j)
    if int(vals.max()) > max_value:
        raise CorruptObjectError(f"{what}: value {int(vals.max())} above the limit {max_value}")
    return vals


# --- other stream layouts ----------------------------------------------------------------------


def pack_codes(codes: np.ndarray, b: int) -> np.ndarray:
    """``b``-bit codes (uint16 ``(n,)``) as bytes: ``8 // b`` codes per byte, least significant bits
    first, the last byte zero-padded (``b`` < 8); one byte each (``b`` = 8); two byte planes, low
    bytes first (``b`` = 16)."""
    if b == 16:
        return to_planes(codes.astype(np.uint16))
    if b == 8:
        return codes.astype(np.uint8)
    per = 8 // b
    c = np.zeros(-(-codes.size // per) * per, np.uint8)
    c[: codes.size] = codes
    c = c.reshape(-1, per)
    out = c[:, 0].copy()
    for j in range(1, per):
        out |= c[:, j] << np.uint8(b * j)
    return out


def unpack_codes(buf: np.ndarray, n: int, b: int, what: str, dtype=np.int64) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``n`` codes as ``dtype`` (``buf`` has the checked length)."""
    if b == 16:
        return from_planes(buf, n, 2).astype(dtype)
    if b == 8:
        return buf.astype(dtype)
    per = 8 // b
    shifts = (np.arange(per, dtype=np.uint8) * b).astype(np.uint8)
    codes = ((buf[:, None] >> shifts) & np.uint8((1 << b) - 1)).reshape(-1)
    if bool(codes[n:].any()):
        raise CorruptObjectError(f"{what}: padding bits after the last code are not zero")
    return codes[:n].astype(dtype)


def to_planes(v: np.ndarray) -> np.ndarray:
    """Little-endian unsigned integers ``(n,)`` of width ``w`` bytes as ``w`` byte planes:
    byte 0 of every value, then byte 1 of every value, ... (zstd codes each plane's statistics)."""
    w = v.dtype.itemsize
    return np.ascontiguousarray(v.astype(v.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, w).T).reshape(-1)


def from_planes(buf: np.ndarray, n: int, w: int) -> np.ndarray:
    """Inverse of :func:`to_planes`: ``n`` unsigned little-endian integers of ``w`` bytes."""
    udt = np.dtype(f"<u{w}")
    return np.ascontiguousarray(buf.reshape(w, n).T).view(udt).reshape(-1).astype(udt.newbyteorder("="))


def pack_bits(v: np.ndarray, r: int) -> np.ndarray:
    """The low ``r`` bits of every element of ``v`` (uint64 ``(n,)``) as a little-endian bit
    stream: field ``i`` at bit offset ``i * r``, least significant bit first, the last byte
    zero-padded. ``ceil(n * r / 8)`` bytes."""
    if r == 0 or v.size == 0:
        return np.empty(0, np.uint8)
    chunk = 1 << 18  # elements per pass (a multiple of 8, so every chunk ends on a byte boundary)
    out = []
    for start in range(0, v.size, chunk):
        part = v[start : start + chunk]
        bitmat = np.empty((part.size, r), np.uint8)  # one byte per bit, r bytes per field
        for j in range(r):
            bitmat[:, j] = (part >> np.uint64(j)) & np.uint64(1)
        out.append(np.packbits(bitmat.reshape(-1), bitorder="little"))
    return np.concatenate(out)


def unpack_bits(buf: np.ndarray, n: int, r: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_bits` (``r <= MAX_GAP_SHIFT``; ``buf`` has the checked length):
    ``n`` fields as uint64. Each field is read from the 8 bytes at its first byte, so the work and
    memory stay ``O(n)`` whatever ``r`` is."""
    if r == 0 or n == 0:
        return np.zeros(n, np.uint64)
    tail = (n * r) % 8
    if tail and int(buf[-1]) >> tail:
        raise CorruptObjectError(f"{what}: padding bits after the last field are not zero")
    padded = np.zeros(buf.size + 8, np.uint8)
    padded[: buf.size] = buf
    bitpos = np.arange(n, dtype=np.uint64) * np.uint64(r)
    first = (bitpos >> np.uint64(3)).astype(np.int64)
    word = np.zeros(n, np.uint64)
    for j in range((r + 7 + 7) // 8):  # bytes touched by an r-bit field at bit offset 0..7
        word |= padded[first + j].astype(np.uint64) << np.uint64(8 * j)
    return (word >> (bitpos & np.uint64(7))) & np.uint64((1 << r) - 1)


def zigzag(s: np.ndarray) -> np.ndarray:
    """Signed -> non-negative: 0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ... (as in protobuf).

    ``s`` must be a signed integer array at least one bit wider than the values it holds."""
    return (s << 1) ^ (s >> (8 * s.dtype.itemsize - 1))


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`."""
    return (z >> 1) ^ -(z & 1)


# --- zstd streams -------------------------------------------------------------------------------

#: The packed codec's level 1: zstd's fast strategy with a 1 KiB hash table and 7-byte matches
#: (:class:`~torch_deltasync.codecs.PackedCodec`), as ``zstandard.ZstdCompressionParameters``
#: keywords (the compiled kernels set the same, :mod:`torch_deltasync._native_zstd`).
LEVEL1_PARAMS = dict(window_log=17, hash_log=10, chain_log=10, search_log=1, min_match=7, target_length=0,
                     strategy=zstandard.STRATEGY_FAST)

tls = threading.local()  # zstd contexts, one per thread (creating one costs ~8 us; not thread-safe)


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor at ``level``."""
    cctx = getattr(tls, "cctx", None)
    if cctx is None or tls.level != level:
        if level == 1:
            cctx = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(**LEVEL1_PARAMS))
        else:
            cctx = zstandard.ZstdCompressor(level=level)
        tls.cctx, tls.level = cctx, level
    return cctx


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    dctx = getattr(tls, "dctx", None)
    if dctx is None:
        dctx = tls.dctx = zstandard.ZstdDecompressor()
    return dctx


def pack_stream(raw: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[int, bytes | np.ndarray, int]:
    """``(method, payload, raw_len)``: zstd when the frame is smaller, else the bytes themselves
    (``raw``, a flat contiguous uint8 array)."""
    n = raw.size
    if n >= MIN_ZSTD_BYTES:
        frame = cctx.compress(raw)
        if len(frame) < n:
            return METHOD_ZSTD, frame, n
    return METHOD_STORED, raw, n


def unpack_stream(method: int, payload: memoryview, raw_len: int, what: str) -> np.ndarray:
    """Decode one stream whose ``raw_len`` the caller has already bounded."""
    if method == METHOD_STORED:
        if len(payload) != raw_len:
            raise CorruptObjectError(f"{what}: stored stream of {len(payload)} bytes, header says {raw_len}")
        return np.frombuffer(payload, dtype=np.uint8)
    if raw_len == 0:
        raise CorruptObjectError(f"{what}: an empty stream must be stored, not compressed")
    try:
        content = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: not a zstd frame ({e})") from None
    if content != raw_len:
        # -1: the frame does not declare its size; anything else disagrees with the header. Either
        # way we refuse before decompressing, so a frame can never expand beyond the checked size.
        raise CorruptObjectError(f"{what}: zstd frame declares {content} bytes, header says {raw_len}")
    try:
        out = decompressor().decompress(payload, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(f"{what}: corrupt zstd frame ({e})") from None
    if len(out) != raw_len:
        raise CorruptObjectError(f"{what}: zstd frame holds {len(out)} bytes, header says {raw_len}")
    return np.frombuffer(out, dtype=np.uint8)

