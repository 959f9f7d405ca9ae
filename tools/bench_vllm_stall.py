"""Stall per sync on a live vLLM engine (CPU build, ``.venv-vllm``): the ``deltasync`` backend vs
vLLM's own full reload and vLLM's own sparse apply, on the same engine and the same change sets.

Run (about 3-5 minutes on 2 cores)::

    .venv-vllm/bin/python tools/bench_vllm_stall.py --out runs/bench_vllm_stall

For each density (changed fraction of every tensor, steps of 1-2 bf16 ULPs) and repetition:

* ``publish``: the trainer publishes the version (``DeltaSender``, local bucket);
* ``stage``: until every worker's readiness file reports it staged (background: download, decode,
  validate, checksum check; the engine could keep generating meanwhile);
* ``stall``: ``start_weight_update`` → ``update_weights`` → ``finish_weight_update`` (all the engine
  loop is blocked for), split by the worker into host-copy writes and the re-pack (layerwise reload
  of the changed modules) or, with the modules re-packed ahead on copies while staging
  (``reload_ahead``), the placing of those copies;
* ``time_to_version``: publish start → the engine serves the version.

Baselines in the same run, on the same engine: vLLM's ``reload_weights`` from a ``save_pretrained``
folder in the page cache (its full reload), a layerwise reload of every module from host memory (the
re-pack alone: the floor of any sync on this build, where every linear weight is re-packed), and
vLLM's sparse apply ``load_checkpoint_weight_patches`` of the same change set (what its
``sparse_nccl`` engine runs; it needs the loader layout and fails on re-packed modules). Results:
``<out>/metrics.jsonl`` (one line per measurement) and ``<out>/summary.json``.

Each density runs ``--reps`` syncs per ``--modes`` entry (the target's ``reload_ahead``: ``auto``
re-packs the changed modules on copies while staging and writes the changes of the kernel tensors
processing leaves as loaded, the embedding, in place; ``copy`` is ``auto`` with those tensors
copied whole from the copies; ``never`` re-packs inside the pause), alternating modes, so they are
compared on the same engine and densities in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the baselines run callables in the worker
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm_live"))

from common import engine, perturb, save, tiny_qwen3  # noqa: E402

import torch  # noqa: E402


def _repack_all(worker) -> float:
    """Layerwise reload of every reloadable module from the backend's host copy (ms)."""
    target = worker.weight_transfer_engine.receiver.target
    target._dirty = set(target.reloaded_modules)
    t = time.perf_counter()
    target.finish(frozenset())
    return (time.perf_counter() - t) * 1e3


def _set_reload_ahead(worker, mode: str) -> None:
    """``mode``: a ``reload_ahead`` value, or ``copy``: ``auto`` with every kernel tensor copied whole
    from its shadow (no tensor patched in place: the commit before patching)."""
    target = worker.weight_transfer_engine.receiver.target
    target.reload_ahead = "auto" if mode == "copy" else mode
    if mode == "copy":  # no parameter patched; the verdicts of the target's own check kept aside
        target._bench_ok = target.__dict__.get("_bench_ok", target._patch_ok)
        target._patch_ok = {v: False for v in target._patch_groups}
    else:
        target._patch_ok = target.__dict__.pop("_bench_ok", target._patch_ok)


def _sparse_apply(worker, path: str, shapes: list) -> dict:
    """vLLM's own sparse apply of the change set saved at ``path`` (``<name>:idx`` / ``<name>:val``
    safetensors; ``shapes``: ``[(name, shape)]``) in ms, or its error."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches,
    )

    model = worker.model_runner.get_model()
    t = load_file(path)
    ps = [CheckpointWeightPatch(n, tuple(s), t[f"{n}:val"].dtype, t[f"{n}:val"], t[f"{n}:idx"]) for n, s in shapes]
    t = time.perf_counter()
    try:
        load_checkpoint_weight_patches(model, ps)
    except Exception as e:  # noqa: BLE001 (reported)
        return {"ms": None, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"ms": (time.perf_counter() - t) * 1e3, "error": None}


def _wait_staged(status_dir: Path, version: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [json.loads(p.read_text()) for p in status_dir.glob("rank-*.json")]
        if states and all(s.get("staged") == version or s.get("held") == version for s in states):
            return
        time.sleep(0.005)
    raise TimeoutError(f"version {version} not staged after {timeout_s} s")


def hf_module_commit(args, densities: list[float]) -> dict:
    """Where the live weights are the loader's layout: a staged update's commit (``index_copy_`` of
    the changed elements) on a Hugging Face module, vs a full in-memory load of the same weights
    (``load_state_dict``, one ``copy_`` per tensor), ratios in one run."""
    from torch_deltasync import DeltaReceiver, DeltaSender, LocalStore

    trainer = tiny_qwen3(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=12, kv_heads=4, head_dim=64)
    replica = tiny_qwen3(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=12, kv_heads=4, head_dim=64,
                         seed=1)
    work = Path(tempfile.mkdtemp(prefix="bench-hf-commit-"))
    sender = DeltaSender(trainer, LocalStore(work / "bucket"), anchor_every=1000)
    receiver = DeltaReceiver(replica, LocalStore(work / "bucket"))
    sender.publish()
    receiver.update()
    out = {}
    seed = 100
    for density in densities:
        commits, loads, prepares = [], [], []
        for _ in range(args.reps):
            seed += 1
            perturb(trainer, frac=density, seed=seed)
            sender.publish()
            t = time.perf_counter()
            staged = receiver.prepare()
            prepares.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            receiver.commit(staged)
            commits.append((time.perf_counter() - t) * 1e3)
            state = {k: v.clone() for k, v in trainer.state_dict().items()}
            t = time.perf_counter()
            replica.load_state_dict(state)
            loads.append((time.perf_counter() - t) * 1e3)
        c, f, p_ = statistics.median(commits), statistics.median(loads), statistics.median(prepares)
        out[f"{density:g}"] = {"commit_ms": c, "full_load_ms": f, "prepare_ms": p_, "commit_over_full_load": c / f}
        print(f"HF module, density {density:.2%}: commit {c:.2f} ms vs full load {f:.2f} ms "
              f"({c / f:.3f}x); prepare (outside the pause) {p_:.1f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default="runs/bench_vllm_stall")
    ap.add_argument("--densities", default="0.01,0.05")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--modes", default="auto,copy,never",
                    help="reload_ahead modes to alternate (copy: auto, kernel tensors copied whole)")
    ap.add_argument("--only-hf", action="store_true", help="only the HF-module commit measurement")
    args = ap.parse_args()
    try:
        densities = [float(x) for x in args.densities.split(",")]
        if not all(0 < d <= 1 for d in densities):
            raise ValueError
    except ValueError:
        ap.error(f"--densities takes comma-separated fractions in (0, 1], got {args.densities!r}")
    modes = args.modes.split(",")
    if any(m not in ("auto", "copy", "never") for m in modes):
        ap.error(f"--modes takes a comma list of auto, copy, never, got {args.modes!r}")
    if min(args.reps, args.hidden, args.layers, args.vocab) < 1:
        ap.error("--reps, --hidden, --layers and --vocab must be >= 1")
    if args.only_hf:
        print(json.dumps(hf_module_commit(args, densities), indent=2))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-stall-"))
    from torch_deltasync import DeltaSender, LocalStore

    model = tiny_qwen3(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=12, kv_heads=4, head_dim=64)
    nparams = sum(p.numel() for p in model.parameters())
    sender = DeltaSender(model, LocalStore(work / "bucket"), anchor_every=1000)
    v0 = sender.publish()
    d0 = save(model, work / "ckpt")
    status = work / "status"
    metrics = work / "commits.jsonl"
    llm = engine(d0)
    llm.init_weight_transfer_engine({"init_info": {"store": str(work / "bucket"), "assume_version": v0,
                                                   "status_dir": str(status), "metrics_path": str(metrics)}})
    rows = []
    seed = 10
    for density in densities:
        for rep, mode in ((r, m) for r in range(args.reps) for m in modes):
            llm.collective_rpc(_set_reload_ahead, args=(mode,))
            seed += 1
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            perturb(model, frac=density, seed=seed)
            t0 = time.perf_counter()
            v = sender.publish()
            t1 = time.perf_counter()
            _wait_staged(status, v)
            t2 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": v}})
            llm.finish_weight_update(weight_version=str(v))
            t3 = time.perf_counter()
            commit = json.loads(metrics.read_text().splitlines()[-1])
            # the same change set as vLLM sparse patches (HF names, flat indices, new values)
            patches = []
            for n, p in model.named_parameters():
                cur, old = p.detach().reshape(-1), before[n].reshape(-1)
                idx = torch.nonzero(cur.view(torch.int16) != old.view(torch.int16)).squeeze(1)
                if idx.numel():
                    patches.append((n, tuple(p.shape), idx, cur[idx].clone()))
            changed = sum(int(i.numel()) for _, _, i, _ in patches)
            d = save(model, work / "reload")
            llm.collective_rpc("reload_weights", kwargs={"weights_path": d, "is_checkpoint_format": True})  # warm
            t4 = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": d, "is_checkpoint_format": True})
            t5 = time.perf_counter()
            repack_ms = llm.collective_rpc(_repack_all)[0]
            from safetensors.torch import save_file

            save_file({f"{n}:{k}": t for n, _, i, v in patches for k, t in (("idx", i), ("val", v))},
                      str(work / "patches.safetensors"))
            sparse = llm.collective_rpc(_sparse_apply, args=(str(work / "patches.safetensors"),
                                                             [(n, list(s)) for n, s, _, _ in patches]))[0]
            row = {
                "density": density, "rep": rep, "reload_ahead": mode, "version": v, "changed": changed, "numel": nparams,
                "publish_ms": (t1 - t0) * 1e3, "stage_wait_ms": (t2 - t1) * 1e3, "stall_ms": (t3 - t2) * 1e3,
                "time_to_version_ms": (t3 - t0) * 1e3, "staged_ahead": commit["staged_ahead"],
                "stage_download_ms": commit["download_ms"], "stage_decode_ms": commit["decode_ms"],
                "stage_verify_ms": commit["verify_ms"], "commit_apply_ms": commit["apply_ms"],
                "commit_repack_ms": commit["reload"]["ms"], "repacked_modules": commit["reload"]["modules"],
                "repacked_ahead": commit["reload"]["ahead"], "repack_ahead_ms": commit["reload"].get("prepare_ms", 0.0),
                "copied_mb": commit["reload"].get("copied_mb", 0.0), "patched": commit["reload"].get("patched", 0),
                "stage_total_ms": commit["total_ms"] - commit["apply_ms"],
                "vllm_full_reload_ms": (t5 - t4) * 1e3, "repack_all_ms": repack_ms,
                "vllm_sparse_apply_ms": sparse["ms"], "vllm_sparse_apply_error": sparse["error"],
            }
            rows.append(row)
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"density {density:.2%} rep {rep} reload_ahead={mode}: stall {row['stall_ms']:.1f} ms (re-pack or "
                  f"placing {row['commit_repack_ms']:.1f} ms; ahead {row['repack_ahead_ms']:.1f} ms) | vLLM full reload {row['vllm_full_reload_ms']:.1f} ms | re-pack all {repack_ms:.1f} ms | "
                  f"sparse apply {sparse['ms'] if sparse['ms'] is not None else sparse['error']}", flush=True)
    summary = {"params": nparams, "rows": len(rows)}
    for density in sorted({r["density"] for r in rows}):
        for mode in modes:
            rs = [r for r in rows if r["density"] == density and r["reload_ahead"] == mode]
            med = {k: statistics.median(r[k] for r in rs) for k in
                   ("stall_ms", "commit_repack_ms", "commit_apply_ms", "repack_ahead_ms", "stage_total_ms",
                    "vllm_full_reload_ms", "repack_all_ms", "time_to_version_ms", "publish_ms", "stage_wait_ms")}
            med["stall_over_full_reload"] = med["stall_ms"] / med["vllm_full_reload_ms"]
            med["stall_over_repack_all"] = med["stall_ms"] / med["repack_all_ms"]
            med["staged_ahead"] = all(r["staged_ahead"] for r in rs)
            med["repacked_ahead"] = [r["repacked_ahead"] for r in rs]
            med["sparse_apply"] = rs[0]["vllm_sparse_apply_error"] or statistics.median(r["vllm_sparse_apply_ms"] for r in rs)
            summary[f"{density:g} reload_ahead={mode}"] = med
        if len(modes) == 2:  # the two modes' stalls, median of the per-rep ratios (same density, same run)
            pairs = [(a, b) for a in rows for b in rows if a["density"] == b["density"] == density
                     and a["rep"] == b["rep"] and (a["reload_ahead"], b["reload_ahead"]) == tuple(modes)]
            summary[f"{density:g} stall {modes[0]} / {modes[1]}"] = statistics.median(
                a["stall_ms"] / b["stall_ms"] for a, b in pairs)
    summary["hf_module"] = hf_module_commit(args, densities)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
