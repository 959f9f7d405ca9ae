"""The ``packed`` codec: one tensor's change set in about one byte per changed element.

At RL learning rates a changed bf16 element almost always moves by one or two ULPs, and changed
elements are spread like a Bernoulli process, so (``docs/research/baselines.md`` §3):

* **positions** are coded as gaps ``g = pos[i] - pos[i-1] - 1``, split Golomb-Rice style at a
  per-tensor shift ``r``: the high part ``g >> r`` as one byte (255 escapes to an unsigned LEB128
  varint, the integer coding of Protocol Buffers,
  https://protobuf.dev/programming-guides/encoding/#varints) and the low ``r`` bits bit-packed. ``r``
  is chosen so that high parts average a few dozen, where zstd's byte-wise Huffman coding gets
  within a few percent of the entropy of Bernoulli positions, about ``log2(e/p)`` bits at density
  ``p``;
* **values** are coded as integer *steps* on the bit pattern, ``new_bits - old_bits`` wrapped to the
  dtype's width (two's complement), zigzag-mapped to unsigned, packed as ``b``-bit codes (``b`` in
  2, 4, 8, 16, chosen per tensor) with an escape to a varint stream for larger steps and to the raw
  new value for the largest ones (sign flips, NaN payloads). Steps are integers, so the receiver
  rebuilds the new value from the old one it holds exactly (:meth:`TensorDelta.resolve`);
* every stream is then compressed with zstd (the ``zstandard`` package) when that makes it smaller.

Each blob also carries the checksum of the old values it was computed against (format section 6),
which :meth:`TensorDelta.resolve` checks before applying steps: relative steps on a drifted base
would otherwise keep the drift, unseen by the additive per-tensor checksums.

Per tensor the encoder falls back to the dense forms when they are smaller: positions as a bitmap
of the whole tensor and values as raw bit patterns, so a tensor at 100% density costs a dense copy
plus a few bytes. ``docs/format.md`` ("Codec packed") is the byte-level specification; this module
is its reference implementation.

Decoding treats its input as untrusted: every declared length is checked against the element
count and the tensor size from the manifest *before* anything is decompressed (no decompression
bombs), zstd frames must declare their exact content size and hold nothing else, every varint,
code, escape and position is range-checked, and any violation raises
:class:`~torch_deltasync.errors.CorruptObjectError`.

Speed: the numpy code here (vectorised, no Python loop per element) is the executable
specification. When numba is available (:mod:`~torch_deltasync._native`), encoding and decoding
run as a few compiled one-pass loops per tensor instead, which write and accept exactly the same
bytes (``tests/unit/test_native.py``); a kernel that finds a blob invalid hands it back to the numpy
decoder, which raises the specific error. The size estimates behind the encoder's choices are
compiled (when numba is there) and shared by both paths. The kernels call libzstd themselves
(:mod:`~torch_deltasync._native_zstd`: the same frames as ``zstandard``), so a tensor is usually
encoded in one kernel call and decoded in one, each one release of the GIL:
:meth:`~torch_deltasync.codecs.Codec.encode_many` / ``decode_many`` run tensors on several threads.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from .. import _native, _native_zstd
from . import _packed_decode as _decode_kernels
from . import _packed_kernels as _kernels
from .._dtypes import int_view_dtype
from ..checksum import checksum
from ..errors import CorruptObjectError
from ._base import _UNSIGNED, Codec, TensorDelta, check_encoder_positions, check_parts, register_codec
from ._packed_decode import zero as _zero
from ._packed_estimates import (
    STEP_CAP, SAMPLE_EVERY, SAMPLE_FROM, best_gap_shift, best_step_code, binary_entropy, gap_shift_window, huffman_bits,
    wide_steps,
)
from ._packed_header import (
    CODE_BITS, MAX_GAP_SHIFT, POS_BITMAP, POS_GAPS, POS_LOW, STREAMS, VAL_RAW, VAL_STEPS, read_header, write_header,
)
from ._bits import METHOD_STORED, compressor, pack_stream, to_planes, unpack_stream, zigzag
# (called through this module's names: tests record the reference readers' calls by patching them here)
from ._packed_streams import (
    _bitmap_positions, _code16_histograms_native, _from_planes_any, _gap_positions, _gap_positions_native,
    _gap_streams, _step_streams, _steps, _steps_native,
)


#: The least an estimate of raw values can be, in bits per byte: Huffman's floor of one bit, the
#: smallest ``p_max`` (1/256) and Gallager's constant (:meth:`PackedCodec._choose_code_bits`).
_RAW_FLOOR_BITS = 1 + 1 / 256 + 0.086


def _flat_cpu(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a flat contiguous CPU tensor (of ``dtype`` if given), without copies when it is one."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu or (dtype is not None and t.dtype != dtype):
        t = t.to("cpu", dtype or t.dtype)
    if t.dim() != 1:
        t = t.reshape(-1)
    return t if t.is_contiguous() else t.contiguous()


def _streams_of(blob: np.ndarray) -> list[tuple[int, np.ndarray, int]]:
    """The streams of a blob the kernels wrote, as ``pack_stream``'s ``(method, payload, raw_len)``."""
    h = read_header(memoryview(blob), "packed codec")
    return [(method, blob[off : off + stored_len], raw_len) for method, raw_len, off, stored_len in h.streams]


def _pack_streams(raw: list[np.ndarray], cctx) -> list[tuple[int, bytes | np.ndarray, int]]:
    """The six streams as :func:`~._bits.pack_stream` gives them, zstd where its frame is shorter,
    except the gaps' low bits (``POS_LOW``), which are stored: below the gap shift a gap's bits are
    close to uniform, zstd shortened none of the 65 such streams of ``tools/bench_codec.py``'s
    change sets, and trying cost 0.1 ns per change at 1% density (``docs/benchmarks.md``, issue
    14, "Rice codes and nibble pairs")."""
    return [pack_stream(x, cctx) if i != POS_LOW else (METHOD_STORED, x, x.size) for i, x in enumerate(raw)]


def _bit_pattern(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a contiguous 1-D CPU tensor as unsigned integers of its width (a view)."""
    return t.view(int_view_dtype(t.dtype)).numpy().view(_UNSIGNED[t.element_size()])



# --- the codec ----------------------------------------------------------------------------------


@register_codec
class PackedCodec(Codec):
    """Gap-coded positions, step-coded values, zstd; dense fallbacks per tensor.

    Stored in a delta object as one part per changed tensor, ``<name>:packed``, a 1-D uint8
    tensor holding the blob specified in ``docs/format.md`` ("Codec packed"). About 1 byte per
    changed bf16 element at RL learning rates (``tools/bench_codec.py``), against 6 for ``raw``.

    Args:
        level: zstd compression level for encoding (any level decodes with the same reader). The
            streams are near-random bytes whose gain comes from zstd's Huffman stage, not from
            matches, so the fastest level 1 is also the smallest here (0.3-0.5% below level 3 on
            the change sets of ``tools/bench_codec.py``). Level 1 runs zstd's fast strategy with
            a 1 KiB hash table and 7-byte minimum matches, which on these streams is twice as fast
            as zstd's own level 1 and no larger.

    Supported inference dtypes: any of width 1, 2 or 4 bytes (fp8, bf16, fp16, fp32) code steps;
    8-byte dtypes (fp64) are always shipped as raw values.

    Example:
        >>> codec = get_codec("packed")
        >>> parts = codec.encode(pos, new, old, numel=w.numel())  # {"packed": uint8 tensor}
        >>> d = codec.decode(parts, numel=w.numel(), count=pos.numel(), dtype=torch.bfloat16)
        >>> torch.equal(bits(d.resolve(old)), bits(new))
        True
    """

    name = "packed"
    # A gap shift / code width to use instead of the estimates' choice (None: choose). Tests set
    # them to drive every decoder path; any value the format allows decodes.
    _force_gap_shift: int | None = None
    _force_code_bits: int | None = None

    def __init__(self, level: int = 1) -> None:
        self.level = level

    # --- encode ---------------------------------------------------------------------------------

    def encode(self, positions, values, old_values, *, numel):
        """Encode one tensor's changes (see :meth:`Codec.encode`).

        Args:
            positions: int64 ``(k,)``, strictly increasing, in ``[0, numel)`` (global flat).
            values: ``(k,)`` new values in the inference dtype (any device).
            old_values: ``(k,)`` the values at the base version, same dtype.
            numel: elements of the full tensor.

        Returns:
            ``{"packed": uint8 (nbytes,)}`` on the CPU. The compiled kernels
            (:mod:`~torch_deltasync._native`) and this numpy code write the same bytes.

        Raises:
            TypeError: positions not a 1-D integer tensor.
            ValueError: positions not strictly increasing or outside ``[0, numel)``, or values and
                old values of different shape or dtype.
        """
        check_encoder_positions(positions, "packed codec")
        pos = _flat_cpu(positions, torch.int64).numpy()
        new, old = _flat_cpu(values), _flat_cpu(old_values)
        k = pos.size
        if new.numel() != k or old.numel() != k or new.dtype != old.dtype:
            raise ValueError(
                f"positions ({k}), values ({new.numel()} {new.dtype}) and old values "
                f"({old.numel()} {old.dtype}) must have the same length and dtype"
            )
        native = _native.enabled()
        width = new.element_size()
        cctx = compressor(self.level)
        new_u, old_u = _bit_pattern(new), _bit_pattern(old)
        if native:
            blob, streams, r, b, base = self._encode_native(pos, new_u, old_u, width, numel, cctx)
            if blob is not None:
                return {"packed": torch.from_numpy(blob)}
        else:
            r, b, base, raw_streams = self._encode_reference(pos, new_u, old_u, old, width, numel,
                                                             self._force_gap_shift, self._force_code_bits)
            streams = _pack_streams(raw_streams, cctx)

        # The dense fallback for positions: a bitmap, when the gaps are not clearly smaller.
        gap_nbytes = sum(len(x[1]) for x in streams[:3])
        pos_mode = POS_GAPS
        if self._bitmap_may_pay(k, numel, gap_nbytes):
            bitmap_nbytes = -(-numel // 8)
            if native:
                bm = np.zeros(bitmap_nbytes, np.uint8)
                if _kernels.bitmap_from_positions(pos, bm):  # cannot happen: the plan checked them
                    raise ValueError(f"positions must be strictly increasing and inside [0, {numel})")
            else:
                mask = np.zeros(bitmap_nbytes * 8, np.uint8)
                mask[pos] = 1
                bm = np.packbits(mask, bitorder="little")
            bm = pack_stream(bm, cctx)
            if len(bm[1]) < gap_nbytes:
                empty = (METHOD_STORED, b"", 0)
                pos_mode, r, streams[:3] = POS_BITMAP, 0, [bm, empty, empty]
        return {"packed": self._blob(pos_mode, r, VAL_STEPS if b else VAL_RAW, b, base, streams)}

    def _encode_native(self, pos: np.ndarray, new_u: np.ndarray, old_u: np.ndarray, width: int, numel: int, cctx):
        """The compiled path of :meth:`encode`: ``(blob, None, r, b, base)`` when the kernels wrote
        the final blob, else ``(None, streams, r, b, base)``, the streams as ``pack_stream``
        gives them, when the bitmap of positions may be smaller or zstd runs in Python (where the
        kernels cannot reach libzstd).

        One kernel call (:func:`._packed_kernels.encode_tensor`) makes the histograms, the gap
        shift and the best small code width, the escape bounds and the base checksum (what the
        receiver's old values must add up to before it applies relative steps) and, where the
        kernels reach libzstd and the code width needs no second look, the streams, their zstd
        frames and the blob."""
        k = pos.size
        force_r, force_b = self._force_gap_shift, self._force_code_bits
        ctx = _native_zstd.compression_context(self.level) if _native_zstd.AVAILABLE else 0
        status, r, b, best, try16, n_costed, n_gap_esc, n_val_esc, base, blob, gap_nbytes = _kernels.encode_tensor(
            pos, new_u, old_u, width, numel, MAX_GAP_SHIFT, -1 if force_r is None else force_r,
            -1 if force_b is None else force_b, _RAW_FLOOR_BITS, ctx)
        if status == _kernels.INVALID:
            raise ValueError(f"positions must be strictly increasing and inside [0, {numel})")
        if status == _kernels.REFINE:
            refined = self._refine_code_bits(
                int(n_costed), width, int(b), float(best), bool(try16),
                lambda: _kernels.byte_histograms(new_u, width),
                lambda: _code16_histograms_native(new_u, old_u, width), k)
            if refined != b:
                b, n_val_esc = refined, k  # no exact bound for 16-bit codes or raw values
        planned = status in (_kernels.REFINE, _kernels.PLANNED)  # the streams are still to be made
        if planned and not ctx:  # zstd from Python
            raw = _kernels.encode_streams(pos, new_u, old_u, width, r, n_gap_esc, b, n_val_esc)
            if raw is not None:
                return None, _pack_streams(raw, cctx), r, b, int(base)
            out = None
        elif planned:  # the blob in a second call
            out = _kernels.encode_compressed(pos, new_u, old_u, width, r, n_gap_esc, b, n_val_esc,
                                             np.uint64(base), ctx)  # (numba returns uint64 as int)
        else:
            out = (blob, gap_nbytes) if status == _kernels.ENCODED else None
        if out is None:  # cannot happen: the bounds above are exact or upper bounds
            raise RuntimeError("packed codec: an escape buffer was too small (a bug in torch_deltasync)")
        blob, gap_nbytes = out
        if self._bitmap_may_pay(k, numel, int(gap_nbytes)):
            return None, _streams_of(blob), r, b, int(base)
        return blob, None, r, b, int(base)

    def _encode_reference(self, pos: np.ndarray, new_u: np.ndarray, old_u: np.ndarray, old: torch.Tensor,
                          width: int, numel: int, force_r: int | None, force_b: int | None):
        """The numpy specification of the encoder's choices and streams (what
        :func:`._packed_kernels.encode_plan` and ``encode_streams`` compute in one pass each):
        ``(r, b, base checksum, the six uncompressed streams)``."""
        k = pos.size
        r_lo, r_hi = gap_shift_window(k, int(pos[-1]) if k else 0, MAX_GAP_SHIFT)
        span = 255 << (r_hi - r_lo)
        gaps = np.diff(pos, prepend=-1) - 1
        if k and (int(gaps.min()) < 0 or int(pos.min()) < 0 or int(pos[-1]) >= numel):
            raise ValueError(f"positions must be strictly increasing and inside [0, {numel})")
        gaps = gaps.view(np.uint64)  # all >= 0 (checked above)
        every = SAMPLE_EVERY if k >= SAMPLE_FROM else 1  # blocks of gaps and steps costed
        sampled = None if every == 1 else (np.arange(k) // _native.BLOCK) % every == 0
        g = gaps if sampled is None else gaps[sampled]
        hist = np.bincount(np.minimum(g >> np.uint64(r_lo), span).astype(np.int64), minlength=span + 1)
        r = self._choose_gap_shift(g.size, r_lo, r_hi, hist) if force_r is None else force_r
        b, z = 0, None
        if width <= 4:
            z = self._zigzag_steps(new_u, old_u, width)
            if every > 1 and wide_steps(int((z[: _native.BLOCK] >= 256).sum()), min(k, _native.BLOCK)):
                every = 1
            if force_b is not None:
                b = force_b
            else:
                sample = z.reshape(-1) if every == 1 else z[sampled]
                hz = np.bincount(np.minimum(sample, STEP_CAP), minlength=STEP_CAP + 1)

                def byte_histograms() -> np.ndarray:
                    return np.stack([np.bincount((new_u >> (8 * j)) & 0xFF, minlength=256) for j in range(width)])

                def code16_histograms() -> tuple[np.ndarray, int]:
                    c16 = np.where(z == 0, 0xFFFF, np.minimum(z - 1, 0xFFFF))
                    h16 = np.stack([np.bincount(c16 & 0xFF, minlength=256), np.bincount(c16 >> 8, minlength=256)])
                    return h16, int((c16 == 0xFFFF).sum())

                b = self._choose_code_bits(sample.size, width, hz, byte_histograms, code16_histograms, k)
        base = checksum(old, torch.from_numpy(pos)) if k else 0
        raw_streams = _gap_streams(gaps, r) + (_step_streams(new_u, width, b, z) if b else
                                               [np.empty(0, np.uint8)] * 2 + [to_planes(new_u)])
        return r, b, base, raw_streams

    @staticmethod
    def _bitmap_may_pay(k: int, numel: int, gap_nbytes: int) -> bool:
        """Whether a bitmap of the positions is worth compressing to compare: the gap streams
        (``gap_nbytes`` stored) are over a quarter of the raw bitmap and over 1.05x the entropy of
        ``k`` Bernoulli positions among ``numel``."""
        return bool(k) and gap_nbytes * 4 > -(-numel // 8) and gap_nbytes * 8 > 1.05 * numel * binary_entropy(k / numel)

    @staticmethod
    def _blob(pos_mode: int, r: int, val_mode: int, b: int, base: int,
              streams: list[tuple[int, bytes, int]]) -> torch.Tensor:
        blob = bytearray(b"".join([write_header(pos_mode, r, val_mode, b, base, streams)] + [s[1] for s in streams]))
        return torch.frombuffer(blob, dtype=torch.uint8)

    @staticmethod
    def _choose_gap_shift(k: int, r_lo: int, r_hi: int, base: np.ndarray) -> int:
        """Shift ``r`` for the split gap coding, by estimated size: the high parts ``g >> r`` as
        Huffman-coded bytes (255 escapes to a varint, costed 16 bits), the low ``r`` bits as raw
        bits. The best ``r`` leaves high parts with a mean of a few dozen, where byte-wise Huffman
        coding is within a few percent of the entropy of geometric gaps.

        Args:
            k: number of gaps the histogram counts (all of them, or a sample: ``SAMPLE_EVERY``).
            r_lo, r_hi: the candidate shifts (:func:`gap_shift_window`).
            base: the histogram of ``min(g >> r_lo, 255 << (r_hi - r_lo))``, int64: it serves every
                candidate, since the high part at shift ``r_lo + d`` is the ``r_lo`` one divided
                by ``2**d``, so its bins are sums of ``2**d`` adjacent bins.
        """
        return 0 if k == 0 else int(best_gap_shift(k, r_lo, r_hi, base))

    @staticmethod
    def _zigzag_steps(new_u: np.ndarray, old_u: np.ndarray, width: int) -> np.ndarray:
        """Zigzag of ``new - old`` wrapped to ``width`` bytes, in ``[0, 2**(8*width))`` (0: no
        change). int32 for widths up to 2 bytes (half the memory traffic), else int64."""
        work = np.int32 if width <= 2 else np.int64
        s = (new_u - old_u).view(f"i{width}").astype(work)  # unsigned subtraction wraps mod 2**(8w)
        return zigzag(s)

    @staticmethod
    def _choose_code_bits(k: int, width: int, hz: np.ndarray, byte_histograms, code16_histograms,
                          k_all: int | None = None) -> int:
        """Code width for the steps stream, or 0 for raw values, by estimated compressed size.

        Each byte stream is costed as zstd's Huffman literals would code it: its order-0 entropy,
        at least one bit per byte, plus Gallager's bound on Huffman redundancy, ``p_max + 0.086``
        bits per byte (R. G. Gallager, "Variations on a theme by Huffman", IEEE Trans. IT 24(6),
        1978). Packing four 2-bit codes per byte lowers ``p_max`` from ~0.44 to ~0.04, which is why
        small codes win at RL learning rates. Raw values win ties. Their estimate is at least
        ``1 + 1/256 + 0.086`` bits per byte (the floor, the smallest ``p_max`` and Gallager's
        constant), so their histograms are only computed when the best step coding costs more.

        Args:
            k: number of changes.
            width: bytes per element (1, 2 or 4).
            hz: histogram of ``min(z, cap)`` over the zigzag steps ``z``, int64 ``(cap + 1,)``.
            byte_histograms: returns the histograms of the bytes of the new bit patterns, int64
                ``(width, 256)``.
            code16_histograms: returns the histograms of the low and high bytes of 16-bit codes,
                ``(2, 256)``, and the number of escapes (code ``2**16 - 1``); called only when
                16-bit codes could win.
            k_all: the changes the other two histograms count, when ``hz`` counts a sample of
                ``k`` of them (``SAMPLE_EVERY``); ``None``: ``k``.
        """
        if k == 0:
            return CODE_BITS[0]
        best_b, best, try16 = best_step_code(k, width, hz)
        return PackedCodec._refine_code_bits(k, width, best_b, best, try16, byte_histograms, code16_histograms, k_all)

    @staticmethod
    def _refine_code_bits(k: int, width: int, best_b: int, best: float, try16: bool,
                          byte_histograms, code16_histograms, k_all: int | None = None) -> int:
        """The second half of :meth:`_choose_code_bits`, from the best of the 2-, 4- and 8-bit
        codes (``best_step_code``): cost 16-bit codes when ``try16``, raw values when the best
        estimate is above their floor. The 16-bit and raw estimates count all ``k_all`` changes,
        so an estimate from a sample of ``k`` is scaled to them first."""
        if k_all is not None and k_all != k:
            best, k = best * k_all / k, k_all
        if try16:  # else almost every step fits 8 bits
            h16, n_esc16 = code16_histograms()
            est = huffman_bits(h16[0], 1, False) + huffman_bits(h16[1], 1, False) + n_esc16 * 8 * width
            if est < best:
                best_b, best = 16, est
        if best >= k * width * _RAW_FLOOR_BITS:
            hb = byte_histograms()
            if sum(huffman_bits(hb[j], 1, False) for j in range(width)) <= best:
                best_b = 0
        return int(best_b)

    # --- decode ---------------------------------------------------------------------------------

    def decode(self, parts: Mapping[str, torch.Tensor], *, numel: int, count: int, dtype: torch.dtype) -> TensorDelta:
        """Decode and validate one tensor's blob (see :meth:`Codec.decode` and ``docs/format.md``).

        The compiled kernels (:mod:`~torch_deltasync._native`) validate what this numpy code
        validates; when a kernel finds the blob invalid, the numpy code decodes it again and
        raises the specific error.

        Returns:
            A :class:`TensorDelta` with CPU tensors: int64 positions; for step-coded entries
            ``steps`` (signed, the dtype's width) and ``relative`` marks them; raw entries carry their
            new value in ``values``. With raw values only, ``steps`` is ``None``. ``base_checksum``
            is the blob's checksum of the old values, which ``resolve`` verifies.

        Raises:
            TypeError: ``count`` or ``numel`` is not an integer.
            CorruptObjectError: wrong part name, dtype or shape; unknown layout version or mode;
                a declared length that the count and tensor size do not allow; a zstd frame
                without or with a different content size, trailing data or corrupt content;
                malformed varints; padding bits set; positions out of range or not increasing; a
                count that does not match; a step beyond the dtype's width.
        """
        what = "packed codec"
        check_parts(parts, {"packed"}, what)
        t = parts["packed"]
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise CorruptObjectError(f"{what}: part must be 1-D uint8, got {t.dtype} {tuple(t.shape)}")
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (count, numel)):
            raise TypeError(f"{what}: count and numel must be integers, got {count!r} and {numel!r}")
        count, numel = int(count), int(numel)
        if not 0 <= count <= numel < 2**63:
            raise CorruptObjectError(f"{what}: count {count} outside [0, {numel}] or tensor of {numel} >= 2**63 elements")
        width = dtype.itemsize
        blob = t.contiguous().numpy()
        native = _native.enabled()
        if native:
            d = _decode_kernels.decode_blob(blob, numel, count, width, dtype, what)
            if d is not None:
                return d
        blob.flags.writeable = False  # (this view only) streams from zstd are read-only too: one kernel type
        # The numpy reference: also what raises the specific error for a blob the kernels refuse.
        data = memoryview(blob)
        h = read_header(data, what)

        def stream(i: int, lo: int, hi: int) -> np.ndarray:
            method, raw_len, off, stored_len = h.streams[i]
            if not lo <= raw_len <= hi:
                raise CorruptObjectError(
                    f"{what}: {STREAMS[i]} stream declares {raw_len} bytes; {count} changes of a "
                    f"{numel}-element tensor allow {lo}..{hi}"
                )
            if method == METHOD_STORED and stored_len == raw_len:  # the common case, checked
                return np.frombuffer(data, np.uint8, raw_len, off)
            return unpack_stream(method, data[off : off + stored_len], raw_len, f"{what}: {STREAMS[i]} stream")

        if h.pos_mode == POS_GAPS:
            pos = _gap_positions_native(stream, h.gap_shift, numel, count, what) if native else None
            if pos is None:
                pos = _gap_positions(stream, h.gap_shift, numel, count, what)
        else:
            nbytes = -(-numel // 8)
            bm = stream(0, nbytes, nbytes)
            stream(1, 0, 0)
            stream(2, 0, 0)
            pos = None
            if native:
                pos = np.empty(count, np.int64)
                if _decode_kernels.bitmap_positions(bm, numel, count, pos) != _native.OK:
                    pos = None
            if pos is None:
                pos = _bitmap_positions(bm, numel, count, what)
        positions = torch.from_numpy(pos)

        if h.val_mode == VAL_RAW:
            for i in (3, 4):
                stream(i, 0, 0)
            new_u = _from_planes_any(stream(5, count * width, count * width), count, width, native)
            return TensorDelta(positions, torch.from_numpy(new_u.view(f"i{width}")).view(dtype), base_checksum=h.base_checksum)
        if width > 4:
            raise CorruptObjectError(f"{what}: step-coded values for a {width}-byte dtype")
        b = h.code_bits
        if b > 8 * width:
            raise CorruptObjectError(f"{what}: code width {b} exceeds the {8 * width}-bit dtype")
        out = _steps_native(stream, count, b, width, what) if native else None
        if out is None:
            out = _steps(stream, count, b, width, what)
        steps, values_u, relative = out
        if values_u is None:  # every entry relative: the values are placeholders (one zero, expanded)
            values = _zero(dtype).expand(count)
        else:
            values = torch.from_numpy(values_u.view(f"i{width}")).view(dtype)
        rel = None if relative is None else torch.from_numpy(relative)
        return TensorDelta(positions, values, torch.from_numpy(steps), rel, h.base_checksum)
