"""Generator backends: the engine a generator replica samples with, behind one small interface.

A backend owns the replica's copy of the policy and exposes (1) ``weights_target()``, what the
replica's ``DeltaReceiver`` writes into, and (2) ``generate()``. The Monarch generator actor
(:class:`recipes.grpo.actors.GeneratorActor`) only talks to this interface, so a GPU machine swaps
the Hugging Face engine for vLLM without touching the actor, the buffer or the controller:

- ``"hf"`` (:class:`HFGenerator`): Hugging Face ``generate`` on CPU, bf16 weights held as a
  plain ``nn.Module`` (``ModuleTarget``).
- ``"vllm"``: the slot for a vLLM engine on GPU whose ``weights_target()`` is the vLLM
  tensor-parallel target from the vLLM issue (deltas land straight on vLLM's parameters) and whose
  ``generate()`` returns the sampled token log-probs (``SamplingParams(logprobs=0)``). Registering
  it is one :func:`register_backend` call; this checkout does not ship it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from .config import GRPOConfig
from .policy import build_policy, sample
from .task import Tokenizer

__all__ = ["GeneratorBackend", "HFGenerator", "register_backend", "make_backend", "backend_names"]


class GeneratorBackend(Protocol):
    """What a generator replica needs from its engine."""

    def weights_target(self) -> Any:
        """An ``nn.Module``, state dict or ``torch_deltasync.Target`` for the ``DeltaReceiver``."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(response_ids [N, T] int64, response_mask [N, T] bool, logprobs [N, T] float32)``."""

    def state_digest(self) -> str:
        """sha256 of the served weights' bf16 bit patterns (``torch_deltasync.testing.state_digest``)."""


class HFGenerator:
    """Hugging Face transformers generation on CPU.

    The replica's model is built from the architecture only (random weights, bf16: the inference
    dtype the trainer publishes); the first ``DeltaReceiver.update`` installs the anchor.

    Args:
        cfg: run configuration.
        tok: tokenizer.
        seed: initialisation seed (deliberately different per replica: every weight must arrive
            through the store).
    """

    def __init__(self, cfg: GRPOConfig, tok: Tokenizer, *, seed: int) -> None:
        self.tok = tok
        self.model = build_policy(cfg, tok, dtype=torch.bfloat16, seed=seed, load_weights=False)

    def weights_target(self) -> torch.nn.Module:
        return self.model

    def generate(self, prompt_ids, prompt_mask, *, max_new_tokens, temperature):
        return sample(self.model, self.tok, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                      temperature=temperature)

    def state_digest(self) -> str:
        from torch_deltasync.testing import state_digest

        return state_digest(self.model)


_BACKENDS: dict[str, Callable[..., GeneratorBackend]] = {"hf": HFGenerator}


def register_backend(name: str, factory: Callable[..., GeneratorBackend]) -> None:
    """Make ``factory(cfg, tok, seed=...)`` available as ``--generator-backend name``."""
    _BACKENDS[name] = factory


def backend_names() -> list[str]:
    return sorted(_BACKENDS) + (["vllm"] if "vllm" not in _BACKENDS else [])


def make_backend(name: str, cfg: GRPOConfig, tok: Tokenizer, *, seed: int) -> GeneratorBackend:
    """Build the backend ``name``.

    Raises:
        NotImplementedError: ``"vllm"`` without a registered vLLM backend.
        ValueError: an unknown name (the message lists the known ones).
    """
    if name in _BACKENDS:
        return _BACKENDS[name](cfg, tok, seed=seed)
    if name == "vllm":
        raise NotImplementedError(
            "the vLLM generator backend needs a CUDA machine with vllm installed and a backend registered with "
            "recipes.grpo.generators.register_backend('vllm', factory) whose weights_target() is the vLLM "
            "tensor-parallel target; this checkout only ships the CPU backend 'hf'"
        )
    raise ValueError(f"unknown generator backend {name!r}; known: {backend_names()}")
