"""FSDP2 (optionally x tensor parallel, HSDP) trainer under torchrun that publishes every optimizer
step as a sparse, lossless delta.

Architecture::

    torchrun --nproc-per-node N                                  any machine that reads the bucket
    ┌──────────────────────────────────────────────┐
    │ rank r:  Qwen3 (fully_shard per decoder layer │            deltasync follow BUCKET
    │          + root) → Adam step → publish()      │  objects   (or DeltaReceiver in your server):
    │   detect changes on its own shard only,       │ ─────────▶ waits for versions/<v>.json,
    │   upload objects/<v>/delta-r<r>-of<N>         │  manifest  downloads every rank's object,
    │ rank 0: gathers per-rank metadata (KiB),      │ ─────────▶ verifies, applies in place,
    │   writes versions/<v>.json last               │            prints density/bytes/latency
    └──────────────────────────────────────────────┘

No rank gathers the model: each rank compares the bf16 cast of its local shard with its snapshot of
the last published version and ships its changed elements with global indices; see docs/fsdp2.md.

Launch (toy size on CPU with gloo; ``--standalone`` picks a free port)::

    torchrun --standalone --nproc-per-node 2 recipes/torchrun_fsdp2.py --bucket runs/fsdp2/bucket --steps 20
    deltasync follow runs/fsdp2/bucket --idle-timeout 10     # in another shell, during or after

On GPUs the same command uses NCCL for training (the sender's own collectives always use gloo).
``--bucket`` takes anything ``open_store`` accepts (a folder, ``s3://...``, ``hf://buckets/...``).

2D and 3D, torchtitan's layout (:func:`parallelize`): ``--tp T`` splits the ranks into a
``(dp_shard, tp)`` mesh, applies tensor parallelism inside each tp group (column-parallel q/k/v,
gate/up and LM head, row-parallel o/down, vocab-parallel embedding) and then ``fully_shard`` over
dp_shard, so column-parallel weights end up ``[_StridedShard(0, sf=T), Shard(0)]``;
``--dp-replicate R`` adds an HSDP replicate dim in front (``(R, dp_shard, tp)``). The follower is
the same: receivers never see how the trainer was sharded::

    torchrun --standalone --nproc-per-node 4 recipes/torchrun_fsdp2.py --bucket runs/2d/bucket --tp 2 --steps 20
    deltasync follow runs/2d/bucket --idle-timeout 10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from torch_deltasync.cli import HelpFormatter  # the deltasync command's: defaults shown
    from torch_deltasync.store import file_in_the_way
    from torch_deltasync.testing import QWEN3_SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--bucket", required=True, help="store to publish to (folder, s3://, hf://buckets/...)")
    p.add_argument("--prefix", default="", help="run prefix inside the bucket")
    p.add_argument("--size", default="tiny", choices=sorted(QWEN3_SIZES), help="Qwen3 config (torch_deltasync.testing)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (one version each)")
    p.add_argument("--lr", type=float, default=3e-6, help="Adam learning rate")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--anchor-every", type=int, default=10, help="a full anchor every N versions")
    p.add_argument("--background", action="store_true",
                   help="upload while the next step trains (coalesces when uploads fall behind)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (a divisor of the world size)")
    p.add_argument("--dp-replicate", type=int, default=1,
                   help="HSDP replicas (a divisor of world / tp); the rest of the ranks shard (dp_shard)")
    p.add_argument("--takeover", action="store_true",
                   help="claim the run prefix even if a crashed earlier job's writer lease is still live (< 60 s)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    p.add_argument("--metrics", default=None, help="JSONL of PublishStats (rank 0)")
    p.add_argument("--save-final", default=None,
                   help="after training, gather the full bf16 weights once and save them (safetensors) "
                        "on rank 0, to check receivers against; off by default")
    args = p.parse_args(argv)
    for flag in ("steps", "batch", "seq", "anchor_every", "tp", "dp_replicate"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        p.error(f"--lr must be a positive finite number, got {args.lr}")
    world = int(os.environ.get("WORLD_SIZE") or 1)  # (torchrun's; checked before any process group or model)
    if world % (args.tp * args.dp_replicate):
        if int(os.environ.get("RANK") or 0):
            sys.exit(2)  # rank 0 says why, once
        p.error(f"--tp {args.tp} x --dp-replicate {args.dp_replicate} must divide the world size {world} "
                "(torchrun --nproc-per-node)")
    for flag in ("save_final", "metrics"):  # checked now, not after training (--save-final) or by dropping records
        path, option = getattr(args, flag), f"--{flag.replace('_', '-')}"
        if path is None:
            continue
        folder = file_in_the_way(os.path.dirname(os.path.abspath(path)))  # (the missing folders are made)
        if folder is not None:
            p.error(f"{option} {path!r}: {folder} is a file, not a folder")
        if os.path.isdir(path):
            p.error(f"{option} {path!r} is a folder: give a file's path")
    return args


def tp_plan(model) -> dict:
    """torchtitan's tensor-parallel plan for a ``Qwen3ForCausalLM`` (``parallelize_module`` style;
    no sequence parallelism): vocab-parallel embedding (weight ``Shard(0)``), column-parallel q/k/v,
    gate/up (``Shard(0)``) and LM head, row-parallel o/down (``Shard(1)``). Norms and MoE experts stay
    unsplit (FSDP shards them over dp only, so every tp rank holds the same block)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}"
        plan.update({f"{pre}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
        if hasattr(layer.mlp, "gate_proj"):  # dense MLP (MoE layers keep their experts unsplit)
            plan.update({f"{pre}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
            plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
    return plan


def parallelize(model, world: int, *, tp: int = 1, dp_replicate: int = 1, device_type: str = "cpu") -> int:
    """Shard ``model`` (a transformers Qwen3) in place the torchtitan way; returns the rank's data-
    parallel index (ranks of one tp group must train on the same batch).

    Mesh ``(dp_replicate, dp_shard, tp)`` with size-1 dims left out, ``dp_shard = world / (dp_replicate
    * tp)``. First ``parallelize_module`` over ``tp`` (:func:`tp_plan`), then ``fully_shard`` per
    decoder layer and the root over ``dp_shard`` (HSDP over ``(dp_replicate, dp_shard)``). Resulting
    placements, e.g. for ``q_proj.weight`` on ``(dp_shard=2, tp=2)``: ``[_StridedShard(0, sf=2),
    Shard(0)]``; ``o_proj.weight``: ``[Shard(0), Shard(1)]``; a norm: ``[Shard(0)]`` on the dp_shard
    sub-mesh (held by every tp rank).

    Raises:
        ValueError: ``tp * dp_replicate`` does not divide ``world``, or ``tp`` does not divide the
            attention heads.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if world % (tp * dp_replicate):
        raise ValueError(f"--tp {tp} x --dp-replicate {dp_replicate} must divide the world size {world}")
    cfg = model.config
    if tp > 1 and (cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp):
        raise ValueError(f"--tp {tp} must divide the attention heads ({cfg.num_attention_heads} query, "
                         f"{cfg.num_key_value_heads} key/value)")
    dims = [("dp_replicate", dp_replicate), ("dp_shard", world // (tp * dp_replicate)), ("tp", tp)]
    dims = [(n, k) for n, k in dims if k > 1 or n == "dp_shard"]
    mesh = init_device_mesh(device_type, tuple(k for _, k in dims), mesh_dim_names=tuple(n for n, _ in dims))
    if tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return dist.get_rank() // tp  # ranks are laid out row-major: the tp group is the innermost dim


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from torch_deltasync import DeltaSender
    from torch_deltasync.testing import adam_step, tiny_qwen3

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")

    model = tiny_qwen3(args.size, seed=args.seed).to(device)  # same init on every rank
    dp_rank = parallelize(model, world, tp=args.tp, dp_replicate=args.dp_replicate, device_type=device.type)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    from torch_deltasync.errors import PrefixInUseError

    try:
        sender = DeltaSender(model, args.bucket, prefix=args.prefix, anchor_every=args.anchor_every,
                             background=args.background, metrics_path=args.metrics, takeover=args.takeover)
    except PrefixInUseError as e:
        raise SystemExit(f"[rank {rank}] {e} (here: --takeover)") from None
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"[rank 0] Qwen3-{args.size}: {nparams:,} parameters over {world} ranks (tp {args.tp}, dp_replicate "
              f"{args.dp_replicate}), publishing to {sender.store.describe()}", flush=True)

    gen = torch.Generator().manual_seed(args.seed * 1000 + dp_rank)  # each dp rank its own data; tp ranks share it

    def report(stats) -> None:
        if rank == 0 and stats is not None:
            print(f"[rank 0] version {stats.version:>5} {stats.kind:<6} changed {stats.changed:>10,} "
                  f"({stats.density:7.3%})  {stats.nbytes:>12,} B  publish {stats.publish_ms:7.1f} ms",
                  flush=True)

    for step in range(args.steps + 1):
        if step:  # version 0 is the initial weights
            loss = adam_step(model, opt, batch=args.batch, seq=args.seq, generator=gen)
            if rank == 0:
                print(f"[rank 0] step {step:>5} loss {loss:.4f}", flush=True)
        version = sender.publish()
        if not args.background:
            report(sender.last_stats)
        elif rank == 0:  # stats of background publishes are printed at the end (and go to --metrics)
            print(f"[rank 0] step {step:>5}: " + (f"version {version} uploading" if version is not None else
                  "previous upload still in flight, coalesced into the next version"), flush=True)
    last = sender.flush()  # also publishes the weights of a coalesced last step
    sender.close()
    if args.background:
        for stats in sender.history:
            report(stats)

    if args.save_final:
        from safetensors.torch import save_file
        from torch.distributed.tensor import DTensor

        full = {}
        for name, t in model.state_dict().items():  # a collective: every rank takes part
            t = t.full_tensor() if isinstance(t, DTensor) else t
            full[name] = t.detach().to(torch.bfloat16).cpu().contiguous()
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.save_final)), exist_ok=True)
            tied = {n for n in full if n == "lm_head.weight" and model.config.tie_word_embeddings}
            save_file({n: t for n, t in full.items() if n not in tied}, args.save_final,
                      metadata={"version": str(last)})
    if rank == 0:
        print(json.dumps({"event": "done", "last_version": last, "world": world, "time": time.time()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
