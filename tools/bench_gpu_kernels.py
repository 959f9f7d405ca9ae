"""GPU kernels of torch_deltasync/_gpu.py against HBM bandwidth and against the torch code they replace.

On one CUDA device, for a tensor of ``--numel`` elements (fp32 live weights, bf16 snapshot) at each
``--density``:

* **detect**: ``_gpu.detect`` with each of its methods (``"reread"``: two passes, each reading the
  fp32 tensor and the bf16 snapshot, 12 bytes per element; ``"bitmask"``: the second pass reads a
  bit per element and the values only where one is set) against the torch path of
  ``ChangeDetector.detect`` (cast, compare, ``nonzero``, gathers); achieved bandwidth = bytes /
  time, as a fraction of the device's copy bandwidth (``copy_`` of a 2 GiB buffer: bytes read +
  written / time);
* **scatter** and **apply_steps**: ``_gpu.scatter`` / ``_gpu.apply_steps`` of the changes into a
  bf16 tensor against ``index_copy_`` (and, for steps, a gather + add + ``index_copy_``).

Issue 14's goal: >= 70% of HBM bandwidth for detection. Two bandwidths are reported: the bytes
the two passes move (12 per element) and the bytes a detection must move at least (one read of
the tensor and the snapshot, 6 per element, plus the changes written, 12 per change), each as a
fraction of the copy bandwidth. Every result is checked bit for bit against the torch path.
Prints one line per density and writes JSON.

    python tools/bench_gpu_kernels.py --numel 500000000 --out runs/gpu/kernels.json

``--device cpu`` runs the same code under Triton's interpreter (``TRITON_INTERPRET=1``, at toy
sizes; wall-clock timers): ``tools/gpu_check.sh --smoke`` checks the script that way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools._cli import check_writable  # noqa: E402
from torch_deltasync import _gpu  # noqa: E402
from torch_deltasync.detect import ChangeDetector  # noqa: E402
from torch_deltasync._dtypes import bits  # noqa: E402


def device_time(fn, device: torch.device, repeat: int = 5) -> float:
    """Median seconds of ``fn`` after one warm-up call: CUDA events on the current stream on a GPU,
    wall-clock time elsewhere."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(numel: int, device: torch.device, timed) -> float:
    """Bytes per second read + written by ``copy_`` between two int16 buffers of ``numel`` elements."""
    src = torch.empty(numel, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    return 2 * numel * 2 / timed(lambda: dst.copy_(src))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=500_000_000)
    ap.add_argument("--density", type=float, nargs="+", default=[0.01, 0.05])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a check of this script)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per measurement (the median is kept)")
    ap.add_argument("--out", default="runs/gpu/kernels.json")
    args = ap.parse_args()
    try:
        dev = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device}: {e}")
    if not all(0 < p <= 1 for p in args.density):  # (NaN fails too)
        ap.error(f"--density takes fractions in (0, 1], got {args.density}")
    check_writable(ap, "--out", args.out)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False); on a lent machine run tools/gpu_check.sh")
    if not _gpu.available(dev):
        ap.error(f"the Triton kernels cannot run on {dev}: a CUDA device, or TRITON_INTERPRET=1 set for the cpu")
    if args.numel < 1 or args.repeat < 1:
        ap.error("--numel and --repeat must be >= 1")
    n = args.numel

    def timed(fn):
        return device_time(fn, dev, args.repeat)

    # copy bandwidth: bytes read + written by copy_ of a 2 GiB buffer (on the cpu: of 4x the tensor)
    copy_bw = copy_bandwidth(1 << 30 if dev.type == "cuda" else max(2 * n, 1 << 16), dev, timed)
    rows = []
    w0 = torch.randn(n, device=dev).mul_(0.02)
    for p in args.density:
        det = ChangeDetector()
        det.reset("w", w0)
        w = w0.clone()
        m = torch.rand(n, device=dev) < p
        w[m] += w[m].abs() * 2**-7
        snap = bits(det.snapshot("w"))
        avail = _gpu.available
        _gpu.available = lambda d: False  # the torch path of the detector
        try:
            want = det.detect("w", w)
            t_torch = timed(lambda: det.detect("w", w))
        finally:
            _gpu.available = avail
        t_detect = {}
        for method in _gpu.METHODS:  # each checked bit for bit against the torch path, then timed
            got = _gpu.detect(w, snap, torch.bfloat16, method=method)
            assert torch.equal(got[0], want.positions) and torch.equal(bits(got[1]), bits(want.values)) \
                and torch.equal(bits(got[2]), bits(want.old_values)), f"detect(method={method!r}) differs from torch"
            t_detect[method] = timed(lambda: _gpu.detect(w, snap, torch.bfloat16, method=method))
        t_kernel = t_detect["reread"]
        k = got[0].numel()
        flat = det.snapshot("w").clone()
        t_scatter = timed(lambda: _gpu.scatter(flat, got[0], got[1]))
        t_index_copy = timed(lambda: flat.index_copy_(0, got[0], got[1]))
        steps = (bits(got[1]) - bits(got[2])).to(torch.int16)
        t_steps = timed(lambda: _gpu.apply_steps(flat, got[0], steps))
        t_steps_torch = timed(lambda: flat.index_copy_(0, got[0], (bits(flat[got[0]]) + steps).view(torch.bfloat16)))
        least = 6 * n + 12 * k  # one read of tensor and snapshot, the changes written (int64 + 2 x bf16)
        row = {"numel": n, "density": k / n, "detect_s": t_kernel, "detect_torch_s": t_torch,
               "detect_gbs": 12 * n / t_kernel / 1e9, "detect_over_copy_bw": 12 * n / t_kernel / copy_bw,
               "detect_least_bytes_over_copy_bw": least / t_kernel / copy_bw,
               "detect_bitmask_s": t_detect["bitmask"],
               "detect_bitmask_least_bytes_over_copy_bw": least / t_detect["bitmask"] / copy_bw,
               "copy_gbs": copy_bw / 1e9, "scatter_s": t_scatter, "index_copy_s": t_index_copy,
               "apply_steps_s": t_steps, "apply_steps_torch_s": t_steps_torch,
               "apply_ns_per_change": t_steps / max(k, 1) * 1e9}
        rows.append(row)
        print(f"density {k / n:.2%}: detect {t_kernel * 1e3:.2f} ms ({row['detect_gbs']:.0f} GB/s, "
              f"{row['detect_over_copy_bw']:.0%} of copy bandwidth {copy_bw / 1e9:.0f} GB/s; the least bytes "
              f"{row['detect_least_bytes_over_copy_bw']:.0%}), bitmask {t_detect['bitmask'] * 1e3:.2f} ms (the least "
              f"bytes {row['detect_bitmask_least_bytes_over_copy_bw']:.0%}) vs torch "
              f"{t_torch * 1e3:.2f} ms; scatter {t_scatter * 1e3:.2f} ms vs index_copy_ {t_index_copy * 1e3:.2f} ms; "
              f"apply_steps {t_steps * 1e3:.2f} ms vs torch {t_steps_torch * 1e3:.2f} ms", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    out.write_text(json.dumps({"device": name, "copy_gbs": copy_bw / 1e9, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
