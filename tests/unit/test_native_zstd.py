"""libzstd called from the compiled kernels (torch_deltasync/_native_zstd.py) against ``zstandard``.

The kernels must write the frames ``zstandard`` writes (the packed codec's bytes do not depend on
the path) and refuse exactly the frames :func:`torch_deltasync.codecs._bits.unpack_stream`
refuses; and the codec must keep working, with the same bytes, where the kernels cannot reach
libzstd.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import zstandard
from test_codecs_packed import make_change_set
from test_native import run_child, same_delta

from torch_deltasync import _native, _native_zstd, get_codec
from torch_deltasync.codecs import PackedCodec, _bits
from torch_deltasync.errors import CorruptObjectError



def test_the_kernels_reach_libzstd():
    # tools/setup.sh installs numba and zstandard's wheel, which ships the CFFI module
    assert _native.enabled() and _native_zstd.AVAILABLE


def streams(seed: int = 0):
    """Byte streams like the codec's: geometric high parts, random low bits, sparse codes, runs."""
    rng = np.random.default_rng(seed)
    for n in (24, 25, 100, 1000, 4096, 70_000, 131_072, 300_000):
        yield rng.geometric(0.05, n).clip(0, 255).astype(np.uint8)
        yield rng.integers(0, 256, n, dtype=np.uint8)
        yield ((rng.random(n) < 0.1) * rng.integers(0, 4, n)).astype(np.uint8)
        yield np.repeat(rng.integers(0, 256, n // 8 + 1, dtype=np.uint8), 8)[:n]


def native_frame(src: np.ndarray, level: int) -> bytes:
    dst = np.empty(int(_native_zstd.compress_bound(src.size)), np.uint8)
    m = _native_zstd.compress(_native_zstd.compression_context(level), src, dst)
    assert m > 0
    return dst[:m].tobytes()


@pytest.mark.parametrize("level", [1, 3, -5, 19])
def test_frames_are_zstandards(level):
    cctx = _bits.compressor(level)
    n = 0
    for src in streams(level % 7):
        assert native_frame(src, level) == cctx.compress(src), (level, src.size)
        n += 1
    assert n == 32


def test_a_context_follows_the_level():
    src = next(streams(1))
    assert native_frame(src, 19) == _bits.compressor(19).compress(src)
    assert native_frame(src, 1) == _bits.compressor(1).compress(src)
    assert native_frame(src, 22) == _bits.compressor(22).compress(src)
    assert native_frame(src, 1) == _bits.compressor(1).compress(src)
    pos = torch.arange(0, 1000, 3)
    with pytest.raises(ValueError, match="level must be less than 23"):  # zstandard's check, before the kernels
        PackedCodec(level=1000).encode(pos, torch.ones(pos.numel()), torch.zeros(pos.numel()), numel=1000)


def frames():
    """``(label, payload, raw_len)``: valid frames and every way a frame can be wrong."""
    src = np.random.default_rng(2).geometric(0.05, 5000).clip(0, 255).astype(np.uint8)
    good = _bits.compressor(1).compress(src)
    n = src.size
    checked = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(src)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    unsized = unsized.compress(src.tobytes()) + unsized.flush()
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"abcd"
    empty = zstandard.ZstdCompressor(level=1).compress(b"")
    yield "good", good, n
    yield "good with checksum", checked, n
    yield "other declared size", good, n - 1
    yield "other declared size, larger", good, n + 1
    yield "trailing byte", good + b"\0", n
    yield "a second frame after it", good + good, n
    yield "a skippable frame after it", good + skippable, n
    yield "skippable frame only", skippable, n
    yield "size not declared", unsized, n
    yield "truncated", good[:-1], n
    yield "header only", good[:6], n
    yield "not a frame", b"\x00" * 40, n
    yield "empty payload", b"", n
    yield "empty frame for an empty stream", empty, 0
    yield "checksum wrong", checked[:-1] + bytes([checked[-1] ^ 1]), n
    for i in (5, 8, len(good) // 2, len(good) - 2):
        bad = bytearray(good)
        bad[i] ^= 0x5A
        yield f"byte {i} flipped", bytes(bad), n


@pytest.mark.parametrize("label, payload, raw_len", list(frames()), ids=[f[0] for f in frames()])
def test_frames_refused_exactly_as_unpack_stream_refuses(label, payload, raw_len):
    try:
        expected = _bits.unpack_stream(_bits.METHOD_ZSTD, memoryview(payload), raw_len, "stream").tobytes()
    except CorruptObjectError:
        expected = None
    dst = np.full(raw_len + 64, 0xEE, np.uint8)  # bytes past raw_len must stay untouched
    status = _native_zstd.decompress(_native_zstd.decompression_context(),
                                     np.frombuffer(payload, np.uint8).copy(), dst[:raw_len])
    assert (status == _native.OK) == (expected is not None), label
    if expected is not None:
        assert dst[:raw_len].tobytes() == expected
    assert (dst[raw_len:] == 0xEE).all()
    if label.startswith("good"):
        assert expected is not None  # the cases above are not all refusals


def test_codec_without_libzstd_in_the_kernels_writes_the_same_bytes(monkeypatch):
    """zstd from Python between two kernel calls (where ``AVAILABLE`` is false) and from the
    kernels give the same blobs and the same decoded deltas."""
    codec = get_codec("packed")
    for seed, numel, density, mix, dtype in [
        (1, 6000, 0.02, {"ulp": 0.95, "many": 0.04, "flip": 0.01}, torch.bfloat16),
        (3, 2000, 0.9, {"random": 1.0}, torch.float32),
        (4, 1 << 20, 0.01, {"ulp": 0.9, "mid": 0.1}, torch.bfloat16),
        (5, 139, 0.5, {"mid": 0.5, "same": 0.25, "ulp": 0.25}, torch.float16),
    ]:
        pos, new, old = make_change_set(seed, dtype, numel, density, mix)
        results = []
        for available in (True, False):
            monkeypatch.setattr(_native_zstd, "AVAILABLE", available)
            blob = codec.encode(pos, new, old, numel=numel)
            results.append((blob, codec.decode(blob, numel=numel, count=pos.numel(), dtype=dtype)))
        (a, da), (b, db) = results
        assert torch.equal(a["packed"], b["packed"]), seed
        assert same_delta(da, db) and torch.equal(da.positions, pos)


def test_without_zstandards_cffi_module(tmp_path):
    """A ``zstandard`` install without its CFFI module: the kernels run, zstd is called from Python,
    the codec round-trips (in a child process where the module cannot be imported)."""
    script = tmp_path / "no_cffi.py"
    script.write_text(
        "import sys\n"
        "sys.modules['zstandard._cffi'] = None\n"
        "import torch\n"
        "from torch_deltasync import _native, _native_zstd, get_codec\n"
        "from torch_deltasync._dtypes import bits\n"
        "assert _native.enabled() and not _native_zstd.AVAILABLE\n"
        "old = torch.randn(50_000).bfloat16()\n"
        "new = old.clone(); new[::7] = (new[::7].float() * 1.01).bfloat16()\n"
        "pos = (bits(old) != bits(new)).nonzero().squeeze(1)\n"
        "c = get_codec('packed')\n"
        "p = c.encode(pos, new[pos], old[pos], numel=50_000)\n"
        "d = c.decode(p, numel=50_000, count=pos.numel(), dtype=torch.bfloat16)\n"
        "assert torch.equal(d.positions, pos)\n"
        "assert torch.equal(bits(d.resolve(old[pos])), bits(new[pos]))\n"
        "print('ok without libzstd in the kernels', pos.numel())\n"
    )
    run_child(script, "ok without libzstd in the kernels")


def test_intrinsics_registered_after_numba_is_imported_replace_their_stand_ins(monkeypatch):
    """A module that registers intrinsics once the kernels are compiled (imported late) has its
    stand-ins replaced at once, as :func:`_native._materialize` does for those registered before."""
    import types

    get_codec("packed").encode(torch.arange(3), torch.ones(3), torch.zeros(3), numel=3)  # numba imported
    assert _native.numba is not None

    def stand_in():
        raise AssertionError("the stand-in was not replaced")

    def intrinsic():
        return "intrinsic"

    late = types.ModuleType("torch_deltasync._late_test_module")
    late.stand_in = stand_in
    monkeypatch.setitem(sys.modules, late.__name__, late)
    _native.register_intrinsics(lambda: {stand_in: intrinsic})
    assert late.stand_in is intrinsic
