"""The LoRA recipe's rollout engines: where a worker's adapter comes from and how it samples.

``recipes/async_grpo_lora.py`` runs its rollout workers on either engine (``--engine``):

* :class:`PeftRollouts` (``hf``): the base model with a PEFT LoRA on CPU, Hugging Face
  ``generate``; :class:`~torch_deltasync.integrations.peft.AdapterReceiver` writes every new
  version into the adapter in place, between batches.
* :class:`VLLMRollouts` (``vllm``): a ``vllm serve`` of the base model with runtime LoRA
  (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``);
  :class:`~torch_deltasync.integrations.vllm.VLLMAdapterLoader` loads every new version as a new
  adapter, and each request names the adapter it samples with, so a swap never changes a request
  that runs (the problem statement's "hot swap" of adapters in a live engine).

Both return rollouts in :func:`recipes.grpo.policy.sample`'s layout (ids, mask, log-probs of the
sampled tokens after temperature) and tag them with the adapter version that sampled them. A
version that cannot be applied or loaded (damaged, refused by the engine, NaN values) is reported
and skipped: the worker samples on with the version it holds, and the next refresh tries the
newest again.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from torch_deltasync.errors import DeltaSyncError

from .policy import pad_responses, sample
from .task import Tokenizer

__all__ = ["PeftRollouts", "VLLMRollouts", "vllm_max_lora_rank"]

#: The ranks vLLM accepts as ``--max-lora-rank`` (``vllm.config.lora.MaxLoRARanks``, vLLM 0.32).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(config: dict[str, Any]) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds every rank of an adapter config
    (``r`` and the ``rank_pattern`` values, as :func:`~torch_deltasync.integrations.peft.check_adapter_config`
    returns it).

    Raises:
        ValueError: a rank above vLLM's largest (512).
    """
    rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANKS[-1]})")


class PeftRollouts:
    """Rollouts from the base model with the run's LoRA (PEFT, CPU), updated in place between batches.

    Args:
        store: the adapter run's store (its prefix).
        base: the base model (the trainer's, from the store).
        tok: the tokenizer (padding and end-of-sequence ids).
        timeout_s: seconds to wait for the adapter config and the first version.
    """

    def __init__(self, store, base: torch.nn.Module, tok: Tokenizer, *, timeout_s: float) -> None:
        from peft import get_peft_model

        from torch_deltasync.follow import poll_until
        from torch_deltasync.integrations.peft import AdapterReceiver, read_adapter_config

        config = poll_until(lambda: _config_or_none(read_adapter_config, store), timeout_s=timeout_s, poll_s=0.2)
        if config is None:
            raise TimeoutError(f"{store.describe()}: no adapter config within {timeout_s} s")
        self.model = get_peft_model(base, config).eval()
        self.tok = tok
        self.receiver = AdapterReceiver(self.model, store)
        self.receiver.wait_for(timeout_s=timeout_s)  # visible; the first refresh() applies it

    @property
    def version(self) -> int | None:
        """The version the adapter holds (``None`` before the first :meth:`refresh`)."""
        return self.receiver.version

    def refresh(self) -> dict[str, Any] | None:
        """Apply the newest version (in place); its update's stats, ``None`` when nothing was newer,
        ``{"error": ...}`` when it could not be applied (:func:`_skipped`)."""
        before = self.receiver.version
        try:
            self.receiver.update()
        except DeltaSyncError as e:
            return _skipped(e, before)
        if self.receiver.version == before:
            return None
        st = self.receiver.last_stats
        return {"path": st.path, "nbytes": st.nbytes, "versions_applied": st.versions_applied, "total_ms": st.total_ms}

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
               temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sample(self.model, self.tok, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                      temperature=temperature)

    def close(self) -> None:
        self.receiver.close()


class VLLMRollouts:
    """Rollouts from a ``vllm serve`` of the base model, the run's adapter versions hot-swapped in.

    The server (:class:`recipes.grpo.vllm_server.VLLMServer`, under ``vllm_python``) serves the base
    model saved in bf16; its OpenMP threads are bound to core ``worker_id % os.cpu_count()``. Every
    new version is loaded through ``/v1/load_lora_adapter`` as ``lora-v<version>`` (the loader keeps
    the two newest); a batch's requests all name the version current when it starts.

    Args:
        store: the adapter run's store (its prefix).
        base: the base model (the trainer's, from the store).
        tok: the tokenizer.
        run_dir: where the server's log goes (``vllm-worker-<worker_id>.log``).
        worker_id: this worker's index.
        seed: the server's sampling seed.
        timeout_s: seconds to wait for the server, the adapter config and the first version.
        vllm_python: vLLM's interpreter (default :func:`~recipes.grpo.vllm_server.default_vllm_python`).

    Raises:
        ServerDied: the server did not come up (the message names its log).
    """

    def __init__(self, store, base: torch.nn.Module, tok: Tokenizer, *, run_dir: str | Path, worker_id: int,
                 seed: int, timeout_s: float, vllm_python: str | None = None) -> None:
        from torch_deltasync.follow import poll_until
        from torch_deltasync.integrations.peft import read_adapter_config_dict

        config = poll_until(lambda: _config_or_none(read_adapter_config_dict, store), timeout_s=timeout_s, poll_s=0.2)
        if config is None:
            raise TimeoutError(f"{store.describe()}: no adapter config within {timeout_s} s")
        self.tok = tok
        self.workdir = Path(tempfile.mkdtemp(prefix="grpo-lora-vllm-"))
        self.server = None
        try:
            self._start(store, base, config, run_dir=run_dir, worker_id=worker_id, seed=seed, timeout_s=timeout_s,
                        vllm_python=vllm_python)
        except BaseException:
            if self.server is not None:
                self.server.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def _start(self, store, base, config, *, run_dir, worker_id, seed, timeout_s, vllm_python) -> None:
        from torch_deltasync.integrations.vllm import VLLMAdapterLoader, server_lora_ops

        from .generators import _save_quietly
        from .vllm_server import VLLMServer

        _save_quietly(copy.deepcopy(base).to(torch.bfloat16), str(self.workdir / "base"))
        self.server = VLLMServer(
            str(self.workdir / "base"), Path(run_dir) / f"vllm-worker-{worker_id}.log", python=vllm_python, seed=seed,
            deltasync=False, start_timeout_s=timeout_s, remove_when_done=str(self.workdir),
            cpus=str(worker_id % (os.cpu_count() or 1)), env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            extra_args=["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(config)), "--max-loras", "2"])
        self.loader = VLLMAdapterLoader(server_lora_ops(self.server.url), store, cache_dir=self.workdir / "adapters",
                                        name="lora", keep=2)
        self.loader.receiver.wait_for(timeout_s=timeout_s)  # visible; the first refresh() loads it

    @property
    def version(self) -> int | None:
        """The version new requests use (``None`` before the first :meth:`refresh`)."""
        cur = self.loader.current
        return None if cur is None else cur.version

    def refresh(self) -> dict[str, Any] | None:
        """Load the newest version into the server; its stats (the receiver's update and the whole
        swap, ``load_ms``), ``None`` when nothing was newer, ``{"error": ...}`` when it could not
        be loaded (:func:`_skipped`)."""
        try:
            got = self.loader.poll()
        except DeltaSyncError as e:
            return _skipped(e, self.version)
        if got is None:
            return None
        st = self.loader.receiver.last_stats
        return {"path": st.path, "nbytes": st.nbytes, "versions_applied": st.versions_applied, "total_ms": st.total_ms,
                "load_ms": got.load_ms}

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
               temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One completion per prompt row through the current adapter (one ``/v1/completions``
        request; vLLM's processed log-probs: after temperature)."""
        self.server.check_alive()
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        out = self.server.complete(prompts, max_tokens=max_new_tokens, temperature=temperature,
                                   stop_token_ids=[self.tok.eos_id], model=self.loader.current.lora_name)
        return pad_responses([c["tokens"] for c in out], [c["logprobs"] for c in out], max_new_tokens=max_new_tokens,
                             eos_id=self.tok.eos_id, pad_id=self.tok.pad_id)

    def close(self) -> None:
        try:
            self.loader.close()
        finally:
            self.server.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)


def _skipped(e: DeltaSyncError, held: int | None) -> dict[str, Any]:
    """A version that could not be applied or loaded: reported on stderr and in the batch's
    metrics; re-raised when the worker holds no version yet (it has nothing to sample with)."""
    if held is None:
        raise e
    print(f"version not taken ({type(e).__name__}: {e}); sampling on with version {held}", file=sys.stderr, flush=True)
    return {"error": f"{type(e).__name__}: {e}"[:500]}


def _config_or_none(read, store):
    """``read(store)``, or ``None`` while the run has no adapter config yet."""
    from torch_deltasync.errors import VersionNotFoundError

    try:
        return read(store)
    except VersionNotFoundError:
        return None
