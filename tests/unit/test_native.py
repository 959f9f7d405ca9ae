"""The compiled kernels (torch_deltasync/_native.py) against the numpy/torch specification.

Every fast path is run twice on the same input, once with the kernels (``_native.set_enabled(True)``)
and once without (the numpy/torch code that is the executable specification), and the results are
compared bit for bit: the same blob bytes from the encoder, the same positions, steps, values and
relative marks (or the same error message) from the decoder, the same checksums, the same detected
changes. Inputs are random (hypothesis), adversarial (special values, extreme positions, forced
code widths and gap shifts) and corrupted (every mutation of the decoder fuzz tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codecs_packed import DTYPES, GOOD, _blob, make_change_set

from torch_deltasync import _native, get_codec
from torch_deltasync.detect import ChangeDetector
from torch_deltasync.errors import ChecksumMismatchError, CorruptObjectError
from torch_deltasync.codecs import _bits, _packed as packed_mod, _packed_decode
from torch_deltasync._dtypes import bits
from torch_deltasync.checksum import checksum, checksum_change, tensor_checksum
from torch_deltasync.codecs import PackedCodec


def both(fn):
    """``(fn() with the kernels, fn() with the numpy/torch specification)``; an exception is
    returned as ``(type, message)``."""

    def run(on: bool):
        prev = _native.set_enabled(on)
        try:
            return fn()
        except (CorruptObjectError, ChecksumMismatchError, ValueError) as e:
            return type(e), str(e)
        finally:
            _native.set_enabled(prev)

    return run(True), run(False)


def same_delta(a, b) -> bool:
    """Two decode results are identical: the same error, or the same tensors bit for bit."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return a == b
    if not torch.equal(a.positions, b.positions) or a.base_checksum != b.base_checksum:
        return False
    if (a.steps is None) != (b.steps is None) or (a.relative is None) != (b.relative is None):
        return False
    if a.steps is not None and not torch.equal(a.steps, b.steps):
        return False
    if a.relative is not None and not torch.equal(a.relative, b.relative):
        return False
    if a.relative is None and a.steps is not None:
        return True  # every entry relative: the values are placeholders
    return torch.equal(bits(a.values.contiguous()), bits(b.values.contiguous()))


def encode_both(pos, new, old, numel):
    codec = get_codec("packed")
    return both(lambda: codec.encode(pos, new, old, numel=numel))


def check_encode_decode(pos, new, old, numel):
    fast, ref = encode_both(pos, new, old, numel)
    assert not isinstance(fast, tuple), fast
    assert torch.equal(fast["packed"], ref["packed"]), "the kernels wrote other bytes than the specification"
    codec = get_codec("packed")
    d_fast, d_ref = both(lambda: codec.decode(fast, numel=numel, count=pos.numel(), dtype=new.dtype))
    assert same_delta(d_fast, d_ref)
    assert torch.equal(d_fast.positions, pos)
    r_fast, r_ref = both(lambda: d_fast.resolve(old))
    assert torch.equal(bits(r_fast), bits(r_ref)) and torch.equal(bits(r_fast), bits(new))
    return fast


# --- encoder and decoder: valid input --------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(list(DTYPES.values())),
    numel=st.one_of(st.integers(0, 64), st.integers(65, 30_000)),
    density=st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.01, 0.001]), st.floats(0.0, 1.0)),
    mix=st.fixed_dictionaries({k: st.floats(0.0, 1.0) for k in ("ulp", "mid", "wide", "many", "flip", "special",
                                                                 "random", "same")}),
)
def test_encode_decode_match_the_specification(seed, dtype, numel, density, mix):
    mix["ulp"] += 1e-3
    pos, new, old = make_change_set(seed, dtype, numel, density, mix)
    check_encode_decode(pos, new, old, numel)


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("b", [0, 2, 4, 8, 16])
@pytest.mark.parametrize("r", [0, 1, 2, 3, 4, 8, 9, 21])
def test_every_code_width_and_gap_shift(monkeypatch, dtype, b, r):
    # r = 1, 2, 4 and 8 take the encoder kernel's byte-gathering path for low bits, 3 and 9 its
    # general one (8 and 9 straddle the decoder's whole-byte path); forcing r outside the
    # estimator's window exercises the kernels' worst-case escape buffers.
    monkeypatch.setattr(PackedCodec, "_force_code_bits", b)
    monkeypatch.setattr(PackedCodec, "_force_gap_shift", r)
    mix = {"ulp": 0.6, "mid": 0.2, "wide": 0.1, "many": 0.05, "flip": 0.02, "special": 0.02, "same": 0.01}
    numel = 3_000_000
    pos, new, old = make_change_set(b * 100 + r, dtype, numel, 0.003, mix)
    blob = check_encode_decode(pos, new, old, numel)["packed"]
    assert (blob[2].item(), blob[4].item()) == (r, b)


@pytest.mark.parametrize("dtype", [torch.float64] + [d for d in (getattr(torch, "float8_e4m3fn", None),) if d])
def test_other_widths(dtype):
    rng = np.random.default_rng(3)
    numel = 9000
    pos = torch.from_numpy(np.sort(rng.choice(numel, 4000, replace=False)))
    old = torch.randn(4000, dtype=torch.float64).to(dtype)
    new = (bits(old) + torch.from_numpy(rng.integers(-3, 4, size=4000)).to(bits(old).dtype)).view(dtype)
    check_encode_decode(pos, new, old, numel)


def test_extreme_positions_and_blocks():
    # Gaps that need escapes and 56-bit shifts, and more changes than one kernel block (4096).
    numel = 2**62
    pos = torch.tensor([0, 1, 2**40, 2**61 + 7, numel - 2, numel - 1], dtype=torch.int64)
    old = torch.full((6,), 0.5, dtype=torch.bfloat16)
    new = (bits(old) + torch.tensor([1, 1, -1, 2, -3, 100], dtype=torch.int16)).view(torch.bfloat16)
    check_encode_decode(pos, new, old, numel)
    for k in (4095, 4096, 4097, 3 * 4096 + 5):
        pos, new, old = make_change_set(k, torch.bfloat16, 2 * k, 0.5, {"ulp": 0.9, "many": 0.1})
        check_encode_decode(pos, new, old, 2 * k)
    pos = torch.arange(10_000)  # every element: dense bitmap and the kernels' bitmap path
    old = torch.randn(10_000).to(torch.bfloat16)
    new = torch.randn(10_000).to(torch.bfloat16)
    check_encode_decode(pos, new, old, 10_000)


@pytest.mark.parametrize("b", [2, 4, 8, 16])
def test_escapes_on_the_edges_of_the_kernels_bit_groups(monkeypatch, b):
    # The kernels find escapes (a gap's high part 255, a step's escape code) by walking one bit per
    # entry in groups of 64, in blocks of 4096: every kind of escape sits on the first and last
    # entries of groups and blocks here, among ordinary entries.
    monkeypatch.setattr(PackedCodec, "_force_code_bits", b)
    monkeypatch.setattr(PackedCodec, "_force_gap_shift", 0)
    k = 3 * 4096 + 70
    edges = np.array(sorted({0, 1, 62, 63, 64, 65, 127, 128, 4095, 4096, 4159, 4160, 8191, 8192, k - 2, k - 1}))
    rng = np.random.default_rng(b)
    gaps = rng.integers(0, 40, k)
    gaps[edges] = np.resize([255, 300, 70_000, 2**30], edges.size)  # escapes of one to five varint bytes
    pos = torch.from_numpy(np.cumsum(gaps + 1) - 1)
    old = bits(torch.randn(k).to(torch.bfloat16)).numpy().astype(np.int64)
    M = (1 << b) - 1
    z = np.resize([1, 2, 3], k)  # steps of +-1 and -2: no escape at any width
    kinds = [zz for zz in (M + 1, M + 2, M + 127, M + 128, M + 300) if zz < 1 << 16] + [0]  # 0: new == old, raw
    z[edges] = np.resize(kinds, edges.size)
    new = (old + ((z >> 1) ^ -(z & 1))) & 0xFFFF
    new_t = torch.from_numpy(new.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    old_t = torch.from_numpy(old.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    numel = int(pos[-1]) + 1
    blob = check_encode_decode(pos, new_t, old_t, numel)["packed"].numpy()
    _, _, r, _, code_bits, _, streams = _packed_decode.parse_header(blob, numel, k, 2)
    assert (r, code_bits) == (0, b)
    assert streams[1, 1] > 0 and streams[4, 1] > 0 and streams[5, 1] > 0  # gap escapes, step escapes, raw values


@pytest.mark.parametrize("mix", [{"ulp": 0.9, "many": 0.1}, {"ulp": 0.5, "mid": 0.3, "same": 0.1, "flip": 0.1},
                                 {"random": 1.0}])
def test_long_change_sets(mix):
    # From 16384 changes the code width is costed on a sample of the steps: the escapes the
    # kernels write are not bounded by the sample (every 8th block here has all of them).
    k = 300_000
    pos, new, old = make_change_set(k, torch.bfloat16, 2 * k, 0.5, mix)
    burst = (torch.arange(k) // 4096) % 8 == 5  # blocks the sample skips
    new = torch.where(burst, (bits(old) ^ -0x8000).view(torch.bfloat16), new)  # sign flips: raw escapes
    check_encode_decode(pos, new, old, 2 * k)


def test_encoder_rejections_match():
    v = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    for pos, numel in ((torch.tensor([5, 5]), 10), (torch.tensor([1, 10]), 10), (torch.tensor([3, 1]), 10),
                       (torch.tensor([-1, 2]), 10),
                       (torch.tensor([5, -2**63]), 10)):  # the gap wraps past 2**63 to a positive int64
        for new in (v, (bits(v) + 1).view(torch.bfloat16)):  # no steps (the plan defers the width), steps of 1
            fast, ref = encode_both(pos, new, v, numel)
            assert fast == ref and fast[0] is ValueError and "strictly increasing" in fast[1]


@pytest.mark.parametrize("where", ["sampled block", "block the plan skips", "after escapes", "last element",
                                   "-2**63 first in a skipped block", "-2**63 alone in the last block"])
@pytest.mark.parametrize("steps", ["small", "wide"])  # wide: the plan leaves the code width to Python (REFINE)
def test_encoder_rejects_long_sets_like_the_specification(where, steps):
    # From SAMPLE_FROM changes the plan costs every SAMPLE_EVERY-th block only, but must check
    # every one. A bad gap after long gaps (escape buffers sized from the gaps' sum, which the bad
    # gap shrinks) must read as bad positions, never reach the streams.
    k = 40_000
    pos = torch.arange(k, dtype=torch.int64) * 3
    numel = 3 * k
    if where == "sampled block":
        pos[4096 * 4 + 7] = pos[4096 * 4 + 6]
    elif where == "block the plan skips":
        pos[4096 + 100] = pos[4096 + 99] - 5
    elif where == "after escapes":
        pos[:4096] = torch.arange(4096) * 1_000_000  # 255+ high parts at any shift the window allows
        pos[4096:] = torch.arange(k - 4096) + 10  # falls back below the first block: one bad gap
        numel = 4096 * 1_000_000
    elif where == "-2**63 first in a skipped block":  # its gap wraps to a positive int64
        pos[4096] = -2**63
    elif where == "-2**63 alone in the last block":
        pos, numel, k = pos[: 5 * 4096 + 1].clone(), 3 * (5 * 4096 + 1), 5 * 4096 + 1
        pos[-1] = -2**63
    else:
        pos[-1] = numel
    rng = np.random.default_rng(0)
    old = torch.from_numpy(rng.integers(0, 1 << 16, k, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    z = rng.integers(1, 3, k) if steps == "small" else rng.integers(1, 1 << 15, k)
    new = (bits(old) + torch.from_numpy(z.astype(np.int16))).view(torch.bfloat16)
    fast, ref = encode_both(pos, new, old, numel)
    assert fast == ref and fast[0] is ValueError and "strictly increasing" in fast[1]


# --- decoder: corrupt input ------------------------------------------------------------------------


def _mutations(rng, blob: bytes, n: int):
    for _ in range(n):
        b = bytearray(blob)
        op = rng.integers(0, 5)
        if op == 0:
            for _ in range(rng.integers(1, 4)):
                i = rng.integers(0, len(b))
                b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:
            i = rng.integers(0, min(len(b), 30))
            b[i] = int(rng.integers(0, 256))
        elif op == 2:
            b = b[: rng.integers(0, len(b))]
        elif op == 3:
            i = rng.integers(0, len(b) + 1)
            b[i:i] = bytes(rng.integers(0, 256, size=rng.integers(1, 5)).astype(np.uint8))
        else:
            i = rng.integers(0, len(b))
            del b[i : i + rng.integers(1, 8)]
        yield bytes(b)


@pytest.fixture
def fallbacks(monkeypatch):
    """Record every call of the reference decoders as ``(name, raised, native mode)``: in native
    mode they run only when a kernel refused the streams, and a kernel may only refuse what the
    specification refuses."""
    calls = []
    for name in ("_gap_positions", "_steps", "_bitmap_positions"):
        ref = getattr(packed_mod, name)

        def wrapped(*a, _ref=ref, _name=name, **kw):
            native = _native.enabled()
            try:
                out = _ref(*a, **kw)
            except CorruptObjectError:
                calls.append((_name, True, native))
                raise
            calls.append((_name, False, native))
            return out

        monkeypatch.setattr(packed_mod, name, wrapped)
    return calls


def refused_only_what_the_spec_refuses(calls) -> bool:
    return all(raised for _, raised, native in calls if native)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mutated_blobs_same_outcome(dtype, fallbacks):
    rng = np.random.default_rng(99)
    codec = get_codec("packed")
    outcomes = {"error": 0, "ok": 0}
    for seed, numel, density, mix in [
        (1, 6000, 0.02, {"ulp": 0.95, "many": 0.04, "flip": 0.01}),
        (2, 300, 0.1, {"ulp": 0.8, "special": 0.2}),
        (3, 2000, 0.9, {"random": 1.0}),
        (4, 1 << 20, 0.001, {"ulp": 0.9, "mid": 0.1}),
    ]:
        pos, new, old = make_change_set(seed, dtype, numel, density, mix)
        blob = codec.encode(pos, new, old, numel=numel)["packed"].numpy().tobytes()
        for b in _mutations(rng, blob, 150):
            for count in (pos.numel(), max(0, pos.numel() - 1)):
                parts = {"packed": torch.tensor(list(b), dtype=torch.uint8)}
                fallbacks.clear()
                fast, ref = both(lambda: codec.decode(parts, numel=numel, count=count, dtype=dtype))
                assert same_delta(fast, ref), (seed, b.hex(), count, fast if isinstance(fast, tuple) else "ok",
                                               ref if isinstance(ref, tuple) else "ok")
                assert refused_only_what_the_spec_refuses(fallbacks), fallbacks
                outcomes["error" if isinstance(ref, tuple) else "ok"] += 1
    assert outcomes["error"] > 300 and outcomes["ok"] > 50, outcomes


@settings(max_examples=300, deadline=None)
@given(
    head=st.tuples(st.just(1), st.integers(0, 1), st.integers(0, 9), st.integers(0, 1), st.sampled_from([0, 2, 4, 8, 16])),
    body=st.binary(max_size=80),
    numel=st.integers(0, 3000),
    count=st.integers(0, 60),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
)
def test_arbitrary_bytes_same_outcome(head, body, numel, count, dtype):
    count = min(count, numel)
    parts = {"packed": torch.tensor(list(bytes(head) + body), dtype=torch.uint8)}
    codec = get_codec("packed")
    fast, ref = both(lambda: codec.decode(parts, numel=numel, count=count, dtype=dtype))
    assert same_delta(fast, ref)


@pytest.mark.parametrize("numel, count, dtype", [(2**40, 2**40, torch.bfloat16),
                                                  (7613716252851486890, 2063690565181498743, torch.float32)])
def test_a_count_the_blob_does_not_hold_is_refused_before_allocating(numel, count, dtype):
    # Six empty stored streams that claim `count` changes: refused from the header (the positions
    # stream must hold `count` bytes), not by allocating `count` positions first (found by fuzzing:
    # MemoryError for 8 TiB, or "array is too big", instead of the reference's error).
    parts = {"packed": torch.tensor(list(bytes([1, 0, 0, 0, 0]) + bytes(8) + bytes(12)), dtype=torch.uint8)}
    fast, ref = both(lambda: get_codec("packed").decode(parts, numel=numel, count=count, dtype=dtype))
    assert isinstance(ref, tuple) and ref[0] is CorruptObjectError and "positions stream declares 0 bytes" in ref[1]
    assert same_delta(fast, ref)


def test_a_zstd_frame_longer_than_the_header_allows_is_not_decompressed(monkeypatch):
    # Stream 5 (raw values) declares 4 * count bytes, but stream 0 is empty: the count is refused
    # from the header before the 256 MiB frame is expanded.
    count = numel = 2**26
    frame = _bits.compressor(1).compress(bytes(4 * count))
    header = bytes([1, 0, 0, 0, 0]) + bytes(8) + bytes(10) + bytes([1]) + _bits.leb128_encode(
        np.array([4 * count, len(frame)], np.uint64)).tobytes()
    parts = {"packed": torch.tensor(list(header + frame), dtype=torch.uint8)}
    expanded = []

    def unpack_stream(*args):
        expanded.append(args[2])
        raise AssertionError("decompressed a stream of a refused blob")

    monkeypatch.setattr(packed_mod, "unpack_stream", unpack_stream)
    monkeypatch.setattr(_packed_decode, "unpack_stream", unpack_stream)
    with pytest.raises(CorruptObjectError, match="positions stream declares 0 bytes"):
        get_codec("packed").decode(parts, numel=numel, count=count, dtype=torch.float32)
    assert expanded == []


@pytest.mark.parametrize("case", [
    # (numel, count, blob fields): each is refused by a kernel and by the specification alike
    (1024, 3, [GOOD[0], GOOD[1], bytes([3, 0, 5, 0x51])]),  # code padding bits set
    (1024, 3, [GOOD[0], GOOD[1], bytes([3, 0, 5, 0x31])]),  # an escape code without escapes
    (1024, 3, [GOOD[0], bytes([0, 3, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0]), bytes([3, 0, 255, 0xCD, 0x06, 0x11])]),  # gap > numel
    (1024, 3, [bytes([1, 0, 2, 1, 2]) + bytes(8), bytes([0, 3, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0]),
               bytes([254, 254, 0, 0x0F, 0x11])]),  # positions past the end
    (1024, 3, [bytes([1, 0, 2, 1, 2]) + bytes(8), bytes([0, 3, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0]),
               bytes([3, 0, 5, 0x40, 0x11])]),  # low-bit padding set
    (1024, 3, [GOOD[0], bytes([0, 3, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0]), bytes([3, 0, 255, 0x80, 0x11])]),  # cut-off varint
    (2**62, 5, [bytes([1, 0, 0, 1, 2]) + bytes(8)]),  # positions wrapping around 2**64 (filled below)
    (8, 3, [bytes([1, 1, 0, 0, 0]) + bytes(8), bytes([0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6]),
            bytes([0b111]) + bytes(6)]),  # a valid bitmap
    (8, 2, [bytes([1, 1, 0, 0, 0]) + bytes(8), bytes([0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4]),
            bytes([0b111]) + bytes(4)]),  # bitmap with another number of bits than the count
    (5, 3, [bytes([1, 1, 0, 0, 0]) + bytes(8), bytes([0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6]),
            bytes([0b1000_0011]) + bytes(6)]),  # bitmap bit past the end of the tensor
])
def test_handwritten_corruptions_same_outcome(case, fallbacks):
    numel, count, fields = case
    if numel == 2**62:
        ext = _bits.leb128_encode(np.array([2**62 - 1 - 255] * 5, np.uint64)).tobytes()
        fields = fields + [bytes([0, 5, 0, len(ext), 0, 0, 0, 2, 0, 0, 0, 0]), bytes([255] * 5), ext, bytes([0, 0])]
    parts = _blob(*fields)
    codec = get_codec("packed")
    fast, ref = both(lambda: codec.decode(parts, numel=numel, count=count, dtype=torch.bfloat16))
    assert same_delta(fast, ref)
    assert refused_only_what_the_spec_refuses(fallbacks), fallbacks
    # a blob the specification refuses was refused by a kernel too (unless a stream-length check,
    # which runs before any kernel, refused it), and a valid one never fell back
    kernel_refused = any(native for _, _, native in fallbacks)
    assert kernel_refused == isinstance(ref, tuple) or "stream" in str(ref)


@pytest.mark.parametrize("r", [0, 1, 7, 8, 9, 40])
@pytest.mark.parametrize("numel", [2**63 - 1, 2**62 + 3, 5_000])
def test_gap_sums_near_and_past_the_end_same_outcome(r, numel):
    # Gap streams built directly (the encoder never writes these): a block's gaps adding up to
    # exactly the last index, one past it, past 2**64 (wrapping back into range), and one gap
    # above numel - 1, in the first and in a later block, against the specification's decoder.
    from torch_deltasync.codecs._packed import _gap_positions, _gap_positions_native, _gap_streams

    rng = np.random.default_rng(r + numel % 97)
    k = 2 * _native.BLOCK + 5
    cases = []
    for at in (0, _native.BLOCK + 3):  # which gap carries the excess
        g = rng.integers(0, 3, k).astype(np.uint64)
        # the gap that puts the last position at numel - 1 (wrapped to 2**64 where k > numel: refused then)
        rest = np.uint64((numel - 1 - (int(g.sum()) - int(g[at]) + k - 1)) % 2**64)
        for extra in (0, 1, 2**63 + 7 if numel > 2**62 else numel):
            x = g.copy()
            x[at] = rest + np.uint64(extra)  # extra > 0: past the end or above numel - 1 (uint64 wraps)
            cases.append(x)
        cases.append(np.full(k, np.uint64(numel - 1)))  # every gap the largest: the sum wraps 2**64 often
        wrap = np.zeros(k, np.uint64)  # two of the largest gaps and a third adding up to 2**64 exactly
        wrap[at : at + 2] = numel - 1
        wrap[at + 2] = (2**64 - 2 * (numel - 1)) % 2**64
        cases.append(wrap)
    for gaps in cases:
        streams = [np.ascontiguousarray(x) for x in _gap_streams(gaps, r)]

        def stream(i, lo, hi, streams=streams):  # as the decoder's: declared lengths checked first
            if not lo <= streams[i].size <= hi:
                raise CorruptObjectError(f"stream {i}")
            return streams[i]

        outcomes = []
        for decode in (_gap_positions_native, _gap_positions):
            try:
                outcomes.append(decode(stream, r, numel, k, "t"))
            except CorruptObjectError:
                outcomes.append(None)
        fast, ref = outcomes
        if ref is None:
            assert fast is None
        else:
            assert fast is not None and np.array_equal(fast, ref) and int(ref[-1]) <= numel - 1


def test_resolve_matches_and_refuses_a_drifted_base():
    pos, new, old = make_change_set(5, torch.bfloat16, 50_000, 0.05, {"ulp": 0.9, "flip": 0.05, "special": 0.05})
    codec = get_codec("packed")
    d = codec.decode(codec.encode(pos, new, old, numel=50_000), numel=50_000, count=pos.numel(), dtype=torch.bfloat16)
    assert d.relative is not None  # raw escapes present
    fast, ref = both(lambda: d.resolve(old))
    assert torch.equal(bits(fast), bits(new)) and torch.equal(bits(ref), bits(new))
    drifted = old.clone()
    drifted.view(torch.int16)[11] ^= 1
    fast, ref = both(lambda: d.resolve(drifted))
    assert fast == ref and fast[0] is ChecksumMismatchError and "base version" in fast[1]


# --- checksums -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn])
def test_checksums_match(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_007, generator=g).to(dtype)
    y = torch.randn(10_007, generator=g).to(dtype)
    pos = torch.sort(torch.randint(0, 2**62, (10_007,), generator=g)).values
    pos[-1] = 2**63 - 1  # the largest index
    for fn in (lambda: checksum(x), lambda: checksum(x, start=2**40), lambda: checksum(x, pos),
               lambda: checksum_change(pos, x, y), lambda: tensor_checksum(x.reshape(1, -1), chunk=1000),
               lambda: checksum(x[:0], pos[:0])):
        fast, ref = both(fn)
        assert fast == ref


# --- change detection ------------------------------------------------------------------------------


def _special_fp32(n: int, seed: int) -> torch.Tensor:
    """fp32 values that stress a bf16 cast: rounding ties, denormals, infinities, signed zeros,
    the largest finite values (round up to infinity) and random bit patterns (no NaN)."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 6, size=n)
    u = np.where(kind == 0, (u & ~np.uint32(0xFFFF)) | np.uint32(0x8000), u)  # exact ties
    u = np.where(kind == 1, u & np.uint32(0x807FFFFF), u)  # denormals
    u = np.where(kind == 2, np.uint32(0x7F7FFFFF) | (u & np.uint32(0x80000000)), u)  # +-max finite
    u = np.where(kind == 3, np.uint32(0x7F800000) | (u & np.uint32(0x80000000)), u)  # +-inf
    u = np.where(kind == 4, u & np.uint32(0x80000000), u)  # +-0
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    u = np.where(nan, u & np.uint32(0xFF7FFFFF), u)  # NaN -> finite
    return torch.from_numpy(u.view(np.float32).copy())


@pytest.mark.parametrize("src_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32), (torch.float16, torch.float16),
                                             (torch.float32, torch.float16)])
@pytest.mark.parametrize("n,chunk", [(0, None), (5, None), (4097, None), (20_011, 1000), (20_011, 7)])
def test_detection_matches(src_dtype, dtype, n, chunk):
    base = _special_fp32(n, n)
    live = base.clone()
    flip = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.2
    live[flip] = _special_fp32(n, n + 1)[flip]
    base, live = base.to(src_dtype), live.to(src_dtype)

    def run():
        det = ChangeDetector(inference_dtype=dtype, chunk_numel=chunk)
        det.reset("w", base)
        ch = det.detect("w", live)
        again = det.detect("w", live)  # sized from the first call's count
        assert torch.equal(again.positions, ch.positions) and torch.equal(bits(again.values), bits(ch.values))
        return ch.positions, bits(ch.values), bits(ch.old_values)

    fast, ref = both(run)
    for a, b in zip(fast, ref):
        assert torch.equal(a, b)
    expected = (bits(base.to(dtype)) != bits(live.to(dtype))).nonzero().squeeze(1)
    assert torch.equal(fast[0], expected)


def test_detection_casts_every_nan_to_one_pattern():
    # torch's fp32 -> bf16 cast writes a NaN as 0xFFFF in its vector lanes and as 0x7FC0 in scalar
    # code; the published cast (anchors, and detection on either path) writes 0x7FC0 wherever it is.
    w = torch.randn(10_000)
    w[17] = float("nan")
    w2 = w.clone()
    w2[3] += 1.0
    w2.view(torch.int32)[17] = -1  # another NaN (sign and payload): the same published bits
    w2[18] = float("nan")
    w2.view(torch.int32)[9_999] = 0x7F800001  # a signalling NaN, in the vector loop's tail

    def run():
        det = ChangeDetector()
        det.reset("w", w)
        ch = det.detect("w", w2)
        return ch.positions, bits(ch.values), bits(det.cast(w2))

    fast, ref = both(run)
    for a, b in zip(fast, ref):
        assert torch.equal(a, b)
    positions, values, cast = fast
    assert positions.tolist() == [3, 18, 9_999] and values[1:].tolist() == [0x7FC0, 0x7FC0]
    assert cast[[17, 18, 9_999]].tolist() == [0x7FC0] * 3
    others = torch.ones(10_000, dtype=torch.bool)
    others[[17, 18, 9_999]] = False
    assert torch.equal(cast[others], bits(w2.to(torch.bfloat16))[others])  # torch's cast elsewhere


def test_kernels_imported_by_name_get_their_dispatchers():
    # After the first kernel call no module of the library still calls through the lazy proxy
    # (e.g. the codec imports the size estimates by name): Python callers reach numba directly.
    import sys

    get_codec("packed").encode(torch.arange(0, 5000, 3), torch.ones(1667, dtype=torch.bfloat16),
                               torch.zeros(1667, dtype=torch.bfloat16), numel=5000)
    left = [(m, n) for m, mod in list(sys.modules.items()) if m.startswith("torch_deltasync")
            for n, f in vars(mod).items() if isinstance(f, _native._Deferred)]
    assert not left


# --- threads ---------------------------------------------------------------------------------------


def test_encode_and_decode_many_match_one_by_one(monkeypatch):
    from torch_deltasync import _pool

    monkeypatch.setattr(_pool, "PARALLEL_MIN_CHANGES", 2000)  # some items on the pool, some inline
    codec = get_codec("packed")
    items = [make_change_set(s, torch.bfloat16, 40_000 + 1000 * s, 0.02 * (s + 1), {"ulp": 0.95, "many": 0.05})
             + (40_000 + 1000 * s,) for s in range(6)]
    items = [(p, n, o, numel) for p, n, o, numel in items]
    serial = [codec.encode(p, n, o, numel=numel) for p, n, o, numel in items]
    many = codec.encode_many(items, threads=3)
    assert all(torch.equal(a["packed"], b["packed"]) for a, b in zip(serial, many))
    decoded = codec.decode_many([(m, numel, p.numel(), torch.bfloat16) for m, (p, _, _, numel) in zip(many, items)],
                                threads=3)
    for d, (p, new, old, _) in zip(decoded, items):
        assert torch.equal(d.positions, p) and torch.equal(bits(d.resolve(old)), bits(new))
    with pytest.raises(ValueError, match="strictly increasing"):
        codec.encode_many(items[:2] + [(items[0][0].flip(0),) + items[0][1:]], threads=2)


@pytest.mark.parametrize("numel, count, dtype, blob, message", [
    (14736, 90, torch.float8_e4m3fn,
     "01000201029dda564e401a59d2015a45000c00000017001c000728b52ffd205ae50100a2050e15b025e90cc3300cc3300cc330659dd01a"
     "216dcb2453ff6b49694310d5c564663c7274294fd9850e92577180411b85c05554cabd46bfc02a00f00a130c8b1eb0108b1eb10170cf13"
     "dd3cf050557dfd3c4450cf1cc11134c130dc400002040202010200020202020002000201020102010000140200020202b3d84ab7ddc39e",
     "gap escapes: expected 6 varints, found 7 complete ones in 12 bytes"),
])
def test_a_blob_with_two_bad_streams_gets_the_specifications_error(numel, count, dtype, blob, message):
    # Found by fuzzing: its gap escapes and its pos_low stream are both wrong. The specification
    # reads the escapes first; the kernels' fallback used to report pos_low.
    parts = {"packed": torch.tensor(list(bytes.fromhex(blob)), dtype=torch.uint8)}
    fast, ref = both(lambda: get_codec("packed").decode(parts, numel=numel, count=count, dtype=dtype))
    assert fast == ref == (CorruptObjectError, f"packed codec: {message}")


# --- without numba ---------------------------------------------------------------------------------


def test_everything_works_without_numba(tmp_path):
    """A platform without numba wheels: the package imports, the kernels are off, and the numpy /
    torch specification encodes, decodes, detects and checksums (in a child process whose
    ``import numba`` fails)."""
    script = tmp_path / "no_numba.py"
    script.write_text(
        "import sys\n"
        "sys.modules['numba'] = None  # import numba raises ImportError\n"
        "import torch\n"
        "from torch_deltasync import _native, get_codec\n"
        "from torch_deltasync.detect import ChangeDetector\n"
        "from torch_deltasync._dtypes import bits\n"
        "from torch_deltasync.checksum import checksum\n"
        "assert not _native.AVAILABLE and not _native.enabled()\n"
        "w = torch.randn(5000)\n"
        "det = ChangeDetector()\n"
        "det.reset('w', w)\n"
        "w2 = w.clone(); w2[::9] += 0.01\n"
        "ch = det.detect('w', w2)\n"
        "assert ch.positions.tolist() == (bits(w.bfloat16()) != bits(w2.bfloat16())).nonzero().squeeze(1).tolist()\n"
        "c = get_codec('packed')\n"
        "p = c.encode(ch.positions, ch.values, ch.old_values, numel=5000)\n"
        "d = c.decode(p, numel=5000, count=ch.numel, dtype=torch.bfloat16)\n"
        "assert torch.equal(bits(d.resolve(ch.old_values)), bits(ch.values))\n"
        "assert checksum(ch.values, ch.positions) == checksum(ch.values.clone(), ch.positions.clone())\n"
        "try:\n"
        "    _native.set_enabled(True)\n"
        "except RuntimeError as e:\n"
        "    assert 'numba is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('set_enabled(True) without numba')\n"
        "print('ok without numba')\n"
    )
    run_child(script, "ok without numba")


def test_a_numba_that_does_not_import_falls_back_with_one_warning(tmp_path):
    """numba installed but failing to import (a release built for an older numpy raises
    ImportError on import): the first call that would use the kernels warns once with numba's
    reason (not when ``TORCH_DELTASYNC_NATIVE=0`` chose the numpy/torch paths), a save and restore
    with ``set_enabled`` keeps working, and the numpy/torch paths write the bytes the kernels do."""
    w = torch.randn(50_000, generator=torch.Generator().manual_seed(5))
    w2 = w.clone()
    w2[::7] += 1e-3
    det = ChangeDetector()
    det.reset("w", w)
    ch = det.detect("w", w2)
    assert _native.enabled()
    blob = get_codec("packed").encode(ch.positions, ch.values, ch.old_values, numel=w.numel())["packed"]
    torch.save({"w": w, "w2": w2, "positions": ch.positions, "blob": blob}, tmp_path / "inputs.pt")
    script = tmp_path / "numba_breaks.py"
    script.write_text(
        "import sys, warnings, importlib.abc, importlib.machinery\n"
        "class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):  # numba is there, its import fails\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        return importlib.machinery.ModuleSpec(name, self) if name == 'numba' else None\n"
        "    def create_module(self, spec):\n"
        "        return None\n"
        "    def exec_module(self, module):\n"
        "        raise ImportError('Numba needs NumPy 2.4 or less. Got NumPy 2.9.')\n"
        "sys.meta_path.insert(0, Broken())\n"
        "import torch\n"
        "from torch_deltasync import _native, get_codec\n"
        "from torch_deltasync.detect import ChangeDetector\n"
        "from torch_deltasync._dtypes import bits\n"
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r})\n"
        "assert _native.AVAILABLE\n"
        "mode = sys.argv[1]\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    if mode == 'idiom':  # save and restore around a comparison, as the first call\n"
        "        prev = _native.set_enabled(False)\n"
        "        assert prev is False\n"
        "        _native.set_enabled(prev)\n"
        "    det = ChangeDetector()\n"
        "    det.reset('w', x['w'])\n"
        "    ch = det.detect('w', x['w2'])\n"
        "    c = get_codec('packed')\n"
        "    blob = c.encode(ch.positions, ch.values, ch.old_values, numel=x['w'].numel())['packed']\n"
        "    d = c.decode({'packed': blob}, numel=x['w'].numel(), count=ch.numel, dtype=torch.bfloat16)\n"
        "    new = d.resolve(ch.old_values)\n"
        "msgs = [str(m.message) for m in caught if issubclass(m.category, RuntimeWarning)]\n"
        "if mode == 'off':  # TORCH_DELTASYNC_NATIVE=0 chose the numpy/torch paths: nothing to warn about\n"
        "    assert msgs == [], msgs\n"
        "else:\n"
        "    assert len(msgs) == 1 and 'Numba needs NumPy 2.4 or less' in msgs[0], msgs\n"
        "assert not _native.enabled()\n"
        "assert torch.equal(ch.positions, x['positions'])\n"
        "assert torch.equal(blob, x['blob'])  # the same bytes as the kernels wrote\n"
        "assert torch.equal(bits(new), bits(x['w2'].bfloat16()[x['positions']]))\n"
        "try:\n"
        "    _native.set_enabled(True)\n"
        "except RuntimeError as e:\n"
        "    assert 'does not import (ImportError: Numba needs NumPy' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('set_enabled(True) with a numba that does not import')\n"
        "print('ok with a broken numba')\n"
    )
    run_child(script, "ok with a broken numba", "first-use")
    run_child(script, "ok with a broken numba", "idiom")
    run_child(script, "ok with a broken numba", "off", env={"TORCH_DELTASYNC_NATIVE": "0"})


def run_child(script: Path, expected: str, *args: str, env: dict | None = None) -> None:
    """Run ``script`` in a child process with this checkout on its path; it must print ``expected``."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root), **(env or {})})
    assert r.returncode == 0 and expected in r.stdout, r.stdout + r.stderr


# --- applying in place -----------------------------------------------------------------------------


@pytest.mark.parametrize("mix", [{"ulp": 1.0}, {"ulp": 0.8, "flip": 0.1, "same": 0.1}, {"random": 1.0}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_to_matches_resolve_and_index_copy(mix, dtype):
    numel = 40_000
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(3)).mul_(0.02).to(dtype)
    rng = np.random.default_rng(4)
    pos = torch.from_numpy(np.sort(rng.choice(numel, 5000, replace=False)))
    _, new, _ = make_change_set(9, dtype, 5000, 1.0, mix)  # new values for 5000 entries
    old = flat[pos]
    new = torch.where(torch.rand(5000, generator=torch.Generator().manual_seed(5)) < 0.5, new,
                      (bits(old) + 1).view(dtype))  # half of them one ULP away: step-coded
    codec = get_codec("packed")
    d = codec.decode(codec.encode(pos, new, old, numel=numel), numel=numel, count=5000, dtype=dtype)
    want = flat.clone().index_copy_(0, pos, d.resolve(old) if d.needs_base else d.values)
    fast, ref = both(lambda: (lambda f: (d.apply_to(f), f)[1])(flat.clone()))
    assert torch.equal(bits(fast), bits(want)) and torch.equal(bits(ref), bits(want))
    drifted = flat.clone()
    drifted.view(bits(drifted).dtype)[pos[7]] ^= 1
    if d.needs_base:
        fast, ref = both(lambda: d.apply_to(drifted))
        assert fast == ref and fast[0] is ChecksumMismatchError
        assert torch.equal(bits(drifted)[pos[8:]], bits(flat)[pos[8:]]), "a refused delta wrote something"
    with pytest.raises(ValueError, match="outside"):
        d.apply_to(flat[: int(pos[-1])].clone())


def test_kernels_refuse_inconsistent_deltas():
    # The kernels index without bounds checks, so a hand-built delta with parts of other lengths
    # or positions outside the tensor is refused before any of them runs.
    from torch_deltasync.codecs import TensorDelta

    v = torch.zeros(4, dtype=torch.bfloat16)
    d = TensorDelta(torch.arange(4), v, torch.ones(3, dtype=torch.int16), None, None)
    with pytest.raises(ValueError, match="shapes"):
        d.resolve(v)
    flat = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="position -1 outside"):
        TensorDelta(torch.tensor([-1, 2]), v[:2]).apply_to(flat)
    with pytest.raises(ValueError, match="position 10 outside"):
        TensorDelta(torch.tensor([2, 10]), v[:2]).apply_to(flat)
    with pytest.raises(ValueError, match="strictly increasing.*entry 1 is 2 after 10"):
        TensorDelta(torch.tensor([10, 2]), v[:2]).apply_to(flat)
    # a repeated position would take both steps (index_copy_, the documented equivalent, takes one)
    with pytest.raises(ValueError, match="strictly increasing.*entry 1 is 3 after 3"):
        TensorDelta(torch.tensor([3, 3]), v[:2], torch.ones(2, dtype=torch.int16)).apply_to(flat)
    assert bool((flat == 0).all())


# --- targets: applying in place ----------------------------------------------------------------------


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float32, torch.float16])
def test_module_target_write_matches_index_copy(storage):
    from torch_deltasync import ModuleTarget

    dtype = torch.float16 if storage == torch.float16 else torch.bfloat16
    numel = 30_000
    base = _special_fp32(numel, 11).to(dtype).to(storage)  # NaN payloads, -0.0, infinities
    rng = np.random.default_rng(12)
    pos = torch.from_numpy(rng.choice(numel, 4000, replace=False))  # unsorted too
    new = _special_fp32(4000, 13).to(dtype)
    # independent expectation: the inference dtype's bit patterns, widened by a 16-bit shift for fp32
    want = bits(base.to(dtype)).clone() if storage == dtype else bits(base).clone()
    nb = bits(new)
    want[pos] = nb if storage == dtype else (nb.to(torch.int32) << 16)

    def run():
        held = {"w": base.clone().reshape(100, 300)}
        t = ModuleTarget(held)
        t.check({"w": (100, 300)}, {}, dtype)
        t.write("w", pos, new)
        return bits(held["w"].reshape(-1))

    fast, ref = both(run)
    assert torch.equal(fast, want) and torch.equal(ref, want)
    bad = pos.clone()
    bad[100] = numel  # outside the tensor: refused before anything is written, on both paths
    for on in (True, False):
        prev = _native.set_enabled(on)
        try:
            w = base.clone()
            t = ModuleTarget({"w": w})
            t.check({"w": (numel,)}, {}, dtype)
            with pytest.raises(CorruptObjectError, match=rf"'w': positions outside \[0, {numel}\) \(min {int(bad.min())}, max {numel}\); nothing written"):
                t.write("w", bad, new)
            assert torch.equal(bits(w), bits(base))
        finally:
            _native.set_enabled(prev)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float32, torch.float16])
def test_module_target_read_matches_the_torch_path(storage):
    # The compiled gather (bf16 out of fp32 storage too) reads the exact bit patterns the torch
    # indexing reads, NaN payloads included; positions outside the tensor are refused on both paths.
    from torch_deltasync import ModuleTarget

    dtype = torch.float16 if storage == torch.float16 else torch.bfloat16
    numel = 30_000
    base = _special_fp32(numel, 14).to(dtype).to(storage)
    pos = torch.from_numpy(np.random.default_rng(15).choice(numel, 5000, replace=False))
    want = bits(base.to(dtype))[pos]

    def run():
        t = ModuleTarget({"w": base.clone().reshape(100, 300)})
        t.check({"w": (100, 300)}, {}, dtype)
        return bits(t.read("w", pos, dtype))

    fast, ref = both(run)
    assert torch.equal(fast, want) and torch.equal(ref, want)
    for bad_at in (numel, -1):
        bad = pos.clone()
        bad[7] = bad_at
        fast, ref = both(lambda: _read_one(base, bad, dtype))
        assert fast == ref and fast[0] is CorruptObjectError and "positions outside [0, 30000)" in fast[1], fast
    # a non-contiguous tensor takes the torch path, same bits
    t = ModuleTarget({"w": base.clone().reshape(300, 100).t()})
    t.check({"w": (100, 300)}, {}, dtype)
    assert torch.equal(bits(t.read("w", pos, dtype)), bits(base.reshape(300, 100).t().to(dtype).reshape(-1))[pos])


def test_module_target_refuses_a_dtype_its_storage_cannot_hold():
    # fp16 storage cannot hold bf16 bit patterns: read and write refuse (no shift into a
    # neighbour's memory, no misread bits), on both paths; a 2-D positions tensor takes the torch path.
    from torch_deltasync import ModuleTarget
    from torch_deltasync.errors import IncompatibleTargetError

    big = torch.arange(16, dtype=torch.float16)
    before = bits(big).clone()
    for on in (True, False):
        prev = _native.set_enabled(on)
        try:
            t = ModuleTarget({"w": big[:8]})
            with pytest.raises(IncompatibleTargetError, match=r"'w' is torch.float16, which cannot hold torch.bfloat16"):
                t.write("w", torch.tensor([7]), torch.tensor([1.0], dtype=torch.bfloat16))
            with pytest.raises(IncompatibleTargetError, match="cannot hold torch.bfloat16"):
                t.read("w", torch.tensor([7]), torch.bfloat16)
            assert torch.equal(bits(big), before)
            got = t.read("w", torch.tensor([[1, 2], [3, 7]]), torch.float16)
            assert torch.equal(bits(got), bits(big)[torch.tensor([[1, 2], [3, 7]])])
        finally:
            _native.set_enabled(prev)


def _read_one(base, pos, dtype):
    from torch_deltasync import ModuleTarget

    t = ModuleTarget({"w": base.clone()})
    t.check({"w": tuple(base.shape)}, {}, dtype)
    return bits(t.read("w", pos, dtype))


def _fake_vllm_target(shape, local_shape, tables, base=0, transpose=False):
    """A :class:`VLLMTarget` holding one tensor ``"w"`` of HF ``shape`` through the given per-dim
    tables (int64 ``HF -> local``, -1 = not held; ``None`` = identity) into a zeroed bf16 parameter
    of ``local_shape`` (transposed storage when ``transpose``), without vLLM."""
    from torch import nn

    from torch_deltasync.targets import VLLMTarget
    from torch_deltasync.targets._vllm_layout import _Entry, _Place, _with_affine, _with_grid

    param = torch.zeros(local_shape[::-1] if transpose else local_shape, dtype=torch.bfloat16)
    if transpose:
        param = param.t()
    t = VLLMTarget(nn.Module())
    p = _Place(param, "w_local", base, tuple(tables), tuple(param.stride()), True)
    p = _with_grid(_with_affine(p, shape), shape)
    t._entries = {"w": _Entry("w", tuple(shape), [p])}
    return t, param, p


def _expected_local(shape, tables, strides, base, pos):
    """``(held mask, local offsets)`` of ``pos`` by plain Python coordinates (the module doc's formula)."""
    held, local = [], []
    for q in pos.tolist():
        coords = np.unravel_index(q, shape)
        loc = [c if tb is None else int(tb[c]) for c, tb in zip(coords, tables)]
        held.append(all(x >= 0 for x in loc))
        local.append(base + sum(x * s for x, s in zip(loc, strides)))
    return held, local


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_vllm_target_write_matches_the_torch_map(data):
    # Random separable maps (split rows, split columns, both, 1-D, transposed storage, a base
    # offset), positions sorted or not, some outside the rank or the tensor: the fused kernel
    # writes exactly what the torch map + index_copy_ writes, or refuses with the same error and
    # writes nothing.
    ndim = data.draw(st.sampled_from([1, 2]))
    shape = tuple(data.draw(st.integers(1, 40)) for _ in range(ndim))
    tables, local_shape = [], []
    for d in range(ndim):
        kind = data.draw(st.sampled_from(["identity", "block", "random"]))
        n = shape[d]
        if kind == "identity":
            tables.append(None)
            local_shape.append(n)
            continue
        held = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
        if kind == "block":
            held = list(range(held[0], held[-1] + 1))
        dst = data.draw(st.permutations(range(len(held)))) if kind == "random" else range(len(held))
        tb = torch.full((n,), -1, dtype=torch.int64)
        tb[torch.tensor(held)] = torch.tensor(list(dst))
        tables.append(tb)
        local_shape.append(len(held))
    transpose = ndim == 2 and data.draw(st.booleans())
    base = 0  # the whole parameter is the local tensor here
    numel = int(np.prod(shape))
    mask = torch.ones(shape, dtype=torch.bool)
    for d, tb in enumerate(tables):
        if tb is not None:
            mask &= (tb >= 0).reshape([-1 if e == d else 1 for e in range(ndim)])
    held_pos = torch.nonzero(mask.reshape(-1)).squeeze(1).tolist()
    k = data.draw(st.integers(1, min(len(held_pos), 200)))
    pos_list = data.draw(st.lists(st.sampled_from(held_pos), min_size=k, max_size=k, unique=True))
    if data.draw(st.booleans()):
        pos_list.sort()
    if data.draw(st.integers(0, 3)) == 0:  # one position outside the tensor or not held here
        pos_list[data.draw(st.integers(0, k - 1))] = data.draw(st.sampled_from([-1, numel, numel + 7] + [
            q for q in range(numel) if not bool(mask.reshape(-1)[q])][:5]))
    pos = torch.tensor(pos_list, dtype=torch.int64)
    vals = torch.arange(1, k + 1, dtype=torch.int16).view(torch.bfloat16)

    def run():
        t, param, _ = _fake_vllm_target(shape, tuple(local_shape), tables, base, transpose)
        try:
            t.write("w", pos, vals)
        except CorruptObjectError as e:
            assert bool((bits(param) == 0).all()), "a refused write changed the parameter"
            with pytest.raises(CorruptObjectError) as refused:  # read refuses the same positions alike
                t.read("w", pos, torch.bfloat16)
            assert str(refused.value) == str(e)
            return type(e), str(e)
        got = t.read("w", pos, torch.bfloat16)  # the fused map + gather reads back what was written
        assert torch.equal(bits(got), bits(vals))
        return bits(param).clone()

    in_range = pos[(pos >= 0) & (pos < numel)]
    own_fast, own_ref = both(lambda: _fake_vllm_target(shape, tuple(local_shape), tables)[0].owned("w", in_range))
    want_own = [bool(mask.reshape(-1)[q]) for q in in_range.tolist()]
    assert own_fast.tolist() == want_own and own_ref.tolist() == want_own
    fast, ref = both(run)
    assert type(fast) is type(ref)
    if isinstance(ref, tuple):
        assert fast == ref
        return
    assert torch.equal(fast, ref)
    _, param, p = _fake_vllm_target(shape, tuple(local_shape), tables, base, transpose)
    held, local = _expected_local(shape, tables, p.strides, base, pos)
    assert all(held)
    flat = torch.zeros(param.untyped_storage().nbytes() // 2, dtype=torch.int16)
    flat[torch.tensor(local)] = bits(vals)
    strided = torch.as_strided(flat, param.shape, param.stride())
    assert torch.equal(fast, strided)


def test_vllm_target_grid_kernels_on_large_rows():
    # One division per row change: long rows with one change each, and many changes in one row.
    shape = (300, 5000)
    cols = torch.full((5000,), -1, dtype=torch.int64)
    cols[2500:] = torch.arange(2500)  # a row-parallel split: rank 1 holds columns 2500..4999
    rng = np.random.default_rng(21)
    rows_hit = np.sort(rng.choice(300, 120, replace=False))
    pos = torch.from_numpy(np.concatenate([rows_hit * 5000 + 2500 + rng.integers(0, 2500, 120),
                                           299 * 5000 + 2500 + np.arange(0, 2500, 3)]))
    pos = torch.unique(pos)
    vals = torch.from_numpy(rng.integers(-30000, 30000, pos.numel(), dtype=np.int16)).view(torch.bfloat16)

    def run():
        t, param, _ = _fake_vllm_target(shape, (300, 2500), [None, cols])
        t.write("w", pos, vals)
        return bits(param).clone()

    fast, ref = both(run)
    want = torch.zeros(300, 2500, dtype=torch.int16)
    want.view(-1)[(pos // 5000) * 2500 + (pos % 5000 - 2500)] = bits(vals)
    assert torch.equal(fast, want) and torch.equal(ref, want)
