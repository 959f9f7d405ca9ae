"""The Monarch actors of the async GRPO recipe: trainer, generator, replay buffer.

Monarch 0.7 dispatches one message at a time per actor (a plain ``@endpoint`` runs to completion
before the next message starts), so each actor here is driven by exactly one controller task and
nothing waits on a message to the same actor: no endpoint can deadlock on another. The soft pause
falls out of that: a generator's in-flight ``generate`` always finishes with the weights it started
with; the controller then sends ``update_weights`` (apply the newest delta) and the next
``generate``. All endpoints are ``async def`` (Monarch refuses actors that mix sync and async
endpoints) and none is named after an ``ActorMesh`` attribute (``stop``, ``size``, ...). Heavy or
fallible initialisation lives in ``setup`` so that errors come back to the caller as
``ActorError`` instead of killing the process.

Batches travel as plain ``{name: tensor}`` dicts (see :class:`.buffer.VersionedReplayBuffer` for
the keys and shapes).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch
from monarch.actor import Actor, current_rank, endpoint

from .config import GRPOConfig

__all__ = ["TrainerActor", "GeneratorActor", "ReplayBufferActor", "to_tensordict", "from_tensordict"]

# Keys of a rollout batch that the trainer reads.
TRAIN_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "gen_logprobs", "advantage")


def to_tensordict(batch: dict[str, torch.Tensor]):
    """A rollout batch dict (``reward``/``done`` at the top level) as the buffer's TensorDict."""
    from tensordict import TensorDict

    b = dict(batch)
    n = b["policy_version"].shape[0]
    nxt = TensorDict(reward=b.pop("reward").reshape(n, 1).float(), done=b.pop("done").reshape(n, 1), batch_size=[n])
    b["next"] = nxt
    return TensorDict(b, batch_size=[n])


def from_tensordict(td) -> dict[str, torch.Tensor]:
    """The buffer's TensorDict as a flat dict (``reward`` ``[N]``, ``advantage`` ``[N]``)."""
    out = {k: td.get(k) for k in td.keys() if k != "next"}
    out["reward"] = td.get(("next", "reward")).reshape(-1)
    if "advantage" in out:
        out["advantage"] = out["advantage"].reshape(-1)
    return out


def _threads() -> None:
    # One intra-op thread per process: several processes share few cores, and oversubscribed
    # OpenMP pools spin instead of working.
    torch.set_num_threads(1)


class TrainerActor(Actor):
    """Owns the fp32 policy (FSDP2-sharded over the mesh when it has several procs), runs GRPO
    steps on its shard of each batch and publishes versions with a ``DeltaSender``.

    Args:
        cfg: run configuration.
        warm_path: safetensors file of the warm start.
        bucket: store path or URI; ``prefix``: the run's sub-path in it.
        master_port: TCP port for the gloo process group (several procs only).
    """

    def __init__(self, cfg: GRPOConfig, warm_path: str, bucket: str, prefix: str, master_port: int) -> None:
        self.cfg, self.warm_path, self.bucket, self.prefix, self.port = cfg, warm_path, bucket, prefix, master_port
        self.sender = None

    @endpoint
    async def setup(self) -> dict[str, Any]:
        """Build the policy and optimizer, publish version 0 (an anchor). Returns its publish stats."""
        t0 = time.perf_counter()
        _threads()
        from torch_deltasync import DeltaSender

        from .policy import build_policy, build_tokenizer, load_warm_start, policy_key

        cfg = self.cfg
        times = {"import_s": time.perf_counter() - t0}
        self.rank = current_rank().rank
        self.world = cfg.trainer_procs
        tok = build_tokenizer(cfg)
        model = build_policy(cfg, tok, dtype=torch.float32, seed=cfg.seed)
        load_warm_start(model, self.warm_path, policy_key(cfg))
        numel = sum(p.numel() for p in model.parameters())
        times["build_s"] = time.perf_counter() - t0 - times["import_s"]
        if self.world > 1:
            model = self._shard(model)
        times["shard_s"] = time.perf_counter() - t0 - times["import_s"] - times["build_s"]
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.sender = DeltaSender(model, self.bucket, prefix=self.prefix, anchor_every=cfg.anchor_every or None,
                                  codec=cfg.codec, inference_dtype=torch.bfloat16)
        self.sender.publish()
        times["setup_s"] = time.perf_counter() - t0
        return {"pid": os.getpid(), "rank": self.rank, "publish": self.sender.last_stats.to_dict(),
                "params": numel, "times": times}

    def _shard(self, model):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=self.rank,
                                world_size=self.world)
        mesh = init_device_mesh("cpu", (self.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    @endpoint
    async def train_step(self, batch: dict[str, torch.Tensor], step: int, publish: bool) -> dict[str, Any]:
        """One GRPO step on this rank's rows of ``batch``, then (if ``publish``) a new version.

        Every rank of the mesh must receive the same call (FSDP2 collectives); rank ``r`` trains
        on rows ``r::world``.
        """
        from .loss import grpo_objective, truncated_is_weights
        from .policy import response_logprobs

        cfg = self.cfg
        t0 = time.perf_counter()
        b = {k: batch[k][self.rank::self.world] for k in TRAIN_KEYS}
        pids, pmask, rids, rmask = b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"].bool()
        kw = dict(temperature=cfg.temperature)
        with torch.no_grad():
            old = response_logprobs(self.model, pids, pmask, rids, rmask, **kw)
        weights = truncated_is_weights(old, b["gen_logprobs"], rmask, cfg.tis_cap)
        n = pids.shape[0]
        mb = n // cfg.minibatches
        losses, clip_fracs = [], []
        for i in range(cfg.minibatches):
            sl = slice(i * mb, (i + 1) * mb)
            lp = response_logprobs(self.model, pids[sl], pmask[sl], rids[sl], rmask[sl], **kw)
            loss, st = grpo_objective(lp, old[sl], b["advantage"][sl].float(), rmask[sl],
                                      clip=(1 - cfg.clip_low, 1 + cfg.clip_high), weights=weights[sl])
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            losses.append(float(loss.detach()))
            clip_fracs.append(st["clip_frac"])
        m = rmask.float()
        ntok = m.sum().clamp(min=1)
        raw_w = torch.exp((old - b["gen_logprobs"]).masked_fill(~rmask, 0.0))
        out: dict[str, Any] = {
            "loss": sum(losses) / len(losses),
            "clip_frac": sum(clip_fracs) / len(clip_fracs),
            "is_weight": float((weights * m).sum() / ntok),
            "is_truncated": float(((raw_w > (cfg.tis_cap or float("inf"))).float() * m).sum() / ntok),
            "kl_gen": float(((b["gen_logprobs"] - old) * m).sum() / ntok),
            "train_ms": (time.perf_counter() - t0) * 1e3,
        }
        if publish:
            v = self.sender.publish()
            out["publish"] = self.sender.last_stats.to_dict() if v is not None else None
        return out

    @endpoint
    async def digest(self) -> str:
        """sha256 of the policy's bf16 bit patterns (full tensors; a collective with several procs)."""
        from torch_deltasync.testing import state_digest

        sd = {}
        for name, t in self.model.state_dict().items():
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            sd[name] = t
        return state_digest(sd)

    @endpoint
    async def save_weights(self, path: str) -> None:
        """Write the policy's full tensors as trained (fp32) to a safetensors file (rank 0; a
        collective with several procs), for checks outside the recipe."""
        from safetensors.torch import save_file

        sd = {}
        for name, t in self.model.state_dict().items():
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            sd[name] = t.detach().clone().contiguous()  # clones: tied tensors would share storage
        if current_rank().rank == 0:
            save_file(sd, path)

    @endpoint
    async def close(self) -> None:
        """Flush the sender; leave the process group."""
        if self.sender is not None:
            self.sender.close()
        if self.cfg.trainer_procs > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


class GeneratorActor(Actor):
    """One rollout replica: its own model copy in a generator backend (which follows the run in the
    store), and the task's reward. Rank ``i`` of the generator mesh is replica ``i``.

    Args:
        cfg: run configuration.
        bucket: store path or URI; ``prefix``: the run's sub-path in it.
    """

    def __init__(self, cfg: GRPOConfig, bucket: str, prefix: str) -> None:
        self.cfg, self.bucket, self.prefix = cfg, bucket, prefix

    @endpoint
    async def setup(self) -> dict[str, Any]:
        """Build the backend (random weights) and attach it to the run; no weights are applied yet."""
        _threads()
        from .generators import make_backend
        from .policy import build_tokenizer, max_new_tokens
        from .task import SortTask

        cfg = self.cfg
        self.index = current_rank().rank
        self.tok = build_tokenizer(cfg)
        self.task = SortTask(digits=cfg.digits)
        self.max_new_tokens = max_new_tokens(cfg, self.tok)
        # the backend seeds torch with this: it is also the replica's sampling seed
        self.backend = make_backend(cfg.generator_backend, cfg, self.tok, seed=cfg.seed + 1000 + self.index,
                                    replica=self.index)
        warm_s = None
        try:
            self.backend.attach(self.bucket, self.prefix)
            if hasattr(self.backend, "warm_up"):  # an engine whose first batch is slow: pay it now
                from .policy import group_prompts

                rng = random.Random(f"{cfg.seed}/{self.index}/warm-up")
                pids, pmask, _ = group_prompts(self.task, self.tok, rng, cfg.prompts_per_batch, cfg.group_size)
                warm_s = self.backend.warm_up(pids, pmask, max_new_tokens=self.max_new_tokens)
        except BaseException:
            close = getattr(self.backend, "close", None)
            if close is not None:
                close()
            raise
        return {"pid": os.getpid(), "index": self.index, "server_pids": list(getattr(self.backend, "server_pids", [])),
                "server_dir": getattr(self.backend, "workdir", None), "warm_up_s": warm_s}

    @endpoint
    async def update_weights(self, version: int) -> dict[str, Any]:
        """Apply versions up to ``version`` (bit-exact, all or nothing). Returns the update stats."""
        before = self.backend.version
        t0 = time.perf_counter()
        st = self.backend.update(version)
        # blocked_ms: the replica generated nothing meanwhile (it updates between batches)
        return {**st, "from_version": before, "blocked_ms": (time.perf_counter() - t0) * 1e3}

    @endpoint
    async def generate(self, batch_index: int) -> dict[str, Any]:
        """Sample ``group_size`` completions for each of ``prompts_per_batch`` fresh prompts with
        the weights held now (and, with ``--interrupt keep|abort``, the versions committed while
        they are generated), and score them.

        Returns:
            ``{"batch": {name: tensor}, "version", "version_end", "syncs", "reward_mean", "gen_ms"}``:
            ``version`` / ``version_end`` are those served at the start / end (they differ when
            versions were committed in flight, one record per commit in ``syncs``); ``resubmitted``
            counts rollouts re-submitted with their prefix after an ``abort`` commit; the batch keys
            are those of the replay buffer plus ``token_version`` ``[N, T]`` (int64, the version
            that produced each token, -1 past the end) and top-level ``reward`` / ``done`` ``[N]``.
            ``policy_version`` is the version of each sample's oldest token.
        """
        from .policy import group_prompts, score

        cfg = self.cfg
        version = self.backend.version
        if version is None:
            raise RuntimeError(f"generator {self.index} holds no weights yet; call update_weights first")
        t0 = time.perf_counter()
        rng = random.Random(f"{cfg.seed}/{self.index}/{batch_index}")
        pids, pmask, answers = group_prompts(self.task, self.tok, rng, cfg.prompts_per_batch, cfg.group_size)
        syncs: list[dict[str, Any]] = []
        resubmitted = 0
        if hasattr(self.backend, "generate_versioned"):
            r = self.backend.generate_versioned(pids, pmask, max_new_tokens=self.max_new_tokens,
                                                interrupt=cfg.interrupt_mode)
            rids, rmask, lp, tver, syncs, resubmitted = r.ids, r.mask, r.logprobs, r.token_version, r.syncs, r.resubmitted
        else:  # one version for the whole batch (drain)
            rids, rmask, lp = self.backend.generate(pids, pmask, max_new_tokens=self.max_new_tokens,
                                                    temperature=cfg.temperature)
            tver = torch.where(rmask.bool(), version, -1).long()
        rewards = score(self.task, self.tok, rids, answers)
        n = len(answers)
        first_group = (self.index + 1) * 10**12 + batch_index * cfg.prompts_per_batch
        # A sample's staleness is that of its oldest token: the buffer's gate then bounds every token.
        oldest = torch.where(rmask.bool(), tver, torch.iinfo(torch.long).max).amin(dim=1)
        batch = {
            "prompt_ids": pids, "prompt_mask": pmask, "response_ids": rids, "response_mask": rmask,
            "gen_logprobs": lp, "policy_version": oldest, "token_version": tver,
            "group_id": torch.arange(first_group, first_group + cfg.prompts_per_batch).repeat_interleave(cfg.group_size),
            "reward": rewards.float(), "done": torch.ones(n, dtype=torch.bool),
        }
        return {"batch": batch, "version": version, "version_end": self.backend.version, "syncs": syncs,
                "resubmitted": resubmitted, "reward_mean": float(rewards.mean()), "gen_ms": (time.perf_counter() - t0) * 1e3}

    @endpoint
    async def fingerprint(self) -> dict[str, Any]:
        """The version held and the backend's evidence of its weights (see ``GeneratorBackend``)."""
        return {"version": self.backend.version, **self.backend.fingerprint()}

    @endpoint
    async def close(self) -> None:
        """Stop the backend's engine process, if it has one (the vLLM server)."""
        close = getattr(getattr(self, "backend", None), "close", None)
        if close is not None:
            close()

    @endpoint
    async def save_weights(self, path: str) -> bool:
        """Write the served weights to a safetensors file if the backend holds them in this process
        (``HFGenerator``); returns whether it did."""
        save = getattr(self.backend, "save_weights", None)
        if save is None:
            return False
        save(path)
        return True


class ReplayBufferActor(Actor):
    """Holds the :class:`.buffer.VersionedReplayBuffer` (torchrl) for the whole run.

    Args:
        cfg: run configuration (capacity, staleness bound, group size, seed).
    """

    def __init__(self, cfg: GRPOConfig) -> None:
        import logging

        from .buffer import VersionedReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)

        self.cfg = cfg
        self.buffer = VersionedReplayBuffer(cfg.buffer_capacity, max_staleness=cfg.max_staleness,
                                            group_size=cfg.group_size, seed=cfg.seed)

    def _stats(self) -> dict[str, int]:
        """The buffer stats and ``fresh`` (usable samples for the last consumer version)."""
        return {**self.buffer.stats(), "fresh": self.buffer.num_fresh()}

    @endpoint
    async def extend(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        """Add a generator batch; returns the buffer stats including ``fresh`` (usable samples)."""
        self.buffer.extend(to_tensordict(batch))
        return self._stats()

    @endpoint
    async def sample(self, batch_size: int, consumer_version: int) -> dict[str, Any]:
        """``{"batch", "stats"}``: ``batch_size`` fresh samples for a trainer at ``consumer_version``
        (``None`` while too few are fresh) and the buffer stats after sampling."""
        td = self.buffer.sample(batch_size, consumer_version)
        return {"batch": None if td is None else from_tensordict(td), "stats": self._stats()}

    @endpoint
    async def stats(self) -> dict[str, int]:
        return self._stats()
