"""The ``packed`` codec of a git revision against the working tree's, alternating in one process.

This VM's speed drifts by up to 1.5x within minutes (``docs/benchmarks.md``, issue 14, eighth
part), so two runs of ``tools/bench_codec.py`` cannot resolve a change of 10-20%. This tool imports
the codec of ``--base`` (``git archive`` of its ``torch_deltasync`` into a temporary directory,
renamed ``tds_base`` so both packages load side by side) next to the working tree's and times both
on the same change sets, alternating which goes first in every round:

* encode: ``Codec.encode_many(..., threads=1)`` over every changed tensor of a set;
* decode+resolve: ``decode`` then ``resolve`` per tensor (what a receiver does), one thread;

in CPU time (``time.process_time``) per changed element, with a DRAM copy of the seed-format bytes
(6 per change) timed after every round as in ``bench_codec.py``. With ``--threads N`` (N > 1)
both run on N threads (``encode_many``; decode+resolve through ``_pool.map_largest_first``, the
helper ``decode_many`` uses) and are timed in wall time, the DRAM copy too. Before timing, both codecs'
output is decoded by both and checked bit for bit against the change set, and the blobs are
compared byte for byte (``same bytes``: a change meant to keep the format must keep it).

Change sets: ``qwen3-100m`` at ``--qwen-lr`` (``--qwen-steps`` real Adam steps, the last one's
changes: ``bench_codec.qwen3_sets``) and the Bernoulli sets of ``--synthetic`` densities
(``bench_codec.synthetic_sets``). Run (about 2 minutes on 2 CPU cores)::

    .venv/bin/python tools/bench_codec_ab.py --base HEAD~1 --jsonl runs/bench_codec_ab.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codec import DramCopy, qwen3_sets, synthetic_sets  # noqa: E402

import torch_deltasync  # noqa: E402
from torch_deltasync._pool import map_largest_first  # noqa: E402
from torch_deltasync._dtypes import bits  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def load_base(rev: str, into: Path):
    """``torch_deltasync`` at git revision ``rev``, imported as ``tds_base`` from ``into``."""
    archive = into / "base.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", rev, "torch_deltasync"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    pkg = into / "tds_base"
    shutil.move(str(into / "torch_deltasync"), pkg)
    for f in pkg.rglob("*.py"):  # absolute self-references (lazy imports, module names in strings)
        f.write_text(f.read_text().replace("torch_deltasync", "tds_base"))
    sys.path.insert(0, str(into))
    return importlib.import_module("tds_base")


def compare(name: str, cs: dict, codecs: dict, rounds: int, copy: DramCopy, threads: int = 1) -> dict:
    """Both codecs on one change set: correctness, then ``rounds`` alternating timed rounds (CPU
    time on one thread; wall time on ``threads`` > 1)."""
    items = [(pos, new, old, numel) for pos, old, new, numel in cs.values() if pos.numel()]
    k = sum(it[0].numel() for it in items)
    blobs = {label: c.encode_many(items, threads=1) for label, c in codecs.items()}
    for label, c in codecs.items():  # each decodes both codecs' blobs bit-exactly
        for src in blobs.values():
            for parts, (pos, new, old, numel) in zip(src, items):
                d = c.decode(parts, numel=numel, count=pos.numel(), dtype=new.dtype)
                got = d.resolve(old) if d.needs_base else d.values
                if not (torch.equal(d.positions, pos) and torch.equal(bits(got), bits(new))):
                    raise AssertionError(f"{name}: the {label} codec did not round-trip bit-exactly")
    same = all(torch.equal(a["packed"], b["packed"]) for a, b in zip(*blobs.values()))

    def decode_one(c, parts, item):
        pos, new, old, numel = item
        d = c.decode(parts, numel=numel, count=pos.numel(), dtype=new.dtype)
        return d.resolve(old) if d.needs_base else d.values

    def decode_all(c, parts_list):
        map_largest_first(lambda x: decode_one(c, *x), list(zip(parts_list, items)),
                          [it[0].numel() for it in items], threads)

    clock = time.process_time if threads == 1 else time.perf_counter

    times = {label: {"encode": [], "decode": []} for label in codecs}
    copies = []
    labels = list(codecs)
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            c = codecs[label]
            t = clock()
            c.encode_many(items, threads=threads)
            times[label]["encode"].append((clock() - t) * 1e9 / k)
            t = clock()
            decode_all(c, blobs[label])
            times[label]["decode"].append((clock() - t) * 1e9 / k)
        copies.append(copy.seconds(6 * k, clock) * 1e9 / k)
    cp = statistics.median(copies)
    row = {"set": name, "changes": k, "copy_ns": cp, "same_bytes": same}
    for label in labels:
        for what in ("encode", "decode"):
            ns = statistics.median(times[label][what])
            row[f"{label}_{what}_ns"], row[f"{label}_{what}_x_copy"] = ns, ns / cp
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    ap.add_argument("--qwen-lr", type=float, default=1e-6, help="Adam lr of the qwen3-100m set (0: no such set)")
    ap.add_argument("--qwen-steps", type=int, default=2)
    ap.add_argument("--synthetic", default="0.01,0.05", help="densities of Bernoulli sets ('' for none)")
    ap.add_argument("--synthetic-numel", type=int, default=40_000_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of encode_many and of decode+resolve (above 1: wall time, not CPU time)")
    ap.add_argument("--jsonl", default=None, help="append one JSON line per change set")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1 or args.qwen_steps < 1 or args.synthetic_numel < 1000 or args.qwen_lr < 0:
        ap.error("--rounds, --threads and --qwen-steps must be >= 1, --synthetic-numel >= 1000, --qwen-lr >= 0")
    try:
        if any(not 0 < float(x) <= 1 for x in args.synthetic.split(",") if x):
            raise ValueError
    except ValueError:
        ap.error(f"--synthetic takes comma-separated densities in (0, 1], got {args.synthetic!r}")
    if not args.qwen_lr and not args.synthetic:
        ap.error("no change sets: give --qwen-lr > 0 or --synthetic densities")
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"],
                      capture_output=True).returncode:
        ap.error(f"--base: {args.base!r} is not a git revision of {REPO}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, Path(tmp))
        codecs = {"base": base.get_codec("packed"), "tree": torch_deltasync.get_codec("packed")}
        sets = {}
        if args.qwen_lr > 0:
            sets.update(qwen3_sets([args.qwen_lr], args.qwen_steps, lambda m: print(m, flush=True)))
        densities = [float(x) for x in args.synthetic.split(",") if x]
        sets.update(synthetic_sets(densities, args.synthetic_numel))
        copy = DramCopy()
        rows = []
        clock = "CPU" if args.threads == 1 else "wall"
        print(f"\n{args.base} ('base') against the working tree ('tree'), {clock} ns per change (x the DRAM copy), "
              f"medians of {args.rounds} alternating rounds, {args.threads} thread(s)")
        print("| change set | changes | DRAM copy ns | encode base | tree | tree / base | decode+resolve base | tree "
              "| tree / base | same bytes |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, cs in sets.items():
            r = compare(name, cs, codecs, args.rounds, copy, args.threads)
            rows.append(r)
            print(f"| {name} | {r['changes']:,} | {r['copy_ns']:.2f} | {r['base_encode_ns']:.2f} ({r['base_encode_x_copy']:.1f}x) "
                  f"| {r['tree_encode_ns']:.2f} ({r['tree_encode_x_copy']:.1f}x) | {r['tree_encode_ns'] / r['base_encode_ns']:.2f} "
                  f"| {r['base_decode_ns']:.2f} ({r['base_decode_x_copy']:.1f}x) | {r['tree_decode_ns']:.2f} "
                  f"({r['tree_decode_x_copy']:.1f}x) | {r['tree_decode_ns'] / r['base_decode_ns']:.2f} "
                  f"| {'yes' if r['same_bytes'] else 'no'} |", flush=True)
    if args.jsonl:
        Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
        with open(args.jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps({"base": args.base, "threads": args.threads, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
