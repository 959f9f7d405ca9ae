"""Memory of ``deltasync demo``: the estimate it prints against the peak resident size measured.

Runs :func:`torch_deltasync.demo.run_demo` for each ``--sizes`` config and reports the peak
resident set size (``ru_maxrss``) of the trainer (this process) and of the receiver process, their
sum, and the ratio measured / estimated (:func:`torch_deltasync.demo.estimate_memory`), in one run.
A ratio near 1 means ``demo`` refuses exactly the sizes that would not fit.

Run one size per invocation (``ru_maxrss`` is a peak over the process's life)::

    PYTHONPATH=. python tools/bench_demo_memory.py --size tiny
    PYTHONPATH=. python tools/bench_demo_memory.py --size 100m     # ~2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import resource
import tempfile


def main() -> None:
    from torch_deltasync.demo import estimate_memory, run_demo
    from torch_deltasync.testing import QWEN3_SIZES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=list(QWEN3_SIZES), help="a key of torch_deltasync.testing.QWEN3_SIZES")
    p.add_argument("--steps", type=int, default=3, help="versions to publish (anchor every 2)")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    with tempfile.TemporaryDirectory() as run_dir:
        ok = run_demo(steps=args.steps, size=args.size, run_dir=run_dir, anchor_every=2)
    trainer = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    receiver = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    est = estimate_memory(args.size)
    gib = 2**30
    print(f"| {args.size} | {est.parameters / 1e6:.1f}M | {trainer / gib:.2f} | {receiver / gib:.2f} | "
          f"{(trainer + receiver) / gib:.2f} | {est.need_nbytes / gib:.2f} | {(trainer + receiver) / est.need_nbytes:.2f} |"
          f"{'' if ok else ' (not bit-exact!)'}")


if __name__ == "__main__":  # the receiver process is spawned: it must not run this again
    main()
