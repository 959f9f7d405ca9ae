"""Core benchmark: bytes, detection, apply and memory of delta sync, as ratios against baselines.

For each synthetic Qwen3 config (std-0.02 init, fp32 master weights, real Adam steps at lr 3e-6 on
random tokens) it measures, in one run on the same machine:

* **bytes**: delta bytes (objects + manifest) / full bf16 model bytes, per version;
* **detection**: time to find the changed elements of every tensor (``ChangeDetector.detect``)
  and update their checksums (``checksum_change``), as ``publish()`` does, / time of a plain memory copy
  (both in CPU time on the CPU, which other jobs on a shared machine barely move; use
  ``--threads 1``, else torch's copy counts the CPU time of its helper threads too) of the bytes detection must read (the fp32 weights and the bf16
  snapshot: 6 bytes per element) into preallocated buffers;
* **publish**: delta publish time / full-snapshot publish time (cast to bf16, ``safetensors``
  save, sha256, put: :class:`FullSnapshotSync`);
* **update**: receiver ``update()`` of one delta (download, sha256, decode, verify, apply) / loading
  the full model from the full snapshot through the same store (get, sha256, safetensors load,
  ``copy_``); **apply** is the in-place write alone over the same baseline, and **sync** is
  publish + update over the baseline's publish + update. Without the download on both sides, the
  update is also given over the **copy floor**: the fastest of three copies of every parsed tensor
  into the baseline's replica (no parse, no fresh memory), the least a full load can cost; the
  safetensors parse allocates fresh tensors, whose first touch costs from about nothing (huge
  pages) to several times the copy, so the full load itself varies several-fold between versions;
* **apply per change**: the receiver's in-place write alone (``target.write`` of the staged
  changes, a ``ModuleTarget`` on a bf16 replica) in ns per changed element, and over a plain
  ``index_copy_`` of the same changes into the same tensors (CPU time);
* **threads** (``--compare-threads``): the receiver's update without the download with its default
  ``threads`` (one per core) against a second receiver that stages on one thread, on the same
  versions in the same run;
* **memory**: extra peak RSS of ``publish()`` and of ``update()`` / model bytes in bf16, for the
  anchor and for steady-state deltas (peak RSS reset through ``/proc/self/clear_refs``).

Usage::

    .venv/bin/python tools/bench_core.py --sizes 100m 500m --steps 3 --out runs/bench/core.json

Results are printed as a table and written as JSON; ``docs/benchmarks.md`` quotes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools._cli import check_writable  # noqa: E402

from safetensors.torch import load as st_load  # noqa: E402
from safetensors.torch import save as st_save  # noqa: E402

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore  # noqa: E402
from torch_deltasync.checksum import checksum_change  # noqa: E402
from torch_deltasync.testing import QWEN3_SIZES, adam_step, first_difference, tiny_qwen3  # noqa: E402


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


class PeakRSS:
    """Extra peak resident memory (bytes) of a code block, above the RSS when it started."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.ok = True
        except OSError:
            self.ok = False
        self.start = _rss_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        self.extra = (_rss_kib("VmHWM") - self.start) * 1024 if self.ok else float("nan")


def _timed(fn, repeat=3, clock=time.perf_counter):
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


class PeakCUDA:
    """Extra peak CUDA memory (bytes) allocated inside a code block."""

    def __enter__(self):
        torch.cuda.synchronize()
        self.start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.extra = torch.cuda.max_memory_allocated() - self.start


def synthetic_step(model: torch.nn.Module, lr: float, gen: torch.Generator) -> None:
    """An Adam-first-step-like update without forward/backward: every element moves by about
    ``lr`` (Adam's first step is ``lr * sign(g)``), so the bf16 density matches real steps at the
    same learning rate (docs/research/environment.md §4) at a fraction of the cost for 1B-7B models."""
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device)
            p.add_(noise.sign_().mul_(lr))


class FullSnapshotSync:
    """The baseline a delta must beat: every version ships the whole model in bf16 as one
    safetensors object through the same store; the receiver reads it, checks its sha256, parses
    it and copies every tensor into its parameters."""

    def __init__(self, model: torch.nn.Module, store: LocalStore) -> None:
        self.model, self.store, self.sha = model, store, None

    def publish(self) -> float:
        t = time.perf_counter()
        data = st_save({n: p.detach().to(torch.bfloat16).contiguous().cpu() for n, p in self.model.state_dict().items()})
        self.sha = hashlib.sha256(data).hexdigest()
        self.store.put("full.safetensors", data)
        return (time.perf_counter() - t) * 1e3

    def update(self, replica: torch.nn.Module, copies: int = 3) -> tuple[float, float, float]:
        """``(total ms, download ms, copy floor ms)``: the download is the get and the sha256
        check, as in ``UpdateStats.download_ms``; the rest (parse into fresh tensors, as
        ``safetensors`` loaders do, and ``copy_`` into the replica) is the full load. The copy floor
        is the fastest of ``copies`` copies of the parsed tensors into the replica, without the
        parse: what a full load costs at best, its fresh memory already faulted in."""
        t = time.perf_counter()
        data = self.store.get("full.safetensors")
        assert hashlib.sha256(data).hexdigest() == self.sha
        t_dl = time.perf_counter()
        tensors = st_load(data)
        params = replica.state_dict()

        def copy() -> None:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(tensors[n])

        copy()
        t_end = time.perf_counter()
        floor = _timed(copy, repeat=copies)
        return (t_end - t) * 1e3, (t_dl - t) * 1e3, floor * 1e3


def apply_vs_index_copy(target, sparse: dict, device: str, repeat: int = 3) -> tuple[float, float, int]:
    """``(apply_s, index_copy_s, changes)``: the receiver's apply step alone (``target.write`` of
    every staged tensor: positions -> live parameter, as ``commit()`` does) against a plain
    ``index_copy_`` of the same positions and values into the same live tensors (the floor of a
    sparse write into that memory), best of ``repeat`` CPU-time runs each (the writes are
    idempotent: the same values again)."""
    items = [(n, p, v) for n, (p, v) in sparse.items() if p.numel()]
    if not items:
        return 0.0, 0.0, 0
    live = target.tensors  # the replica's tensors (bf16 here: the inference dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    clock = time.perf_counter if device.startswith("cuda") else time.process_time

    def apply():
        for n, p, v in items:
            target.write(n, p, v)
        sync()

    def index_copy():
        with torch.no_grad():
            for n, p, v in items:
                live[n].view(-1).index_copy_(0, p, v)
        sync()

    return (_timed(apply, repeat, clock), _timed(index_copy, repeat, clock), sum(p.numel() for _, p, _ in items))


def bench_size(size: str, steps: int, lr: float, workdir: Path, device: str = "cpu", synthetic: bool = False,
               compare_threads: bool = False) -> dict:
    model = tiny_qwen3(size, seed=0, device=device)
    numel = sum(p.numel() for p in model.parameters())
    model_nbytes = numel * 2
    opt = None if synthetic else torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    print(f"\n== Qwen3 {size}: {numel / 1e6:.1f}M parameters, bf16 {model_nbytes / 2**20:.0f} MiB, "
          f"{device}, {'synthetic' if synthetic else 'Adam'} steps", flush=True)

    def step():
        if synthetic:
            synthetic_step(model, lr, gen)
        else:
            adam_step(model, opt, generator=gen)

    step()  # allocate Adam state before any measurement
    Peak = PeakCUDA if device.startswith("cuda") else PeakRSS

    store = LocalStore(workdir / f"{size}-delta", fsync=False)
    full_store = LocalStore(workdir / f"{size}-full", fsync=False)
    sender = DeltaSender(model, store, anchor_every=1000)
    full_sync = FullSnapshotSync(model, full_store)  # the baseline: a full bf16 copy per version
    replica = tiny_qwen3(size, seed=1, dtype=torch.bfloat16, device=device)
    receiver = DeltaReceiver(replica, store)  # threads=None: one per core (the default)
    # --compare-threads: a second replica updated by a receiver that stages on the calling thread only
    serial = DeltaReceiver(tiny_qwen3(size, seed=3, dtype=torch.bfloat16, device=device), store, threads=1) \
        if compare_threads else None
    full_replica = tiny_qwen3(size, seed=2, dtype=torch.bfloat16, device=device)


    with Peak() as m:
        sender.publish()
    anchor_pub_mem = m.extra
    with Peak() as m:
        receiver.update()
    anchor_upd_mem = m.extra
    if serial is not None:
        serial.update()

    # memory-copy baseline: read the fp32 weights and the bf16 snapshot into preallocated buffers
    params = [p.detach() for p in model.parameters()]
    snaps = [sender.detector.snapshot(n) for n in sender.detector.names()]
    buf32 = torch.empty(max(p.numel() for p in params), device=device)
    buf16 = torch.empty(max(s.numel() for s in snaps), dtype=torch.bfloat16, device=device)

    def memcpy():
        for p in params:
            buf32[: p.numel()].copy_(p.reshape(-1))
        for s in snaps:
            buf16[: s.numel()].copy_(s)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    rows = []
    for i in range(steps):
        step()
        det = sender.detector
        sd = model.state_dict()
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        def detection():  # what publish() does per tensor: detect, then the checksum update
            for n in det.names():
                ch = det.detect(n, sd[n])
                checksum_change(ch.positions, ch.old_values, ch.values)
            sync()

        # CPU time on the CPU (one thread: steady on a machine shared with other jobs), wall on CUDA
        clock = time.perf_counter if device.startswith("cuda") else time.process_time
        detect_s = _timed(detection, repeat=3, clock=clock)
        copy_s = _timed(memcpy, repeat=3, clock=clock)
        with Peak() as mp:
            sender.publish()
        st = sender.last_stats
        full_publish_ms = full_sync.publish()
        os.sync()  # untimed: the snapshot's writeback would otherwise stall the measurements below
        if serial is not None and i % 2 == 0:  # alternate which receiver goes first
            serial.update()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        with Peak() as mu:
            staged = receiver.prepare()  # what update() does, keeping the staged changes for the apply rows
            receiver.commit(staged)
        ru2 = resource.getrusage(resource.RUSAGE_SELF)
        update_rusage = {"user_ms": (ru2.ru_utime - ru.ru_utime) * 1e3, "sys_ms": (ru2.ru_stime - ru.ru_stime) * 1e3,
                         "minor_faults": ru2.ru_minflt - ru.ru_minflt}
        ust = receiver.last_stats
        if serial is not None and i % 2 == 1:
            serial.update()
        apply_s, index_copy_s, n_apply = apply_vs_index_copy(receiver.target, staged._sparse or {}, device)
        full_update_ms, full_download_ms, copy_floor_ms = full_sync.update(full_replica)
        full_load_ms = full_update_ms - full_download_ms
        update_load_ms = ust.total_ms - ust.download_ms
        assert first_difference(model, replica) is None and first_difference(model, full_replica) is None
        row = {
            "version": st.version, "changed": st.changed, "density": st.density,
            "delta_nbytes": st.nbytes, "full_nbytes": st.full_nbytes, "bytes_ratio": st.nbytes / model_nbytes,
            "detect_s": detect_s, "memcpy_s": copy_s, "detect_over_memcpy": detect_s / copy_s,
            "publish_ms": st.publish_ms, "full_publish_ms": full_publish_ms,
            "publish_ratio": st.publish_ms / full_publish_ms,
            "update_ms": ust.total_ms, "apply_ms": ust.apply_ms, "full_update_ms": full_update_ms,
            "update_ratio": ust.total_ms / full_update_ms, "apply_over_full_load": ust.apply_ms / full_update_ms,
            "sync_ratio": (st.publish_ms + ust.total_ms) / (full_publish_ms + full_update_ms),
            # download excluded on both sides (get + sha256): issue 14's receiver goal
            "update_load_ms": update_load_ms, "full_load_ms": full_load_ms,
            "update_parts_ms": {k: getattr(ust, f"{k}_ms") for k in ("plan", "download", "decode", "verify", "apply")},
            "update_rusage": update_rusage,
            "update_over_load_excl_download": update_load_ms / full_load_ms,
            # the strictest baseline: copying every tensor into preallocated, faulted-in memory
            "full_copy_floor_ms": copy_floor_ms, "update_over_copy_floor_excl_download": update_load_ms / copy_floor_ms,
            "apply_ns_per_change": apply_s / max(n_apply, 1) * 1e9,
            "index_copy_ns_per_change": index_copy_s / max(n_apply, 1) * 1e9,
            "apply_over_index_copy": apply_s / index_copy_s if index_copy_s else float("nan"),
            "publish_peak_extra_over_model": mp.extra / model_nbytes,
            "update_peak_extra_over_model": mu.extra / model_nbytes,
        }
        if serial is not None:
            sst = serial.last_stats
            row["serial_update_load_ms"] = sst.total_ms - sst.download_ms
            row["serial_update_parts_ms"] = {k: getattr(sst, f"{k}_ms") for k in ("download", "decode", "verify", "apply")}
            row["threads_speedup"] = row["serial_update_load_ms"] / update_load_ms
            assert first_difference(model, serial.target.tensors) is None
        rows.append(row)
        print(f"  v{st.version}: density {st.density:.2%}, bytes {row['bytes_ratio']:.4f} of full, "
              f"detect {detect_s * 1e3:.0f} ms = {row['detect_over_memcpy']:.2f}x memcpy, "
              f"publish {st.publish_ms:.0f} ms vs full {full_publish_ms:.0f} ms, "
              f"update {ust.total_ms:.0f} ms (apply {ust.apply_ms:.1f}) vs full {full_update_ms:.0f} ms, "
              f"without the download {update_load_ms:.0f} vs {full_load_ms:.0f} ms = {row['update_over_load_excl_download']:.3f} "
              f"(vs the copy floor {copy_floor_ms:.0f} ms: {row['update_over_copy_floor_excl_download']:.3f}) "
              f"({', '.join(f'{k} {v:.0f}' for k, v in row['update_parts_ms'].items())}; "
              f"user {update_rusage['user_ms']:.0f} sys {update_rusage['sys_ms']:.0f} ms, "
              f"{update_rusage['minor_faults']} page faults), "
              f"target.write {row['apply_ns_per_change']:.2f} ns/change = {row['apply_over_index_copy']:.2f}x "
              f"index_copy_ ({row['index_copy_ns_per_change']:.2f}), "
              f"peak +{row['publish_peak_extra_over_model']:.2f}x / +{row['update_peak_extra_over_model']:.2f}x model",
              flush=True)
        if serial is not None:
            print(f"    staging on 1 thread: update without the download {row['serial_update_load_ms']:.0f} ms "
                  f"({', '.join(f'{k} {v:.0f}' for k, v in row['serial_update_parts_ms'].items())}); "
                  f"default threads {row['threads_speedup']:.2f}x faster", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
    return {
        "size": size, "numel": numel, "model_nbytes": model_nbytes, "lr": lr, "steps": rows, "median": med,
        "anchor_publish_peak_extra_over_model": anchor_pub_mem / model_nbytes,
        "anchor_update_peak_extra_over_model": anchor_upd_mem / model_nbytes,
        "snapshot_nbytes_over_model": sender.detector.snapshot_nbytes() / model_nbytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["100m", "500m"], choices=list(QWEN3_SIZES))
    ap.add_argument("--steps", type=int, default=3, help="Adam steps (delta versions) per size")
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (weights, snapshots and replicas live there)")
    ap.add_argument("--synthetic", action="store_true",
                    help="Adam-first-step-like updates without forward/backward (for 1B/7B sizes)")
    ap.add_argument("--compare-threads", action="store_true",
                    help="also update a second replica with a receiver that stages on one thread (threads=1), "
                         "alternating which goes first, and report the default receiver's speedup over it")
    ap.add_argument("--out", default="runs/bench/core.json")
    args = ap.parse_args()
    if args.steps < 1 or (args.threads is not None and args.threads < 1):
        ap.error("--steps and --threads must be >= 1")
    if not args.device.startswith(("cpu", "cuda")) or (args.device.startswith("cuda") and not torch.cuda.is_available()):
        ap.error(f"--device {args.device}: cpu, or cuda on a machine with a GPU")
    check_writable(ap, "--out", args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"host": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "sizes": []}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            results["sizes"].append(bench_size(size, args.steps, args.lr, Path(tmp), args.device, args.synthetic,
                                                 args.compare_threads))
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print("\nmedians over delta versions:")
    print(f"{'size':>6} {'params':>8} {'density':>8} {'bytes/full':>10} {'detect/memcpy':>13} {'publish/full':>12} "
          f"{'update/full':>11} {'excl. download':>14} {'/copy floor':>11} {'sync/full':>9} {'apply/full':>10} {'apply ns':>8} {'/index_copy':>11} {'pub mem':>8} {'upd mem':>8} {'anchor pub mem':>14} {'anchor upd mem':>14}")
    for r in results["sizes"]:
        m = r["median"]
        print(f"{r['size']:>6} {r['numel'] / 1e6:>7.0f}M {m['density']:>8.2%} {m['bytes_ratio']:>10.4f} "
              f"{m['detect_over_memcpy']:>13.2f} {m['publish_ratio']:>12.3f} {m['update_ratio']:>11.3f} "
              f"{m['update_over_load_excl_download']:>14.3f} {m['update_over_copy_floor_excl_download']:>11.3f} "
              f"{m['sync_ratio']:>9.3f} "
              f"{m['apply_over_full_load']:>10.4f} {m['apply_ns_per_change']:>8.2f} {m['apply_over_index_copy']:>11.2f} "
              f"{m['publish_peak_extra_over_model']:>8.2f} "
              f"{m['update_peak_extra_over_model']:>8.2f} {r['anchor_publish_peak_extra_over_model']:>14.2f} "
              f"{r['anchor_update_peak_extra_over_model']:>14.2f}")
        if "threads_speedup" in m:
            print(f"{'':>6} staging on the default threads: {m['threads_speedup']:.2f}x faster than on one "
                  f"(update without the download, median)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
