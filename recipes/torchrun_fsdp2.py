"""FSDP2 trainer under torchrun that publishes every optimizer step as a sparse, lossless delta.

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
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bucket", required=True, help="store to publish to (folder, s3://, hf://buckets/...)")
    p.add_argument("--prefix", default="", help="run prefix inside the bucket")
    p.add_argument("--size", default="tiny", help="Qwen3 config from torch_deltasync.testing.QWEN3_SIZES")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (one version each)")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--anchor-every", type=int, default=10, help="a full anchor every N versions")
    p.add_argument("--background", action="store_true",
                   help="upload while the next step trains (coalesces when uploads fall behind)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", default=None, help="JSONL of PublishStats (rank 0)")
    p.add_argument("--save-final", default=None,
                   help="after training, gather the full bf16 weights once and save them (safetensors) "
                        "on rank 0, to check receivers against; off by default")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch_deltasync import DeltaSender
    from torch_deltasync.testing import adam_step, tiny_qwen3

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")

    model = tiny_qwen3(args.size, seed=args.seed).to(device)  # same init on every rank
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sender = DeltaSender(model, args.bucket, prefix=args.prefix, anchor_every=args.anchor_every,
                         background=args.background, metrics_path=args.metrics)
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"[rank 0] Qwen3-{args.size}: {nparams:,} parameters over {world} ranks, publishing to "
              f"{sender.store.describe()}", flush=True)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own data

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
            tied = {n for n in full if n == "lm_head.weight" and model.config.tie_word_embeddings}
            save_file({n: t for n, t in full.items() if n not in tied}, args.save_final,
                      metadata={"version": str(last)})
    if rank == 0:
        print(json.dumps({"event": "done", "last_version": last, "world": world, "time": time.time()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
