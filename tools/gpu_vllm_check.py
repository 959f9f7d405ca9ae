"""GPU check of the vLLM path with a real engine (CUDA graphs on), for ``tools/gpu_check.sh``.

1. Saves a tiny Qwen2 checkpoint (bf16), publishes it as anchor ``v0`` with ``DeltaSender``.
2. Starts ``vllm.LLM`` on it with the ``deltasync`` weight-transfer backend (``enforce_eager=False``:
   CUDA graphs hold the parameters' pointers) and attaches with ``assume_version=v0``.
3. Runs ``--steps`` real Adam steps on the HF model, publishing a delta after each, and commits each
   version with ``update_llm`` (wait until staged -> start -> update -> finish -> reset prefix cache);
   bf16 linears on GPU keep the loader layout, so the commit writes the changed elements in place.
4. Greedy-generates from fixed token ids and reads vLLM's own ``compute_weight_checksums``, then
   starts a fresh engine (subprocess) on the final checkpoint and does the same: identical tokens
   and checksums mean the in-place commit reached the parameters the captured CUDA graphs read.

Needs a full vLLM install on the GPU machine (``pip install vllm==0.33.0`` with its CUDA
dependencies); ``tools/setup.sh`` only installs the CPU oracle. Writes a JSON summary to ``--out``.

Usage::

    .venv/bin/python tools/gpu_vllm_check.py --out runs/gpu/vllm_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda")  # before testing_vllm (which defaults to cpu)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[1, 17, 42, 99, 7, 3], [5, 6, 7, 8], [250, 251, 252, 253, 254, 255, 256, 257]]


def _generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _engine(path: str, backend: bool):
    from vllm import LLM

    kw = dict(weight_transfer_config={"backend": "deltasync"}) if backend else {}
    return LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
               gpu_memory_utilization=0.25, enforce_eager=False, seed=0, **kw)


def _checksums(llm) -> list[dict[str, str]]:
    """vLLM's own per-parameter checksums, one dict per worker."""
    return llm.collective_rpc("compute_weight_checksums")


def fresh(path: str) -> None:
    """Subprocess entry: generate with a fresh engine on ``path``, print tokens and checksums as JSON."""
    llm = _engine(path, backend=False)
    print("FRESH " + json.dumps({"tokens": _generate(llm), "checksums": _checksums(llm)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu/vllm_engine.json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", default="runs/gpu/vllm_engine")
    ap.add_argument("--fresh", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fresh:
        fresh(args.fresh)
        return

    import torch

    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.integrations.vllm import attach_llm, update_llm
    from torch_deltasync.testing import adam_step
    from torch_deltasync.testing_vllm import TINY_VLLM_CONFIGS, hf_model

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"ok": False}
    spec = TINY_VLLM_CONFIGS["qwen2"]
    hf = hf_model(spec, seed=0).cuda()
    bf16 = lambda: {k: t.detach().to(torch.bfloat16).cpu() for k, t in hf.state_dict().items()}  # noqa: E731
    hf.save_pretrained(work / "ckpt0", state_dict=bf16())
    store = LocalStore(work / "bucket")
    sender = DeltaSender(hf, store, anchor_every=1000)
    v0 = sender.publish()
    t0 = time.perf_counter()
    llm = _engine(str(work / "ckpt0"), backend=True)
    result["engine_start_s"] = time.perf_counter() - t0
    result["tokens_v0"] = _generate(llm)
    attach_llm(llm, str(work / "bucket"), assume_version=v0)  # the engine loaded v0's checkpoint
    opt = torch.optim.Adam(hf.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    updates = []
    for _ in range(args.steps):
        adam_step(hf, opt, batch=2, seq=32, generator=g)
        v = sender.publish()
        u = update_llm(llm, v)
        updates.append(u.to_dict())
        print(f"v{v}: stall {u.stall_ms:.1f} ms, wait for staging {u.wait_ms:.1f} ms, total {u.total_ms:.1f} ms, "
              f"staged ahead {u.staged}", flush=True)
    result["updates"] = updates
    result["tokens_updated"] = _generate(llm)
    result["checksums_updated"] = _checksums(llm)
    hf.save_pretrained(work / "ckpt_final", state_dict=bf16())
    del llm
    proc = subprocess.run([sys.executable, __file__, "--fresh", str(work / "ckpt_final")],
                          capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("FRESH ")]
    got = json.loads(line[-1][6:]) if line else {}
    result["tokens_fresh"] = got.get("tokens")
    if not line:
        result["fresh_stderr"] = proc.stderr[-4000:]
    result["tokens_match_fresh_engine"] = result["tokens_fresh"] == result["tokens_updated"]
    result["checksums_match_fresh_engine"] = got.get("checksums") == result["checksums_updated"]
    result["tokens_changed_from_v0"] = result["tokens_updated"] != result["tokens_v0"]
    result["ok"] = bool(result["tokens_match_fresh_engine"] and result["checksums_match_fresh_engine"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items()
                      if not k.startswith(("tokens_", "checksums_")) or k.endswith("_fresh_engine")}))
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
