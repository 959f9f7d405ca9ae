r"""Async GRPO on Monarch actor meshes, with weights synced to the generators by lossless deltas.

Launch from the repository root (defaults: ~0.4M-parameter Qwen3, digit sorting, 2 generator
replicas, 1 trainer process, 200 GRPO steps; a few minutes on a 2-core CPU)::

    python -m recipes.async_grpo                       # README main command (after tools/setup.sh)
    python -m recipes.async_grpo --steps 50 --generators 3 --max-staleness 1 --run-name quick
    python -m recipes.async_grpo --trainer-procs 2     # FSDP2 over gloo, every rank publishes its shard
    python -m recipes.async_grpo --bucket s3://bucket/runs --model /path/to/hf/checkpoint
    python -m recipes.async_grpo --engine vllm         # a vLLM server per replica, commits in flight

Architecture (one host; every box is a Monarch actor, every arrow an endpoint call)::

    client process (controller, asyncio)                     store (--bucket; default <run>/bucket)
    ┌───────────────────────────────────────────┐          ┌──────────────────────────────────┐
    │ warm start (supervised, cached)           │          │ versions/<v>.json  (manifest)    │
    │ train loop ── sample(B, v) ──► ReplayBuffer│          │ objects/<v>/anchor|delta-*.st    │
    │   │           (torchrl, this_proc actor)   │          └──────────▲──────────────┬───────┘
    │   │ train_step(batch, publish) ───────────────► trainer mesh ───┘ publish      │ update
    │   │                                        │    (N procs; FSDP2 when N > 1;    │ (pull,
    │   ▼ newest version v                       │     DeltaSender on every rank)    │  apply
    │ rollout loop i (one per replica): ─────────────► generator mesh, replica i ◄───┘  in place)
    │   if v_i < v: update_weights(v)   [soft pause: between batches]                 │
    │   generate(batch) ─► rewards ─► ReplayBuffer.extend (MCAdvantage groups)        │
    └───────────────────────────────────────────┘

* Rollouts and training run concurrently (one asyncio task per generator replica, one for the
  trainer). Each Monarch actor handles one message at a time, and each actor is driven by exactly
  one task, so no endpoint ever waits on another message to the same actor.
* Soft pause: when the trainer publishes version ``v``, each generator finishes the batch it is
  generating with the weights it started with, applies the delta (``DeltaReceiver.update``,
  bit-exact, all or nothing), then continues. Samples carry the version that generated them.
* Staleness: the buffer drops (and counts) samples more than ``--max-staleness`` versions older
  than the trainer's newest version; rollouts pause while the buffer already holds enough fresh
  samples (back-pressure). Optional truncated importance sampling (``--tis-cap``) corrects for
  the lag and for bf16 generation using the stored generation log-probs.
* ``--engine vllm``: each replica runs a vLLM OpenAI server (``.venv-vllm``) that its actor starts
  and stops (:mod:`recipes.grpo.vllm_server`); versions reach it through vLLM's RL routes and the
  ``deltasync`` backend, staged in the background and committed under running
  rollouts (``--interrupt keep``, :mod:`recipes.grpo.inflight`); every token carries
  the version that produced it (``token_version``), and staleness is bounded by a sample's oldest
  token.
* Faults: a generator replica that dies is reported with its pid and the error, and the run
  continues on the remaining replicas; when none is left, or the trainer fails, or any call
  exceeds ``--call-timeout``, or the run cannot start (a store it cannot reach, an engine that does
  not come up: ``status`` "setup_failed"), the run stops with a message and exit status 1 (never
  a hang).
* One live run per run folder: a run holds ``runs/<run-name>`` (:mod:`recipes.grpo.rundir`), and a
  second run with the same ``--run-name`` and ``--runs-dir`` refuses to start, changing nothing.

Outputs in ``runs/<run-name>/``: ``metrics.jsonl`` (one event per line: ``publish``, ``update``,
``rollout``, ``step``, ``generator_lost``, ...), ``summary.json``, ``reward.png``, ``sync.png``,
``lag.png`` (trained tokens by version lag), ``logs/`` (vLLM server logs),
``weights/`` (at the end: ``trainer.safetensors``, the policy as trained, and ``generator<i>.safetensors``,
each live HF generator's weights as served), ``warmstart/`` (the cached supervised warm start) and
``bucket/`` (the default store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from recipes.grpo.config import GRPOConfig
from recipes.grpo.vllm_server import free_port
from torch_deltasync.bucket import clear_local_bucket
from torch_deltasync.cli import HelpFormatter

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_START_S = 900.0  # generator setup with --engine vllm: the server's start timeout plus its setup
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "reward.png", "sync.png", "lag.png")  # under runs/<name>/

log = logging.getLogger("recipes.async_grpo")


# --- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = GRPOConfig()
    p = argparse.ArgumentParser(
        prog="python -m recipes.async_grpo",
        description="Async GRPO on Monarch actor meshes; trainer -> generators weight sync by lossless deltas.",
        formatter_class=HelpFormatter,  # the deltasync command's: no '(default: None)' after a help that says it
    )
    a = p.add_argument
    a("--run-name", default=d.run_name, help="run folder name under --runs-dir")
    a("--runs-dir", default=d.runs_dir, help="parent folder of run folders")
    a("--bucket", default=d.bucket, help="store path or URI (default: embedded local bucket <run>/bucket)")
    a("--steps", type=int, default=d.steps, help="GRPO steps")
    a("--publish-every", type=int, default=d.publish_every, help="publish a version every N GRPO steps")
    a("--max-staleness", type=int, default=d.max_staleness, help="max policy lag (versions) of a trained sample")
    a("--trainer-procs", type=int, default=d.trainer_procs, help="trainer processes (FSDP2 over gloo when > 1)")
    a("--generators", type=int, default=d.generators, help="generator replicas (one process each)")
    a("--lr", type=float, default=d.lr, help="GRPO Adam learning rate")
    a("--seed", type=int, default=d.seed, help="random seed")
    a("--model", dest="model_path", default=d.model_path, help="local Hugging Face checkpoint instead of the built-in Qwen3")
    a("--hidden-size", type=int, default=d.hidden_size, help="width of the built-in Qwen3")
    a("--layers", dest="num_layers", type=int, default=d.num_layers, help="layers of the built-in Qwen3")
    a("--digits", type=int, default=d.digits, help="digits per sorting prompt")
    a("--warmstart-steps", type=int, default=d.warmstart_steps, help="supervised warm-start steps (0: none)")
    a("--warmstart-noise", type=float, default=d.warmstart_noise, help="digit error rate of the warm-start demonstrator")
    a("--train-batch", type=int, default=d.train_batch, help="samples per GRPO step")
    a("--minibatches", type=int, default=d.minibatches, help="optimizer steps per GRPO step")
    a("--prompts-per-batch", type=int, default=d.prompts_per_batch, help="prompts per generator batch")
    a("--group-size", type=int, default=d.group_size, help="completions per prompt")
    a("--temperature", type=float, default=d.temperature, help="sampling temperature")
    a("--tis-cap", type=float, default=d.tis_cap,
      help="truncated importance-sampling cap on pi_old/pi_gen; 0 turns the correction off")
    a("--anchor-every", type=int, default=d.anchor_every, help="full anchor every N versions (0: first only)")
    a("--codec", default=d.codec, help="delta codec")
    a("--engine", "--generator-backend", dest="generator_backend", default=d.generator_backend,
      help="generator engine: hf (transformers in the replica), vllm (a vLLM server per replica, .venv-vllm), "
           "vllm-offline (in-process vllm.LLM, GPU)")
    a("--interrupt", default=d.interrupt, choices=["keep", "drain", "abort"],
      help="rollouts in flight at a new version: keep (continue on the new weights), drain (finish first), "
           "abort (stop, re-submit with their prefix on the new weights); default: keep with vllm, drain with hf")
    a("--sync-poll-ms", type=float, default=d.sync_poll_ms,
      help="keep/abort: how often a generator looks for a newly staged version while its rollouts run")
    a("--sync-lag", type=int, default=d.sync_lag,
      help="keep/abort: commit in flight once the newest staged version is this many versions ahead (1: every version)")
    a("--vllm-python", default=d.vllm_python, help="python of the vLLM environment; None: .venv-vllm/bin/python")
    a("--max-buffered", type=int, default=d.max_buffered, help="fresh buffered samples at which rollouts pause (default: train batch)")
    a("--call-timeout", dest="call_timeout_s", type=float, default=d.call_timeout_s, help="seconds before an unanswered actor call stops the run")
    a("--kill-generator", type=int, default=None, help="fault injection: SIGKILL this generator replica ...")
    a("--kill-at-step", type=int, default=None, help="... at this GRPO step")
    a("--kill-target", default=d.kill_target, choices=["actor", "server"],
      help="... its actor process, or (--engine vllm) its vLLM server")
    a("--log-every", type=int, default=1, help="print a step line every N steps")
    a("--no-progress", action="store_true", help="no progress bars (logs and CI)")
    return p


def config_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> GRPOConfig:
    """The run's :class:`GRPOConfig`; an invalid option exits with a usage error (``parser.error``)."""
    parser = parser or build_parser()
    fields = set(GRPOConfig.__dataclass_fields__)
    kw = {k: v for k, v in vars(ns).items() if k in fields}
    if kw.get("tis_cap") is not None:
        if kw["tis_cap"] < 0:
            parser.error(f"--tis-cap must be >= 0 (0 turns the correction off), got {kw['tis_cap']}")
        if kw["tis_cap"] == 0:
            kw["tis_cap"] = None
    try:
        cfg = GRPOConfig(**kw)
        cfg.check_environment()
        return cfg
    except ValueError as e:
        parser.error(str(e))


# --- the controller --------------------------------------------------------------------------------


class RunAborted(RuntimeError):
    """The run cannot start or continue (its folder is in use, a setup failure, trainer failure, no
    generator left, timeout); the message says why."""


def _first_line(e: BaseException) -> str:
    """``Type: message`` on one line (Monarch's supervision errors span several), at most ~400 characters."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and "Traceback" in text:  # a remote error: its last line is the exception itself
        return f"{type(e).__name__}: {lines[-1][:400]}"
    detail = " ".join(text.split())
    return f"{type(e).__name__}: {detail[:400]}"


class Controller:
    """Drives one run: spawns the meshes, runs the rollout and train loops, writes the outputs."""

    def __init__(self, cfg: GRPOConfig, *, progress: bool = True, log_every: int = 1) -> None:
        self.cfg = cfg
        self.progress = progress
        self.log_every = max(1, log_every)
        self.run_dir = cfg.run_dir
        self.latest_version = 0
        self.step = 0
        self.stopping = False
        self.stopped_by = "Ctrl-C"  # or "SIGTERM" (main)
        self.abort: str | None = None
        self.alive: list[bool] = []
        self.gen_pids: list[int] = []
        self.gen_version: list[int | None] = []
        self.lost: list[dict[str, Any]] = []
        self.fresh = 0
        self.pending_apply_ms: list[float] = []
        self.samples_generated = 0
        self.server_pids: list[int] = []
        self.bar = None
        self.metrics = None
        self.t_start = time.perf_counter()
        self.store_info: dict[str, str] = {}
        self.lease = None  # the run folder's (recipes.grpo.rundir)
        self.busy: set[str] = set()  # meshes whose setup is still running

    # -- output helpers -------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    async def call(self, fut, what: str, timeout: float | None = None):
        """Await a Monarch future; after ``timeout`` seconds raise ``TimeoutError`` naming the call (no hang)."""
        timeout = self.cfg.call_timeout_s if timeout is None else timeout
        try:
            return await _within(fut, timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError(f"{what} did not answer within {timeout:g} s") from None

    # -- faults ---------------------------------------------------------------------------------

    def _fault_hook(self, failure) -> None:
        # Monarch calls this for failures of meshes the client owns; the default exits the process.
        # We keep running: the affected calls fail (SupervisionError) and the loops report them.
        self.metrics.write("supervision_event", detail=str(failure)[:2000])

    def lose_generator(self, i: int, err: BaseException) -> None:
        if not self.alive[i]:
            return
        self.alive[i] = False
        n = sum(self.alive)
        rec = {"generator": i, "pid": self.gen_pids[i], "step": self.step, "error": _first_line(err)}
        self.lost.append(rec)
        self.metrics.write("generator_lost", **rec, alive=n)
        if n:
            self.say(f"!! generator {i} (pid {rec['pid']}) lost at GRPO step {self.step}: {rec['error']}; "
                     f"continuing with {n} of {len(self.alive)} replicas")
        else:
            self.abort = (f"all {len(self.alive)} generator replicas are lost (last: generator {i}, pid {rec['pid']}, "
                          f"at GRPO step {self.step}: {rec['error']})")
            self.say(f"!! {self.abort}; stopping")
        self.sample_event.set()

    # -- loops ----------------------------------------------------------------------------------

    async def rollout_loop(self, i: int) -> None:
        """Replica ``i``: [apply the newest version] -> generate a batch -> add it to the buffer, until stopped.

        A failure of the replica (dead process, endpoint error, timeout) loses this replica only;
        a failure of the replay buffer stops the run.
        """
        cfg = self.cfg
        gen = self.gens.slice(procs=i)
        batch_index = 0
        while not self.stopping and self.abort is None:
            while self.fresh >= cfg.buffered_limit and not self.stopping and self.abort is None:
                self.space_event.clear()  # back-pressure: the trainer has enough fresh samples
                await _wait(self.space_event, 0.5)
            if self.stopping or self.abort is not None:
                return
            try:
                target = self.latest_version
                held = self.gen_version[i]
                # drain: apply the newest version between batches. keep/abort: the generator commits
                # staged versions itself while rollouts run (from the batch's first one on); it is brought
                # up to date here only at the start and when it fell behind the staleness bound.
                behind = held is None or held < target if cfg.interrupt_mode == "drain" else \
                    held is None or target - held > cfg.max_staleness
                if behind:
                    # Soft pause: the previous batch has finished; apply the delta, then go on.
                    st = await self.call(gen.update_weights.call_one(target), f"generator {i} update_weights({target})")
                    self.gen_version[i] = st["version"]
                    rec = self.metrics.write("update", generator=i, **st)
                    if rec.get("apply_ms") is not None:
                        self.pending_apply_ms.append(rec["apply_ms"])
                out = await self.call(gen.generate.call_one(batch_index), f"generator {i} generate")
            except Exception as e:  # noqa: BLE001 - this replica is gone or broken; the others go on
                if not self.stopping:
                    self.lose_generator(i, e)
                return
            batch_index += 1
            if self.stopping:
                return
            n = len(out["batch"]["reward"])
            for st in out["syncs"]:  # versions committed while this batch was generated
                self.metrics.write("update", generator=i, in_batch=True, **st)
            self.gen_version[i] = out["version_end"]
            self.metrics.write("rollout", generator=i, version=out["version"], version_end=out["version_end"],
                               reward=out["reward_mean"], gen_ms=out["gen_ms"], samples=n, syncs=len(out["syncs"]),
                               resubmitted=out["resubmitted"])
            self.samples_generated += n
            try:
                st = await self.call(self.rb.extend.call_one(out["batch"]), "replay buffer extend")
            except Exception as e:  # noqa: BLE001
                self.abort = f"the replay buffer failed: {_first_line(e)}"
                self.sample_event.set()
                return
            self.fresh = st["fresh"]
            self.sample_event.set()

    async def next_batch(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.monotonic()
        while True:
            if self.abort is not None:
                raise RunAborted(self.abort)
            got = await self.call(self.rb.sample.call_one(cfg.train_batch, self.latest_version), "replay buffer sample")
            self.fresh = got["stats"]["fresh"]  # stale samples may just have been dropped: wake rollouts
            self.space_event.set()
            if got["batch"] is not None:
                return got
            if time.monotonic() - t0 > cfg.sample_timeout_s:
                raise RunAborted(f"no batch of {cfg.train_batch} fresh samples within {cfg.sample_timeout_s:.0f} s "
                                 f"(generators alive: {sum(self.alive)})")
            self.sample_event.clear()
            await _wait(self.sample_event, 0.5)

    def inject_fault(self) -> None:
        cfg = self.cfg
        if cfg.kill_generator is None or self.step != cfg.kill_at_step:
            return
        i = cfg.kill_generator
        what = "generator"
        pid = self.gen_pids[i]
        if cfg.kill_target == "server":
            what, pid = "the vLLM server of generator", self.gen_server_pids[i][-1]
        self.say(f"!! fault injection: SIGKILL {what} {i} (pid {pid}) at GRPO step {self.step}")
        self.metrics.write("fault_injected", generator=i, pid=pid, step=self.step, target=cfg.kill_target)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def train_loop(self) -> None:
        from recipes.grpo.inflight import tokens_by_lag
        from recipes.grpo.report import STEP_HEADER, step_line

        cfg = self.cfg
        rewards: list[float] = []
        self.say(STEP_HEADER)
        task = asyncio.current_task()
        for step in range(cfg.steps):
            if _cancelling(task):
                raise asyncio.CancelledError  # a Ctrl-C whose cancellation an await dropped (see _within)
            self.step = step
            if not self.owns_folder():  # paused past its lease: another run took the folder
                raise RunAborted(f"the run folder {self.run_dir} was taken over by another run; this one stops "
                                 "without touching it")
            self.inject_fault()
            t0 = time.perf_counter()
            got = await self.next_batch()
            wait_ms = (time.perf_counter() - t0) * 1e3
            batch = got["batch"]
            publish = (step + 1) % cfg.publish_every == 0 or step == cfg.steps - 1
            try:
                res = await self.call(self.trainer.train_step.call(batch, step, publish), f"trainer step {step}")
            except Exception as e:  # noqa: BLE001
                raise RunAborted(f"the trainer failed at GRPO step {step}: {_first_line(e)}") from e
            out = res.item(procs=0)
            lag = batch["lag"].float()
            by_lag = tokens_by_lag(batch["token_version"], batch["response_mask"], self.latest_version)
            pub = out.pop("publish", None)
            if pub is not None:
                self.latest_version = pub["version"]
                self.metrics.write("publish", step=step, **pub)
            apply_ms = sum(self.pending_apply_ms) / len(self.pending_apply_ms) if self.pending_apply_ms else None
            self.pending_apply_ms = []
            reward = float(batch["reward"].mean())
            rewards.append(reward)
            rec = self.metrics.write(
                "step", step=step, version=self.latest_version, reward=reward, reward_std=float(batch["reward"].std()),
                lag_max=int(lag.max()), lag_mean=float(lag.mean()), wait_ms=wait_ms, apply_ms=apply_ms,
                generators_alive=sum(self.alive), fresh=self.fresh, dropped_stale=got["stats"]["dropped_stale"],
                tokens_by_lag=by_lag, publish=pub, **out,
            )
            if step % self.log_every == 0 or step == cfg.steps - 1:
                self.say(step_line(rec))
            if self.bar is not None:
                recent = rewards[-20:]
                self.bar.set_postfix(reward=f"{sum(recent) / len(recent):.3f}", v=self.latest_version,
                                     gens=sum(self.alive))
                self.bar.update()

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """The whole run; returns the summary. On Ctrl-C (the task is cancelled) the meshes are shut
        down first (the generators stop their engine servers), a summary of the steps done so far
        is written (``status`` "interrupted", no bit-exactness check), then the cancellation goes on.

        Raises:
            RunAborted: the run folder is another live run's (nothing in it is changed), or the run
                could not start (the meshes are shut down and the summary has ``status``
                "setup_failed"), or it stopped (no generator left, the trainer failed, a timeout)."""
        try:
            return await self._run()
        except asyncio.CancelledError:
            self.stopping = True
            self.say("!! interrupted: stopping the generators' engines and the meshes")
            await self.shutdown()
            if self.metrics is not None:
                done = len(self.metrics.of("step"))
                self.write_summary({"status": "interrupted", "message": f"interrupted ({self.stopped_by}) after {done} GRPO "
                                    "steps", "bit_exact": None, **self.progress_so_far()})
            raise
        finally:
            if self.lease is not None:  # the run folder is free for the next run
                self.lease.release()

    async def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.t_start = time.perf_counter()
        from recipes.grpo.report import MetricsLog
        from recipes.grpo.rundir import RunFolderInUse, claim_run_folder

        prefix = f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        try:  # before anything in the folder is removed: it may be a live run's
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.lease = claim_run_folder(self.run_dir, prefix)
        except RunFolderInUse as e:
            raise RunAborted(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a folder that cannot be made or written
            raise RunAborted(f"cannot use the run folder {self.run_dir}: {_first_line(e)}") from None
        for old in RUN_OUTPUTS:  # a previous run's in this folder would pass for this one's
            (self.run_dir / old).unlink(missing_ok=True)
        shutil.rmtree(self.run_dir / "weights", ignore_errors=True)  # so would its weights (another engine's too)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.metrics.write("config", **cfg.to_dict())
        self.sample_event = asyncio.Event()
        self.space_event = asyncio.Event()
        try:
            ws, t0_info = await self.setup(prefix)
        except Exception as e:  # noqa: BLE001 - any failure before the first step: say why, stop everything
            message = f"setup failed: {_first_line(e)}"
            self.metrics.write("setup_failed", error=message)
            await self.shutdown()
            self.write_summary({"status": "setup_failed", "message": message, "bit_exact": None,
                                **self.progress_so_far()})
            raise RunAborted(message) from e

        status, message = "ok", None
        t_train = time.perf_counter()
        tasks: list[asyncio.Task] = []
        try:
            if self.progress:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=cfg.steps, desc="GRPO", unit="step", dynamic_ncols=True)
            tasks = [asyncio.create_task(self.rollout_loop(i)) for i in range(cfg.generators)]
            await self.train_loop()
        except (RunAborted, TimeoutError) as e:
            status, message = "aborted", str(e)
        finally:
            self.stopping = True
            self.sample_event.set()
            self.space_event.set()
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            if tasks:
                done, pending = await asyncio.wait(tasks, timeout=min(60.0, cfg.call_timeout_s))
                for t in pending:
                    t.cancel()
        train_s = time.perf_counter() - t_train

        bit_exact, digests = None, {}  # None: not checked (the run stopped first)
        if status == "ok":
            try:
                bit_exact, digests = await self.final_check()
            except Exception as e:  # noqa: BLE001
                status, message = "aborted", f"final bit-exactness check failed: {_first_line(e)}"
        if message:
            self.say(f"!! run stopped: {message}")
        rb_stats = {}
        try:
            rb_stats = await self.call(self.rb.stats.call_one(), "replay buffer stats", timeout=30)
        except Exception:  # noqa: BLE001
            pass
        await self.shutdown()

        return self.write_summary({
            "dropped_stale": rb_stats.get("dropped_stale"),
            "bit_exact": bit_exact,
            "status": status,
            "message": message,
            "samples_trained": rb_stats.get("sampled"),
            "buffer_overflow": rb_stats.get("overflow"),
            "params": t0_info["params"],
            "warm_start": ws,
            "digests": digests,
            "train_s": train_s,
            **self.progress_so_far(),
        })

    async def setup(self, prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Open the store, spawn the meshes, warm-start (or load the cache) and set up the trainer and
        the generators; returns ``(warm start info, trainer rank 0's setup info)``."""
        cfg = self.cfg
        if cfg.bucket is None:
            bucket_path = self.run_dir / "bucket"
            dropped = clear_local_bucket(bucket_path)  # ours: a fresh chain per run (never a live run's)
            if dropped:
                print(f"emptied {bucket_path}: {dropped} versions of earlier runs deleted")
            bucket = str(bucket_path.resolve())
        else:
            # Every process must find the same folder, whatever its working directory.
            bucket = cfg.bucket if "://" in str(cfg.bucket) else str(Path(cfg.bucket).resolve())
        self.bucket, self.prefix = bucket, prefix
        self.store_info = {"bucket": bucket, "prefix": prefix}

        import torch
        import monarch.actor as ma
        from monarch.actor import this_host, this_proc

        from recipes.grpo.actors import GeneratorActor, ReplayBufferActor, TrainerActor
        from recipes.grpo.policy import build_tokenizer, warm_start, warm_start_path

        ma.unhandled_fault_hook = self._fault_hook
        # Spawn first: the processes boot (imports) while the warm start runs here.
        t0 = time.perf_counter()
        self.trainer_procs = this_host().spawn_procs(per_host={"procs": cfg.trainer_procs}, name="trainer")
        self.gen_procs = this_host().spawn_procs(per_host={"procs": cfg.generators}, name="generators")
        warm_path = warm_start_path(cfg)
        self.trainer = self.trainer_procs.spawn("trainer", TrainerActor, cfg, str(warm_path.resolve()), bucket,
                                                prefix, free_port())
        self.gens = self.gen_procs.spawn("generator", GeneratorActor, cfg, bucket, prefix)

        torch.set_num_threads(1)  # several busy processes share few cores; extra threads only spin
        tok = build_tokenizer(cfg)
        task = asyncio.current_task()  # a first Ctrl-C cancels it: the warm start (synchronous here) stops then
        try:
            _, ws = warm_start(cfg, tok, progress=self.progress,
                               should_stop=lambda: _cancelling(task))
        except KeyboardInterrupt:  # the task's cancellation is pending: take it at an await, so that
            await asyncio.sleep(0)  # run()'s shutdown awaits are not cancelled in turn
            raise asyncio.CancelledError from None
        # The replay buffer lives in this process, its actor on a Monarch thread. Spawn it only once
        # this thread's imports are done: transformers imported from two threads at once can hand
        # one of them a half-initialised module ("cannot import name ... from transformers...").
        import recipes.grpo.buffer  # noqa: F401 - imported here, so the actor's __init__ imports nothing

        self.rb = this_proc().spawn("replay_buffer", ReplayBufferActor, cfg)
        self.metrics.write("warm_start", **ws)
        took = "cached" if ws["cached"] else f"{ws['seconds']:.1f} s"
        if ws.get("rebuilt"):
            took += f" ({ws['rebuilt']}; rebuilt)"
        self.say(f"warm start: {took}; reward of greedy answers "
                 f"{ws['reward_greedy']:.3f}, of sampled answers {ws['reward_sampled']:.3f}")

        setup_t, setup_g = await self._setup_meshes()
        t0_info = setup_t.item(procs=0)
        gens = sorted(setup_g.values(), key=lambda x: x["index"])
        self.gen_pids = [g["pid"] for g in gens]
        self.gen_server_pids = [g.get("server_pids", []) for g in gens]
        self.server_pids = [p for g in gens for p in g.get("server_pids", [])]
        self.alive = [True] * cfg.generators
        self.gen_version = [None] * cfg.generators
        self.metrics.write("publish", step=-1, **t0_info["publish"])
        self.metrics.write("setup", trainer_pids=[v["pid"] for v in setup_t.values()], generator_pids=self.gen_pids,
                           server_pids=self.server_pids, server_dirs=[g["server_dir"] for g in gens if g.get("server_dir")],
                           params=t0_info["params"], seconds=time.perf_counter() - t0,
                           warm_up_s=[g.get("warm_up_s") for g in gens],
                           trainer_times=[v["times"] for v in setup_t.values()])
        self.say(f"policy: {t0_info['params']:,} parameters; trainer procs {cfg.trainer_procs} "
                 f"(pids {[v['pid'] for v in setup_t.values()]}); generator pids {self.gen_pids}; "
                 f"store {bucket} / {prefix}")

        return ws, t0_info

    async def _setup_meshes(self) -> tuple[Any, Any]:
        """``setup`` of the trainer and of the generator mesh, concurrently. If one fails, the other
        is no longer waited for. ``self.busy`` keeps the meshes whose setup is still running, so that
        :meth:`shutdown` stops their processes instead of queueing a ``close`` behind it."""
        cfg = self.cfg
        self.busy = {"trainer", "generators"}

        async def setup(mesh: str, fut, what: str, timeout: float | None = None):
            try:
                out = await self.call(fut, what, timeout)
            except TimeoutError:
                raise  # (still running there)
            except Exception:
                self.busy.discard(mesh)
                raise
            self.busy.discard(mesh)
            return out

        tasks = [
            asyncio.ensure_future(setup("trainer", self.trainer.setup.call(), "trainer setup")),
            # a vLLM server may take minutes to come up on a busy CPU (it has its own start timeout)
            asyncio.ensure_future(setup("generators", self.gens.setup.call(), "generator setup",
                                        max(cfg.call_timeout_s, SERVER_START_S) if cfg.generator_backend == "vllm"
                                        else None)),
        ]
        try:
            setup_t, setup_g = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return setup_t, setup_g

    def progress_so_far(self) -> dict[str, Any]:
        """The summary fields the controller itself knows at any time (also after a Ctrl-C)."""
        return {
            "samples_generated": self.samples_generated,
            "generators": self.cfg.generators,
            "generators_alive": sum(self.alive),
            "generators_lost": self.lost,
            "trainer_procs": self.cfg.trainer_procs,
            "lr": self.cfg.lr,
            "store": self.store_info,
            "wall_s": time.perf_counter() - self.t_start,
        }

    def owns_folder(self) -> bool:
        """Whether this run still holds its run folder (a store error reads as yes)."""
        try:
            return self.lease is None or self.lease.holds()
        except Exception:  # noqa: BLE001 - the folder's record could not be read: carry on
            return True

    def write_summary(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` (:func:`recipes.grpo.report.summarize` of the metrics so far and
        ``extra``) and the plots; returns the summary."""
        from recipes.grpo.report import plot_lag, plot_reward, plot_sync, summarize

        summary = summarize(self.metrics, cfg=self.cfg.to_dict(), extra=extra)
        if not self.owns_folder():
            self.say(f"!! the run folder {self.run_dir} belongs to another run now: no summary or plots written")
            return summary
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        if not summary["steps"]:  # nothing to plot (a Ctrl-C before the first step)
            return summary
        try:
            plot_reward(self.metrics, self.run_dir / "reward.png")
            plot_sync(self.metrics, self.run_dir / "sync.png")
            plot_lag(self.metrics, self.run_dir / "lag.png")
        except Exception as e:  # noqa: BLE001 - plots are a convenience; the summary is the record
            self.say(f"(plots skipped: {type(e).__name__}: {e})")
        return summary

    async def final_check(self) -> tuple[bool, dict[str, Any]]:
        """Bring every live generator to the newest version and compare bf16 bits with the trainer."""
        v = self.latest_version
        trainer_digest = (await self.call(self.trainer.digest.call(), "trainer digest")).item(procs=0)
        digests: dict[str, Any] = {"version": v, "trainer": trainer_digest}
        # The weights themselves, for checks outside the recipe: <run_dir>/weights/trainer.safetensors
        # (fp32, as trained) and generator<i>.safetensors (bf16, as served; HF backend only).
        folder = self.run_dir / "weights"
        folder.mkdir(parents=True, exist_ok=True)
        await self.call(self.trainer.save_weights.call(str(folder / "trainer.safetensors")), "trainer weights")
        ok = any(self.alive)
        oracle = None
        for i, alive in enumerate(self.alive):
            if not alive:
                continue
            g = self.gens.slice(procs=i)
            try:
                st = await self.call(g.update_weights.call_one(v), f"generator {i} final update")
                self.metrics.write("update", generator=i, final=True, **st)
                fp = await self.call(g.fingerprint.call_one(), f"generator {i} fingerprint")
            except Exception as e:  # noqa: BLE001 - a replica lost at the very end
                self.lose_generator(i, e)
                continue
            if "digest" in fp:  # bitwise: sha256 of the bf16 bit patterns, same as the trainer's
                same = fp["version"] == v and fp["digest"] == trainer_digest
                digests[f"generator{i}"] = fp["digest"]
            else:  # a vLLM engine: checksums checked against the manifest at every commit, and outputs
                if oracle is None and "probe" in fp:
                    oracle = await self.fresh_engine_probe(folder / "trainer.safetensors", trainer_digest)
                    digests["fresh_engine"] = oracle["digest"]
                same = fp["version"] == v and fp.get("checksums_verified") == v
                if "probe" in fp:
                    same = same and oracle["digest"] == trainer_digest and fp["probe"] == oracle["probe"]
                digests[f"generator{i}"] = (f"checksums verified at version {fp.get('checksums_verified')}; outputs "
                                            f"{'equal' if fp.get('probe') == (oracle or {}).get('probe') else 'DIFFER from'} "
                                            "a fresh engine on the trainer's weights")
            ok = ok and same
        ok = ok and any(self.alive)
        self.metrics.write("bit_exact", ok=ok, **digests)
        for i, alive in enumerate(self.alive):
            if alive:
                await self.call(self.gens.slice(procs=i).save_weights.call_one(str(folder / f"generator{i}.safetensors")),
                                f"generator {i} weights")
        return ok, digests

    async def fresh_engine_probe(self, weights: Path, trainer_digest: str) -> dict[str, Any]:
        """The probe outputs of a fresh vLLM server (no weight transfer) started from the trainer's
        weights cast to bf16, and the sha256 of that checkpoint's bits (it must equal the trainer's)."""
        from recipes.grpo.generators import fresh_engine_probe

        return await asyncio.to_thread(fresh_engine_probe, self.cfg, weights, self.run_dir / "logs" / "vllm-fresh.log")

    async def shutdown(self) -> None:
        """Stop every live generator's engine (``close``), then the trainer and both meshes; best
        effort, once. A generator process that is gone took its engine server with it (the server's
        supervisor ends it when the actor's pipe closes), and so does one whose mesh is still in its
        ``setup`` (a failed setup of the other mesh): its processes are stopped without a ``close``,
        which would wait behind the setup."""
        if getattr(self, "_shut", False):
            return
        self._shut = True
        busy = self.busy
        steps = []
        if hasattr(self, "gens") and "generators" not in busy:
            steps += [(f"generator {i} close", lambda i=i: self.gens.slice(procs=i).close.call_one())
                      for i, alive in enumerate(self.alive or [True] * self.cfg.generators) if alive]
        if hasattr(self, "trainer"):
            if "trainer" not in busy:
                steps.append(("trainer close", lambda: self.trainer.close.call()))
            steps.append(("trainer procs stop", lambda: self.trainer_procs.stop()))
        if hasattr(self, "gen_procs"):
            steps.append(("generator procs stop", lambda: self.gen_procs.stop()))
        for what, fut in steps:
            try:
                await self.call(fut(), what, timeout=60)
            except Exception as e:  # noqa: BLE001 - best effort; the summary is already complete
                if hasattr(self, "metrics"):
                    self.metrics.write("shutdown_error", what=what, error=_first_line(e))


def _print_summary(s: dict[str, Any]) -> None:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\n== summary ({s['status']}) ==")
    print(f"steps {s['steps']}, versions published {s['versions_published']}, wall {s['wall_s']:.0f} s "
          f"(GRPO {s['train_s']:.0f} s, warm start {s['warm_start'].get('seconds', 0):.0f} s)")
    print(f"reward: first 10% {f(s['reward_first'], '.3f')} -> last 10% {f(s['reward_last'], '.3f')}")
    print(f"sync: mean density {f(s['mean_density'], '.2%')}, bytes {f(s['bytes_ratio'], '.4f')} of full copies, "
          f"publish {f(s['mean_publish_ms'], '.1f')} ms, apply {f(s['mean_apply_ms'], '.1f')} ms "
          f"(whole update {f(s['mean_update_ms'], '.1f')} ms)")
    print(f"staleness: max policy lag {s['max_policy_lag']} (bound {s['max_staleness']}), dropped stale "
          f"{s['dropped_stale']}; generators alive {s['generators_alive']}/{s['generators']}")
    print(f"engine {s['engine']} ({s['interrupt']}): syncs {s['syncs']} ({s['inflight_syncs']} in flight, "
          f"{s['syncs_across_rollouts']} with rollouts generating across them), stall mean "
          f"{f(s['mean_stall_ms'], '.1f')} / max {f(s['max_stall_ms'], '.1f')} ms, "
          f"{f(None if s['sync_time_frac'] is None else 100 * s['sync_time_frac'], '.2f')}% of generation time; "
          f"trained tokens by version lag {s['tokens_by_lag']}")
    exact = {True: "YES", False: "NO"}.get(s["bit_exact"], "not checked")  # (the run stopped: see the message)
    print(f"bit-exact (every live generator vs trainer bf16): {exact}")
    if s.get("message"):
        print(f"message: {s['message']}")


def _cancelling(task: "asyncio.Task | None") -> bool:
    """Whether ``task`` has a cancellation pending (a Ctrl-C; ``Task.cancelling``, Python 3.11+)."""
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


async def _within(aw, seconds: float):
    """``await aw``, raising ``TimeoutError`` after ``seconds``. ``asyncio.timeout``, not
    ``asyncio.wait_for``: on Python 3.11, ``wait_for`` returns the result of an inner wait that
    finishes just as the task is cancelled and drops the cancellation, so a Ctrl-C could be lost.
    Python 3.10 has only ``wait_for``."""
    if sys.version_info < (3, 11):
        return await asyncio.wait_for(aw, seconds)
    async with asyncio.timeout(seconds):
        return await aw


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Wait for ``event`` at most ``seconds`` (:func:`_within`)."""
    try:
        await _within(event.wait(), seconds)
    except (TimeoutError, asyncio.TimeoutError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    cfg = config_from_args(ns, parser)
    # Child processes import the recipe by module name and use one thread each.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("torch._library.opaque_object", "torch._opaque_base", "torch.utils.cpp_extension", "torchrl"):
        logging.getLogger(noisy).setLevel(logging.ERROR)  # import-time deprecation chatter
    ctl = Controller(cfg, progress=not ns.no_progress and sys.stderr.isatty(), log_every=ns.log_every)

    def terminate(signum: int, frame: Any) -> None:  # (timeout, systemd, Kubernetes, Slurm): as Ctrl-C
        ctl.stopped_by = "SIGTERM"
        signal.raise_signal(signal.SIGINT)  # asyncio.run cancels the run on SIGINT

    signal.signal(signal.SIGTERM, terminate)
    try:
        summary = asyncio.run(ctl.run())
    except RunAborted as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):  # (Python 3.10: a Ctrl-C in the warm start)
        done = cfg.run_dir / "summary.json"
        print(f"interrupted ({ctl.stopped_by}){f'; summary of the steps done: {done}' if done.exists() else ''}",
              file=sys.stderr)
        return 143 if ctl.stopped_by == "SIGTERM" else 130
    _print_summary(summary)
    print(f"outputs: {cfg.run_dir}/{', '.join(RUN_OUTPUTS)}")
    return 0 if summary["status"] == "ok" and summary["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
