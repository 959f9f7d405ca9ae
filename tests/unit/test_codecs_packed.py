"""Tests of the ``packed`` codec (torch_deltasync/codecs/_packed.py, docs/format.md "Codec packed").

Round trips are checked bit-exactly on integer views: the decoded positions must equal the encoded
ones and ``TensorDelta.resolve(old)`` must reproduce the new bit patterns. Golden blobs are written
by hand from the spec, not copied from the encoder.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore, get_codec
from torch_deltasync.errors import ChecksumMismatchError, CorruptObjectError
from torch_deltasync._dtypes import bits
from torch_deltasync.codecs import TensorDelta
from torch_deltasync.manifest import load_manifest, seal_manifest
from torch_deltasync.codecs import PackedCodec
from torch_deltasync.codecs._bits import leb128_decode as _leb128_decode, leb128_encode as _leb128_encode
from torch_deltasync.testing import adam_step, first_difference, tiny_qwen3

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IDT = {torch.bfloat16: np.int16, torch.float16: np.int16, torch.float32: np.int32,
       torch.float64: np.int64, torch.uint8: np.int8}


def _from_bits(b: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b)).view(dtype)


def _bits_np(t: torch.Tensor) -> np.ndarray:
    return bits(t.contiguous()).numpy().copy()


def roundtrip(pos: torch.Tensor, new: torch.Tensor, old: torch.Tensor, numel: int,
              codec: PackedCodec | None = None) -> tuple[dict, TensorDelta]:
    """Encode, decode and check bit-exactness; return the parts and the decoded delta."""
    codec = codec or get_codec("packed")
    parts = codec.encode(pos, new, old, numel=numel)
    assert set(parts) == {"packed"} and parts["packed"].dtype == torch.uint8
    d = codec.decode(parts, numel=numel, count=pos.numel(), dtype=new.dtype)
    assert d.positions.dtype == torch.int64
    assert torch.equal(d.positions, pos.to(torch.int64))
    got = d.resolve(old)
    assert got.dtype == new.dtype
    assert torch.equal(bits(got), bits(new)), "decoded values differ from the encoded ones"
    return parts, d


def make_change_set(seed: int, dtype: torch.dtype, numel: int, density: float, mix: dict[str, float]):
    """Positions, old and new values of a random change set.

    ``mix`` gives the share of each kind of change: ``ulp`` (+-1..3 steps on the bit pattern),
    ``mid`` (up to +-200 steps), ``wide`` (up to +-30000 steps), ``many`` (up to +-2**(W-2)
    steps), ``flip`` (sign flip), ``special`` (NaN payloads, +-Inf, +-0), ``random`` (any bit
    pattern), ``same`` (bits unchanged).
    """
    rng = np.random.default_rng(seed)
    idt = IDT[dtype]
    W = np.dtype(idt).itemsize * 8
    k = int(round(numel * density))
    pos = np.sort(rng.choice(numel, size=k, replace=False)) if k else np.empty(0, np.int64)
    # Old values: realistic weights with some special patterns mixed in.
    old = torch.randn(k, generator=torch.Generator().manual_seed(seed)).mul_(0.02).to(dtype)
    ob = _bits_np(old).astype(np.int64)
    kinds = list(mix)
    kind = rng.choice(len(kinds), size=k, p=np.array([mix[x] for x in kinds]) / sum(mix.values()))
    nb = ob.copy()
    mod = 1 << W
    for i, name in enumerate(kinds):
        m = kind == i
        n = int(m.sum())
        if name == "ulp":
            nb[m] = ob[m] + rng.choice([-3, -2, -1, 1, 2, 3], size=n, p=[.02, .04, .44, .44, .04, .02])
        elif name == "mid":
            nb[m] = ob[m] + rng.integers(-200, 201, size=n)
        elif name == "wide":
            nb[m] = ob[m] + rng.integers(-30000, 30001, size=n)
        elif name == "many":
            nb[m] = ob[m] + rng.integers(-(1 << (W - 2)), 1 << (W - 2), size=n)
        elif name == "flip":
            nb[m] = ob[m] ^ (1 << (W - 1))
        elif name == "special":
            spec = _bits_np(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], dtype=dtype))
            nb[m] = spec.astype(np.int64)[rng.integers(0, 5, size=n)]
            # NaN payloads: exponent all ones, random non-zero mantissa.
            nan = rng.random(n) < 0.5
            mant = {16: (10 if dtype == torch.float16 else 7), 32: 23}[W]
            exp_ones = ((1 << (W - 1 - mant)) - 1) << mant
            payload = rng.integers(1, 1 << mant, size=n) | exp_ones
            nb[np.flatnonzero(m)[nan]] = payload[nan]
        elif name == "random":
            nb[m] = rng.integers(0, mod, size=n)
        elif name == "same":
            pass
    nb = ((nb % mod) + mod) % mod  # wrap to W bits
    nb = np.where(nb >= mod // 2, nb - mod, nb).astype(idt)
    new = _from_bits(nb, dtype)
    return torch.from_numpy(pos.astype(np.int64)), new, old


# --- golden bytes (hand-written from docs/format.md) -------------------------------------------------


ZERO_CK = bytes(8)  # a base checksum of 0 (only relative steps are checked against it)


def _ck(values: torch.Tensor, positions) -> bytes:
    """The header's base checksum: format section 6's checksum of the old values, 8 bytes LE."""
    from torch_deltasync.checksum import checksum

    return checksum(values, torch.tensor(positions)).to_bytes(8, "little")


def _h(*modes: int, ck: bytes = ZERO_CK) -> bytes:
    """A header's fixed part: version, positions mode, gap shift, values mode, code width, checksum."""
    return bytes(modes) + ck


def _bf16(values):
    return torch.tensor(values, dtype=torch.bfloat16)


def _step(old: torch.Tensor, steps) -> torch.Tensor:
    return (bits(old).to(torch.int32) + torch.tensor(steps, dtype=torch.int32)).to(torch.int16).view(torch.bfloat16)


def test_golden_steps_blob():
    # positions 3, 4, 10 of 1024; steps +1, -1, +1.
    # gaps 3, 0, 5; shift r = 0 -> gap bytes 03 00 05 (stored: 3 bytes < 24), no escapes or low bits.
    # zigzag 2, 1, 2 -> 2-bit codes 1, 0, 1 -> 0b00_01_00_01 = 0x11.
    old = _bf16([1.0, 2.0, -0.5])
    new = _step(old, [1, -1, 1])
    blob = (_h(1, 0, 0, 1, 2, ck=_ck(old, [3, 4, 10]))  # version, gaps, r = 0, steps, b = 2, checksum
            + bytes([0, 3, 0, 0, 0, 0,  # positions: stored 3 B; pos_ext, pos_low: empty
                     0, 1, 0, 0, 0, 0,  # codes: stored 1 B; ext, raw: empty
                     3, 0, 5, 0x11]))
    pos = torch.tensor([3, 4, 10])
    parts, d = roundtrip(pos, new, old, 1024)
    assert bytes(parts["packed"].tolist()) == blob
    d2 = get_codec("packed").decode({"packed": torch.tensor(list(blob), dtype=torch.uint8)},
                                    numel=1024, count=3, dtype=torch.bfloat16)
    assert d2.steps.tolist() == [1, -1, 1] and d2.relative is None


def test_golden_escapes_decode():
    # Three changes at 0, 200, 201 of 300 with b = 2 (M = 3):
    #   +1     -> z 2  -> code 1
    #   +5     -> z 10 -> code 3 (escape), ext e = z - M = 7
    #   raw    -> code 3, ext e = 0, raw value 0xBF80 (-1.0) as byte planes 80 | BF
    # gaps 0, 199, 0 -> gap bytes 00 C7 00 (r = 0, all below 255).
    # codes 1, 3, 3 -> 0b00_11_11_01 = 0x3D.
    old = _bf16([0.25, 3.0, 1.0])
    blob = _h(1, 0, 0, 1, 2, ck=_ck(old, [0, 200, 201])) + bytes([
                  0, 3, 0, 0, 0, 0,  # positions stored, 3 B
                  0, 1,              # codes stored, 1 B
                  0, 2,              # ext stored, 2 B
                  0, 2,              # raw stored, 2 B
                  0x00, 0xC7, 0x00,
                  0x3D,
                  7, 0,
                  0x80, 0xBF])
    d = get_codec("packed").decode({"packed": torch.tensor(list(blob), dtype=torch.uint8)},
                                   numel=300, count=3, dtype=torch.bfloat16)
    assert d.positions.tolist() == [0, 200, 201]
    assert d.relative.tolist() == [True, True, False]
    got = d.resolve(old)
    assert bits(got).tolist() == (bits(old)[:2] + torch.tensor([1, 5], dtype=torch.int16)).tolist() + [-16512]


def test_golden_split_gaps_decode():
    # Positions 1030, 1031, 2000 of 5000, gap shift r = 2, raw bf16 values:
    #   gaps 1030, 0, 968 -> high parts 257, 0, 242 and low 2-bit parts 2, 0, 0.
    #   gap bytes FF 00 F2 (255 escapes), pos_ext varint 257 - 255 = 02,
    #   pos_low fields 2, 0, 0 -> bits 01 00 00 (LSB first) -> byte 0x02.
    vals = [0x3F80, 0xBF80, 0x0001]
    blob = _h(1, 0, 2, 0, 0) + bytes([
                  0, 3, 0, 1, 0, 1,     # positions 3 B, pos_ext 1 B, pos_low 1 B
                  0, 0, 0, 0, 0, 6,     # raw values 6 B
                  0xFF, 0x00, 0xF2, 0x02, 0x02]
                 + [v & 0xFF for v in vals] + [v >> 8 for v in vals])
    d = get_codec("packed").decode({"packed": torch.tensor(list(blob), dtype=torch.uint8)},
                                   numel=5000, count=3, dtype=torch.bfloat16)
    assert d.positions.tolist() == [1030, 1031, 2000]
    assert d.steps is None
    assert [v & 0xFFFF for v in bits(d.values).tolist()] == vals


def test_golden_bitmap_raw_blob():
    # Every element of an 8-element fp16 tensor changes to random bits: bitmap FF and raw values.
    numel = 8
    pos = torch.arange(numel)
    old = torch.zeros(numel, dtype=torch.float16)
    vals = [0x1234, 0x7C01, 0xFC00, 0x8000, 0x0001, 0x3C00, 0xABCD, 0x5555]
    new = torch.tensor(vals, dtype=torch.int32).to(torch.int16).view(torch.float16)
    lo = [v & 0xFF for v in vals]
    hi = [v >> 8 for v in vals]
    blob = _h(1, 1, 0, 0, 0) + bytes([0, 1, 0, 0, 0, 0,  0, 0, 0, 0, 0, 16,  0xFF] + lo + hi)
    d = get_codec("packed").decode({"packed": torch.tensor(list(blob), dtype=torch.uint8)},
                                   numel=numel, count=numel, dtype=torch.float16)
    assert d.steps is None
    assert torch.equal(d.positions, pos)
    assert torch.equal(bits(d.values), bits(new))
    roundtrip(pos, new, old, numel)


# --- round trips -----------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(list(DTYPES.values())),
    numel=st.one_of(st.integers(0, 64), st.integers(65, 20_000)),
    density=st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.01]), st.floats(0.0, 1.0)),
    ulp=st.floats(0.0, 1.0),
    mid=st.floats(0.0, 1.0),
    wide=st.floats(0.0, 1.0),
    many=st.floats(0.0, 1.0),
    flip=st.floats(0.0, 0.3),
    special=st.floats(0.0, 0.3),
    random=st.floats(0.0, 0.3),
    same=st.floats(0.0, 0.1),
)
def test_roundtrip_property(seed, dtype, numel, density, ulp, mid, wide, many, flip, special, random, same):
    mix = {"ulp": ulp + 1e-3, "mid": mid, "wide": wide, "many": many, "flip": flip, "special": special,
           "random": random, "same": same}
    pos, new, old = make_change_set(seed, dtype, numel, density, mix)
    roundtrip(pos, new, old, numel)


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("density", [0.001, 0.03, 0.3, 1.0])
def test_roundtrip_rl_like(dtype, density):
    pos, new, old = make_change_set(7, dtype, 50_000, density, {"ulp": 0.97, "many": 0.02, "flip": 0.01})
    roundtrip(pos, new, old, 50_000)


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("b", [0, 2, 4, 8, 16])
@pytest.mark.parametrize("r", [0, 1, 5, 20])
def test_every_code_width_and_gap_shift(monkeypatch, dtype, b, r):
    # The encoder picks b and r by estimates; force each one so every decoder path is exercised.
    monkeypatch.setattr(PackedCodec, "_force_code_bits", b)
    monkeypatch.setattr(PackedCodec, "_force_gap_shift", r)
    mix = {"ulp": 0.6, "mid": 0.2, "wide": 0.1, "many": 0.05, "flip": 0.02, "special": 0.02, "same": 0.01}
    numel = 2_000_000  # sparse enough that even 20-bit gap fields beat the bitmap
    pos, new, old = make_change_set(b * 100 + r, dtype, numel, 0.005, mix)
    parts, d = roundtrip(pos, new, old, numel)
    blob = parts["packed"]
    assert blob[2].item() == r and blob[3].item() == (1 if b else 0) and blob[4].item() == b
    if b:
        assert d.relative is not None  # the "same", "flip" and "special" entries escape to raw values


def test_steps_refuse_old_values_other_than_the_senders():
    # Steps are relative: applied to a drifted base they would silently keep the drift, and the
    # additive per-tensor checksum cannot see it. The blob carries the checksum of the old values.
    pos, new, old = make_change_set(5, torch.bfloat16, 10_000, 0.05, {"ulp": 1.0})
    _, d = roundtrip(pos, new, old, 10_000)
    assert d.steps is not None and d.base_checksum is not None
    drifted = old.clone()
    drifted.view(torch.int16)[7] ^= 1
    with pytest.raises(ChecksumMismatchError, match="base"):
        d.resolve(drifted)
    assert d.select(torch.arange(d.numel) % 2 == 0).base_checksum is None  # a subset cannot be checked


def test_empty():
    codec = get_codec("packed")
    for numel in (0, 1, 1000):
        e = torch.empty(0, dtype=torch.bfloat16)
        parts, d = roundtrip(torch.empty(0, dtype=torch.int64), e, e, numel)
        assert d.numel == 0 and parts["packed"].numel() == 25  # the header alone: 5 + 8 + 6 x 2 bytes
    with pytest.raises(CorruptObjectError):  # a count that the empty streams cannot hold
        codec.decode(parts, numel=1000, count=1, dtype=torch.bfloat16)


def test_huge_gaps_and_positions():
    # Positions near the top of a 2**62-element tensor: wide gap fields, no dense fallback.
    numel = 2**62
    pos = torch.tensor([0, 1, 2**40, 2**61 + 7, numel - 2, numel - 1], dtype=torch.int64)
    old = _bf16([0.5] * 6)
    new = _step(old, [1, 1, -1, 2, -3, 100])
    parts, _ = roundtrip(pos, new, old, numel)
    assert parts["packed"].numel() < 25 + 6 * 8 + 6 * 2  # header + below raw int64 positions + bf16 values


def test_unchanged_entries_are_shipped_exactly():
    # The codec does not require bits to differ (steps of 0 are sent as raw escapes).
    steps = [0, 1, 0, -1] * 500  # enough +-1 steps that the encoder picks step coding
    old = torch.randn(2000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    new = _step(old, steps)
    _, d = roundtrip(torch.arange(2000), new, old, 2000)
    assert d.relative is not None and d.relative.tolist() == [s != 0 for s in steps]


@pytest.mark.parametrize("dtype", [torch.float64] + [d for d in (getattr(torch, "float8_e4m3fn", None),) if d])
def test_other_widths(dtype):
    rng = np.random.default_rng(1)
    k, numel = 500, 3000
    pos = torch.from_numpy(np.sort(rng.choice(numel, k, replace=False)))
    old = torch.randn(k, dtype=torch.float64).to(dtype)
    ob = bits(old)
    step = torch.from_numpy(rng.integers(-2, 3, size=k)).to(ob.dtype)
    new = (ob + step).view(dtype)
    _, d = roundtrip(pos, new, old, numel)
    if dtype == torch.float64:
        assert d.steps is None  # 8-byte dtypes ship raw values


def test_sign_flips_and_nan_payloads_all_dtypes():
    for dtype in DTYPES.values():
        pos, new, old = make_change_set(3, dtype, 4000, 0.25, {"flip": 1.0, "special": 1.0})
        roundtrip(pos, new, old, 4000)


@pytest.mark.parametrize("density", [0.3, 0.7, 0.99, 1.0])
def test_dense_fallback_is_no_larger_than_a_dense_copy(density):
    # Fresh random values (e.g. a re-initialised tensor): positions must cost no more than a
    # bitmap and values no more than raw bit patterns, so the blob stays below a dense copy.
    numel = 65536
    g = torch.Generator().manual_seed(int(density * 100))
    old = torch.randn(numel, generator=g).mul_(0.02).to(torch.bfloat16)
    new = torch.randn(numel, generator=g).mul_(0.02).to(torch.bfloat16)
    changed = torch.rand(numel, generator=g) < density
    new = torch.where(changed, new, old)
    pos = (bits(old) != bits(new)).nonzero().squeeze(1)
    parts, d = roundtrip(pos, new[pos], old[pos], numel)
    k = pos.numel()
    assert parts["packed"].numel() <= numel // 8 + 2 * k + 32
    if density >= 0.99:
        assert parts["packed"].numel() <= 2 * numel


def test_compresses_rl_steps_well():
    # 2% density, mostly +-1 ULP: raw costs 6 B per change; packed must be far below 1.5.
    pos, new, old = make_change_set(11, torch.bfloat16, 400_000, 0.02, {"ulp": 0.98, "many": 0.01, "flip": 0.01})
    parts, _ = roundtrip(pos, new, old, 400_000)
    per = parts["packed"].numel() / pos.numel()
    assert per < 1.5, per


def test_encoder_rejects_bad_input():
    codec = get_codec("packed")
    v = _bf16([1.0, 2.0])
    with pytest.raises(ValueError):
        codec.encode(torch.tensor([5, 5]), v, v, numel=10)
    with pytest.raises(ValueError):
        codec.encode(torch.tensor([1, 10]), v, v, numel=10)
    with pytest.raises(ValueError):
        codec.encode(torch.tensor([1, 2]), v, v[:1], numel=10)


# --- varints ---------------------------------------------------------------------------------------


def test_leb128_known_values():
    # Protocol Buffers examples: 150 -> 96 01; 300 -> AC 02; 2**63 - 1 -> 8 x FF, 7F.
    v = np.array([0, 1, 127, 128, 150, 300, 2**63 - 1], dtype=np.uint64)
    enc = _leb128_encode(v).tobytes()
    assert enc == bytes([0, 1, 0x7F, 0x80, 0x01, 0x96, 0x01, 0xAC, 0x02] + [0xFF] * 8 + [0x7F])
    assert _leb128_decode(np.frombuffer(enc, np.uint8), 7, 2**63 - 1, "t").tolist() == v.tolist()


@pytest.mark.parametrize("buf,n,limit,why", [
    (b"\x80", 1, 1000, "cut off"),
    (b"\x01\x80", 2, 1000, "cut off"),
    (b"\x81\x00", 1, 1000, "overlong"),
    (b"\x01\x02", 1, 1000, "two varints, one expected"),
    (b"\x01", 2, 1000, "one varint, two expected"),
    (b"\xff\x07", 1, 1000, "1023 above the limit"),
    (b"\xff\xff\x03", 1, 1000, "3 bytes where 2 suffice for the limit"),
    (b"\x05", 0, 1000, "bytes where none expected"),
])
def test_leb128_rejects(buf, n, limit, why):
    with pytest.raises(CorruptObjectError):
        _leb128_decode(np.frombuffer(buf, np.uint8), n, limit, why)


@pytest.mark.parametrize("r", [1, 3, 8, 13, 56])
def test_bit_fields_roundtrip_across_chunks(r):
    # More fields than one encoder chunk (2**18), and a count that does not fill the last byte.
    from torch_deltasync.codecs._bits import pack_bits as _pack_bits, unpack_bits as _unpack_bits

    n = (1 << 18) + 13
    v = np.random.default_rng(r).integers(0, 1 << r, size=n, dtype=np.uint64)
    buf = _pack_bits(v, r)
    assert buf.size == -(-n * r // 8)
    assert np.array_equal(_unpack_bits(buf, n, r, "t"), v)
    # Field i starts at bit i * r, least significant bit first.
    assert _pack_bits(np.array([2, 0, 0], np.uint64), 2).tolist() == [0x02]
    assert _pack_bits(np.array([1, 1, 1], np.uint64), 3).tolist() == [0b01001001, 0b0]


# --- defensive decoding ----------------------------------------------------------------------------


def _blob(*fields: bytes) -> dict:
    return {"packed": torch.tensor(list(b"".join(fields)), dtype=torch.uint8)}


def _decode(parts, numel=1024, count=3, dtype=torch.bfloat16):
    return get_codec("packed").decode(parts, numel=numel, count=count, dtype=dtype)


GOOD = [_h(1, 0, 0, 1, 2), bytes([0, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]), bytes([3, 0, 5, 0x11])]
HEAD, DESC, PAY = GOOD


def test_good_blob_decodes():
    assert _decode(_blob(*GOOD)).positions.tolist() == [3, 4, 10]


def _desc(pos=3, pos_ext=0, pos_low=0, codes=1, ext=0, raw=0) -> bytes:
    """Stream descriptors of stored streams with these lengths (each < 128)."""
    return bytes([0, pos, 0, pos_ext, 0, pos_low, 0, codes, 0, ext, 0, raw])


@pytest.mark.parametrize("fields,why", [
    ([_h(2, 0, 0, 1, 2), DESC, PAY], "unknown layout version"),
    ([_h(1, 2, 0, 1, 2), DESC, PAY], "unknown positions mode"),
    ([_h(1, 0, 0, 2, 2), DESC, PAY], "unknown values mode"),
    ([_h(1, 0, 0, 1, 3), DESC, PAY], "code width 3"),
    ([_h(1, 0, 0, 0, 2), DESC, PAY], "raw values with a code width"),
    ([_h(1, 0, 57, 1, 2), DESC, PAY], "gap shift above 56"),
    ([_h(1, 1, 1, 1, 2), DESC, PAY], "gap shift with a bitmap"),
    ([HEAD, DESC, bytes([3, 0, 5])], "blob shorter than its streams"),
    ([HEAD, DESC, PAY + b"\x00"], "trailing byte"),
    ([HEAD, DESC[:10]], "header cut off"),
    ([HEAD, DESC, bytes([3, 0, 5, 0x51])], "padding bits set"),
    ([HEAD, DESC, bytes([3, 0, 5, 0x31])], "an escape code without escapes"),
    ([HEAD, _desc(pos_ext=2), bytes([3, 0, 255, 0xCD, 0x06, 0x11])], "gap 1100 > numel - 1"),
    ([_h(1, 0, 2, 1, 2), _desc(pos_low=1), bytes([254, 254, 0, 0x0F, 0x11])], "positions 2039, 2040 >= numel"),
    ([_h(1, 0, 2, 1, 2), _desc(pos_low=1), bytes([3, 0, 5, 0x40, 0x11])], "low-bit padding set"),
    ([_h(1, 0, 2, 1, 2), _desc(pos_low=2), bytes([3, 0, 5, 0, 0, 0x11])], "too many low-bit bytes"),
    ([HEAD, _desc(pos=2), bytes([3, 0, 0x11])], "two gap bytes for three changes"),
    ([HEAD, _desc(pos_ext=1), bytes([3, 0, 5, 7, 0x11])], "gap escape bytes without escapes"),
    ([HEAD, _desc(pos_ext=1), bytes([3, 0, 255, 0x80, 0x11])], "cut-off gap escape varint"),
    ([HEAD, _desc(codes=2), bytes([3, 0, 5, 0x11, 0])], "codes stream too long"),
    ([HEAD, _desc(ext=1), bytes([3, 0, 5, 0x11, 1])], "escape bytes without escapes"),
    ([HEAD, bytes([2]) + DESC[1:], PAY], "unknown stream method"),
    ([HEAD, DESC[:11] + bytes([0x80, 0x00])], "overlong header varint"),
])
def test_malformed_blobs_raise(fields, why):
    with pytest.raises(CorruptObjectError):
        _decode(_blob(*fields))


def test_wrong_part_dtype_or_name():
    blob = _blob(*GOOD)["packed"]
    with pytest.raises(CorruptObjectError):
        _decode({"packed": blob.to(torch.int16)})
    with pytest.raises(CorruptObjectError):
        _decode({"idx": blob})
    with pytest.raises(CorruptObjectError):
        _decode({"packed": blob, "extra": blob})
    with pytest.raises(CorruptObjectError):
        _decode({"packed": blob.reshape(1, -1)})
    with pytest.raises(CorruptObjectError):
        _decode(_blob(*GOOD), count=4)  # the object's count disagrees with the streams
    with pytest.raises(CorruptObjectError):
        _decode(_blob(*GOOD), numel=10)  # position 10 outside a 10-element tensor
    for count, numel in ((3.0, 1024), (True, 1024), (3, 1024.0), ("3", 1024)):  # (not numba's typing errors)
        with pytest.raises(TypeError, match="count and numel must be integers"):
            _decode(_blob(*GOOD), count=count, numel=numel)
    assert _decode(_blob(*GOOD), count=np.int64(3), numel=np.int32(1024)).numel == 3


def test_positions_that_wrap_around_2_64_are_rejected():
    # numel = 2**62; five maximal gaps: positions 2**62-1, 2**63-1, ... wrap to 2**62-1 again.
    ext = _leb128_encode(np.array([2**62 - 1 - 255] * 5, np.uint64)).tobytes()  # r = 0: all escape
    codes = bytes([0, 0])  # five 2-bit codes of 0: z = 1 (step -1)
    blob = _blob(_h(1, 0, 0, 1, 2), bytes([0, 5, 0, len(ext), 0, 0, 0, 2, 0, 0, 0, 0]), bytes([255] * 5), ext, codes)
    with pytest.raises(CorruptObjectError, match="outside"):
        _decode(blob, numel=2**62, count=5)


def _zstd_stream(payload: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(level=3, **kw).compress(payload)


def test_zstd_bombs_and_lies_are_refused_before_decompressing():
    count, numel = 3, 1024
    bomb = _zstd_stream(bytes(50_000_000))  # 50 MB of zeros in a few KB
    assert len(bomb) < 10_000

    def with_positions(method, raw_len, payload):
        lens = _leb128_encode(np.array([raw_len] + ([len(payload)] if method else []), np.uint64)).tobytes()
        return _blob(_h(1, 0, 0, 1, 2), bytes([method]), lens, bytes([0, 0, 0, 0, 0, 1, 0, 0, 0, 0]), payload,
                     bytes([0x11]))

    # The header declares 50 MB of positions: more than 3 changes can need, refused up front.
    with pytest.raises(CorruptObjectError, match="allow"):
        _decode(with_positions(1, 50_000_000, bomb), numel=numel, count=count)
    # The header declares 3 bytes but the frame says 50 MB: refused before decompressing.
    with pytest.raises(CorruptObjectError, match="declares"):
        _decode(with_positions(1, 3, bomb), numel=numel, count=count)
    # A frame without a content size.
    frame = _zstd_stream(bytes([3, 0, 5]), write_content_size=False)
    with pytest.raises(CorruptObjectError, match="declares -1"):
        _decode(with_positions(1, 3, frame), numel=numel, count=count)
    # A valid frame with trailing data inside the stream.
    frame = _zstd_stream(bytes([3, 0, 5]))
    with pytest.raises(CorruptObjectError, match="corrupt zstd"):
        _decode(with_positions(1, 3, frame + b"\x00"), numel=numel, count=count)
    # Not a frame at all.
    with pytest.raises(CorruptObjectError, match="not a zstd frame"):
        _decode(with_positions(1, 3, b"\x00" * 12), numel=numel, count=count)
    # A compressed empty stream is not canonical.
    e = _zstd_stream(b"")
    with pytest.raises(CorruptObjectError, match="empty"):
        _decode(_blob(HEAD, bytes([0, 3, 0, 0, 0, 0, 0, 1, 1, 0, len(e), 0, 0]), bytes([3, 0, 5, 0x11]), e))
    # And the honest frame decodes.
    assert _decode(with_positions(1, 3, frame)).positions.tolist() == [3, 4, 10]


def _check_well_formed(d: TensorDelta, numel: int, count: int, dtype: torch.dtype, old: torch.Tensor):
    """What any successfully decoded delta must satisfy, whatever bytes produced it."""
    p = d.positions
    assert p.dtype == torch.int64 and p.shape == (count,)
    if count:
        assert int(p[0]) >= 0 and int(p[-1]) < numel
        assert bool((p[1:] > p[:-1]).all())
    assert d.values.dtype == dtype and d.values.shape == (count,)
    if d.steps is not None:
        assert d.steps.shape == (count,) and d.steps.dtype == bits(d.values).dtype
        assert d.relative is None or (d.relative.dtype == torch.bool and d.relative.shape == (count,))
    # Applying it cannot write out of bounds: index_copy_ validates, and positions are in range.
    # Steps resolved against other old values than the sender's are refused (a clean error).
    target = torch.zeros(numel, dtype=dtype)
    try:
        new = d.resolve(old[:count] if old.numel() >= count else torch.zeros(count, dtype=dtype))
    except ChecksumMismatchError:
        return
    target.index_copy_(0, p, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fuzz_mutated_streams(dtype):
    """Random mutations of valid blobs: a clean CorruptObjectError or a well-formed delta."""
    rng = np.random.default_rng(1234)
    codec = get_codec("packed")
    cases = []
    for seed, numel, density, mix in [
        (1, 5000, 0.02, {"ulp": 0.95, "many": 0.04, "flip": 0.01}),  # zstd streams, escapes, raw
        (2, 300, 0.1, {"ulp": 0.8, "special": 0.2}),  # small: stored streams
        (3, 2000, 0.9, {"random": 1.0}),  # bitmap + raw values
    ]:
        pos, new, old = make_change_set(seed, dtype, numel, density, mix)
        blob = codec.encode(pos, new, old, numel=numel)["packed"].numpy().tobytes()
        cases.append((blob, numel, pos.numel(), old))
    outcomes = {"error": 0, "ok": 0}
    for trial in range(600):
        blob, numel, count, old = cases[trial % len(cases)]
        b = bytearray(blob)
        op = rng.integers(0, 6)
        if op == 0:  # flip random bits
            for _ in range(rng.integers(1, 4)):
                i = rng.integers(0, len(b))
                b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1:  # random byte values, often in the header
            for _ in range(rng.integers(1, 3)):
                i = rng.integers(0, min(len(b), 24) if rng.random() < 0.6 else len(b))
                b[i] = int(rng.integers(0, 256))
        elif op == 2:  # truncate
            b = b[: rng.integers(0, len(b))]
        elif op == 3:  # insert bytes
            i = rng.integers(0, len(b) + 1)
            b[i:i] = bytes(rng.integers(0, 256, size=rng.integers(1, 5)).astype(np.uint8))
        elif op == 4:  # delete a span
            i = rng.integers(0, len(b))
            del b[i : i + rng.integers(1, 8)]
        else:  # lie about the count or the size of the tensor
            count = max(0, count + int(rng.integers(-2, 3)))
            numel = max(count, numel + int(rng.integers(-50, 50)))
        try:
            d = codec.decode({"packed": torch.tensor(list(b), dtype=torch.uint8)}, numel=numel, count=count, dtype=dtype)
        except CorruptObjectError:
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        _check_well_formed(d, numel, count, dtype, old)
    assert outcomes["error"] > 300, outcomes  # most mutations must be caught


@settings(max_examples=300, deadline=None)
@given(
    head=st.tuples(st.just(1), st.integers(0, 1), st.integers(0, 3), st.integers(0, 1), st.sampled_from([0, 2, 4, 8, 16])),
    body=st.binary(max_size=64),
    numel=st.integers(0, 300),
    count=st.integers(0, 40),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_fuzz_arbitrary_bytes(head, body, numel, count, dtype):
    """Plausible headers followed by arbitrary bytes: never a crash, hang or out-of-range result."""
    count = min(count, numel)
    parts = {"packed": torch.tensor(list(bytes(head) + body), dtype=torch.uint8)}
    try:
        d = get_codec("packed").decode(parts, numel=numel, count=count, dtype=dtype)
    except CorruptObjectError:
        return
    _check_well_formed(d, numel, count, dtype, torch.zeros(count, dtype=dtype))


# --- end to end -------------------------------------------------------------------------------------


def test_default_codec_is_packed(tmp_path):
    model = torch.nn.Linear(8, 4)
    assert DeltaSender(model, LocalStore(tmp_path / "b")).codec.name == "packed"


def test_end_to_end_sender_receiver_bit_exact(tmp_path):
    """Packed deltas through a store: every version bit-exact on the receiver, whether it follows
    every version, skips versions (a chain of step-coded deltas composed before applying), or
    joins late (anchor + deltas)."""
    torch.manual_seed(0)
    model = tiny_qwen3("tiny", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # large steps: escapes and raw values occur
    gen = torch.Generator().manual_seed(0)
    store = LocalStore(tmp_path / "bucket")
    raw_store = LocalStore(tmp_path / "raw")
    sender = DeltaSender(model, store, codec="packed", anchor_every=6)
    raw_sender = DeltaSender(model, raw_store, codec="raw", anchor_every=6)
    follower = tiny_qwen3("tiny", seed=1, dtype=torch.bfloat16)
    skipper = tiny_qwen3("tiny", seed=2, dtype=torch.bfloat16)
    r_follow = DeltaReceiver(follower, store)
    r_skip = DeltaReceiver(skipper, store)
    packed_bytes = raw_bytes = 0
    for step in range(9):
        if step:
            for g in opt.param_groups:
                g["lr"] = 1e-3 if step % 2 else 3e-5  # alternate big and RL-sized steps
            adam_step(model, opt, generator=gen)
        v = sender.publish()
        assert raw_sender.publish() == v
        if sender.last_stats.kind == "delta":
            packed_bytes += sender.last_stats.nbytes
            raw_bytes += raw_sender.last_stats.nbytes
            assert load_manifest(store, v).codec == "packed"
        assert r_follow.update() == v
        assert first_difference(follower, model) is None, f"version {v}"
        if step % 3 == 2:
            assert r_skip.update() == v
            assert r_skip.last_stats.versions_applied == 3
            if v == 5:  # three step-coded deltas composed on the receiver's own values
                assert r_skip.last_stats.path == "delta"
            assert first_difference(skipper, model) is None, f"version {v} (skipping)"
        r_follow.verify()
    late = tiny_qwen3("tiny", seed=3, dtype=torch.bfloat16)
    r_late = DeltaReceiver(late, store)
    assert r_late.update() == v and r_late.last_stats.path == "anchor"
    assert r_late.last_stats.versions_applied > 1  # anchor + packed deltas
    assert first_difference(late, model) is None
    assert packed_bytes < raw_bytes / 2, (packed_bytes, raw_bytes)


@pytest.mark.parametrize("tamper", ["header", "zstd", "codes"])
def test_receiver_refuses_a_tampered_packed_object(tmp_path, tamper):
    """A delta object whose packed blob was altered (and whose sha256 in the manifest was updated
    to match, as an attacker with write access would) is refused; the receiver keeps its weights."""
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from torch_deltasync.format import read_header, sha256_hex
    from torch_deltasync.keys import manifest_key
    from torch_deltasync.testing import state_bits

    model = tiny_qwen3("tiny", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(model, store, anchor_every=100)
    replica = tiny_qwen3("tiny", seed=1, dtype=torch.bfloat16)
    receiver = DeltaReceiver(replica, store)
    sender.publish()
    receiver.update()
    held = state_bits(replica)
    adam_step(model, opt, generator=torch.Generator().manual_seed(0))
    v = sender.publish()

    m = load_manifest(store, v)
    key = m.objects[0].key
    data = store.get(key)
    _, meta = read_header(data)
    tensors = st_load(data)
    name = max(tensors, key=lambda n: tensors[n].numel())  # the largest blob: zstd streams
    blob = tensors[name].clone()
    if tamper == "header":
        blob[4] = 3  # code width 3 does not exist
    elif tamper == "zstd":
        assert blob[13].item() == 1, "expected a zstd-compressed positions stream"
        blob[blob.numel() // 3] ^= 0x5A  # inside the compressed streams
    else:
        blob[-1] ^= 0x01  # last byte of the last stream: decodes, but to other values
    tensors[name] = blob
    bad = st_save(tensors, metadata=meta)
    store.put(key, bad)
    doc = json.loads(store.get(manifest_key(v)))
    doc["objects"][0].update(nbytes=len(bad), sha256=sha256_hex(bad))
    store.put(manifest_key(v), seal_manifest(doc))

    with pytest.raises(CorruptObjectError):
        receiver.update()
    assert receiver.version == v - 1
    after = state_bits(replica)
    assert all(torch.equal(held[n], after[n]) for n in held), "a refused update changed the weights"


def test_cli_inspect_and_verify_a_packed_run(tmp_path, capsys):
    from helpers import make_mlp, train_step

    from torch_deltasync.cli import main

    trainer = make_mlp(0)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(trainer, store, anchor_every=3)  # packed by default
    states = []  # bf16 bit patterns of every published version
    for _ in range(4):
        train_step(trainer, opt, gen)
        sender.publish()
        states.append({n: t.detach().to(torch.bfloat16).view(torch.int16).clone() for n, t in trainer.state_dict().items()})
    changed = sum(int((states[2][n] != states[1][n]).sum()) for n in states[2])  # bits that differ, 1 -> 2
    obj = store.root / "objects" / f"{2:012d}" / "delta-r00000-of00001.safetensors"
    assert main(["inspect", str(obj)]) == 0
    out = capsys.readouterr().out
    assert "codec: packed" in out and f"{changed:,} changed elements" in out
    assert main(["verify", str(store.root)]) == 0
    assert "4/4 versions verified" in capsys.readouterr().out


@pytest.mark.parametrize("threads", [1, 2])
def test_object_decoded_on_threads_names_the_corrupt_tensor(tmp_path, threads):
    # decode_delta decodes an object's tensors on a thread pool; a corrupt tensor is still named
    # in the error, and the others decode to what was published.
    from safetensors.torch import load as st_load, save as st_save

    from torch_deltasync.format import decode_delta, read_delta, read_header

    g = torch.Generator().manual_seed(0)
    model = {n: torch.randn(3000, generator=g) for n in ("a", "b", "c")}
    store = LocalStore(tmp_path / "bucket")
    sender = DeltaSender(model, store, anchor_every=100)
    sender.publish()
    before = {n: t.to(torch.bfloat16) for n, t in model.items()}
    for t in model.values():
        t[::7] += 0.01
    v = sender.publish()
    sender.close()
    m = load_manifest(store, v)
    o = m.delta_objects[0]
    data = store.get(o.key)
    good = decode_delta(data, m, o, threads=threads)
    for n, t in model.items():
        want = (bits(t.to(torch.bfloat16)) != bits(before[n])).nonzero().squeeze(1)
        assert torch.equal(good[n].positions, want)
        assert torch.equal(bits(good[n].resolve(before[n][want])), bits(t.to(torch.bfloat16))[want])
    tensors = st_load(data)
    blob = tensors["b:packed"].clone()
    blob[0] = 99  # the layout version byte
    tensors["b:packed"] = blob
    _, meta = read_header(data, "test")
    bad = st_save(tensors, metadata=meta)
    with pytest.raises(CorruptObjectError, match=rf"object {o.key}: tensor 'b': .*packed layout version 99"):
        decode_delta(bad, m, o, threads=threads)
    # read_delta checks the object and its counts but decodes nothing: the receiver decodes each
    # tensor where it stages it; the corrupt one fails there, named the same way.
    encoded = read_delta(bad, m, o)
    assert {n: e.count for n, e in encoded.items()} == {n: good[n].numel for n in "abc"}
    assert torch.equal(encoded["a"].decode().positions, good["a"].positions)
    with pytest.raises(CorruptObjectError, match=rf"object {o.key}: tensor 'b': .*packed layout version 99"):
        encoded["b"].decode()


@pytest.mark.parametrize("mix", [{"random": 1.0}, {"wide": 1.0}, {"ulp": 0.9, "many": 0.1}])
@pytest.mark.parametrize("k", [16_384, 30_000, 100_000])
def test_a_sampled_code_width_estimate_chooses_as_costing_every_step(monkeypatch, mix, k):
    # From SAMPLE_FROM changes the code width is costed on every SAMPLE_EVERY-th block of
    # steps, unless the first block is spread wide (its entropy is underestimated on a sample:
    # 2-bit codes were chosen for random and wide steps, 9% larger than 16-bit codes or raw values).
    from torch_deltasync import _native
    from torch_deltasync.codecs import _packed

    pos, new, old = make_change_set(k, torch.bfloat16, 2 * k, 0.5, mix)
    codec = get_codec("packed")
    sampled = codec.encode(pos, new, old, numel=2 * k)["packed"]
    prev = _native.set_enabled(False)  # the specification, costing every step
    try:
        monkeypatch.setattr(_packed, "SAMPLE_FROM", 1 << 62)
        every_step = codec.encode(pos, new, old, numel=2 * k)["packed"]
    finally:
        _native.set_enabled(prev)
    assert sampled[4].item() == every_step[4].item()  # the code width
    assert sampled.numel() <= 1.01 * every_step.numel()
    d = codec.decode({"packed": sampled}, numel=2 * k, count=k, dtype=torch.bfloat16)
    assert torch.equal(bits(d.resolve(old)), bits(new))


@pytest.mark.parametrize("layout", ["bernoulli", "bursts", "periodic"])
@pytest.mark.parametrize("density", [0.002, 0.018, 0.1])
def test_a_sampled_gap_shift_estimate_chooses_as_costing_every_gap(monkeypatch, layout, density):
    # From SAMPLE_FROM changes the gap shift is costed on every SAMPLE_EVERY-th block of 4096 gaps.
    # Bernoulli positions (what RL steps give) and bursts choose the shift that costing every gap
    # chooses; positions whose density changes with the sampling period fool the sample, which
    # may cost a shift off by one: at most a few percent.
    from torch_deltasync import _native
    from torch_deltasync.codecs import _packed

    rng = np.random.default_rng(7)
    k = 60_000
    numel = int(k / density)
    if layout == "bernoulli":
        pos = np.sort(rng.choice(numel, size=k, replace=False))
    elif layout == "bursts":  # a tenth of the changes in 30 dense runs, the rest spread out
        runs = np.concatenate([s + np.arange(200) for s in rng.choice(numel - 200, size=30, replace=False)])
        pos = np.unique(np.concatenate([runs, rng.choice(numel, size=k - runs.size, replace=False)]))
    else:  # the sampled blocks (every 4th of 4096 changes) dense, the others sparse
        gaps = np.where((np.arange(k) // 4096) % 4 == 0, 1, int(1.3 / density))
        pos = np.cumsum(gaps) - 1
        numel = int(pos[-1]) + 1
    pos = torch.from_numpy(pos.astype(np.int64))
    old = torch.randn(pos.numel(), generator=torch.Generator().manual_seed(1)).mul_(0.02).bfloat16()
    new = (bits(old) + 1).view(torch.bfloat16)
    codec = get_codec("packed")
    sampled = codec.encode(pos, new, old, numel=numel)["packed"]
    prev = _native.set_enabled(False)  # the specification, costing every gap
    try:
        assert torch.equal(codec.encode(pos, new, old, numel=numel)["packed"], sampled)
        monkeypatch.setattr(_packed, "SAMPLE_FROM", 1 << 62)
        every_gap = codec.encode(pos, new, old, numel=numel)["packed"]
    finally:
        _native.set_enabled(prev)
    if layout != "periodic":
        assert sampled[2].item() == every_gap[2].item()  # the gap shift
    assert sampled.numel() <= 1.05 * every_gap.numel()
    d = codec.decode({"packed": sampled}, numel=numel, count=pos.numel(), dtype=torch.bfloat16)
    assert torch.equal(d.positions, pos)
    assert torch.equal(bits(d.resolve(old)), bits(new))


def _huffman_bits_by_definition(hist, per_byte, table):
    # huffman_bits as its docstring states it: Shannon's -sum c log2(c / total) over the non-zero
    # bins, at least one bit per byte, Gallager's p_max + 0.086 per byte, 4 bits per table symbol.
    c = hist[hist > 0].astype(np.float64)
    if not c.size:
        return 0.0
    total, nbytes = c.sum(), c.sum() / per_byte
    entropy = float(-(c * np.log2(c / total)).sum())
    table_bits = 4 * min(c.size ** per_byte, 256) if table else 0
    return max(entropy, nbytes) + nbytes * ((c.max() / total) ** per_byte + 0.086) + table_bits


def _histogram(rng, m):
    # sparse or dense, small counts (the table's range) or large ones (log2 calls), or empty
    scale = float(rng.choice([0.0, 1, 30, 3000, 1e6]))
    return (rng.exponential(scale, m) * (rng.random(m) < rng.uniform(0.02, 1))).astype(np.int64)


def test_size_estimates_match_their_definitions():
    # huffman_bits sums c log2 c from a table (and splits Shannon's log), best_gap_shift builds
    # each shift's bins from prefix sums, best_step_code costs the escapes' tails in one pass:
    # each must give what the plain formulas give, so the encoder's choices stay the same.
    from torch_deltasync.codecs._packed_estimates import best_gap_shift, best_step_code, huffman_bits

    rng = np.random.default_rng(3)
    try16_seen = set()
    for _ in range(300):
        h = _histogram(rng, int(rng.choice([1, 4, 256, 5000])))
        for per_byte in (1, 2, 4):
            for table in (False, True):
                want = _huffman_bits_by_definition(h, per_byte, table)
                assert huffman_bits(h, per_byte, table) == pytest.approx(want, rel=1e-12, abs=1e-9)

        base = _histogram(rng, (255 << 3) + 1)
        k = int(base.sum()) + int(rng.integers(0, 50))  # high parts past the window count as escapes
        if k:
            ests = []
            for r in range(5, 9):
                f = 1 << (r - 5)
                hist = np.array([base[j * f : (j + 1) * f].sum() for j in range(255)] + [0], np.int64)
                hist[255] = k - hist[:255].sum()
                ests.append(_huffman_bits_by_definition(hist, 1, True) + hist[255] * 16 + k * r)
            assert best_gap_shift(k, 5, 8, base) == 5 + int(np.argmin(ests))

        if rng.random() < 0.5:
            hz = _histogram(rng, 4097)
            hz[int(rng.integers(1, 4096)) :] *= rng.random() < 0.5  # often an empty top, as steps give
        else:  # steps as RL gives them: mostly small, about 1 in 64 wide (try16's threshold either side)
            hz = np.zeros(4097, np.int64)
            hz[:256] = _histogram(rng, 256) + 1
            n_wide = max(int(hz[:256].sum()) // 63 + int(rng.integers(-2, 3)), 0)
            hz[-1] = rng.integers(0, n_wide + 1)  # some of them huge (the last bin, cap)
            hz[256:-1] = rng.multinomial(n_wide - hz[-1], rng.dirichlet(np.full(3840, 0.05)))
        k = int(hz.sum())
        for width in (1, 2, 4) if k else ():
            ests = {}
            for b in (2, 4, 8):  # every width has at least 8 bits
                M = (1 << b) - 1
                codes = np.append(hz[1 : M + 1], hz[M + 1 :].sum() + hz[0])
                ests[b] = (_huffman_bits_by_definition(codes, 8 // b, False) + (hz[0] + hz[-1]) * 8 * width
                           + _huffman_bits_by_definition(hz[M + 1 : -1], 1, False))
            b, est, try16 = best_step_code(k, width, hz)
            assert b == min(ests, key=ests.get) and est == pytest.approx(ests[b], rel=1e-12)
            assert try16 == (width >= 2 and hz[256:].sum() * 64 >= k)
            try16_seen.add((try16, width >= 2 and abs(hz[256:].sum() * 64 - k) < 256))
    assert try16_seen >= {(True, True), (False, True)}  # both sides of the threshold, close to it
