"""Benchmark: applying sparse changes to a vLLM TP rank, against vLLM's own full ``load_weights``.

For each model size it builds the vLLM model one worker of a ``--tp``-way engine holds (rank
``--rank``, on ``--device``; vLLM's own classes, see ``torch_deltasync.testing_vllm``), loads a full
random bf16 state with vLLM's ``load_weights`` (the baseline: what a dense weight sync does per
step), then applies ``nnz`` changed elements spread over all tensors in proportion to their size
through ``VLLMTarget`` (``owned`` + ``write``: the receiver's apply step, after decoding) and
checks the result bitwise against ``load_weights`` of the changed state. Reported per (size, nnz):

* ``apply_ms`` (best of ``--repeats``, as is ``load_weights_ms``) and ``ns_per_change`` (per changed element of the model);
* ``ratio`` = apply time / ``load_weights`` time of the full model on the same rank;
* ``write_ns_per_held``: ``VLLMTarget.write`` alone (what ``commit()`` runs) per change this rank
  holds, and ``write_over_index_copy``: over an ``index_copy_`` of the same values at the same
  local offsets, precomputed (the floor of a sparse write into these parameters); both in CPU
  time on the CPU.

The same nnz on a larger model must cost about the same (apply is O(nnz), not O(model)), while
``load_weights`` grows with the model.

Usage::

    .venv/bin/python tools/bench_vllm_apply.py --sizes small 100m --nnz 1e3 1e4 1e5 1e6 \\
        --tp 2 --rank 1 --out runs/bench/vllm_apply.json

Writes JSON (all rows), JSONL (one line per row) and a PNG plot next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools._cli import check_writable  # noqa: E402
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from torch_deltasync.targets._vllm_layout import _flat  # noqa: E402
from torch_deltasync.targets import VLLMTarget  # noqa: E402
from torch_deltasync.testing import QWEN3_SIZES  # noqa: E402
from torch_deltasync.testing_vllm import build_vllm_model, load_hf_weights, vllm_config, vllm_state_bits  # noqa: E402

BF16 = torch.bfloat16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_shapes(spec: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the transformers model's state dict (built on the meta device)."""
    import transformers

    from torch_deltasync.testing_vllm import _hf_config

    with torch.device("meta"):
        model = getattr(transformers, spec["arch"])(_hf_config(spec))
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def _changes(shapes: dict[str, tuple[int, ...]], nnz: int, gen: torch.Generator):
    """``{name: (sorted unique int64 positions, bf16 values)}``, about ``nnz`` in all, spread in
    proportion to each tensor's size."""
    total = sum(math.prod(s) for s in shapes.values())
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        k = min(numel, max(1, round(nnz * numel / total)))
        pos = torch.unique(torch.randint(0, numel, (k,), generator=gen))
        out[name] = (pos, torch.randn(pos.numel(), generator=gen).to(BF16))
    return out


def bench_size(size: str, nnzs: list[int], tp: int, rank: int, device: torch.device, repeats: int) -> list[dict]:
    spec = dict(arch="Qwen3ForCausalLM", model_type="qwen3", tie_word_embeddings=False, **QWEN3_SIZES[size])
    shapes = _hf_shapes(spec)
    gen = torch.Generator().manual_seed(0)
    state = {n: (torch.randn(s, generator=gen) * 0.02).to(BF16) for n, s in shapes.items()}
    vc = vllm_config(spec)
    model = build_vllm_model(vc, rank, tp).to(device)
    numel = sum(math.prod(s) for s in shapes.values())

    load_ms = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        load_hf_weights(model, state)
        _sync(device)
        load_ms.append((time.perf_counter() - t0) * 1e3)
    load = min(load_ms)  # best of N: least disturbed by other load on a shared machine

    target = VLLMTarget(model, moe_backends=("TRITON", "BATCHED_TRITON", "CPU"))
    t0 = time.perf_counter()
    target.check(shapes, {}, BF16)
    check_ms = (time.perf_counter() - t0) * 1e3
    for name, (pos, val) in _changes(shapes, min(nnzs), torch.Generator().manual_seed(1)).items():
        own = target.owned(name, pos)  # untimed warm-up: the first write loads the compiled kernels
        target.write(name, pos[own], val[own])
    load_hf_weights(model, state)
    rows = []
    for nnz in nnzs:
        changes = _changes(shapes, nnz, gen)
        actual = sum(p.numel() for p, _ in changes.values())
        held = 0
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            held = 0
            for name, (pos, val) in changes.items():
                own = target.owned(name, pos)
                p, v = pos[own], val[own]
                target.write(name, p, v)
                held += p.numel()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        # The write alone (what commit() runs; owned() and the selection happen while staging)
        # against the floor of a sparse write: index_copy_ of the same values at the same local
        # offsets of the same parameters, precomputed.
        held_changes = {}
        for name, (pos, val) in changes.items():
            own = target.owned(name, pos)
            if bool(own.any()):
                held_changes[name] = (pos[own], val[own])
        floor = []
        for name, (pos, val) in held_changes.items():
            e = target._entries[name]
            for p in e.places:
                floor.append((_flat(p.param), target._owned_local(e, p, pos), val.to(device)))
        write_t, copy_t = [], []
        clock = time.perf_counter if device.type == "cuda" else time.process_time  # CPU time: steadier on a shared box
        for _ in range(repeats):
            _sync(device)
            t0 = clock()
            for name, (pos, val) in held_changes.items():
                target.write(name, pos, val)
            _sync(device)
            write_t.append(clock() - t0)
            t0 = clock()
            with torch.no_grad():
                for flat, local, val in floor:
                    flat.index_copy_(0, local, val)
            _sync(device)
            copy_t.append(clock() - t0)
        # Correctness: the same changes loaded by vLLM itself give the same bits.
        new_state = {}
        for name, t in state.items():
            pos, val = changes[name]
            flat = t.clone().reshape(-1)
            flat[pos] = val
            new_state[name] = flat.reshape(t.shape)
        ref = build_vllm_model(vc, rank, tp).to(device)
        load_hf_weights(ref, new_state)
        a, b = vllm_state_bits(model), vllm_state_bits(ref)
        exact = all(torch.equal(a[n], b[n]) for n in a)
        del ref
        load_hf_weights(model, state)  # back to the base state for the next nnz
        apply = min(times)
        row = dict(size=size, params=numel, tp=tp, rank=rank, device=str(device), nnz=actual, held=held,
                   apply_ms=apply, ns_per_change=apply * 1e6 / actual, load_weights_ms=load,
                   ratio=apply / load, check_ms=check_ms, bit_exact=exact,
                   write_ns_per_held=min(write_t) * 1e9 / max(held, 1),
                   index_copy_ns_per_held=min(copy_t) * 1e9 / max(held, 1),
                   write_over_index_copy=min(write_t) / min(copy_t))
        rows.append(row)
        print(f"{size:>6} {numel / 1e6:8.1f}M  nnz {actual:>9,d}  held {held:>9,d}  apply {apply:9.2f} ms "
              f"({row['ns_per_change']:7.1f} ns/change)  load_weights {load:9.1f} ms  ratio {row['ratio']:.4f}  "
              f"exact={exact}; write {row['write_ns_per_held']:.2f} ns/held change = "
              f"{row['write_over_index_copy']:.2f}x index_copy_ ({row['index_copy_ns_per_held']:.2f})", flush=True)
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for size in dict.fromkeys(r["size"] for r in rows):
        rs = [r for r in rows if r["size"] == size]
        line, = ax.plot([r["nnz"] for r in rs], [r["apply_ms"] for r in rs], "o-", label=f"apply, {size}")
        ax.axhline(rs[0]["load_weights_ms"], color=line.get_color(), ls="--", label=f"load_weights, {size}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("changed elements (nnz)")
    ax.set_ylabel("ms")
    ax.set_title(f"vLLM TP rank apply vs full load_weights ({rows[0]['device']}, tp {rows[0]['tp']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "100m"], choices=sorted(QWEN3_SIZES))
    ap.add_argument("--nnz", nargs="+", type=float, default=[1e3, 1e4, 1e5, 1e6])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", default="runs/bench/vllm_apply.json")
    args = ap.parse_args()
    if min(args.nnz) < 1 or args.repeats < 1 or args.tp < 1 or not 0 <= args.rank < args.tp or args.threads < 0:
        ap.error("--nnz and --repeats must be >= 1, --tp >= 1, 0 <= --rank < --tp and --threads >= 0")
    check_writable(ap, "--out", args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for size in args.sizes:
        rows += bench_size(size, [int(n) for n in args.nnz], args.tp, args.rank, device, args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=platform.machine(), torch=torch.__version__, threads=torch.get_num_threads(),
                cmd=" ".join(sys.argv))
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    with open(out.with_suffix(".jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.jsonl')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
