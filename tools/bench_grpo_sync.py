"""Where a generator's in-flight sync time goes (``--engine vllm``), measured on one live vLLM server
with the main job's default policy and batch.

    .venv/bin/python tools/bench_grpo_sync.py                  # 20 versions, default config
    .venv/bin/python tools/bench_grpo_sync.py --versions 40 --density 0.1

One :class:`recipes.grpo.generators.VLLMServerGenerator` (the recipe's engine: a vLLM server from
``.venv-vllm``, ``deltasync`` backend) serves the recipe's default policy. For each version the
trainer side publishes an RL-like change (``torch_deltasync.testing.synthetic_step``), waits until
the server's backend has staged it, and then:

* **commit, idle**: ``VLLMServerGenerator.sync("keep")`` with nothing running, each HTTP call of
  ``update_server`` timed (``/pause``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``/resume``; the stall is pause → resume);
* **a batch in flight**: one batch of the default size (``prompts_per_batch x group_size``
  rollouts) through :func:`recipes.grpo.inflight.generate_inflight` with ``keep``, the next version
  staged before it starts, so the loop commits it under the running requests (the recipe's case);
* **a batch, no sync** (``drain``): the same batch without a commit;
* **an idle round trip**: ``GET /is_paused`` (the floor of any one HTTP call to the server).

Printed: medians per item, and the fraction of generation time a sync costs for one commit per
batch and per version (the recipe generates about ``train_batch / (generators x batch)`` batches per
replica per version). Results: ``docs/async_grpo.md`` and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools._cli import check_writable  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=20)
    p.add_argument("--density", type=float, default=0.1, help="changed fraction per version (the default run: ~11%%)")
    p.add_argument("--out", default=None, help="write the raw timings as JSON here")
    ns = p.parse_args()
    if ns.versions < 1 or not 0 < ns.density <= 1:
        p.error("--versions must be >= 1 and 0 < --density <= 1")
    if ns.out:  # before the server starts
        check_writable(p, "--out", ns.out)

    import torch

    import torch_deltasync.integrations.vllm as tdv
    from recipes.grpo.config import GRPOConfig
    from recipes.grpo.generators import VLLMServerGenerator
    from recipes.grpo.policy import build_policy, build_tokenizer, encode_prompts, max_new_tokens
    from recipes.grpo.task import SortTask
    from torch_deltasync import DeltaSender, LocalStore
    from torch_deltasync.integrations.vllm import wait_staged
    from torch_deltasync.testing import synthetic_step

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-grpo-sync-"))
    cfg = GRPOConfig(generator_backend="vllm", runs_dir=str(work), run_name="run")
    tok = build_tokenizer(cfg)
    trainer = build_policy(cfg, tok)
    state = {n: t.detach() for n, t in trainer.state_dict().items()}
    bucket = str(work / "bucket")
    sender = DeltaSender(trainer, LocalStore(bucket), prefix="p", anchor_every=cfg.anchor_every or None, codec=cfg.codec)
    sender.publish()

    calls: list[tuple[str, float]] = []
    real_call = tdv._Server.call

    def timed(self, method, path, params=None, body=None):  # every HTTP call update_server makes
        t0 = time.perf_counter()
        try:
            return real_call(self, method, path, params, body)
        finally:
            calls.append((path, (time.perf_counter() - t0) * 1e3))

    tdv._Server.call = timed
    gen = VLLMServerGenerator(cfg, tok, seed=1)
    rows: dict[str, list[float]] = {k: [] for k in ("pause", "start_weight_update", "update_weights",
                                                     "finish_weight_update", "resume", "stall", "sync_call",
                                                     "batch_keep", "batch_keep_stall", "batch_drain", "rtt")}
    try:
        gen.attach(bucket, "p")
        gen.update(0)
        task = SortTask(digits=cfg.digits)
        rng = __import__("random").Random(0)
        step = 0

        def publish_staged() -> int:
            nonlocal step
            step += 1
            synthetic_step(state, step, density=ns.density)
            v = sender.publish()
            wait_staged(gen.status_dir, v, timeout_s=300)
            return v

        def batch():
            problems = [task.problem(rng) for _ in range(cfg.prompts_per_batch)]
            return encode_prompts(tok, [q for q, _ in problems for _ in range(cfg.group_size)])

        T = max_new_tokens(cfg, tok)
        for _ in range(ns.versions):
            publish_staged()
            calls.clear()
            t0 = time.perf_counter()
            st = gen.sync("keep")
            rows["sync_call"].append((time.perf_counter() - t0) * 1e3)
            rows["stall"].append(st["stall_ms"])
            for path, ms in calls:
                key = path.strip("/")
                if key in rows:
                    rows[key].append(ms)
            publish_staged()
            pids, pmask = batch()
            t0 = time.perf_counter()
            r = gen.generate_versioned(pids, pmask, max_new_tokens=T, interrupt="keep")
            rows["batch_keep"].append((time.perf_counter() - t0) * 1e3)
            rows["batch_keep_stall"].append(sum(s["stall_ms"] for s in r.syncs))
            pids, pmask = batch()
            t0 = time.perf_counter()
            gen.generate_versioned(pids, pmask, max_new_tokens=T, interrupt="drain")
            rows["batch_drain"].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            with urllib.request.urlopen(gen.server.url + "/is_paused", timeout=60) as resp:
                resp.read()
            rows["rtt"].append((time.perf_counter() - t0) * 1e3)
    finally:
        gen.close()
        tdv._Server.call = real_call
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    per_version = cfg.train_batch / (cfg.generators * cfg.prompts_per_batch * cfg.group_size)
    print(f"load average {os.getloadavg()}; {ns.versions} versions at density {ns.density}; medians in ms:")
    for k, v in med.items():
        print(f"  {k:22s} {v:8.1f}")
    print(f"sync stall / drain batch: {med['stall'] / med['batch_drain']:.1%} (one commit per batch); "
          f"per version ({per_version:.2f} batches per replica per version): "
          f"{med['stall'] / (per_version * med['batch_drain']):.1%}")
    print(f"HTTP calls inside the pause: 5 x idle round trip {med['rtt']:.1f} ms = {5 * med['rtt']:.1f} ms "
          f"of the {med['stall']:.1f} ms stall")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"rows": rows, "medians": med, "density": ns.density,
                                            "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
