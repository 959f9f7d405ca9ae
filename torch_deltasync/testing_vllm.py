"""vLLM's own models and loaders on CPU, at any tensor-parallel rank, as a test oracle.

vLLM 0.33 builds its layers with the TP rank and size it reads from
``vllm.distributed.parallel_state`` *while constructing* them; afterwards the loaders only use the
rank stored on each layer. So swapping the process-group globals for small stubs during
construction builds the exact model a worker of a ``tp``-way engine holds, in one CPU process,
without ``torch.distributed``, CUDA or ``vllm._C`` (``docs/research/vllm-cpu-oracle.md``). Loading full
HF tensors with the model's own ``load_weights`` then gives the reference per-rank layout.

Needs ``vllm`` installed (``tools/setup.sh`` installs the 0.33.0 wheel with ``--no-deps``), and
``VLLM_TARGET_DEVICE=cpu`` in the environment before vLLM is first imported (set here if unset).
Only the loader layout is produced: ``process_weights_after_loading`` is never run, so nothing is
repacked for CPU kernels, and no forward pass is possible.

Example:
    >>> spec = TINY_VLLM_CONFIGS["qwen2"]
    >>> hf = hf_model(spec, seed=0)
    >>> vc = vllm_config(spec, tmp_path)
    >>> ranks = [build_vllm_model(vc, r, 4) for r in range(4)]
    >>> for m in ranks:
    ...     load_hf_weights(m, hf.state_dict())
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

__all__ = ["TINY_VLLM_CONFIGS", "hf_model", "vllm_config", "build_vllm_model", "load_hf_weights",
           "vllm_state_bits", "fake_tp"]

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

#: Tiny configs of the architectures the vLLM target supports, chosen to hit the layout edge
#: cases at TP 1-8: fewer KV heads than ranks (KV replication), tied and untied embeddings,
#: vocabularies that are not multiples of 64 (padding rows; at ``qwen3`` TP 8 three ranks hold only
#: padding), biases on column- and row-parallel layers, and a fused MoE.
TINY_VLLM_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen2: q/k/v biases, 2 KV heads (replicated at TP 4 and 8), untied, vocab 1000 -> 1024 padded.
    "qwen2": dict(arch="Qwen2ForCausalLM", model_type="qwen2", vocab_size=1000, hidden_size=64,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  tie_word_embeddings=False),
    # Qwen3: q/k norms, 1 KV head (MQA), tied embeddings, vocab 70 -> 128 padded.
    "qwen3": dict(arch="Qwen3ForCausalLM", model_type="qwen3", vocab_size=70, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                  head_dim=16, tie_word_embeddings=True),
    # Llama: biases on attention (o_proj: replicated row-parallel bias) and MLP, 4 KV heads, untied.
    "llama": dict(arch="LlamaForCausalLM", model_type="llama", vocab_size=333, hidden_size=64,
                  intermediate_size=80, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    # Qwen3-MoE: 8 experts (fused 3-D expert tensors in transformers 5), router, untied.
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=500, hidden_size=64,
                      intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                      norm_topk_prob=True, tie_word_embeddings=False),
}


def _hf_config(spec: Mapping[str, Any]):
    from transformers import AutoConfig

    fields = {k: v for k, v in spec.items() if k not in ("arch", "model_type")}
    fields.setdefault("max_position_embeddings", 128)
    fields.setdefault("rms_norm_eps", 1e-6)
    cfg = AutoConfig.for_model(spec["model_type"], initializer_range=0.02, **fields)
    cfg.architectures = [spec["arch"]]
    return cfg


def hf_model(spec: Mapping[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers model of a :data:`TINY_VLLM_CONFIGS` entry (fp32 master weights, std-0.02
    init after ``torch.manual_seed(seed)``)."""
    import transformers

    cfg = _hf_config(spec)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = getattr(transformers, spec["arch"])(cfg)
    return model.to(dtype)


def vllm_config(spec: Mapping[str, Any], workdir: str | Path | None = None, *, dtype: str = "bfloat16",
                enable_expert_parallel: bool = False):
    """A ``VllmConfig`` for ``spec`` on the CPU with dummy weights (writes ``config.json`` under
    ``workdir``, a new temporary folder by default)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    d = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="deltasync-vllm-"))
    d.mkdir(parents=True, exist_ok=True)
    _hf_config(spec).save_pretrained(d)
    mc = ModelConfig(model=str(d), dtype=dtype, skip_tokenizer_init=True, max_model_len=128)
    pc = ParallelConfig(enable_expert_parallel=enable_expert_parallel)
    return VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"), load_config=LoadConfig(load_format="dummy"),
                      parallel_config=pc)


class _Group:
    """Stand-in for a vLLM ``GroupCoordinator``: the attributes layer constructors read."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group = self.rank = rank
        self.world_size = size
        self.device_group = self.cpu_group = _ProcessGroup(rank, size)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


class _ProcessGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@contextlib.contextmanager
def fake_tp(tp_rank: int, tp_size: int, *, ep: bool = False) -> Iterator[None]:
    """Make vLLM's parallel-state getters report TP rank ``tp_rank`` of ``tp_size`` (PP, DP,
    PCP and DCP of size 1; EP over the TP ranks when ``ep``) inside the block."""
    from vllm.distributed import parallel_state as ps

    names = ("_TP", "_PP", "_DP", "_EP", "_PCP", "_DCP")
    saved = {n: getattr(ps, n, None) for n in names}
    try:
        ps._TP = _Group(tp_rank, tp_size)
        for n in ("_PP", "_DP", "_PCP", "_DCP"):
            setattr(ps, n, _Group(0, 1))
        ps._EP = _Group(tp_rank, tp_size) if ep else _Group(0, 1)
        yield
    finally:
        for n, v in saved.items():
            setattr(ps, n, v)


def build_vllm_model(vllm_cfg, tp_rank: int, tp_size: int) -> nn.Module:
    """The model one worker of a ``tp_size``-way engine builds, at rank ``tp_rank`` (bf16 params,
    contents undefined until loaded)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture

    vc = copy.copy(vllm_cfg)
    cls, _ = get_model_architecture(vc.model_config)
    old = torch.get_default_dtype()
    with set_current_vllm_config(vc), fake_tp(tp_rank, tp_size, ep=vc.parallel_config.enable_expert_parallel):
        # Each build registers its attention layers by name; a second build in one process would
        # raise "Duplicate layer name" without this.
        vc.compilation_config.static_forward_context.clear()
        torch.set_default_dtype(vc.model_config.dtype)
        try:
            model = cls(vllm_config=vc)
        finally:
            torch.set_default_dtype(old)
    return model


def load_hf_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> set[str]:
    """vLLM's own ``model.load_weights`` from full HF tensors (cast to ``dtype``); returns the
    vLLM names it loaded."""
    with torch.no_grad():
        return model.load_weights((n, t.detach().to(dtype)) for n, t in state_dict.items())


def vllm_state_bits(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a vLLM model as an integer bit view (a copy), for bitwise comparison."""
    from ._dtypes import bits

    return {n: bits(p.detach().contiguous()).clone() for n, p in model.named_parameters()}
