"""Receiver staging on threads: ``DeltaReceiver.prepare`` with ``threads=1`` against more, in one process.

A Qwen3 model (``--size``) takes ``--steps`` real Adam steps at ``--lr``, each published as a delta;
one bf16 replica's receiver holds version 1 and stages the last version ``--rounds`` times per
setting, alternating the settings in every round (the order flips each round), so the VM's drift
between minutes falls on both alike. ``prepare`` writes nothing, so every round stages the same
update. Reported per setting: the medians of staging (decode, old-value reads, resolve, merge:
``UpdateStats.decode_ms``) + verification (``verify_ms``), without the download, in ms and ns per
change, the process's CPU seconds per wall second, and the speedup of each setting over the first
(``threads=1`` by default). ``docs/benchmarks.md`` (issue 14, tenth part) quotes it.

Run (about 2 minutes on 2 CPU cores for ``100m``)::

    .venv/bin/python tools/bench_staging.py --size 100m --lr 3e-6 --jsonl runs/bench_staging.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_deltasync import DeltaReceiver, DeltaSender  # noqa: E402
from torch_deltasync.testing import adam_step, first_difference, tiny_qwen3  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", help="a key of torch_deltasync.testing.QWEN3_SIZES")
    ap.add_argument("--lr", type=float, default=3e-6, help="Adam learning rate (sets the density)")
    ap.add_argument("--steps", type=int, default=2, help="Adam steps, each published (stage v1 -> v<steps>)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="settings compared (first: baseline)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--jsonl", default=None, help="append one JSON line with the results")
    args = ap.parse_args()
    torch.set_num_threads(1)  # torch's own intra-op threads stay out of the comparison

    model = tiny_qwen3(args.size)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    with tempfile.TemporaryDirectory() as store:
        sender = DeltaSender(model, store)
        sender.publish()
        for i in range(args.steps):
            adam_step(model, opt, generator=torch.Generator().manual_seed(i))
            sender.publish()
        last = sender.version
        receiver = DeltaReceiver(tiny_qwen3(args.size, seed=1, dtype=torch.bfloat16), store)
        receiver.update(1)
        config = receiver.receiver_config
        runs: dict[int, list[tuple[float, float]]] = {t: [] for t in args.threads}
        changed = 0
        for r in range(args.rounds):
            for t in (args.threads if r % 2 == 0 else args.threads[::-1]):
                receiver.receiver_config = dataclasses.replace(config, threads=t)
                wall, cpu = time.perf_counter(), time.process_time()
                staged = receiver.prepare(last)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                runs[t].append((staged.stats.decode_ms + staged.stats.verify_ms, cpu / wall))
                changed = sum(p.numel() for p, _ in staged._sparse.values())
                del staged
            print(f"round {r + 1}/{args.rounds}", flush=True)
        receiver.receiver_config = config
        receiver.update(last)
        assert first_difference(model, receiver.target.tensors) is None  # the staged bits were right
    base = statistics.median(ms for ms, _ in runs[args.threads[0]])
    out = {"size": args.size, "lr": args.lr, "steps": args.steps, "changed": changed, "rounds": args.rounds,
           "settings": {}}
    print(f"\nstaging + verification of v1 -> v{last} ({changed:,} changes), medians of {args.rounds}")
    print("| threads | ms | ns per change | CPU / wall | speedup over the first |\n|---:|---:|---:|---:|---:|")
    for t, xs in runs.items():
        ms = statistics.median(x for x, _ in xs)
        row = {"ms": ms, "ns_per_change": ms * 1e6 / max(changed, 1), "cpu_per_wall": statistics.median(c for _, c in xs),
               "speedup": base / ms}
        out["settings"][str(t)] = row
        print(f"| {t} | {ms:.1f} | {row['ns_per_change']:.1f} | {row['cpu_per_wall']:.2f} | {row['speedup']:.2f}x |")
    if args.jsonl:
        Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
