"""Bytes a receiver downloads to cross an anchor: the planner's cheapest path against the anchor path.

A ``tiny_qwen3("tiny")`` trainer (fp32 Adam, lr 3e-6, random tokens) publishes versions 0-11 with an
anchor every 10 versions (every anchor after the first also carries a delta from the version before).
For receivers holding versions 5 to 10, it prints the plan to version 11 chosen by
``DeltaReceiver.plan`` (the delta parts, across the anchor 10) and the anchor path from version 10
(``plan(force_anchor=True)``, what the planner downloaded before issue 15), in bytes and as a ratio,
measured in one run; then applies the chosen plan and verifies the checksums.

Run (a few seconds)::

    python tools/bench_plan.py
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore
from torch_deltasync.testing import adam_step, tiny_qwen3


def main() -> None:
    store = LocalStore(tempfile.mkdtemp(prefix="bench-plan-"), fsync=False)
    trainer = tiny_qwen3("tiny", seed=0)
    opt = torch.optim.Adam(trainer.parameters(), lr=3e-6)
    sender = DeltaSender(trainer, store, anchor_every=10)
    replicas = {held: tiny_qwen3("tiny", seed=1, dtype=torch.bfloat16) for held in range(5, 11)}
    receivers = {held: DeltaReceiver(m, store) for held, m in replicas.items()}
    for v in range(12):
        if v:
            adam_step(trainer, opt)
        sender.publish()
        if v in receivers:
            receivers[v].update()
    sender.close()
    print("| held | plan to 11 | bytes | anchor path bytes | ratio |")
    print("|---:|---|---:|---:|---:|")
    for held, r in receivers.items():
        plan, anchor = r.plan(11), r.plan(11, force_anchor=True)
        steps = " ".join(f"v{s.version}:{s.kind}" for s in plan.steps)
        print(f"| {held} | {plan.path} ({steps}) | {plan.nbytes:,} | {anchor.nbytes:,} | {anchor.nbytes / plan.nbytes:.1f}x |")
        assert r.update(11) == 11
        r.verify()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
    main()
