"""The async GRPO main job on both engines, back to back: ``--engine hf`` and ``--engine vllm``
(``--interrupt keep``) with the same options, then one table from their ``summary.json``.

    .venv/bin/python tools/bench_grpo_engines.py                          # the default run
    .venv/bin/python tools/bench_grpo_engines.py --steps 50 -- --digits 3 # shorter, extra recipe options

Columns: wall time (process start to exit), samples generated per second of GRPO time, reward of
the first / last 10% of steps, mean / max stall per sync (the time an engine stood still for a
sync: the pause around a commit in flight, or the whole update between batches), the fraction of
generation time lost to syncs, in-flight syncs and trained tokens by version lag. Results:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(engine: str, runs_dir: str, steps: int | None, extra: list[str]) -> dict:
    name = f"bench-{engine}"
    cmd = [sys.executable, "-m", "recipes.async_grpo", "--engine", engine, "--runs-dir", runs_dir, "--run-name", name,
           "--no-progress", "--log-every", "50", *(["--steps", str(steps)] if steps else []), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{engine}: exit {proc.returncode}")
    s = json.loads((Path(runs_dir) / name / "summary.json").read_text())
    s["process_wall_s"] = wall
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-dir", default="runs/bench-engines")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("extra", nargs="*", help="further recipe options (after --)")
    ns = p.parse_args()
    rows = {e: run(e, ns.runs_dir, ns.steps, ns.extra) for e in ("hf", "vllm")}
    print(f"load average at the end: {os.getloadavg()}")
    print("| engine | wall s | GRPO s | samples/s | reward first → last | mean / max stall ms | sync time lost | "
          "in-flight syncs / syncs | tokens by lag | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e, s in rows.items():
        print(f"| {e} ({s['interrupt']}) | {s['process_wall_s']:.0f} | {s['train_s']:.0f} | "
              f"{s['samples_generated'] / s['train_s']:.1f} | {s['reward_first']:.3f} → {s['reward_last']:.3f} | "
              f"{s['mean_stall_ms']:.1f} / {s['max_stall_ms']:.1f} | {100 * s['sync_time_frac']:.2f}% | "
              f"{s['inflight_syncs']} / {s['syncs']} | {s['tokens_by_lag']} | {s['bit_exact']} |")
    print(json.dumps({e: {k: s.get(k) for k in ("process_wall_s", "train_s", "samples_generated", "reward_first",
                                                 "reward_last", "mean_stall_ms", "max_stall_ms", "sync_time_frac",
                                                 "inflight_syncs", "syncs", "tokens_by_lag", "bit_exact")}
                      for e, s in rows.items()}))


if __name__ == "__main__":
    main()
