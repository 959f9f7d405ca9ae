"""Page faults of decoding whole change sets: glibc's default allocator against raised thresholds.

A receiver decodes every changed tensor of a version and resolves its steps against the old values
(``DeltaReceiver.prepare``, tensor by tensor); the decoded arrays (positions, steps, values, mask
and the resolved values: 10-15 bytes per change) are allocated afresh for every version, and the
positions and new values stay alive until the version is committed. This tool decodes a whole set
(``Codec.decode_many``, one thread) and resolves it, ``--rounds`` rounds per change set, and
reports per round ns per change (wall time) and the minor page faults (``getrusage``), in two
child processes run alternately: glibc's defaults, and
``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864`` (glibc's own environment
variables: a fixed 32 MiB mmap threshold, up to 64 MiB of free heap kept), one child per change set
(a receiver holds one model; glibc's adaptive thresholds depend on what the process freed before,
so sets measured in one process change each other's figures). The first round of each
child also faults in memory the process never had; later rounds show whether an update re-faults
what the one before freed (``docs/benchmarks.md``, issue 14, ninth part).

Change sets: ``qwen3-100m`` at ``--qwen-lrs`` after ``--qwen-steps`` Adam steps and the Bernoulli
sets at 1% and 5% of ``--synthetic-numel`` elements (``tools/bench_codec.py`` builds both).

Run (about 3 minutes on 2 CPU cores)::

    .venv/bin/python tools/bench_page_faults.py --jsonl runs/bench_page_faults.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TUNED = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "67108864"}


def measure(sets_path: str, rounds: int) -> list[dict]:
    """Rounds of ``decode_many`` + ``resolve`` over every set in ``sets_path`` (this process)."""
    from torch_deltasync.codecs import get_codec

    codec = get_codec("packed")
    out = []
    for name, cs in torch.load(sets_path).items():
        items = [(pos, new, old, numel) for pos, old, new, numel in cs.values() if pos.numel()]
        nnz = sum(pos.numel() for pos, *_ in items)
        blobs = codec.encode_many(items, threads=1)
        for r in range(rounds):
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter_ns()
            deltas = codec.decode_many([(b, numel, pos.numel(), new.dtype) for b, (pos, new, _, numel)
                                        in zip(blobs, items)], threads=1)
            news = [d.resolve(old) for d, (_, _, old, _) in zip(deltas, items)]
            t1, f1 = time.perf_counter_ns(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for got, (_, new, _, _) in zip(news, items):  # outside the timed part
                assert torch.equal(got.view(torch.int16), new.view(torch.int16)), name
            del deltas, news
            out.append({"set": name, "round": r, "changes": nnz, "ns_per_change": (t1 - t0) / nnz,
                        "faults": f1 - f0, "fault_bytes_per_change": (f1 - f0) * 4096 / nnz})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qwen-lrs", default="1e-6,3e-6")
    p.add_argument("--qwen-steps", type=int, default=2)
    p.add_argument("--synthetic-numel", type=int, default=40_000_000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--trials", type=int, default=2, help="alternating default/tuned children")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rounds < 2 and not a.child:
        p.error(f"--rounds must be >= 2 (the first round of each child is not reported), got {a.rounds}")
    if a.trials < 1 or a.qwen_steps < 1 or a.synthetic_numel < 1000:
        p.error("--trials and --qwen-steps must be >= 1, --synthetic-numel >= 1000")
    torch.set_num_threads(1)
    if a.child:
        print(json.dumps(measure(a.child, a.rounds)))
        return 0

    import tempfile

    import bench_codec

    sets = bench_codec.synthetic_sets([0.01, 0.05], a.synthetic_numel)
    lrs = [float(x) for x in a.qwen_lrs.split(",") if x]
    if lrs:
        sets.update(bench_codec.qwen3_sets(lrs, a.qwen_steps, lambda m: print(m, file=sys.stderr)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, cs) in enumerate(sets.items()):  # one model per process, as a receiver has
            path = str(Path(tmp) / f"set{i}.pt")
            torch.save({name: cs}, path)
            for trial in range(a.trials):
                for mode in ("default", "tuned") if trial % 2 == 0 else ("tuned", "default"):
                    env = {k: v for k, v in os.environ.items() if k not in TUNED}
                    env.update(TUNED if mode == "tuned" else {})
                    res = subprocess.run([sys.executable, __file__, "--child", path, "--rounds", str(a.rounds)],
                                         env=env, capture_output=True, text=True, check=True)
                    rows += [{**r, "mode": mode, "trial": trial} for r in json.loads(res.stdout.splitlines()[-1])]
    if a.jsonl:
        Path(a.jsonl).parent.mkdir(parents=True, exist_ok=True)
        with open(a.jsonl, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("| change set | changes | default: ns per change | faults per round | tuned: ns per change | "
          "faults per round | default / tuned |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in sets:
        got = {m: [r for r in rows if r["set"] == name and r["mode"] == m and r["round"] > 0]
               for m in ("default", "tuned")}
        if not got["default"]:
            continue

        def span(m, key, fmt):
            vals = [r[key] for r in got[m]]
            return f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"

        med = {m: sorted(r["ns_per_change"] for r in got[m])[len(got[m]) // 2] for m in got}
        print(f"| {name} | {got['default'][0]['changes']:,} | {span('default', 'ns_per_change', '{:.1f}')} | "
              f"{span('default', 'faults', '{:,}')} | {span('tuned', 'ns_per_change', '{:.1f}')} | "
              f"{span('tuned', 'faults', '{:,}')} | {med['default'] / med['tuned']:.2f}x |")
    print("(rounds after the first of each child; ranges over children and rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
