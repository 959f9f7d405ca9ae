"""The blob header of the ``packed`` codec (``docs/format.md``, "Codec packed"): layout version,
position and value modes, gap shift, code width, base checksum, and the six streams' methods and
lengths. Read from untrusted bytes: every field is range-checked before use."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CorruptObjectError
from ._bits import MAX_VARINT_BYTES, METHOD_STORED, METHOD_ZSTD

#: Version byte of a packed tensor blob (byte 0). Decoders refuse any other value.
LAYOUT_VERSION = 1
#: Code widths (bits per changed element) a steps stream may use.
CODE_BITS = (2, 4, 8, 16)

POS_GAPS, POS_BITMAP = 0, 1
VAL_RAW, VAL_STEPS = 0, 1
STREAMS = ("positions", "pos_ext", "pos_low", "codes", "ext", "raw")
#: The stream of the gaps' low bits, which the reference encoder stores without trying zstd.
POS_LOW = STREAMS.index("pos_low")
#: Largest gap shift ``r``: an ``r``-bit field plus its bit offset within a byte fits 64 bits.
MAX_GAP_SHIFT = 56


@dataclass(frozen=True)
class Header:
    pos_mode: int
    gap_shift: int
    val_mode: int
    code_bits: int
    base_checksum: int
    streams: tuple[tuple[int, int, int, int], ...]  # (method, raw_len, offset, stored_len) x 6


# version, positions mode, gap shift, values mode, code width (1 byte each), base checksum (u64 LE)
HEADER_FIXED = 13


SMALL_VARINTS = [bytes([v]) for v in range(128)]


def varint_bytes(v: int) -> bytes:
    """Unsigned LEB128 of one non-negative integer."""
    if v < 128:
        return SMALL_VARINTS[v]
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def write_header(pos_mode: int, gap_shift: int, val_mode: int, code_bits: int, base_checksum: int,
                  streams: list[tuple[int, bytes, int]]) -> bytes:
    parts = [bytes((LAYOUT_VERSION, pos_mode, gap_shift, val_mode, code_bits)), base_checksum.to_bytes(8, "little")]
    for method, payload, raw_len in streams:
        parts.append(SMALL_VARINTS[method])
        parts.append(varint_bytes(raw_len))
        if method != METHOD_STORED:
            parts.append(varint_bytes(len(payload)))
    return b"".join(parts)


def read_header(data: memoryview, what: str) -> Header:
    if len(data) < HEADER_FIXED:
        raise CorruptObjectError(f"{what}: {len(data)} bytes is too short for a packed header")
    version, pos_mode, gap_shift, val_mode, code_bits = (data[i] for i in range(5))
    base_checksum = int.from_bytes(data[5:13], "little")
    if version != LAYOUT_VERSION:
        raise CorruptObjectError(f"{what}: packed layout version {version}, this reader knows {LAYOUT_VERSION}")
    if pos_mode not in (POS_GAPS, POS_BITMAP):
        raise CorruptObjectError(f"{what}: unknown positions mode {pos_mode}")
    if gap_shift > (MAX_GAP_SHIFT if pos_mode == POS_GAPS else 0):
        raise CorruptObjectError(f"{what}: gap shift {gap_shift} (at most {MAX_GAP_SHIFT}, 0 with a bitmap)")
    if val_mode == VAL_RAW and code_bits != 0:
        raise CorruptObjectError(f"{what}: raw values with code width {code_bits} (must be 0)")
    if val_mode == VAL_STEPS and code_bits not in CODE_BITS:
        raise CorruptObjectError(f"{what}: code width {code_bits}, expected one of {CODE_BITS}")
    if val_mode not in (VAL_RAW, VAL_STEPS):
        raise CorruptObjectError(f"{what}: unknown values mode {val_mode}")
    at = HEADER_FIXED

    def varint() -> int:
        nonlocal at
        v = 0
        for j in range(MAX_VARINT_BYTES):
            if at >= len(data):
                raise CorruptObjectError(f"{what}: header cut off")
            byte = data[at]
            at += 1
            v |= (byte & 0x7F) << (7 * j)
            if byte < 0x80:
                if j and byte == 0:
                    raise CorruptObjectError(f"{what}: overlong varint in the header")
                return v
        raise CorruptObjectError(f"{what}: header varint longer than {MAX_VARINT_BYTES} bytes")

    entries = []
    for name in STREAMS:
        if at >= len(data):
            raise CorruptObjectError(f"{what}: header cut off")
        method = data[at]
        at += 1
        if method not in (METHOD_STORED, METHOD_ZSTD):
            raise CorruptObjectError(f"{what}: {name} stream has unknown method {method}")
        raw_len = varint()
        stored_len = raw_len if method == METHOD_STORED else varint()
        entries.append([method, raw_len, 0, stored_len])
    for e in entries:
        e[2] = at
        at += e[3]
    if at != len(data):
        raise CorruptObjectError(f"{what}: streams add up to {at} bytes, the blob has {len(data)}")
    return Header(pos_mode, gap_shift, val_mode, code_bits, base_checksum, tuple(tuple(e) for e in entries))
