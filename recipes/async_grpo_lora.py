"""Asynchronous GRPO with LoRA: adapter versions through an object store, episodes through HTTP.

The setup of "asynchronous LoRA-GRPO over HF Jobs" (the project's fourth problem statement): a
trainer and rollout workers that never talk NCCL and need not share a network. The trainer publishes every adapter
version to a store (a local folder here; ``s3://`` or ``hf://buckets/`` in production); the workers
follow the store and generate with the newest adapter they hold; finished episodes reach the trainer
through a small HTTP ring buffer that drops stale ones. GRPO clips the importance ratio of the
rollout policy (the adapter version that generated an episode) to ``[0.8, 1.2]``.

Architecture::

    trainer (this process)                      store (--store)                  rollout workers (N processes)
    ┌─────────────────────────────┐   adapter/adapter_config.json      ┌──────────────────────────────┐
    │ Qwen3 + LoRA (peft), Adam   │   objects/<v>/anchor|delta-*.st    │ hf: base + LoRA (peft), CPU,  │
    │ GRPO, ratio clip [0.8, 1.2] │ ─AdapterSender──▶ versions/<v> ──▶ │   AdapterReceiver in place    │
    │ publish() every step        │   base/model.safetensors           │ vllm: vllm serve + runtime    │
    │                             │                                    │   LoRA, VLLMAdapterLoader     │
    └──────────▲──────────────────┘                                    │ sample G completions/prompt,  │
               │ POST /sample (trainer version, B episodes)            │ reward, group advantage       │
    ┌──────────┴──────────────────────────────────────────────────┐    └──────────────┬───────────────┘
    │ rollout service (deltasync serve-buffer; a thread here):      │ ◀── POST /episodes (429 when full)
    │ torchrl ReplayBuffer ring, drops lag > --max-lag, /stats      │
    └───────────────────────────────────────────────────────────────┘

The task is verifiable and tiny, and the same as the main job's (``python -m recipes.async_grpo``):
the prompt is ``<bos> d1 .. dL =`` (random digits), the answer the digits sorted (``--task sort``) or
copied (``--task copy``) then ``<eos>``, the reward the fraction of answer positions that are right.
Both recipes share ``recipes/grpo/``: the task, reward and character tokenizer (``task.py``),
sampling, token log-probs and supervised batches (``policy.py``), the clipped objective
(``loss.py``) and torchrl's group advantages (``buffer.py``). The base model is a ``tiny_qwen3``
taught to copy digits for a few supervised steps (``--warmup-steps``), so it starts competent but
not sharp; RL on the adapter then teaches it to sort. The trainer writes the base to the store
(``base/model.safetensors``), so workers anywhere start from the same weights.

The workers sample with Hugging Face ``generate`` on a PEFT model (``--engine hf``, the default), or
each with a ``vllm serve`` of the base model (``--engine vllm``, vLLM from ``.venv-vllm``) into which
every adapter version is hot-swapped as a new LoRA adapter (``VLLMAdapterLoader``), as the problem
statement's workers do; :mod:`recipes.grpo.lora_rollouts` holds both.

Run everything on this machine (trainer + service thread + 2 worker processes), a few minutes on 2 CPU
cores::

    python recipes/async_grpo_lora.py --run-dir runs/lora-grpo
    python recipes/async_grpo_lora.py --run-dir runs/lora-grpo-vllm --engine vllm

Or apart (each line on its own machine; the store and the service must be reachable from all)::

    deltasync serve-buffer --host 0.0.0.0 --port 8088 --token-file tok --vocab-size 16 --max-lag 2
    python recipes/async_grpo_lora.py trainer --service-url http://HOST:8088 --token-file tok --store s3://bucket/runs
    python recipes/async_grpo_lora.py worker  --service-url http://HOST:8088 --token-file tok --store s3://bucket/runs --worker-id 0
    python recipes/async_grpo_lora.py worker  ... --worker-id 1 --engine vllm     # a worker with a vllm serve of its own

A trainer refuses a ``--prefix`` that already holds an earlier run's versions (the service and the
workers would mix that run's episodes and base with the new one's): give each run its own prefix,
and restart the service and the workers with it. ``run`` starts its default store
(``RUN_DIR/bucket``) afresh. A worker skips a version it cannot apply or load (reported on stderr
and in its ``worker-<i>.jsonl``) and samples on with the one it holds.

Output in ``--run-dir``: ``metrics.jsonl`` (one line per trainer step: reward, loss, ratio and clip
fraction, lag, adapter version, kind and bytes), ``publish.jsonl`` (the sender's per-version stats),
``worker-<i>.jsonl`` (per rollout batch: version used, update path, bytes and times, reward), ``summary.json``
(reward first vs last steps, adapter bytes per version, lag, the service's episode accounting, a
bit-exact check of the final adapter loaded with PEFT's own loader), ``final_adapter/`` (the last
version, materialised), ``trainer_adapter.safetensors`` (the trainer's adapter as trained) and
``metrics.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the shared GRPO modules live in recipes/grpo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.grpo.buffer import group_advantages  # noqa: E402
from recipes.grpo.config import attention_shape  # noqa: E402
from recipes.grpo.loss import grpo_objective  # noqa: E402
from recipes.grpo.policy import group_prompts, response_logprobs, score, sft_batch, sft_loss  # noqa: E402
from recipes.grpo.task import CharTokenizer, CopyTask, SortTask  # noqa: E402

# --- task and tokenizer (shared with recipes/async_grpo.py: recipes/grpo/task.py) ----------------

TOK = CharTokenizer()


def make_task(name: str, digits: int) -> SortTask:
    """``--task sort`` (:class:`SortTask`) or ``--task copy`` (:class:`CopyTask`)."""
    return CopyTask(digits=digits) if name == "copy" else SortTask(digits=digits)


# --- models ------------------------------------------------------------------------------------


def lora_targets() -> list[str]:
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(seed: int = 0) -> torch.nn.Module:
    """The base model's architecture: ``tiny_qwen3`` over the digit vocabulary, with the main
    recipe's heads (:func:`recipes.grpo.config.attention_shape`: 2 heads of 32, as vLLM's CPU
    attention needs a head size of at least 32)."""
    from torch_deltasync.testing import tiny_qwen3

    heads, kv_heads, head_dim = attention_shape(64)
    return tiny_qwen3("tiny", seed=seed, vocab_size=TOK.vocab_size, hidden_size=64, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim)


def make_base(args) -> torch.nn.Module:
    """``tiny_qwen3`` over the digit vocabulary, taught to copy (answer, then end-of-sequence) for
    ``--warmup-steps`` full fine-tuning steps (:func:`recipes.grpo.policy.sft_batch` /
    :func:`~recipes.grpo.policy.sft_loss`)."""
    model = base_model(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng, task = random.Random(args.seed), CopyTask(digits=args.digits)
    for _ in range(args.warmup_steps):
        loss = sft_loss(model, *sft_batch(task, TOK, rng, 64))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval()


def put_base(store, model) -> None:
    from safetensors.torch import save

    store.put("base/model.safetensors", save({n: t.detach().contiguous() for n, t in model.state_dict().items()}))


def load_base(store, timeout_s: float) -> torch.nn.Module:
    """The trainer's base model from the store (safetensors bytes, never pickle)."""
    from safetensors.torch import load

    from torch_deltasync.errors import ObjectNotFoundError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = store.get("base/model.safetensors")
            break
        except ObjectNotFoundError:
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer has not written base/model.safetensors") from None
            time.sleep(0.2)
    model = base_model()
    model.load_state_dict(load(data))
    return model.eval()


# --- rollout worker ----------------------------------------------------------------------------


def make_rollouts(args, store, base):
    """The worker's engine (``--engine``): :class:`~recipes.grpo.lora_rollouts.PeftRollouts` or
    :class:`~recipes.grpo.lora_rollouts.VLLMRollouts`, holding the run's first version."""
    from recipes.grpo.lora_rollouts import PeftRollouts, VLLMRollouts

    if args.engine == "vllm":
        return VLLMRollouts(store, base, TOK, run_dir=args.run_dir, worker_id=args.worker_id,
                            seed=10_000 + args.worker_id, timeout_s=args.startup_timeout, vllm_python=args.vllm_python)
    return PeftRollouts(store, base, TOK, timeout_s=args.startup_timeout)


def run_worker(args) -> int:
    """Follow the adapter run, generate groups, post them until the trainer closes the service."""
    from torch_deltasync.errors import RolloutServiceError, ServiceClosedError
    from torch_deltasync.integrations.rollout import RolloutClient
    from torch_deltasync.store import open_store

    torch.set_num_threads(1)
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)  # (apart, the trainer's run folder is elsewhere)
    store = open_store(args.store).sub(args.prefix)
    engine = make_rollouts(args, store, load_base(store, args.startup_timeout))
    client = RolloutClient(args.service_url, token=_token(args))
    torch.manual_seed(10_000 + args.worker_id)  # sampling (recipes.grpo.policy.sample)
    rng, task = random.Random(10_000 + args.worker_id), make_task(args.task, args.digits)
    metrics = open(Path(args.run_dir) / f"worker-{args.worker_id}.jsonl", "a") if args.run_dir else None
    batch = 0
    try:
        while True:
            update = engine.refresh()  # the newest version (None when there is none newer)
            version = engine.version
            pids, pmask, answers = group_prompts(task, TOK, rng, args.prompts, args.group)
            comps, cmask, lps = engine.sample(pids, pmask, max_new_tokens=task.max_new_tokens,
                                              temperature=args.temperature)
            rewards = score(task, TOK, comps, answers)
            adv = group_advantages(rewards, args.group)
            episodes = [{
                "prompt": pids[i].tolist(), "completion": comps[i][cmask[i]].tolist(),
                "logprobs": lps[i][cmask[i]].tolist(), "reward": float(rewards[i]), "advantage": float(adv[i]),
                "policy_version": version, "group": f"w{args.worker_id}-{batch}-{i // args.group}",
                "worker": f"w{args.worker_id}",
            } for i in range(pids.shape[0])]
            try:
                res = client.post_episodes(episodes, max_wait_s=args.startup_timeout)
            except ServiceClosedError:
                break
            if metrics:
                metrics.write(json.dumps({
                    "batch": batch, "version": version, "reward_mean": float(rewards.mean()),
                    "stored": res["stored"], "dropped_stale": res["dropped_stale"],
                    "trainer_version": res["trainer_version"], "update": update,
                }) + "\n")
                metrics.flush()
            batch += 1
    except RolloutServiceError as e:
        print(f"worker {args.worker_id}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
        engine.close()
        if metrics:
            metrics.close()
    print(f"worker {args.worker_id}: {batch} batches, stopped by the trainer", flush=True)
    return 0


# --- trainer -----------------------------------------------------------------------------------


def grpo_loss(model, td, clip_low: float, clip_high: float, temperature: float):
    """Clipped-ratio GRPO loss over completion tokens (token mean) against the rollout policy:
    :func:`recipes.grpo.loss.grpo_objective` with the rollout log-probs as ``old_logp`` and no
    importance weights, on log-probs from :func:`recipes.grpo.policy.response_logprobs`.

    Args:
        td: :func:`~torch_deltasync.integrations.rollout.collate_episodes` of episodes
            whose prompts all have one length (this task's prompts do).

    Returns:
        ``(loss, stats)``: stats has the mean ratio and the fraction of clipped tokens.

    Raises:
        ValueError: prompts of different lengths.
    """
    cmask = td["completion_mask"]
    starts = cmask.long().argmax(1)
    p = int(starts[0])
    if not bool((starts == p).all()):
        raise ValueError(f"prompts of different lengths in one batch ({sorted(set(starts.tolist()))}); "
                         "this loss expects one prompt length")
    ids = td["input_ids"]
    logp = response_logprobs(model, ids[:, :p], td["attention_mask"][:, :p].long(), ids[:, p:], cmask[:, p:],
                             temperature=temperature)
    return grpo_objective(logp, td["logprobs"][:, p:], td["advantage"], cmask[:, p:],
                          clip=(1 - clip_low, 1 + clip_high))


def run_trainer(args, service_url: str, token: str | None, workers: list | None = None) -> dict:
    from peft import LoraConfig, get_peft_model

    from torch_deltasync.integrations.rollout import RolloutClient, collate_episodes
    from torch_deltasync.integrations.peft import AdapterSender, adapter_state_dict, materialize_adapter
    from torch_deltasync.store import open_store

    torch.manual_seed(args.seed)
    run_dir = Path(args.run_dir)
    store = open_store(args.store).sub(args.prefix)
    base = make_base(args)
    put_base(store, base)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=lora_targets(),
                                            lora_dropout=0.0))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    client = RolloutClient(service_url, token=token)
    client.stats()  # the service answers before version 0 is published (a retry would find the prefix used)
    sender = AdapterSender(model, store, metrics_path=run_dir / "publish.jsonl")
    version = sender.publish()
    client.set_version(version)
    versions = [_version_row(sender)]
    rows = []
    t_start = time.monotonic()
    print(f"trainer: adapter {sum(p.numel() for p in adapter_state_dict(model).values()):,} parameters, "
          f"version {version} published; waiting for episodes", flush=True)
    lost: set[int] = set()
    try:
        for step in range(args.steps):
            for i, w in enumerate(workers or []):
                if i not in lost and w.poll() is not None:
                    lost.add(i)
                    print(f"trainer: worker {i} exited with status {w.returncode} (its log: "
                          f"{run_dir / f'worker-{i}.log'}); {len(workers) - len(lost)} left", flush=True)
            t0 = time.monotonic()
            batch = None
            while batch is None:
                batch = client.sample(args.batch, trainer_version=version, wait_s=2.0)
                if batch is None:
                    gone = [i for i, w in enumerate(workers or []) if w.poll() is not None]
                    if gone:
                        raise RuntimeError(f"rollout worker {gone[0]} exited with status {workers[gone[0]].returncode} "
                                           f"before the first batch; see its log, {run_dir / f'worker-{gone[0]}.log'}"
                                           + (f", and its vLLM server's, {run_dir / f'vllm-worker-{gone[0]}.log'}"
                                              if args.engine == "vllm" else ""))
                    if time.monotonic() - t0 > args.startup_timeout:
                        raise TimeoutError(f"no {args.batch} fresh episodes within {args.startup_timeout} s")
            wait_s = time.monotonic() - t0
            td = collate_episodes(batch, pad_id=TOK.pad_id)
            model.train()
            loss, st = grpo_loss(model, td, args.clip, args.clip, args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            version = sender.publish()
            client.set_version(version)
            versions.append(_version_row(sender))
            lag = td["lag"].float()
            row = {
                "step": step, "version": version, "kind": sender.last_stats.kind,
                "adapter_nbytes": sender.last_stats.nbytes, "adapter_objects_nbytes": versions[-1]["objects_nbytes"],
                "full_adapter_nbytes": sender.last_stats.full_nbytes,
                "density": sender.last_stats.density, "reward_mean": float(td["reward"].mean()),
                "loss": float(loss.detach()), **st, "lag_mean": float(lag.mean()), "lag_max": int(lag.max()),
                "policy_versions": sorted(set(td["policy_version"].tolist())),
                "wait_s": wait_s, "step_s": time.monotonic() - t0, "elapsed_s": time.monotonic() - t_start,
            }
            rows.append(row)
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
                print(f"step {step:4d}  v{version:<4d} {row['kind']:<6s} {row['adapter_nbytes']:>7,d} B  "
                      f"reward {row['reward_mean']:.3f}  lag {row['lag_mean']:.2f} (max {row['lag_max']})  "
                      f"ratio {row['ratio_mean']:.3f} clip {row['clip_frac']:.3f}  wait {wait_s:.2f}s", flush=True)
        sender.flush()
        client.close_service()
        if workers:
            for i, w in enumerate(workers):  # a worker stops at its next post (the service is closed)
                try:
                    w.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    print(f"trainer: worker {i} did not stop within 30 s of the service closing; killed", flush=True)
                    w.kill()
                    w.wait()
        service = client.stats()
    finally:
        client.close()
        sender.close()
    # the final version, materialised and loaded with PEFT's own loader, is the trainer's adapter
    out = materialize_adapter(store, run_dir / "final_adapter")
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(load_base(store, 10), str(out))
    from torch_deltasync.testing import bitwise_equal

    exact = bitwise_equal(adapter_state_dict(loaded), adapter_state_dict(model))
    # The trainer's final adapter as trained (fp32), for checks outside the recipe against
    # final_adapter/adapter_model.safetensors.
    from safetensors.torch import save_file

    save_file({n: t.detach().clone().contiguous() for n, t in adapter_state_dict(model).items()},
              str(run_dir / "trainer_adapter.safetensors"))
    return _summary(args, rows, versions, service, exact, workers)


def _version_row(sender) -> dict:
    """One published version: ``nbytes`` = its objects + manifest (what a publish uploads),
    ``objects_nbytes`` = the adapter objects alone, ``full_nbytes`` = the adapter in bf16."""
    from torch_deltasync.manifest import load_manifest

    st = sender.last_stats
    return {"version": st.version, "kind": st.kind, "nbytes": st.nbytes,
            "objects_nbytes": load_manifest(sender.store, st.version).nbytes, "full_nbytes": st.full_nbytes,
            "density": st.density}


def _summary(args, rows, versions, service, exact, workers) -> dict:
    k = max(1, len(rows) // 5)
    lags = [r["lag_mean"] for r in rows]
    by_kind = {}
    for v in versions:
        by_kind.setdefault(v["kind"], []).append(v["nbytes"])
    summary = {
        "steps": len(rows), "task": args.task, "digits": args.digits,
        "reward_first": sum(r["reward_mean"] for r in rows[:k]) / k,
        "reward_last": sum(r["reward_mean"] for r in rows[-k:]) / k,
        "reward_window_steps": k,
        "adapter_bytes_per_version": [[v["version"], v["kind"], v["nbytes"]] for v in versions],
        "adapter_object_bytes_mean": sum(v["objects_nbytes"] for v in versions) / len(versions),
        "adapter_full_nbytes": versions[0]["full_nbytes"],
        "adapter_bytes_mean": sum(v["nbytes"] for v in versions) / len(versions),
        "adapter_bytes_by_kind": {kd: {"versions": len(b), "mean_nbytes": sum(b) / len(b)} for kd, b in by_kind.items()},
        "lag_mean": sum(lags) / len(lags), "lag_max": max(r["lag_max"] for r in rows), "max_lag_allowed": service["max_lag"],
        "ratio_mean": sum(r["ratio_mean"] for r in rows) / len(rows),
        "clip_frac_mean": sum(r["clip_frac"] for r in rows) / len(rows),
        "episodes": {k2: service[k2] for k2 in ("accepted", "sampled", "dropped_stale", "dropped_stale_on_arrival",
                                                 "evicted", "size", "unaccounted", "rejected_full")},
        "lag_sampled": service["lag_sampled"],
        "final_adapter_bit_exact": exact,
        "workers_exit_codes": [w.returncode for w in workers] if workers else None,
        # the workers' engine and their updates: known here only when this process started them
        "engine": args.engine if workers else None,
        "worker_updates": _worker_updates(Path(args.run_dir)) if workers else None,
        "elapsed_s": rows[-1]["elapsed_s"] if rows else 0.0,
    }
    return summary


def _worker_updates(run_dir: Path) -> dict:
    """The workers' adapter updates (``worker-<i>.jsonl``): how many, by path, and their times
    (``total_ms``: the receiver's update; ``load_ms``, vLLM workers: the whole swap, store reads to
    the engine's load), and how many versions were skipped (not applied or refused by the engine)."""
    ups = []
    for path in sorted(run_dir.glob("worker-*.jsonl")):
        ups += [r["update"] for r in map(json.loads, path.read_text().splitlines()) if r.get("update")]
    skipped = [u for u in ups if "error" in u]
    ups = [u for u in ups if "error" not in u]
    out = {"count": len(ups), "by_path": {}, "skipped": len(skipped)}  # skipped: versions not applied / loaded
    for u in ups:
        out["by_path"][u["path"]] = out["by_path"].get(u["path"], 0) + 1
    for key in ("total_ms", "load_ms"):
        vals = sorted(u[key] for u in ups if u.get(key) is not None)
        if vals:
            out[key] = {"median": vals[len(vals) // 2], "max": vals[-1]}
    return out


def _plot(run_dir: Path, rows: list[dict], summary: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.6))
    steps = [r["step"] for r in rows]
    ax[0].plot(steps, [r["reward_mean"] for r in rows], lw=1)
    ax[0].set(xlabel="trainer step", ylabel="batch reward", title=f"reward ({summary['task']})")
    vs = summary["adapter_bytes_per_version"]
    ax[1].bar([v for v, _, _ in vs], [b for _, _, b in vs], color=["C1" if k == "anchor" else "C0" for _, k, _ in vs])
    ax[1].axhline(summary["adapter_full_nbytes"], color="k", lw=0.8, ls="--", label="full adapter (bf16)")
    ax[1].set(xlabel="adapter version", ylabel="bytes published", title="bytes per version (orange: full)")
    ax[1].legend()
    ax[2].plot(steps, [r["lag_mean"] for r in rows], lw=1, label="mean")
    ax[2].plot(steps, [r["lag_max"] for r in rows], lw=1, label="max")
    ax[2].set(xlabel="trainer step", ylabel="versions behind", title="policy lag of trained episodes")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(run_dir / "metrics.png", dpi=110)
    plt.close(fig)


# --- entry points ------------------------------------------------------------------------------


def _versions_held(store: str, prefix: str) -> list[int]:
    """The versions a run prefix already holds (an earlier run's)."""
    from torch_deltasync.keys import list_versions
    from torch_deltasync.store import open_store

    return list_versions(open_store(store).sub(prefix))


def _token(args) -> str | None:
    from torch_deltasync.integrations.rollout import read_token

    return read_token(getattr(args, "token_file", None))


def _worker_cmd(args, url: str, i: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "worker", "--service-url", url, "--store", args.store,
            "--prefix", args.prefix, "--worker-id", str(i), "--token-file", args.token_file, "--run-dir", args.run_dir,
            "--task", args.task, "--digits", str(args.digits), "--prompts", str(args.prompts), "--group",
            str(args.group), "--temperature", str(args.temperature), "--startup-timeout", str(args.startup_timeout),
            "--engine", args.engine, *(["--vllm-python", args.vllm_python] if args.vllm_python else [])]


def run_all(args) -> dict:
    """Service thread + trainer here, ``--workers`` rollout worker processes."""
    from torch_deltasync.integrations.rollout import RolloutServiceConfig, start_service

    run_dir = Path(args.run_dir)
    if args.store is None:
        args.store = str(run_dir / "bucket")
    token, token_file = secrets.token_urlsafe(24), run_dir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    args.token_file = str(token_file)  # the workers read it from there
    cfg = RolloutServiceConfig(capacity=args.capacity or 2 * args.batch, max_lag=args.max_lag, vocab_size=TOK.vocab_size,
                               max_prompt_tokens=64, max_completion_tokens=64, token=token, retry_after_s=0.2)
    service = start_service(cfg)
    if args.engine == "vllm":
        # The vLLM servers are bound one per core; a 2-thread trainer beside them took 0.44 s per step
        # against 0.18 s with one thread (40 steps, 2 cores).
        torch.set_num_threads(1)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    workers = []
    try:
        for i in range(args.workers):
            log = open(run_dir / f"worker-{i}.log", "w")
            workers.append(subprocess.Popen(_worker_cmd(args, service.url, i), env=env, stdout=log, stderr=subprocess.STDOUT))
        return run_trainer(args, service.url, cfg.token, workers)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        service.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from torch_deltasync.cli import HelpFormatter  # the deltasync command's: defaults shown

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("role", nargs="?", default="run", choices=("run", "trainer", "worker"),
                   help="run: everything here (default); trainer / worker: one role against --service-url")
    p.add_argument("--run-dir", default="runs/async-grpo-lora", help="metrics, logs, summary (and the default store)")
    p.add_argument("--store", default=None, help="adapter store: folder, s3://..., hf://buckets/... (default: RUN_DIR/bucket)")
    p.add_argument("--prefix", default="lora-grpo", help="run prefix inside the store")
    p.add_argument("--service-url", default=None, help="rollout service URL (trainer/worker roles)")
    p.add_argument("--token-file", default=None, help="shared service token (else $DELTASYNC_BUFFER_TOKEN)")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes (run role)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="rollout workers' engine: hf (PEFT on CPU, the adapter updated in place) or vllm (a vllm serve "
                        "per worker, every adapter version hot-swapped in as a new LoRA adapter)")
    p.add_argument("--vllm-python", default=None,
                   help="vLLM's interpreter for --engine vllm (default: $TORCH_DELTASYNC_VLLM_PYTHON, else .venv-vllm)")
    p.add_argument("--worker-id", type=int, default=0, help="this worker's id, with the role worker")
    p.add_argument("--steps", type=int, default=150, help="trainer steps (one adapter version each)")
    p.add_argument("--batch", type=int, default=64, help="episodes per trainer step")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout batch")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--task", choices=("sort", "copy"), default="sort", help="the verifiable task")
    p.add_argument("--digits", type=int, default=3, help="digits per prompt (a completion is these digits + <eos>)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (rollout and loss)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=int, default=16, help="LoRA alpha")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate of the adapter")
    p.add_argument("--clip", type=float, default=0.2, help="ratio clip: [1 - clip, 1 + clip]")
    p.add_argument("--max-lag", type=int, default=2, help="staleness threshold of the service (versions)")
    p.add_argument("--capacity", type=int, default=None,
                   help="service ring capacity in episodes (default 2 x --batch: workers wait on 429s instead of "
                        "producing episodes that go stale)")
    p.add_argument("--warmup-steps", type=int, default=15, help="supervised copy steps of the base model")
    p.add_argument("--seed", type=int, default=0, help="model and sampling seed")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for peers")
    args = p.parse_args(argv)
    for flag in ("workers", "steps", "batch", "prompts", "digits", "rank", "alpha"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.digits > 32:  # recipes.grpo.task.SortTask
        p.error(f"--digits must be at most 32, got {args.digits}")
    if args.group < 2:  # group advantages compare completions of one prompt
        p.error(f"--group must be at least 2 (completions per prompt, compared with each other), got {args.group}")
    for flag in ("lr", "startup_timeout", "temperature"):
        if not 0 < getattr(args, flag) < float("inf"):
            p.error(f"--{flag.replace('_', '-')} must be a positive finite number, got {getattr(args, flag)}")
    if not 0 <= args.clip < float("inf"):
        p.error(f"--clip must be a finite number >= 0, got {args.clip}")
    if args.max_lag < 0 or args.warmup_steps < 0:
        p.error(f"--max-lag and --warmup-steps must be >= 0, got {args.max_lag} and {args.warmup_steps}")
    if args.engine == "vllm":
        from recipes.grpo.vllm_server import default_vllm_python

        python = args.vllm_python or default_vllm_python()
        if not Path(python).exists():
            p.error(f"--engine vllm: vLLM's interpreter {python} does not exist; run `bash tools/setup.sh` (it builds "
                    ".venv-vllm) or pass --vllm-python")
        from recipes.grpo.lora_rollouts import VLLM_MAX_LORA_RANKS

        if args.rank > VLLM_MAX_LORA_RANKS[-1]:
            p.error(f"--engine vllm: --rank {args.rank} is above vLLM's largest --max-lora-rank "
                    f"({VLLM_MAX_LORA_RANKS[-1]})")
    if args.store is not None and args.store.startswith("memory://"):
        p.error("--store memory://... lives inside one process, but the trainer and the rollout workers are separate "
                "processes; use a folder, s3://... or hf://buckets/...")
    try:  # the store's form and a run prefix that stays inside it (they failed as tracebacks, after start-up)
        from torch_deltasync.errors import StoreNotFoundError
        from torch_deltasync.store import check_prefix, check_store

        check_prefix(args.prefix, "--prefix")
        if args.store is not None:
            check_store(args.store)
    except (TypeError, ValueError, ImportError, StoreNotFoundError) as e:
        p.error(str(e))
    if args.role != "run" and not (args.service_url and args.store):
        p.error(f"{args.role}: --service-url and --store are required")
    # a worker posts prompts x group episodes at once; the service refuses a post its ring cannot hold
    # (a service started apart has its own --capacity, which only it knows)
    ring = args.capacity if args.capacity is not None else 2 * args.batch
    if args.role != "trainer" and ring < args.prompts * args.group:
        p.error(f"the service ring holds {ring} episodes ({'--capacity' if args.capacity is not None else '2 x --batch'})"
                f", fewer than one worker post of --prompts x --group = {args.prompts * args.group}: raise it or "
                "lower those")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "worker":
        return run_worker(args)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "publish.jsonl"):
        (run_dir / name).unlink(missing_ok=True)
    if args.role == "run":  # this run's workers write theirs here (appending)
        for path in run_dir.glob("worker-*.jsonl"):
            path.unlink()
    if args.role == "run" and args.store is None:  # the run's own store: a new run starts it afresh
        from torch_deltasync.bucket import clear_local_bucket
        from torch_deltasync.errors import PrefixInUseError

        try:
            dropped = clear_local_bucket(run_dir / "bucket")
        except (PrefixInUseError, FileExistsError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if dropped:
            print(f"emptied {run_dir / 'bucket'}: {dropped} versions of earlier runs deleted")
    else:
        held = _versions_held(args.store, args.prefix)
        if held:
            print(f"error: {args.store} prefix {args.prefix!r} already holds adapter versions {held[0]}..{held[-1]} of "
                  "an earlier run. This trainer starts a new adapter (and base); the rollout service and the workers "
                  "would mix that run's episodes and base with this one's. Use a new --prefix (and restart the "
                  "service and the workers), or delete that prefix.", file=sys.stderr)
            return 2
    if args.role == "trainer":
        summary = run_trainer(args, args.service_url, _token(args))
    else:
        summary = run_all(args)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(run_dir, rows, summary)
    e = summary["episodes"]
    print(f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} (first/last {summary['reward_window_steps']} steps)")
    print(f"adapter bytes per version: mean {summary['adapter_bytes_mean']:,.0f} published (objects "
          f"{summary['adapter_object_bytes_mean']:,.0f} + manifest) for a {summary['adapter_full_nbytes']:,}-byte bf16 "
          f"adapter; by kind: {json.dumps(summary['adapter_bytes_by_kind'])}")
    print(f"lag: mean {summary['lag_mean']:.2f}, max {summary['lag_max']} (threshold {summary['max_lag_allowed']})")
    print(f"episodes: {e['accepted']} accepted = {e['sampled']} sampled + {e['dropped_stale']} dropped stale + "
          f"{e['evicted']} evicted + {e['size']} left (unaccounted {e['unaccounted']}); "
          f"{e['rejected_full']} refused while full (429)")
    up = summary["worker_updates"]
    if up and up["count"]:
        swap = f", whole swap into vLLM median {up['load_ms']['median']:.1f} ms" if "load_ms" in up else ""
        print(f"worker adapter updates ({summary['engine']}): {up['count']} ({up['by_path']}), update median "
              f"{up['total_ms']['median']:.1f} ms{swap}")
    print(f"final adapter bit-exact after materialise + PeftModel.from_pretrained: {summary['final_adapter_bit_exact']}")
    print(json.dumps({"summary": str(run_dir / "summary.json")}))
    ok = summary["final_adapter_bit_exact"] and e["unaccounted"] == 0 and summary["lag_max"] <= summary["max_lag_allowed"]
    return 0 if ok else 1


if __name__ == "__main__":
    from torch_deltasync.errors import DeltaSyncError

    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally blocks have stopped the workers, their servers and the service
        print("async_grpo_lora: interrupted", file=sys.stderr)
        sys.exit(130)
    except (DeltaSyncError, OSError, RuntimeError, TimeoutError) as e:  # (a service, store or worker that failed)
        print(f"async_grpo_lora: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
