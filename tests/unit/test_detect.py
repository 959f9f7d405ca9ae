"""ChangeDetector: bit-view comparison, chunking, sign flips, NaN payloads, layouts, dtypes."""

from __future__ import annotations

import threading

import pytest
import torch

from torch_deltasync.detect import ChangeDetector

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def naive(old: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (old.to(dtype).reshape(-1).view(INT[dtype]) != new.to(dtype).reshape(-1).view(INT[dtype])).nonzero().squeeze(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [7, 1000, None])
def test_matches_naive_bit_compare(dtype, chunk):
    torch.manual_seed(0)
    w = torch.randn(3000) * 0.02
    det = ChangeDetector(inference_dtype=dtype, chunk_numel=chunk)
    det.reset("w", w)
    old = w.clone()
    w += torch.randn(3000) * 1e-5
    ch = det.detect("w", w)
    expected = naive(old, w, dtype)
    assert torch.equal(ch.positions, expected)
    assert torch.equal(ch.values.view(INT[dtype]), w.to(dtype)[expected].view(INT[dtype]))
    assert torch.equal(ch.old_values.view(INT[dtype]), old.to(dtype)[expected].view(INT[dtype]))


def test_sign_of_zero_and_nan_payloads_are_changes():
    w = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    det = ChangeDetector()
    det.reset("w", w)
    w2 = w.clone()
    w2[0] = -0.0  # -0.0 == 0.0 as floats, but the bits differ
    bits = w2.view(torch.int16)
    bits[2] = bits[2] ^ 1  # another NaN payload: NaN != NaN as floats, bits tell the truth
    ch = det.detect("w", w2)
    assert ch.positions.tolist() == [0, 2]
    assert torch.equal(ch.values.view(torch.int16), w2[[0, 2]].view(torch.int16))
    det.commit("w", ch)
    assert det.detect("w", w2).numel == 0  # an unchanged NaN is not a change


def test_non_contiguous_and_commit():
    base = torch.randn(64, 32)
    w = base.t()  # non-contiguous view (32, 64)
    det = ChangeDetector()
    det.reset("w", w)
    base[3, 5] += 1.0  # element (5, 3) of the transposed view
    ch = det.detect("w", w)
    assert ch.positions.tolist() == [5 * 64 + 3]
    det.commit("w", ch)
    assert torch.equal(det.snapshot("w").view(torch.int16), w.contiguous().reshape(-1).to(torch.bfloat16).view(torch.int16))


def test_size_mismatch_is_refused():
    det = ChangeDetector()
    det.reset("w", torch.zeros(10))
    with pytest.raises(ValueError, match="10"):
        det.detect("w", torch.zeros(11))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32, torch.float16])
def test_a_cast_in_another_dtype_is_refused(dtype):
    # its bit patterns would be read at the inference dtype's width: past the end of a narrower
    # snapshot (heap bytes reported as old values), false changes from a wider one
    d = ChangeDetector()  # bf16
    with pytest.raises(TypeError, match=rf"reset\('w'\): cast must be in the inference dtype torch.bfloat16, got {dtype}"):
        d.reset("w", cast=torch.zeros(1000, dtype=dtype))
    d.reset("w", cast=torch.zeros(1000, dtype=torch.bfloat16))
    assert d.detect("w", torch.zeros(1000, dtype=torch.bfloat16)).numel == 0


def test_cpu_snapshot_device():
    det = ChangeDetector(snapshot_device="cpu")
    w = torch.randn(100)
    det.reset("w", w)
    assert det.snapshot("w").device.type == "cpu"
    assert det.snapshot_nbytes() == 200


@pytest.mark.slow
def test_more_than_2_31_elements_use_int64_positions():
    n = 2**31 + 10
    w = torch.zeros(n, dtype=torch.bfloat16)
    det = ChangeDetector()
    det.reset("w", w)
    w[n - 3] = 1.0
    w[5] = -1.0
    ch = det.detect("w", w)
    assert ch.positions.dtype == torch.int64
    assert ch.positions.tolist() == [5, n - 3]


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "torch"])
def test_different_tensors_detected_on_several_threads_at_once_are_exact(native, monkeypatch):
    """Each thread has its own temporaries (the compiled path's block scratch, torch's chunk
    buffers): eight threads detecting eight tensors at once, all released together by a barrier,
    find exactly what one thread finds, bit for bit (shared scratch would mix their blocks)."""
    from torch_deltasync import _native

    if native and not _native.enabled():
        pytest.skip("the compiled kernels are switched off (TORCH_DELTASYNC_NATIVE=0 or no numba)")
    if not native:
        monkeypatch.setattr(_native, "enabled", lambda: False)
    gen = torch.Generator().manual_seed(0)
    n, k = 8, 1 << 18
    live = {f"w{i}": torch.randn(k, generator=gen) * 0.02 for i in range(n)}
    serial, threaded = ChangeDetector(chunk_numel=4096), ChangeDetector(chunk_numel=4096)
    for det in (serial, threaded):
        for name, w in live.items():
            det.reset(name, w)
    for w in live.values():
        w.add_(torch.randn(k, generator=gen) * 1e-4)  # ~5-30% of the bf16 elements change
    expected = {name: serial.detect(name, w) for name, w in live.items()}
    barrier = threading.Barrier(n, timeout=10)
    found: dict[str, list] = {name: [] for name in live}
    errors: list[BaseException] = []

    def run(name):
        try:
            barrier.wait()
            for _ in range(3):  # several passes, so the threads' kernels surely overlap
                found[name].append(threaded.detect(name, live[name]))
        except BaseException as e:  # noqa: BLE001 - a thread's error only warns; fail the test on it
            errors.append(e)

    workers = [threading.Thread(target=run, args=(name,)) for name in live]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, errors
    for name, want in expected.items():
        assert want.numel > 1000 and len(found[name]) == 3
        for got in found[name]:
            assert torch.equal(got.positions, want.positions), name
            assert torch.equal(got.values.view(torch.int16), want.values.view(torch.int16)), name
            assert torch.equal(got.old_values.view(torch.int16), want.old_values.view(torch.int16)), name


_NAN = {torch.float16: -1, torch.float32: -1, torch.float64: -1}  # all ones: a negative NaN with a payload
_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("src,dtype,want", [
    (torch.float32, torch.bfloat16, 0x7FC0), (torch.float64, torch.bfloat16, 0x7FC0),
    (torch.float16, torch.float32, 0x7FC00000), (torch.float32, torch.float16, 0x7E00),
    (torch.float32, torch.float8_e4m3fn, 0x7F), (torch.float32, torch.float8_e5m2, 0x7F),
])
def test_the_published_cast_writes_one_nan_whatever_the_layout(src, dtype, want):
    # torch's cast gives a NaN other bits in vector lanes, in a loop's scalar tail and for strided
    # input; anchors (cast) and change detection (chunks of any size) must publish the same bits.
    n = (1 << 12) + 3
    base = torch.randn(2 * n).to(src)
    nans = [0, 5, n - 1]  # in the vector body, and the last element (a tail)
    base.view(_VIEW[src.itemsize])[[2 * p for p in nans]] = _NAN[src]
    strided = base[::2]
    contiguous = strided.contiguous()
    view = _VIEW[dtype.itemsize]
    finite = torch.ones(n, dtype=torch.bool)
    finite[nans] = False
    for chunk in (None, 7, n - 1):
        det = ChangeDetector(inference_dtype=dtype, chunk_numel=chunk)
        for t in (strided, contiguous):
            out = det.cast(t).view(view)
            assert out[nans].tolist() == [want] * 3
            assert torch.equal(out[finite], contiguous.to(dtype).view(view)[finite])
        det.reset("w", torch.zeros(n, dtype=src))
        ch = det.detect("w", strided)
        assert ch.values.view(view)[torch.isin(ch.positions, torch.tensor(nans))].tolist() == [want] * 3
        det.reset("w", strided)
        assert det.detect("w", contiguous).numel == 0  # the anchor's bits are what detection sees
