"""What ``collector.update_policy_weights_()`` costs with each torchrl weight-sync scheme.

One ``MultiSyncCollector`` with ``--workers`` worker processes (``fork``) on ``PendulumEnv`` per
scheme, a policy of ``--hidden`` x ``--layers`` (fp32 master weights on the trainer), and
``--updates`` real Adam steps at an RL-like learning rate (``--lr``) between updates, after one
untimed warm-up update (the first anchor, kernel loading). Each
``update_policy_weights_()`` returns once every worker applied the weights (all schemes run with
their synchronous acknowledgements), so its wall time is the trainer's stall per update.

Schemes, measured in the same run:

* ``delta-bf16``: :class:`DeltaWeightSyncScheme` through a local folder, workers hold bf16;
* ``delta-fp32``: the same, lossless in fp32;
* ``torchrl-mp``: torchrl's ``MultiProcessWeightSyncScheme`` (full fp32 copy per worker through
  multiprocessing queues);
* ``torchrl-shared``: torchrl's default ``SharedMemWeightSyncScheme`` (fp32 weights in shared memory,
  one host only).

Reported per scheme: median time of ``update_policy_weights_()`` (ms), bytes that leave the trainer
per update (delta: the objects and manifest published, read by every worker; mp: one full fp32 copy
per worker; shared: one full fp32 copy into shared memory, never leaves the host) and the fraction of
elements whose bits changed in the published dtype. Ratios are against ``torchrl-mp`` in this run (against
the first of ``--schemes`` when it is not among them).

Run (about a minute on 2 CPU cores)::

    PYTHONPATH=. python tools/bench_torchrl.py --hidden 1024 --layers 4 --updates 8

Writes one JSON line per scheme to ``--metrics`` (default ``runs/bench_torchrl.jsonl``) and prints a
Markdown table for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
from torch import nn


class BigNet(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        dims = [2] + [hidden] * layers + [1]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        x = torch.stack([th, thdot], -1).to(self.layers[0].weight.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x.float().clamp(-2, 2)


def make_env():
    from torchrl.envs.custom.pendulum import PendulumEnv

    return PendulumEnv()


def run(name: str, args) -> dict:
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiSyncCollector
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    from torch_deltasync.integrations.torchrl import DeltaWeightSyncScheme

    torch.manual_seed(0)
    policy = TensorDictModule(BigNet(args.hidden, args.layers), in_keys=["th", "thdot"], out_keys=["action"])
    numel = sum(p.numel() for p in policy.parameters())
    tmp = tempfile.mkdtemp(prefix="bench_torchrl_")
    if name.startswith("delta"):
        dtype = torch.bfloat16 if name == "delta-bf16" else torch.float32
        scheme = DeltaWeightSyncScheme(tmp, inference_dtype=dtype, receiver_dtype=dtype, anchor_every=args.anchor_every,
                                       ack_timeout_s=600, poll_interval_s=0.01)
    elif name == "torchrl-mp":
        scheme = MultiProcessWeightSyncScheme()
    else:
        scheme = SharedMemWeightSyncScheme()
    collector = MultiSyncCollector([make_env] * args.workers, policy, frames_per_batch=8 * args.workers,
                                   total_frames=-1, weight_sync_schemes={"policy": scheme})
    opt = torch.optim.Adam(policy.parameters(), args.lr)
    gen = torch.Generator().manual_seed(1)
    times, nbytes, density, publish_ms, worker_ms = [], [], [], [], []
    try:
        for i in range(args.updates + 1):  # update 0: an untimed warm-up (first calls load kernels)
            opt.zero_grad()
            for p in policy.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            t = time.perf_counter()
            collector.update_policy_weights_()
            if not i:
                continue
            times.append((time.perf_counter() - t) * 1e3)
            if name.startswith("delta"):
                st = scheme.last_publish
                nbytes.append(st.nbytes)
                density.append(st.density)
                publish_ms.append(st.publish_ms)
                states = collector.map_fn("_receiver_schemes['policy'].receiver_state")
                worker_ms.append(max(s["last_update"]["update_ms"] + s["last_update"]["apply_ms"] for s in states))
            elif name == "torchrl-mp":
                nbytes.append(numel * 4 * args.workers)
            else:
                nbytes.append(numel * 4)
    finally:
        collector.shutdown()
        if hasattr(scheme, "shutdown"):
            scheme.shutdown()
    return {"scheme": name, "numel": numel, "workers": args.workers, "updates": args.updates,
            "update_ms_median": median(times), "update_ms": times, "bytes_per_update": median(nbytes),
            "density": median(density) if density else None,
            "publish_ms_median": median(publish_ms) if publish_ms else None,
            "worker_update_ms_median": median(worker_ms) if worker_ms else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate (RL fine-tuning: 1e-6 .. 1e-5)")
    p.add_argument("--anchor-every", type=int, default=100)
    p.add_argument("--schemes", default="delta-bf16,delta-fp32,torchrl-mp,torchrl-shared")
    p.add_argument("--metrics", default="runs/bench_torchrl.jsonl")
    args = p.parse_args()
    schemes = ("delta-bf16", "delta-fp32", "torchrl-mp", "torchrl-shared")
    bad = [s for s in args.schemes.split(",") if s not in schemes]
    if bad:
        p.error(f"--schemes takes a comma list of {', '.join(schemes)} (got {bad})")
    if min(args.hidden, args.layers, args.workers, args.updates, args.anchor_every) < 1:
        p.error("--hidden, --layers, --workers, --updates and --anchor-every must be >= 1")
    mp.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    rows = [run(name, args) for name in args.schemes.split(",")]
    Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
    with open(args.metrics, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    base = next((r for r in rows if r["scheme"] == "torchrl-mp"), rows[0])
    print(f"\n{rows[0]['numel']:,} parameters, {args.workers} workers, {args.updates} updates, Adam lr {args.lr:g}\n")
    vs = f"vs {base['scheme']}"  # torchrl-mp when it ran, else the first scheme
    print(f"| scheme | update_policy_weights_() median | {vs} | of which publish | worker download+apply "
          f"| bytes out per update | {vs} | changed elements |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        d = "" if r["density"] is None else f"{100 * r['density']:.2f}%"
        pub = "" if r["publish_ms_median"] is None else f"{r['publish_ms_median']:.1f} ms"
        wrk = "" if r["worker_update_ms_median"] is None else f"{r['worker_update_ms_median']:.1f} ms"
        print(f"| {r['scheme']} | {r['update_ms_median']:.1f} ms | {r['update_ms_median'] / base['update_ms_median']:.2f}x "
              f"| {pub} | {wrk} | {r['bytes_per_update'] / 1e6:.2f} MB | {r['bytes_per_update'] / base['bytes_per_update']:.3f}x | {d} |")


if __name__ == "__main__":
    main()
