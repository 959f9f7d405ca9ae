"""Small models and real training steps for demos, tests and benchmarks.

No model or dataset can be downloaded here, so everything is built from configs: a
Qwen3-architecture causal LM from ``transformers`` with the usual std-0.02 initialisation, and Adam
steps on random tokens. ``transformers`` is imported lazily.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._dtypes import bits, cast

__all__ = ["QWEN3_SIZES", "tiny_qwen3", "adam_step", "bitwise_equal", "state_bits", "state_digest", "first_difference",
           "synthetic_step", "set_full_weights"]

#: Named Qwen3 configs: ~0.2M (tests), ~3M (demo), ~100M and ~500M (benchmarks), ~1B / ~7B-sized (GPU).
QWEN3_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64),
    "500m": dict(vocab_size=64000, hidden_size=1280, intermediate_size=3584, num_hidden_layers=18,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=80),
    "1b": dict(vocab_size=128000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, head_dim=128),
}


def tiny_qwen3(size: str = "tiny", *, seed: int = 0, tie_word_embeddings: bool = False,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", **overrides: Any) -> nn.Module:
    """A ``Qwen3ForCausalLM`` built from a named config (see :data:`QWEN3_SIZES`), std-0.02 init.

    Args:
        size: a key of :data:`QWEN3_SIZES`.
        seed: ``torch.manual_seed`` before initialisation, so two calls give identical weights.
        tie_word_embeddings: share ``lm_head.weight`` with ``model.embed_tokens.weight``.
        dtype: parameter dtype (fp32 master weights by default).
        device: where to build it (building 1B-7B configs directly on a GPU is much faster).
        overrides: any other ``Qwen3Config`` field.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(QWEN3_SIZES[size])
    cfg.update(overrides)
    config = Qwen3Config(tie_word_embeddings=tie_word_embeddings, initializer_range=0.02, **cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(dtype)


def adam_step(model: nn.Module, optimizer: torch.optim.Optimizer, *, batch: int = 2, seq: int = 32,
              generator: torch.Generator | None = None) -> float:
    """One real training step (next-token loss on random tokens); returns the loss."""
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def state_bits(model: nn.Module | dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every floating tensor cast to ``dtype`` as the sender publishes it (:func:`~torch_deltasync.
    _dtypes.cast`: torch's cast, NaNs as one pattern) and viewed as integers (for bitwise comparison)."""
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    return {n: bits(cast(t, dtype)) for n, t in sd.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}


def first_difference(a: nn.Module | dict, b: nn.Module | dict, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """``None`` when every tensor of ``a`` and ``b`` is bit-identical in ``dtype``, else a description
    of the first difference (name and element count)."""
    sa, sb = state_bits(a, dtype), state_bits(b, dtype)
    if sa.keys() != sb.keys():
        return f"different tensor names: {sorted(sa.keys() ^ sb.keys())[:5]}"
    for n in sa:
        if sa[n].shape != sb[n].shape:
            return f"{n}: shape {tuple(sa[n].shape)} vs {tuple(sb[n].shape)}"
        if not torch.equal(sa[n], sb[n]):
            return f"{n}: {int((sa[n] != sb[n]).sum())} of {sa[n].numel()} elements differ"
    return None


def bitwise_equal(a: nn.Module | dict, b: nn.Module | dict, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether every tensor of ``a`` and ``b`` has identical bits in ``dtype`` (integer views, never floats)."""
    return first_difference(a, b, dtype) is None


def state_digest(model: nn.Module | dict, dtype: torch.dtype = torch.bfloat16) -> str:
    """sha256 over the bit patterns of every floating tensor in ``dtype`` (sorted by name): equal
    digests mean bit-identical weights, so two processes can compare states cheaply."""
    import hashlib

    h = hashlib.sha256()
    for name, b in sorted(state_bits(model, dtype).items()):
        h.update(name.encode())
        h.update(b.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def synthetic_step(state: dict[str, torch.Tensor], step: int, *, density: float = 0.05, scale: float = 0.01) -> None:
    """A synthetic optimizer step, identical on every process: in place, about ``density`` of the
    elements of every tensor of ``state`` are multiplied by ``1 + scale * randn`` (a few bf16 ULPs at
    the default ``scale``, as an RL-rate Adam step moves them). The random draws are seeded by ``step``
    and the tensor's position in sorted name order, so every rank (and a test process) computes the
    same full weights without communication, whatever the model is sharded like.

    Args:
        state: ``{name: full fp32 tensor}``, modified in place.
        step: which step (>= 1); the same ``step`` gives the same change set.
        density: fraction of elements changed (0..1).
        scale: relative size of a change.
    """
    for i, (name, w) in enumerate(sorted(state.items())):
        g = torch.Generator().manual_seed(1000 * step + i)
        mask = torch.rand(w.shape, generator=g) < density
        w.mul_(1 + mask * torch.randn(w.shape, generator=g) * scale)


@torch.no_grad()
def set_full_weights(model: nn.Module | dict, weights: dict[str, torch.Tensor]) -> None:
    """Write full tensors into a (possibly sharded) model: every ``DTensor`` entry's local shard
    receives its part of ``weights[name]`` as DTensor itself cuts it
    (``distribute_tensor(..., src_data_rank=None)``: a local split, no communication); plain tensors
    are copied whole. Every rank passes the same ``weights``.

    Args:
        model: an ``nn.Module`` (its ``state_dict(keep_vars=True)``) or a dict of tensors / DTensors.
        weights: ``{name: full tensor}`` in HF layout for every floating entry of ``model``.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    items = model.items() if isinstance(model, dict) else model.state_dict(keep_vars=True).items()
    for n, t in items:
        if isinstance(t, DTensor):
            mine = distribute_tensor(weights[n].to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(mine.to_local())
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            t.copy_(weights[n])
