"""LoRA adapter sync: bytes per version under the by-size policy, against shipping full adapters.

For each learning rate in ``--lrs`` this builds a Qwen3-architecture model (``testing.tiny_qwen3(--size)``)
with a LoRA adapter (``--rank``, all seven projections, ``peft``), and trains the adapter for
``--steps`` real Adam steps on random tokens, publishing after every step through three senders in
lockstep (same weights, own snapshots, own stores):

* ``delta``: every version a delta (``AnchorPolicy(every=None)``);
* ``by_size``: :class:`~torch_deltasync.integrations.peft.AdapterSender`'s default (``max_delta_ratio=1.0``,
  ``chain_ratio=2.0``): a delta when it is smaller than the adapter, else the adapter, and a full
  adapter (carrying its delta) once the deltas since the last one add up to twice its size.

Each configuration runs with every codec in ``--codecs`` (``packed``, the library default:
gap-coded positions and step-coded values with zstd; ``raw``: 4 + 2 bytes per changed bf16 element).
The baseline is the seed system's: upload ``adapter_model.safetensors`` (the bf16 adapter, as
``safetensors.torch.save`` writes it) every version. Published bytes count objects and manifest.

Two starts: ``fresh`` (PEFT's initialisation, ``lora_B = 0``: the first steps of a run) and
``trained`` (``lora_B ~ N(0, 0.02)``: an adapter well into a run). It reports the bf16 density
(elements whose bf16 bits changed per version), bytes per version (objects + manifest, mean over
versions 1..steps: the upload bandwidth) and the ratio of each policy to ``full`` in the same run, and what a follower
that holds the previous version downloads (the receiver plans the cheapest path).

Run (about two minutes on 2 cores)::

    PYTHONPATH=. python tools/bench_lora.py --size small --rank 16 --steps 24

Appends every record to ``--metrics`` (JSONL), as the other tools do.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from statistics import mean, median

import torch


def _run(size: str, rank: int, lr: float, steps: int, start: str, codec: str, root: Path,
         chain_ratio: float | None = None) -> dict:
    from peft import LoraConfig, get_peft_model

    from torch_deltasync import AnchorPolicy, LocalStore
    from torch_deltasync.integrations.peft import AdapterReceiver, AdapterSender
    from torch_deltasync.testing import adam_step, tiny_qwen3

    model = get_peft_model(tiny_qwen3(size, seed=0), LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if start == "trained":
        torch.manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    by_size = None if chain_ratio is None else AnchorPolicy(every=None, chain_ratio=chain_ratio, max_delta_ratio=1.0)
    policies = {"delta": AnchorPolicy(every=None), "by_size": by_size}
    senders = {k: AdapterSender(model, LocalStore(root / k, fsync=False), anchor_policy=p, codec=codec)
               for k, p in policies.items()}
    follower = AdapterReceiver(None, LocalStore(root / "by_size", fsync=False))
    gen = torch.Generator().manual_seed(0)
    rows = {k: [] for k in senders}
    follow = []
    for step in range(steps + 1):
        if step:
            adam_step(model, opt, batch=2, seq=32, generator=gen)
        for k, s in senders.items():
            s.publish()
            rows[k].append(s.last_stats)
        follower.update()
        follow.append(follower.last_stats.nbytes)
    from safetensors.torch import save

    from torch_deltasync.integrations.peft import adapter_state_dict

    full_nbytes = rows["delta"][0].full_nbytes
    file_nbytes = len(save({n: t.detach().to(torch.bfloat16).contiguous() for n, t in adapter_state_dict(model).items()}))
    med = {k: mean(st.nbytes for st in r[1:]) for k, r in rows.items()}
    med["file"] = file_nbytes
    return {
        "size": size, "rank": rank, "lr": lr, "start": start, "codec": codec, "steps": steps,
        "adapter_params": rows["delta"][0].numel, "adapter_bf16_nbytes": full_nbytes,
        "density_median": median(st.changed / st.numel for st in rows["delta"][1:]),
        "by_size_kinds": [st.kind for st in rows["by_size"]],
        "nbytes_median": med,
        "ratio_to_file": {k: med[k] / file_nbytes for k in med},
        "follower_nbytes_mean": mean(follow[1:]),
        "follower_ratio_to_file": mean(follow[1:]) / file_nbytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--lrs", default="1e-6,1e-5,1e-4,1e-3")
    p.add_argument("--codecs", default="packed,raw", help="delta codecs to compare (packed is the default)")
    p.add_argument("--chain-ratio", type=float, default=None, help="override the by-size policy's chain_ratio")
    p.add_argument("--metrics", default="runs/bench/lora.jsonl")
    args = p.parse_args()
    from torch_deltasync.codecs import get_codec
    from torch_deltasync.testing import QWEN3_SIZES

    if args.size not in QWEN3_SIZES:
        p.error(f"--size must be one of {list(QWEN3_SIZES)}, got {args.size!r}")
    if args.rank < 1 or args.steps < 1:
        p.error("--rank and --steps must be >= 1")
    try:
        if not args.lrs or any(float(x) <= 0 for x in args.lrs.split(",")):
            raise ValueError
    except ValueError:
        p.error(f"--lrs takes comma-separated learning rates > 0, got {args.lrs!r}")
    try:
        for codec in args.codecs.split(","):
            get_codec(codec)
    except (KeyError, ValueError) as e:
        p.error(f"--codecs: {e}")
    if args.chain_ratio is not None and args.chain_ratio <= 0:
        p.error(f"--chain-ratio must be > 0, got {args.chain_ratio}")
    torch.set_num_threads(1)
    Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
    out = []
    with open(args.metrics, "a") as f:
        for codec in args.codecs.split(","):
            for start in ("fresh", "trained"):
                for lr in (float(x) for x in args.lrs.split(",")):
                    with tempfile.TemporaryDirectory() as d:
                        r = _run(args.size, args.rank, lr, args.steps, start, codec, Path(d), args.chain_ratio)
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    out.append(r)
                    print(f"{codec:6s} {start:8s} lr {lr:7.0e}: density {r['density_median']:.3f}", flush=True)
    r0 = out[0]
    print(f"\nmodel {args.size}, LoRA r={args.rank}: {r0['adapter_params']:,} adapter parameters, "
          f"{r0['adapter_bf16_nbytes']:,} B in bf16; density: median, bytes: mean over versions 1..{args.steps}\n")
    print("| codec | start | lr | bf16 density | adapter file B (baseline) | delta-only B/version | by-size B/version | "
          "delta-only / file | by-size / file | follower download / file | by-size kinds (v1..) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in out:
        m, q = r["nbytes_median"], r["ratio_to_file"]
        kinds = "".join("A" if k == "anchor" else "d" for k in r["by_size_kinds"][1:])
        print(f"| {r['codec']} | {r['start']} | {r['lr']:.0e} | {r['density_median']:.3f} | {m['file']:,.0f} | {m['delta']:,.0f} | "
              f"{m['by_size']:,.0f} | {q['delta']:.2f} | {q['by_size']:.2f} | {r['follower_ratio_to_file']:.2f} | `{kinds}` |")

if __name__ == "__main__":
    main()
