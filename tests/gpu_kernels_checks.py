"""Checks of torch_deltasync/_gpu.py against the CPU specification, run by tests/unit/test_gpu.py
in a child process: on the CPU under Triton's interpreter (TRITON_INTERPRET=1 must be set before
triton is imported), or on a CUDA device (``python tests/gpu_kernels_checks.py cuda``).

Prints one line per check and "all checks passed" at the end; any mismatch raises."""

from __future__ import annotations

import sys

import numpy as np
import torch

from torch_deltasync import _gpu, _native, get_codec
from torch_deltasync.detect import ChangeDetector
from torch_deltasync._dtypes import bits


def special_fp32(n: int, seed: int) -> torch.Tensor:
    """fp32 values that stress a bf16 cast (ties, denormals, +-max, +-inf, +-0, random bits; no NaN)."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 6, size=n)
    u = np.where(kind == 0, (u & ~np.uint32(0xFFFF)) | np.uint32(0x8000), u)
    u = np.where(kind == 1, u & np.uint32(0x807FFFFF), u)
    u = np.where(kind == 2, np.uint32(0x7F7FFFFF) | (u & np.uint32(0x80000000)), u)
    u = np.where(kind == 3, np.uint32(0x7F800000) | (u & np.uint32(0x80000000)), u)
    u = np.where(kind == 4, u & np.uint32(0x80000000), u)
    u = np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), u & np.uint32(0xFF7FFFFF), u)
    return torch.from_numpy(u.view(np.float32).copy())


def cpu_detect(base: torch.Tensor, live: torch.Tensor, dtype: torch.dtype):
    """The specification: the CPU detector's torch path."""
    prev = _native.set_enabled(False)
    try:
        det = ChangeDetector(inference_dtype=dtype)
        det.reset("w", base)
        ch = det.detect("w", live)
    finally:
        _native.set_enabled(prev)
    return ch.positions, bits(ch.values), bits(ch.old_values)


def main(device: str) -> None:
    for src_dtype, dtype in [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                             (torch.float32, torch.float32), (torch.float16, torch.float16)]:
        for n in (0, 1, 1023, 1024, 5001):
            base = special_fp32(n, n)
            live = base.clone()
            flip = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.3
            live[flip] = special_fp32(n, n + 1)[flip]
            base, live = base.to(src_dtype), live.to(src_dtype)
            snap = bits(base.to(dtype)).to(device)
            want = cpu_detect(base, live, dtype)
            for method in _gpu.METHODS:
                got = _gpu.detect(live.to(device), snap, dtype, base=7, method=method)
                assert got is not None
                assert torch.equal(got[0].cpu(), want[0] + 7), (src_dtype, dtype, n, method)
                assert torch.equal(bits(got[1]).cpu(), want[1]) and torch.equal(bits(got[2]).cpu(), want[2])
        print(f"detect {src_dtype} -> {dtype} ({', '.join(_gpu.METHODS)}): ok")
    w = torch.randn(3000)
    w[100] = float("nan")
    w.view(torch.int32)[2_999] = -1  # a NaN with a payload, in the last block
    snap = torch.zeros(3000, dtype=torch.int16)
    want = cpu_detect(torch.zeros(3000), w, torch.bfloat16)  # the CPU kernel: NaN -> 0x7FC0
    for method in _gpu.METHODS:
        got = _gpu.detect(w.to(device), snap.to(device), torch.bfloat16, method=method)
        assert all(torch.equal(g.cpu() if i == 0 else bits(g).cpu(), x) for i, (g, x) in enumerate(zip(got, want)))
        assert bits(got[1])[got[0] == 100].tolist() == bits(got[1])[got[0] == 2_999].tolist() == [0x7FC0]
    assert _gpu.detect(w.half().to(device), bits(w.to(torch.bfloat16)).to(device), torch.bfloat16) is None
    print("detect casts NaN as the CPU does, and leaves other dtype pairs to torch: ok")

    rng = np.random.default_rng(0)
    for dtype in (torch.bfloat16, torch.float32):
        numel = 7000
        pos = torch.from_numpy(np.sort(rng.choice(numel, 2500, replace=False)))
        flat = torch.randn(numel).to(dtype)
        vals = torch.randn(2500).to(dtype)
        want = flat.clone().index_copy_(0, pos, vals)
        got = flat.to(device, copy=True)
        _gpu.scatter(got, pos.to(device), vals.to(device))
        assert torch.equal(bits(got.cpu()), bits(want))
        print(f"scatter {dtype}: ok")

    codec = get_codec("packed")
    numel = 9000
    flat = (torch.randn(numel) * 0.02).to(torch.bfloat16)
    pos = torch.from_numpy(np.sort(rng.choice(numel, 3000, replace=False)))
    old = flat[pos]
    for steps_kind in ("ulp", "with raw escapes"):
        s = torch.from_numpy(rng.choice([-2, -1, 1, 2], size=3000)).to(torch.int16)
        if steps_kind != "ulp":
            s[::50] = 0  # unchanged entries: raw escapes
            s[1::50] = -32768  # a step larger than any varint of 2 bytes: raw escape
        new = (bits(old) + s).view(torch.bfloat16)
        d = codec.decode(codec.encode(pos, new, old, numel=numel), numel=numel, count=3000, dtype=torch.bfloat16)
        assert d.steps is not None and (d.relative is None) == (steps_kind == "ulp")
        want = flat.clone().index_copy_(0, pos, d.resolve(old))
        got = flat.to(device, copy=True)
        _gpu.apply_steps(got, d.positions.to(device), d.steps.to(device),
                         None if d.relative is None else d.relative.to(device),
                         None if d.relative is None else d.values.to(device))
        assert torch.equal(bits(got.cpu()), bits(want))
        print(f"apply_steps ({steps_kind}): ok")
    print("all checks passed")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
