"""Generator backends: the engine a generator replica samples with, behind one small interface.

A backend owns the replica's copy of the policy and how versions reach it. The Monarch generator
actor (:class:`recipes.grpo.actors.GeneratorActor`) only talks to this interface, so a GPU machine
swaps the Hugging Face engine for vLLM without touching the actor, the buffer or the controller:

- ``"hf"`` (:class:`HFGenerator`, the default, tested): Hugging Face ``generate`` on CPU; the bf16
  weights are a plain ``nn.Module`` that a :class:`~torch_deltasync.DeltaReceiver` updates in place.
- ``"vllm"`` (:class:`VLLMServerGenerator`, tested on vLLM's CPU build): a vLLM OpenAI server process
  (``.venv-vllm``) on 127.0.0.1 that the replica starts and stops; weights reach it only through
  vLLM's RL routes and the ``deltasync`` backend (:func:`torch_deltasync.integrations.vllm.update_server`),
  and versions are committed while rollouts are in flight (:mod:`.inflight`), every token tagged
  by the engine with the version that sampled it.
- ``"vllm-offline"`` (:class:`VLLMGenerator`, GPU only, **not exercised by this repository's tests**, which
  run on CPU): an offline ``vllm.LLM`` running ``torch_deltasync``'s ``deltasync`` weight-transfer
  backend; every tensor-parallel worker stages each version in the background (verified against
  the manifest's checksums) and commits it onto vLLM's parameters
  (:func:`torch_deltasync.integrations.vllm.update_llm`: wait until staged, start, update, finish,
  reset the prefix cache). Needs ``--model PATH`` (vLLM serves a checkpoint).

Add another engine with :func:`register_backend`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from .config import GRPOConfig
from .policy import build_policy, sample
from .task import Tokenizer


def _save_quietly(model, folder: str) -> None:
    """``save_pretrained`` in a generator process, without transformers' "Writing model shards"
    progress bar (the run's console shows the controller's progress only)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(folder, safe_serialization=True)

__all__ = ["GeneratorBackend", "HFGenerator", "VLLMServerGenerator", "VLLMGenerator", "register_backend", "make_backend", "backend_names"]


class GeneratorBackend(Protocol):
    """What a generator replica needs from its engine."""

    version: int | None
    """The version the engine serves (``None`` before the first update)."""

    def attach(self, store: str, prefix: str) -> None:
        """Follow the run at ``prefix`` in ``store`` (no weights are applied yet)."""

    def update(self, version: int) -> dict[str, Any]:
        """Apply versions up to ``version``, bit-exactly, all or nothing. Returns stats with at
        least ``version`` and, where known, ``apply_ms`` and ``total_ms``."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(response_ids [N, T] int64, response_mask [N, T] bool, logprobs [N, T] float32)``: the
        log-probs are those of the distribution each token was sampled from."""

    def fingerprint(self) -> dict[str, Any]:
        """Evidence of the served weights: ``{"digest": sha256 of the bf16 bit patterns}``
        (:func:`torch_deltasync.testing.state_digest`, compared with the trainer's) or
        ``{"checksums_verified": version}`` (engine checksums equal the manifest's)."""


class HFGenerator:
    """Hugging Face transformers generation on CPU.

    The replica's model is built from the architecture only (random weights, bf16: the inference
    dtype the trainer publishes); the first update installs the anchor, so every weight the
    replica serves has arrived through the store.

    Args:
        cfg: run configuration.
        tok: tokenizer.
        seed: initialisation seed (deliberately different per replica).
        replica: this generator's index (unused: the model runs in the actor's process).
    """

    def __init__(self, cfg: GRPOConfig, tok: Tokenizer, *, seed: int, replica: int = 0) -> None:
        self.tok = tok
        self.model = build_policy(cfg, tok, dtype=torch.bfloat16, seed=seed, load_weights=False)
        self.receiver = None

    @property
    def version(self) -> int | None:
        return None if self.receiver is None else self.receiver.version

    def attach(self, store: str, prefix: str) -> None:
        from torch_deltasync import DeltaReceiver

        self.receiver = DeltaReceiver(self.model, store, prefix=prefix)

    def update(self, version: int) -> dict[str, Any]:
        before = self.receiver.version
        self.receiver.update(version)
        st = self.receiver.last_stats
        stats = st.to_dict() if st is not None and before != self.receiver.version else {}
        return {**stats, "version": self.receiver.version}

    def generate(self, prompt_ids, prompt_mask, *, max_new_tokens, temperature):
        return sample(self.model, self.tok, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                      temperature=temperature)

    def fingerprint(self) -> dict[str, Any]:
        from torch_deltasync.testing import state_digest

        return {"digest": state_digest(self.model)}

    def save_weights(self, path: str) -> None:
        """The served bf16 weights, as a safetensors file."""
        from safetensors.torch import save_file

        save_file({n: t.detach().clone().contiguous() for n, t in self.model.state_dict().items()}, path)


class VLLMServerGenerator:
    """A vLLM OpenAI-compatible server (``.venv-vllm``, 127.0.0.1) as the replica's engine.

    The server starts from a checkpoint of the policy's architecture with random weights (written to
    a temporary folder); the first update installs the run's anchor through the ``deltasync``
    backend, so every weight it serves has arrived through the store and vLLM's RL routes. The
    backend stages each newer version in the background; :meth:`sync` commits a staged version
    (``POST /pause?mode=keep|abort&clear_cache=true`` → start / update / finish → ``/resume``), which
    is the only time the engine stops generating.

    Args:
        cfg: run configuration (``run_dir`` for the server log, ``vllm_python``, ``temperature``).
        tok: tokenizer (end-of-sequence id).
        seed: the engine's sampling seed and the initialisation seed of the placeholder weights.
        replica: this generator's index (0-based): its server's OpenMP threads are bound to core
            ``replica % os.cpu_count()`` (``VLLM_CPU_OMP_THREADS_BIND`` from the environment wins).

    Raises:
        ServerDied: the server did not come up (the message names its log).
    """

    #: Prompts of the end-of-run comparison with a fresh engine (token ids of the built-in tokenizer's range).
    PROBES = [[1, 3, 4, 5], [1, 7, 6, 5, 4], [1, 4, 4, 10, 12, 3]]

    def __init__(self, cfg: GRPOConfig, tok: Tokenizer, *, seed: int, replica: int = 0) -> None:
        import os
        import tempfile

        from .vllm_server import VLLMServer

        self.cfg, self.tok = cfg, tok
        self.workdir = tempfile.mkdtemp(prefix="grpo-vllm-")
        model = build_policy(cfg, tok, dtype=torch.bfloat16, seed=seed, load_weights=False)
        _save_quietly(model, self.workdir)
        del model
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"vllm-{os.getpid()}.log"
        # One core per replica: vLLM's automatic binding puts every single-rank CPU server on core 0,
        # so two replicas took turns on one core and one of them stalled for seconds at a time.
        self.server = VLLMServer(self.workdir, self.log_path, python=cfg.vllm_python, seed=seed,
                                 remove_when_done=self.workdir, cpus=str(replica % (os.cpu_count() or 1)))
        self.version: int | None = None
        self.status_dir: str | None = None

    @property
    def server_pids(self) -> list[int]:
        """The supervisor's and the server's pids."""
        return [p for p in (self.server.proc.pid, self.server.server_pid) if p]

    def attach(self, store: str, prefix: str) -> None:
        from torch_deltasync.integrations.vllm import attach_server

        info = attach_server(self.server.url, store, prefix)
        self.status_dir = info.get("status_dir")

    def warm_up(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int) -> float:
        """Generate one batch on the placeholder weights, as a rollout does (one request per prompt
        group, all at once), and return its seconds. A fresh vLLM CPU server's first batch costs
        5-21 s on 2 cores against 0.1-0.9 s for the next ones (docs/async_grpo.md); paid here, at
        set-up, it neither delays the first rollouts nor lengthens a commit whose pause waits for a
        slow engine step. The outputs are discarded."""
        import time
        from concurrent.futures import ThreadPoolExecutor

        groups: dict[tuple[int, ...], int] = {}
        for row, m in zip(prompt_ids, prompt_mask):
            key = tuple(row[m.bool()].tolist())
            groups[key] = groups.get(key, 0) + 1
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="warm-up") as pool:
            futures = [pool.submit(self.server.generate, list(p), max_tokens=max_new_tokens,
                                   temperature=self.cfg.temperature, n=n, stop_token_ids=[self.tok.eos_id])
                       for p, n in groups.items()]
            for f in futures:
                f.result()
        return time.perf_counter() - t0

    def update(self, version: int, *, stage_timeout_s: float = 2.0) -> dict[str, Any]:
        """Commit ``version`` or a newer one, once every worker staged it (drain: nothing is in flight).

        The backend stages only the newest version it sees, so by the time a replica asks for
        ``version`` its workers may have staged a newer one and will never stage ``version``
        itself: the commit takes the newest version every worker staged, if it is ``>= version``
        (waiting up to ``stage_timeout_s`` for one; past it, ``version`` is committed and the
        workers prepare it inside the pause). The replica generates nothing meanwhile, so a
        pause that prepares costs no more than waiting; a long wait only lets a stager that falls
        behind a fast trainer chase it (a 44 s wait with the old 60 s bound on a loaded machine)."""
        import time

        from torch_deltasync.integrations.vllm import read_readiness, update_server

        from .inflight import commit_target

        self.server.check_alive()
        before = self.version
        if before is not None and before >= version:
            return {"version": before}
        deadline = time.monotonic() + stage_timeout_s
        target = version
        while self.status_dir is not None:  # the readiness files the workers rewrite as they stage
            states = read_readiness(self.status_dir)
            v = commit_target([s.get("staged") for s in states.values()], None)
            if v is not None and v >= version:
                target = v
                break
            if not states or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        # staged just now (or waited for above): a short wait covers a stager that moved on meanwhile
        r = update_server(self.server.url, target, mode="wait", stage_timeout_s=1.0)
        self.version = r.version
        return {"version": r.version, "apply_ms": r.stall_ms, "stall_ms": r.stall_ms, "wait_ms": r.wait_ms,
                "total_ms": r.total_ms, "staged": r.staged, "steps_ms": r.steps_ms}

    def sync(self, mode: str = "keep") -> dict[str, Any] | None:
        """Commit the newest version every worker has staged, if at least ``cfg.sync_lag`` newer than
        the served one (:func:`.inflight.commit_target`), pausing with ``mode`` (``"keep"``: running requests freeze and continue on the new weights;
        ``"abort"``: they return what they have). No waiting for staging: the pause covers the
        commit only. ``None``: nothing newer is staged (one read of the readiness files, no HTTP)."""
        from torch_deltasync.integrations.vllm import read_readiness, update_server

        from .inflight import commit_target

        self.server.check_alive()
        if self.status_dir is None:
            return None
        v = commit_target([s.get("staged") for s in read_readiness(self.status_dir).values()], self.version,
                          self.cfg.sync_lag)
        if v is None:
            return None
        r = update_server(self.server.url, v, mode=mode)
        before, self.version = self.version, r.version
        return {"version": r.version, "from_version": before, "stall_ms": r.stall_ms, "apply_ms": r.stall_ms,
                "total_ms": r.total_ms, "staged": r.staged, "mode": mode, "steps_ms": r.steps_ms}

    def generate(self, prompt_ids, prompt_mask, *, max_new_tokens, temperature):
        r = self.generate_versioned(prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, interrupt="drain")
        return r.ids, r.mask, r.logprobs

    def generate_versioned(self, prompt_ids, prompt_mask, *, max_new_tokens: int, interrupt: str):
        """:func:`.inflight.generate_inflight` on this server (polling every ``cfg.sync_poll_ms``)."""
        from .inflight import generate_inflight

        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        return generate_inflight(_TokenAPI(self), prompts, max_new_tokens=max_new_tokens, interrupt=interrupt,
                                 eos_id=self.tok.eos_id, pad_id=self.tok.pad_id, poll_s=self.cfg.sync_poll_ms / 1e3)

    def probe(self) -> list[dict[str, Any]]:
        """Greedy completions of :attr:`PROBES` with the top-5 log-probs of every step (exact float bits)."""
        return probe(self.server)

    def fingerprint(self) -> dict[str, Any]:
        # Before committing a version the worker checked the per-tensor checksums of what it
        # installs against the manifest; the controller also compares outputs with a fresh engine.
        return {"checksums_verified": self.version, "probe": self.probe()}

    def close(self) -> None:
        import shutil

        self.server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class _TokenAPI:
    """:class:`.inflight.InflightEngine` over a :class:`VLLMServerGenerator`."""

    def __init__(self, gen: VLLMServerGenerator) -> None:
        self.gen = gen

    @property
    def version(self) -> int | None:
        return self.gen.version

    def generate(self, prompt: list[int], max_tokens: int, n: int) -> list[dict[str, Any]]:
        return self.gen.server.generate(prompt, max_tokens=max_tokens, temperature=self.gen.cfg.temperature, n=n,
                                        stop_token_ids=[self.gen.tok.eos_id])

    def sync(self, mode: str) -> dict[str, Any] | None:
        return self.gen.sync(mode)


def probe(server) -> list[dict[str, Any]]:
    """Greedy completions (8 tokens, top-5 log-probs as float hex) of :attr:`VLLMServerGenerator.PROBES`
    on a :class:`.vllm_server.VLLMServer`."""
    return server.complete(VLLMServerGenerator.PROBES, max_tokens=8, temperature=0.0, logprobs=5, top_logprobs=True)


def fresh_engine_probe(cfg: GRPOConfig, weights: str | Path, log_path: str | Path) -> dict[str, Any]:
    """The end-of-run oracle of the ``vllm`` engine: the trainer's weights (a safetensors file, any
    float dtype) cast to bf16 into a checkpoint of the policy, served by a fresh vLLM server without
    weight transfer.

    Returns:
        ``{"probe": :func:`probe` outputs, "digest": sha256 of the checkpoint's bf16 bits}``
        (:func:`torch_deltasync.testing.state_digest`, comparable with the trainer's digest).
    """
    import shutil
    import tempfile

    from safetensors.torch import load_file

    from torch_deltasync.testing import state_digest

    from .policy import build_tokenizer
    from .vllm_server import VLLMServer

    tok = build_tokenizer(cfg)
    model = build_policy(cfg, tok, dtype=torch.bfloat16, load_weights=False)
    sd = {k: t.to(torch.bfloat16) for k, t in load_file(str(weights)).items()}
    model.load_state_dict(sd, strict=True)
    digest = state_digest(model)
    folder = tempfile.mkdtemp(prefix="grpo-vllm-fresh-")
    try:
        _save_quietly(model, folder)
        server = VLLMServer(folder, log_path, python=cfg.vllm_python, seed=cfg.seed, deltasync=False)
        try:
            return {"probe": probe(server), "digest": digest}
        finally:
            server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class VLLMGenerator:
    """An offline ``vllm.LLM`` on GPU, updated by ``torch_deltasync``'s ``deltasync`` weight-transfer
    backend.

    Not exercised by this repository's tests (they run on CPU); the weight path it uses
    (:func:`~torch_deltasync.integrations.vllm.attach_llm` /
    :func:`~torch_deltasync.integrations.vllm.update_llm`) is tested against vLLM's own layouts in
    ``tests/test_vllm_*.py`` and against a live CPU engine in ``tests/integration/test_vllm_live.py``.

    Args:
        cfg: run configuration; ``cfg.model_path`` is the checkpoint vLLM loads (its weights are
            replaced by the run's anchor on the first update).
        tok: tokenizer (end-of-sequence id).
        seed: sampling seed.
        replica: this generator's index (unused: vLLM places its own workers).

    Raises:
        ValueError: no ``--model``.
        ImportError: vLLM is not installed.
    """

    def __init__(self, cfg: GRPOConfig, tok: Tokenizer, *, seed: int, replica: int = 0) -> None:
        if not cfg.model_path:
            raise ValueError("the vLLM generator serves a checkpoint: pass --model PATH")
        from vllm import LLM

        self.tok = tok
        self.llm = LLM(
            model=cfg.model_path, dtype="bfloat16", seed=seed, enforce_eager=True,
            gpu_memory_utilization=min(0.9, 0.8 / cfg.generators),
            # Sampled-token log-probs of the distribution actually sampled from (after temperature).
            logprobs_mode="processed_logprobs",
            weight_transfer_config={"backend": "deltasync"},
        )
        self.version: int | None = None

    def attach(self, store: str, prefix: str) -> None:
        from torch_deltasync.integrations.vllm import attach_llm

        attach_llm(self.llm, store, prefix)

    def update(self, version: int) -> dict[str, Any]:
        from torch_deltasync.integrations.vllm import update_llm

        r = update_llm(self.llm, version)
        self.version = r.version
        # apply_ms: the commit (start_weight_update -> prefix-cache reset); staging ran beforehand
        return {"version": r.version, "apply_ms": r.stall_ms, "wait_ms": r.wait_ms, "total_ms": r.total_ms,
                "staged": r.staged}

    def generate(self, prompt_ids, prompt_mask, *, max_new_tokens, temperature):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=row[m.bool()].tolist()) for row, m in zip(prompt_ids, prompt_mask)]
        params = SamplingParams(temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_new_tokens, logprobs=0,
                                stop_token_ids=[self.tok.eos_id])
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        n = len(prompts)
        ids = torch.full((n, max_new_tokens), self.tok.pad_id, dtype=torch.long)
        mask = torch.zeros((n, max_new_tokens), dtype=torch.bool)
        lp = torch.zeros((n, max_new_tokens), dtype=torch.float32)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            toks = list(c.token_ids)[:max_new_tokens]
            ids[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            mask[i, :len(toks)] = True
            lp[i, :len(toks)] = torch.tensor([c.logprobs[t][tid].logprob for t, tid in enumerate(toks)])
        return ids, mask, lp

    def fingerprint(self) -> dict[str, Any]:
        # Before committing a version every worker checked the full per-tensor checksums of the
        # state it installs (its host copy, in HF layout) against the manifest, i.e. against the
        # trainer's bf16 weights at this version.
        return {"checksums_verified": self.version}


_BACKENDS: dict[str, Callable[..., GeneratorBackend]] = {"hf": HFGenerator, "vllm": VLLMServerGenerator,
                                                          "vllm-offline": VLLMGenerator}


def register_backend(name: str, factory: Callable[..., GeneratorBackend]) -> None:
    """Make ``factory(cfg, tok, seed=..., replica=...)`` available as ``--generator-backend name``
    (``replica``: the generator's index, 0-based)."""
    _BACKENDS[name] = factory


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def make_backend(name: str, cfg: GRPOConfig, tok: Tokenizer, *, seed: int, replica: int = 0) -> GeneratorBackend:
    """Build the backend ``name`` for generator ``replica`` (0-based).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown generator backend {name!r}; known: {backend_names()}")
    return _BACKENDS[name](cfg, tok, seed=seed, replica=replica)
