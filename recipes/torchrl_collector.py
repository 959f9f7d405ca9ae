"""Asynchronous PPO on torchrl's pure-torch Pendulum, with weights synced as sparse deltas.

Architecture::

    this process (trainer)                          store (a folder here)           N worker processes
    ──────────────────────                          ─────────────────────           ──────────────────
    MultiAsyncCollector ◀── batches (torchrl) ──────────────────────────────────── Collector + PendulumEnv,
    GAE → replay buffer (StalenessAwareSampler)                                    actor in --serve-dtype,
    ClipPPOLoss, Adam                                                              DeltaWeightSyncScheme
    collector.update_policy_weights_() ─▶ DeltaWeightSyncScheme ─▶ versions/… ─▶    receiver thread applies
        publishes version v (anchor / delta)          objects/…                     each version in place
        waits for both workers' acks                                               and tags every frame
    sampler.consumer_version = v                                                   with its version

Every collected frame carries ``policy_version``: the version whose weights computed its action. The
replay buffer samples with torchrl's ``StalenessAwareSampler`` and never returns frames more than
``--max-staleness`` versions behind the trainer. Per iteration one JSON line goes to
``<out>/metrics.jsonl`` (reward, versions, staleness, bytes published against a full copy); at the
end the workers' weights are read back and compared bitwise with the trainer's cast (both are saved:
``<out>/trainer.safetensors``, the actor as trained, and ``<out>/worker-<i>.safetensors``, each
worker's bit patterns as served), and a plot is written to ``<out>/metrics.png`` when matplotlib is
installed.

Run (CPU, about a minute)::

    python recipes/torchrl_collector.py --out runs/torchrl_collector --iters 30

Options worth knowing: ``--serve-dtype bfloat16`` serves the actor in bf16 (the default ships the
fp32 weights losslessly), ``--store s3://bucket/run`` publishes to S3 instead of a folder,
``--start-method fork`` starts the workers faster on Linux (torchrl's default is ``spawn``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
from torch import nn


class ActorNet(nn.Module):
    """Gaussian actor body for Pendulum: runs in its weights' dtype (fp32 or bf16) and returns
    ``loc`` and ``scale`` in fp32, so the distribution math stays in full precision."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                  nn.Linear(hidden, 2))

    def forward(self, th: torch.Tensor, thdot: torch.Tensor):
        x = torch.stack([th.cos(), th.sin(), thdot / 8.0], -1).to(self.body[0].weight.dtype)
        out = self.body(x).float()
        loc, scale = out[..., :1], nn.functional.softplus(out[..., 1:]) + 1e-3
        return loc, scale


class ValueNet(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return self.body(torch.stack([th.cos(), th.sin(), thdot / 8.0], -1))


def make_env():
    from torchrl.envs.custom.pendulum import PendulumEnv

    return PendulumEnv()


def make_actor():
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor, TanhNormal

    env = make_env()
    module = TensorDictModule(ActorNet(), in_keys=["th", "thdot"], out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], spec=env.action_spec, distribution_class=TanhNormal,
                              distribution_kwargs={"low": -2.0, "high": 2.0}, return_log_prob=True)


def main(argv: list[str] | None = None) -> dict:
    from torch_deltasync.cli import HelpFormatter  # the deltasync command's: defaults shown

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--out", default="runs/torchrl_collector", help="folder for metrics (and the store by default)")
    p.add_argument("--store", default=None, help="store URI (default: <out>/bucket)")
    p.add_argument("--iters", type=int, default=30, help="training iterations (one weight update each)")
    p.add_argument("--workers", type=int, default=2, help="collector worker processes")
    p.add_argument("--frames-per-batch", type=int, default=256, help="frames per collected batch")
    p.add_argument("--serve-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the workers hold the actor's weights in (bit-identical to the trainer's cast)")
    p.add_argument("--anchor-every", type=int, default=10, help="publish a full anchor every N versions")
    p.add_argument("--max-staleness", type=int, default=2, help="versions a sampled frame may lag the trainer")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate")
    p.add_argument("--start-method", default=None, choices=["fork", "spawn", "forkserver"],
                   help="multiprocessing start method of the workers (default: torchrl's, spawn)")
    p.add_argument("--seed", type=int, default=0, help="policy and environment seed")
    args = p.parse_args(argv)
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a positive number, got {args.lr}")
    for name in ("iters", "workers", "frames_per_batch", "anchor_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_staleness < 0:
        p.error(f"--max-staleness must be >= 0 (versions), got {args.max_staleness}")
    if args.store is not None and args.store.startswith("memory://"):
        p.error("--store memory://... lives inside one process, but the collector's workers are separate processes; "
                "use a folder, s3://... or hf://buckets/...")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out} is a file; give a folder")
    if args.start_method:
        mp.set_start_method(args.start_method, force=True)

    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiAsyncCollector
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import StalenessAwareSampler
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    from torch_deltasync.integrations.torchrl import DeltaWeightSyncScheme
    from torch_deltasync.testing import state_bits

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    torch.manual_seed(args.seed)
    serve = getattr(torch, args.serve_dtype)
    actor = make_actor()
    critic = TensorDictModule(ValueNet(), in_keys=["th", "thdot"], out_keys=["state_value"])

    scheme = DeltaWeightSyncScheme(args.store or str(out / "bucket"), prefix=f"actor-{int(time.time())}",
                                   inference_dtype=serve, receiver_dtype=serve, anchor_every=args.anchor_every,
                                   ack_timeout_s=300)
    sampler = StalenessAwareSampler(max_staleness=args.max_staleness)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(args.frames_per_batch * 8), sampler=sampler,
                                batch_size=min(64, args.frames_per_batch))
    gae = GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=True)
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=1e-3)
    opt = torch.optim.Adam(loss.parameters(), args.lr)
    # Built last, right before the try: a collector not shut down keeps its worker processes (and
    # this process) alive forever.
    collector = MultiAsyncCollector([make_env] * args.workers, actor, frames_per_batch=args.frames_per_batch,
                                    total_frames=args.frames_per_batch * args.iters, max_frames_per_traj=200,
                                    track_policy_version=True, weight_sync_schemes={"policy": scheme})

    t0 = time.perf_counter()
    summary: dict = {}
    try:
        for it, data in enumerate(collector):
            with torch.no_grad():
                gae(data)
            rb.extend(data.reshape(-1))
            for _ in range(4):
                batch = rb.sample()
                losses = loss(batch)
                total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                opt.zero_grad()
                total.backward()
                nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
                opt.step()
            t = time.perf_counter()
            collector.update_policy_weights_()  # publish version v; returns once the workers applied it
            update_ms = (time.perf_counter() - t) * 1e3
            sampler.consumer_version = scheme.version
            pub = scheme.last_publish
            versions = data["policy_version"].float()
            row = {
                "event": "iteration", "iteration": it, "version": scheme.version, "time_s": time.perf_counter() - t0,
                "frames": data.numel(), "reward": data["next", "reward"].mean().item(),
                "data_versions": sorted({int(v) for v in data["policy_version"].reshape(-1).tolist()}),
                "staleness_mean": float(scheme.version - 1 - versions.mean()),
                "workers_at_version": all(v == scheme.version for v in scheme.worker_versions().values())
                and len(scheme.worker_versions()) == args.workers,
                "publish_kind": pub.kind, "publish_nbytes": pub.nbytes, "full_nbytes": pub.full_nbytes,
                "changed": pub.changed, "numel": pub.numel, "update_ms": update_ms,
            }
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"iter {it:3d}  v{row['version']:<4d} reward {row['reward']:8.3f}  data from {row['data_versions']}  "
                  f"{row['publish_kind']:6s} {row['publish_nbytes']:>8,d} B of {row['full_nbytes']:,d}  "
                  f"update {update_ms:6.1f} ms", flush=True)
        # The collector is exhausted and its workers idle: read their weights back and compare bitwise.
        want = state_bits(actor, serve)
        states = collector.map_fn("_receiver_schemes['policy'].receiver_state",
                                  list_of_kwargs=[{"include_weights": True}] * args.workers)
        exact = all(s["version"] == scheme.version and all(torch.equal(s["weights"][n], b) for n, b in want.items())
                    for s in states)
        # The weights themselves, for checks outside this script: the trainer's actor as trained and
        # each worker's bit patterns as served.
        from safetensors.torch import save_file

        save_file({n: t.detach().contiguous() for n, t in actor.state_dict().items()}, str(out / "trainer.safetensors"))
        for i, s in enumerate(states):
            save_file({n: t.contiguous() for n, t in s["weights"].items()}, str(out / f"worker-{i}.safetensors"))
        summary = {"event": "verify", "version": scheme.version, "workers_bitexact": exact,
                   "workers": [s["version"] for s in states]}
        with open(metrics_path, "a") as f:
            f.write(json.dumps(summary) + "\n")
        print(f"workers hold version {summary['workers']}, bit-identical to the trainer's {args.serve_dtype} cast: {exact}")
    finally:
        collector.shutdown()
        scheme.shutdown()
    _plot(metrics_path, out / "metrics.png")
    if not summary.get("workers_bitexact"):
        raise SystemExit("workers differ from the trainer")
    return summary


def _plot(metrics_path: Path, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    rows = [r for r in rows if r["event"] == "iteration"]
    if not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    x = [r["version"] for r in rows]
    axes[0].plot(x, [r["reward"] for r in rows])
    axes[0].set(xlabel="policy version", ylabel="mean reward per step", title="Pendulum")
    axes[1].plot(x, [r["publish_nbytes"] / r["full_nbytes"] for r in rows], marker=".")
    axes[1].set(xlabel="policy version", ylabel="bytes published / full copy", title="delta size")
    axes[2].plot(x, [r["staleness_mean"] for r in rows])
    axes[2].set(xlabel="policy version", ylabel="versions behind", title="staleness of collected data")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def run(argv: list[str] | None = None) -> int:
    """:func:`main` as a command: a one-line error (exit 1) for a store or folder that fails, exit
    130 on Ctrl-C (the collector and its workers are shut down by ``main``)."""
    from torch_deltasync.errors import DeltaSyncError

    try:
        main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (DeltaSyncError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
