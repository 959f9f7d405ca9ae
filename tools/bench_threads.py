"""The library's helper threads, ``threads=1`` against more, in one process: the sender's reading
of a version (change detection) and the receiver's staging of it.

A Qwen3 model (``--size``) takes ``--steps`` real Adam steps at ``--lr`` (which sets the density).
Each setting of ``--threads`` is measured ``--rounds`` times, alternating the settings in every
round (the order flips each round; an untimed warm-up round first), so the VM's drift between
minutes falls on all alike:

* **sender** (``--side sender``): one :class:`~torch_deltasync.DeltaSender` per setting
  (``SenderConfig.threads``), each on its own store (``LocalStore(fsync=False)``), all on the
  same model. The model alternates between its weights before and after all the steps, and every
  sender publishes each state, so every publish is a delta of the same change set (all steps'
  changes). Reported: ``PublishStats.detect_ms`` (reading the weights: cast, compare, positions,
  checksum update), ``encode_ms``, ``upload_ms`` and ``publish_ms``.
* **receiver** (``--side receiver``): one bf16 replica's receiver holds version 1 and stages the
  last version with ``ReceiverConfig.threads`` set to each setting (the changes of the steps after
  the first), then commits it (the writes, ``UpdateStats.apply_ms``: tensors on threads where the
  target declares ``concurrent_writes``, as ``ModuleTarget`` does) and goes back to version 1
  (the weights restored in place, ``DeltaReceiver.assume``), so every round stages and commits
  the same update. Reported: staging (decode, old-value reads, resolve, merge:
  ``UpdateStats.decode_ms``) + verification (``verify_ms``), without the download; the commit.

Per setting: medians in ms and ns per change (per element read, for detection), the process's CPU
seconds per wall second, and the speedup over the first setting (``threads=1`` by default), and
how many tensors are large enough to be shared out at all (below the thresholds they run on the
calling thread whatever the setting: the ``tiny`` model has none). Both sides end by checking a
replica bit-exact against the model, and say so. ``docs/benchmarks.md`` (issue 14,
tenth and eleventh parts) quotes it.

Run (about 2 minutes per side on 2 CPU cores for ``100m``)::

    .venv/bin/python tools/bench_threads.py --size 100m --lr 3e-6 --jsonl runs/bench_threads.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore  # noqa: E402
from torch_deltasync._pool import PARALLEL_MIN_CHANGES  # noqa: E402
from torch_deltasync.sender._sender import DETECT_MIN_NUMEL  # noqa: E402
from torch_deltasync.testing import QWEN3_SIZES, adam_step, first_difference, tiny_qwen3  # noqa: E402


def _trained(args) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """The model and its states ``[before, after each step]`` (copies)."""
    model = tiny_qwen3(args.size)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    for i in range(args.steps):
        adam_step(model, opt, generator=torch.Generator().manual_seed(i))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return model, states


def _alternate(settings: list[int], rounds: int, run: Callable[[int], dict],
               start: Callable[[int], None] = lambda r: None) -> dict[int, list[dict]]:
    """``start(round)``, then ``run(setting)`` for every setting, in every round, the order flipped
    each round; returns each setting's results with the process's CPU seconds per wall second.
    Round 0 is an untimed warm-up (first calls load the compiled kernels and fault in buffers)."""
    out: dict[int, list[dict]] = {t: [] for t in settings}
    for r in range(rounds + 1):
        start(r)
        for t in (settings if r % 2 == 0 else settings[::-1]):
            wall, cpu = time.perf_counter(), time.process_time()
            row = run(t)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if r:
                out[t].append({**row, "cpu_per_wall": cpu / wall})
        print(f"round {r}/{rounds}" if r else "warm-up round", flush=True)
    return out


def _table(title: str, runs: dict[int, list[dict]], key: str, per: int, unit: str, extra: tuple[str, ...] = ()) -> dict:
    """Print the medians of ``runs`` as a Markdown table and return them."""
    first = next(iter(runs))
    base = statistics.median(x[key] for x in runs[first])
    print(f"\n{title}")
    cols = " | ".join(extra)
    print(f"| threads | {key} | ns per {unit} | CPU / wall | speedup over the first |{' ' + cols + ' |' if extra else ''}")
    print("|---:" * (5 + len(extra)) + "|")
    table = {}
    for t, xs in runs.items():
        med = {k: statistics.median(x[k] for x in xs) for k in (key, "cpu_per_wall", *extra)}
        med["ns_per_" + unit] = med[key] * 1e6 / max(per, 1)
        med["speedup"] = base / med[key]
        table[str(t)] = med
        cells = "".join(f" {med[k]:.1f} |" for k in extra)
        print(f"| {t} | {med[key]:.1f} | {med['ns_per_' + unit]:.2f} | {med['cpu_per_wall']:.2f} | "
              f"{med['speedup']:.2f}x |{cells}")
    return table


def sender_side(args) -> dict:
    model, states = _trained(args)
    before, after = states[0], states[-1]
    numel = sum(v.numel() for v in before.values())
    with tempfile.TemporaryDirectory() as root:
        model.load_state_dict(before)
        senders = {t: DeltaSender(model, LocalStore(f"{root}/t{t}", fsync=False), threads=t, anchor_every=0)
                   for t in args.threads}
        for s in senders.values():
            s.publish()  # the anchor
        flip = [after, before]
        changed = 0

        def publish(t: int) -> dict:
            nonlocal changed
            senders[t].publish()
            st = senders[t].last_stats
            assert st.kind == "delta", st
            changed = st.changed
            return {"detect_ms": st.detect_ms, "encode_ms": st.encode_ms, "upload_ms": st.upload_ms,
                    "publish_ms": st.publish_ms}

        # each round: the model flips state, every sender publishes the same change
        runs = _alternate(args.threads, args.rounds, publish, start=lambda r: model.load_state_dict(flip[r % 2]))
        replica = tiny_qwen3(args.size, seed=1, dtype=torch.bfloat16)
        for t, s in senders.items():
            DeltaReceiver(replica, f"{root}/t{t}").update()
            assert first_difference(model, replica) is None, f"threads={t}: the replica differs"
            s.close()
    shared = sum(v.numel() >= DETECT_MIN_NUMEL for v in before.values())
    table = _table(f"reading a version for changes ({changed:,} changes of {numel:,} elements; {shared} of "
                   f"{len(before)} tensors large enough to share out), medians of {args.rounds}",
                   runs, "detect_ms", numel, "element", extra=("encode_ms", "upload_ms", "publish_ms"))
    print(f"every setting's store updated a bf16 replica bit-exactly ({len(senders)} checked)")
    return {"side": "sender", "changed": changed, "numel": numel, "shared_tensors": shared, "settings": table}


def receiver_side(args) -> dict:
    trainer, states = _trained(args)
    with tempfile.TemporaryDirectory() as store:
        sender = DeltaSender(trainer, store)
        for state in states:  # each state published in turn: v0 (before the steps) .. v<steps>
            trainer.load_state_dict(state)
            sender.publish()
        del states
        last = sender.version
        replica = tiny_qwen3(args.size, seed=1, dtype=torch.bfloat16)
        receiver = DeltaReceiver(replica, store)
        receiver.update(1)
        held = {k: v.clone() for k, v in replica.state_dict().items()}  # version 1, to go back to
        config = receiver.receiver_config
        changed = 0

        shared = 0

        def stage(t: int) -> dict:
            nonlocal changed, shared
            receiver.receiver_config = dataclasses.replace(config, threads=t)
            staged = receiver.prepare(last)
            counts = [p.numel() for p, _ in staged._sparse.values()]
            changed, shared = sum(counts), sum(c >= PARALLEL_MIN_CHANGES for c in counts)
            receiver.commit(staged)
            assert first_difference(trainer, replica) is None, f"threads={t}: the replica differs"
            apply_ms = staged.stats.apply_ms
            replica.load_state_dict(held)  # in place: back to version 1 for the next round
            receiver.assume(1)
            return {"stage_ms": staged.stats.decode_ms + staged.stats.verify_ms, "apply_ms": apply_ms}

        runs = _alternate(args.threads, args.rounds, stage)
        receiver.receiver_config = config
        sender.close()
    title = f"v1 -> v{last} ({changed:,} changes; {shared} tensors large enough to share out), medians of {args.rounds}"
    table = _table(f"staging + verification of {title}", runs, "stage_ms", changed, "change")
    commit = _table(f"commit (the writes; ModuleTarget) of {title}", runs, "apply_ms", changed, "change")
    print("every commit updated the replica bit-exactly")
    return {"side": "receiver", "changed": changed, "shared_tensors": shared, "settings": table, "commit": commit}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("sender", "receiver", "both"), default="both")
    ap.add_argument("--size", default="100m", help="a key of torch_deltasync.testing.QWEN3_SIZES (tiny, small, 100m, ...)")
    ap.add_argument("--lr", type=float, default=3e-6, help="Adam learning rate (sets the density)")
    ap.add_argument("--steps", type=int, default=2, help="Adam steps (the receiver stages v1 -> v<steps>)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="settings compared (first: baseline)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--jsonl", default=None, help="append one JSON line per side with the results")
    args = ap.parse_args()
    if args.size not in QWEN3_SIZES:
        ap.error(f"--size must be one of {sorted(QWEN3_SIZES)}, got {args.size!r}")
    if min(args.threads) < 1 or args.rounds < 1 or args.steps < 2:
        ap.error("--threads must be >= 1, --rounds >= 1 and --steps >= 2 (the receiver stages v1 -> v<steps>)")
    torch.set_num_threads(1)  # torch's own intra-op threads stay out of the comparison
    sides = ("sender", "receiver") if args.side == "both" else (args.side,)
    for side in sides:
        out = {"size": args.size, "lr": args.lr, "steps": args.steps, "rounds": args.rounds,
               **(sender_side(args) if side == "sender" else receiver_side(args))}
        if args.jsonl:
            Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
