"""Sharded publishing: per-rank publish time and bytes vs world size, for the same model.

For every world size in ``--worlds`` (default 1, 2, 3, 4) this starts that many CPU ranks in one gloo
process group (``torch_deltasync._ranks.run_ranks``), builds the same Qwen3-architecture model
(``testing.tiny_qwen3(--size)``, same seed), shards it with FSDP2 (``fully_shard`` per decoder layer
and the root), and runs ``--steps`` real Adam steps at an RL learning rate, publishing after each one
(foreground; version 0 is the anchor, the rest are deltas). Per rank and version it records:

* ``detect_ms``, ``encode_ms``, ``upload_ms``, ``publish_ms`` (wall, ``PublishStats``);
* ``cpu_ms``: CPU time of the publish on the rank's thread (``time.thread_time``), which does not
  grow when more ranks than cores share the machine (wall times do);
* ``object_nbytes``: the size of the rank's own object, and the snapshot bytes it keeps.

It prints a Markdown table with medians over the delta versions and ratios against world size 1 in
the same run, and writes every record to ``--metrics`` (JSONL) and a plot next to it (if matplotlib
is installed).

Run (about a minute on 2 cores)::

    PYTHONPATH=. python tools/bench_fsdp2.py --size small --steps 6 --worlds 1,2,3,4

``--layouts fsdp,fsdp_tp,hsdp`` instead compares sharding layouts on one process group of
``--layout-world`` ranks (default 4): plain FSDP2 over all ranks, torchtitan's FSDP2 x TP
(dp_shard x tp 2) and HSDP (2 replicas x dp_shard), built by ``recipes/torchrun_fsdp2.py:parallelize``.
All layouts publish the *same* model and change set: version 0, then ``--steps`` synthetic steps
(``testing.synthetic_step``, written into each layout's shards with ``testing.set_full_weights``), so
bytes are comparable to the byte (real Adam steps would differ between layouts in the last bits).
Per layout it prints the slowest rank's publish CPU, the largest and the mean per-rank object, the
version's bytes and the largest snapshot, with ratios against plain FSDP2 in the same run::

    PYTHONPATH=. python tools/bench_fsdp2.py --layouts fsdp,fsdp_tp,hsdp --size small --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from torch_deltasync._ranks import run_ranks


def _rank(rank: int, world: int, size: str, steps: int, lr: float, bucket: str, threads: int | None = None) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.manifest import load_manifest
    from torch_deltasync.testing import adam_step, tiny_qwen3

    model = tiny_qwen3(size, seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    store = LocalStore(bucket, fsync=False)  # measure our work, not the disk's fsync latency
    sender = DeltaSender(model, store, anchor_every=1000, threads=threads)
    gen = torch.Generator().manual_seed(rank)
    # the same global batch at every world size: 4 sequences split over the ranks (at least one each)
    batch = max(1, 4 // world)
    records = []
    for step in range(steps + 1):
        if step:
            adam_step(model, opt, batch=batch, seq=32, generator=gen)
        dist.barrier()  # every rank starts its publish together
        cpu0 = time.thread_time()
        version = sender.publish()
        cpu_ms = (time.thread_time() - cpu0) * 1e3
        st = sender.last_stats
        m = load_manifest(sender.store, version)
        mine = [o.nbytes for o in m.objects if o.rank == rank]
        records.append({"world": world, "rank": rank, "threads": threads, "version": version, "kind": st.kind,
                        "detect_ms": st.detect_ms, "encode_ms": st.encode_ms, "upload_ms": st.upload_ms,
                        "publish_ms": st.publish_ms, "cpu_ms": cpu_ms,
                        "object_nbytes": mine[0] if mine else 0, "version_nbytes": st.nbytes,
                        "changed": st.changed, "numel": st.numel,
                        "snapshot_nbytes": sender.detector.snapshot_nbytes()})
    sender.close()
    return records


def _rank_layouts(rank: int, world: int, layouts: list[str], size: str, steps: int, bucket: str,
                  codec: str) -> list[dict]:
    import torch.distributed as dist

    from recipes.torchrun_fsdp2 import parallelize
    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.manifest import load_manifest
    from torch_deltasync.testing import set_full_weights, synthetic_step, tiny_qwen3

    records = []
    for layout in layouts:
        model = tiny_qwen3(size, seed=0)
        weights = {n: t.detach().clone() for n, t in model.state_dict().items()}  # full, evolves identically
        parallelize(model, world, tp=2 if layout == "fsdp_tp" else 1, dp_replicate=2 if layout == "hsdp" else 1)
        store = LocalStore(os.path.join(bucket, layout), fsync=False)
        sender = DeltaSender(model, store, anchor_every=1000, codec=codec)
        for step in range(steps + 1):
            if step:  # the same change set for every layout (seeded by step), outside the timing
                synthetic_step(weights, step)
            set_full_weights(model, weights)
            dist.barrier()  # every rank starts its publish together
            cpu0 = time.thread_time()
            version = sender.publish()
            cpu_ms = (time.thread_time() - cpu0) * 1e3
            st = sender.last_stats
            m = load_manifest(sender.store, version)
            records.append({"layout": layout, "world": world, "rank": rank, "version": version, "kind": st.kind,
                            "cpu_ms": cpu_ms, "publish_ms": st.publish_ms,
                            "object_nbytes": sum(o.nbytes for o in m.objects if o.rank // sender._slots == rank),
                            "version_nbytes": st.nbytes, "changed": st.changed, "numel": st.numel,
                            "snapshot_nbytes": sender.detector.snapshot_nbytes()})
        sender.close()
    return records


def _layout_table(records: list[dict]) -> str:
    rows = ["| layout | delta publish CPU, slowest rank | ratio | delta object, largest rank | ratio "
            "| delta object, mean rank | version bytes (all ranks) | ratio | anchor object, largest rank "
            "| snapshot, largest rank | ratio | density |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out = {}
    for layout in dict.fromkeys(r["layout"] for r in records):
        rs = [r for r in records if r["layout"] == layout]
        w = rs[0]["world"]
        deltas = [r for r in rs if r["kind"] == "delta"]
        per_rank = lambda key, sel: [median(r[key] for r in sel if r["rank"] == k) for k in range(w)]  # noqa: E731
        out[layout] = {
            "cpu": max(per_rank("cpu_ms", deltas)),
            "obj_max": max(per_rank("object_nbytes", deltas)),
            "obj_mean": sum(per_rank("object_nbytes", deltas)) / w,
            "version": median(r["version_nbytes"] for r in deltas if r["rank"] == 0),
            "anchor": max(r["object_nbytes"] for r in rs if r["kind"] == "anchor"),
            "snapshot": max(r["snapshot_nbytes"] for r in deltas),
            "density": median(r["changed"] / r["numel"] for r in deltas if r["rank"] == 0),
        }
    b = out[next(iter(out))]
    for layout, s in out.items():
        rows.append(
            f"| {layout} | {s['cpu']:.1f} ms | {s['cpu'] / b['cpu']:.2f} | {s['obj_max'] / 1024:.1f} KiB | "
            f"{s['obj_max'] / b['obj_max']:.2f} | {s['obj_mean'] / 1024:.1f} KiB | {s['version'] / 1024:.1f} KiB | "
            f"{s['version'] / b['version']:.3f} | {s['anchor'] / 2**20:.2f} MiB | {s['snapshot'] / 2**20:.2f} MiB | "
            f"{s['snapshot'] / b['snapshot']:.2f} | {s['density']:.2%} |")
    return "\n".join(rows)


def _summary(records: list[dict]) -> dict[int, dict]:
    out = {}
    for w in sorted({r["world"] for r in records}):
        deltas = [r for r in records if r["world"] == w and r["kind"] == "delta"]
        anchors = [r for r in records if r["world"] == w and r["kind"] == "anchor"]
        per_rank = lambda key, rs: max(median(r[key] for r in rs if r["rank"] == k) for k in range(w))  # noqa: E731
        out[w] = {
            "cpu_ms": per_rank("cpu_ms", deltas),
            "publish_ms": per_rank("publish_ms", deltas),
            "detect_ms": per_rank("detect_ms", deltas),
            "object_nbytes": per_rank("object_nbytes", deltas),
            "anchor_object_nbytes": per_rank("object_nbytes", anchors),
            "version_nbytes": median(r["version_nbytes"] for r in deltas if r["rank"] == 0),
            "snapshot_nbytes": max(r["snapshot_nbytes"] for r in deltas),
            "density": median(r["changed"] / r["numel"] for r in deltas if r["rank"] == 0),
        }
    return out


def _table(summary: dict[int, dict]) -> str:
    base = summary[min(summary)]
    rows = ["| ranks | delta publish CPU / rank | ratio | wall / rank | ratio | delta object / rank | ratio "
            "| anchor object / rank | version bytes (all ranks) | snapshot / rank | density |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w, s in summary.items():
        rows.append(
            f"| {w} | {s['cpu_ms']:.1f} ms | {s['cpu_ms'] / base['cpu_ms']:.2f} | {s['publish_ms']:.1f} ms | "
            f"{s['publish_ms'] / base['publish_ms']:.2f} | {s['object_nbytes'] / 1024:.1f} KiB | "
            f"{s['object_nbytes'] / base['object_nbytes']:.2f} | {s['anchor_object_nbytes'] / 2**20:.2f} MiB | "
            f"{s['version_nbytes'] / 1024:.1f} KiB | {s['snapshot_nbytes'] / 2**20:.2f} MiB | {s['density']:.2%} |")
    return "\n".join(rows)


def _plot(summary: dict[int, dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ws = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(ws, [summary[w]["cpu_ms"] for w in ws], "o-", label="CPU / rank")
    a.plot(ws, [summary[w]["publish_ms"] for w in ws], "s--", label="wall / rank")
    a.set(xlabel="ranks", ylabel="ms per delta publish (slowest rank)", xticks=ws)
    a.legend()
    b.plot(ws, [summary[w]["object_nbytes"] / 1024 for w in ws], "o-", label="delta object / rank")
    b.plot(ws, [summary[w]["version_nbytes"] / 1024 for w in ws], "s--", label="version (all ranks)")
    b.set(xlabel="ranks", ylabel="KiB", xticks=ws)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", help="Qwen3 config (torch_deltasync.testing.QWEN3_SIZES)")
    p.add_argument("--steps", type=int, default=6, help="Adam steps (delta versions) per world size")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--worlds", default="1,2,3,4")
    p.add_argument("--threads", type=int, default=None,
                   help="sender threads per rank (default: threads=None, the host's cores shared out among the ranks)")
    p.add_argument("--metrics", default="runs/bench_fsdp2.jsonl")
    p.add_argument("--layouts", default=None,
                   help="compare layouts instead of world sizes: a comma list of fsdp, fsdp_tp, hsdp")
    p.add_argument("--layout-world", type=int, default=4, help="ranks for --layouts (a multiple of 2)")
    p.add_argument("--codec", default="packed", help="delta codec for --layouts (raw: 6 bytes per change)")
    args = p.parse_args()
    from torch_deltasync.codecs import get_codec
    from torch_deltasync.testing import QWEN3_SIZES

    if args.size not in QWEN3_SIZES:
        p.error(f"--size must be one of {list(QWEN3_SIZES)}, got {args.size!r}")
    if args.steps < 1 or (args.threads is not None and args.threads < 1) or args.layout_world < 2:
        p.error("--steps and --threads must be >= 1, --layout-world >= 2")
    if not args.layouts and args.codec != "packed":
        p.error("--codec applies to --layouts only")
    try:
        get_codec(args.codec)
    except (KeyError, ValueError) as e:
        p.error(f"--codec: {e}")
    try:
        if not args.layouts and min(int(w) for w in args.worlds.split(",")) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--worlds takes comma-separated world sizes >= 1, got {args.worlds!r}")
    if args.layouts:
        layouts = args.layouts.split(",")
        bad = [x for x in layouts if x not in ("fsdp", "fsdp_tp", "hsdp")]
        if bad or args.layout_world % 2:
            p.error(f"--layouts takes fsdp, fsdp_tp, hsdp (got {bad}) on an even --layout-world")
        metrics = Path(args.metrics)
        metrics.parent.mkdir(parents=True, exist_ok=True)
        print(f"cores: {os.cpu_count()}, model: Qwen3-{args.size}, {args.layout_world} ranks, {args.steps} "
              f"synthetic delta versions per layout, codec {args.codec}", flush=True)
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-layouts-") as bucket:
            per_rank = run_ranks(_rank_layouts, args.layout_world, layouts, args.size, args.steps, bucket,
                                 args.codec, timeout_s=3600)
        recs = [r for rank in per_rank for r in rank]
        with open(metrics, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"done in {time.perf_counter() - t:.1f} s", flush=True)
        print(_layout_table(recs))
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    metrics = Path(args.metrics)
    metrics.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    print(f"cores: {os.cpu_count()}, model: Qwen3-{args.size}, {args.steps} delta versions per world size", flush=True)
    for w in worlds:
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-fsdp2-") as bucket:
            per_rank = run_ranks(_rank, w, args.size, args.steps, args.lr, bucket, args.threads, timeout_s=1800)
        recs = [r for rank in per_rank for r in rank]
        records += recs
        with open(metrics, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"world {w}: done in {time.perf_counter() - t:.1f} s", flush=True)
    summary = _summary(records)
    _plot(summary, metrics.with_suffix(".png"))
    print(_table(summary))


if __name__ == "__main__":
    main()
