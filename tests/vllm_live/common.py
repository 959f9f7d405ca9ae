"""Shared helpers of the live vLLM scripts (run by ``.venv-vllm/bin/python``, vLLM CPU build).

The scripts print one JSON object on their last stdout line; ``tests/integration/test_vllm_live.py`` (in
``.venv``) runs them and checks what they report. Models are tiny Qwen3s built from a config
(no downloads); every engine runs in bf16, eager, with a 1 GiB KV cache.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

PROMPTS = [[11, 42, 7, 99, 3, 250, 17], [5, 6, 7, 8], [301, 2, 77, 140, 9, 9, 1, 64, 33]]


def tiny_qwen3(hidden: int = 128, layers: int = 2, vocab: int = 512, heads: int = 4, kv_heads: int = 2,
               head_dim: int = 64, tie: bool = True, seed: int = 0):
    """A small Qwen3 causal LM (transformers), bf16, random weights from ``seed`` (vLLM CPU attention
    needs a head dim of 32 or more)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, tie_word_embeddings=tie, torch_dtype="bfloat16")
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def perturb(model, *, frac: float = 0.03, seed: int = 1) -> None:
    """An RL-like step: about ``frac`` of every floating tensor's elements move by 1-2 bf16 ULPs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            mask = torch.rand(flat.shape, generator=g) < frac
            bits = flat.view(torch.int16)
            step = torch.randint(1, 3, flat.shape, generator=g, dtype=torch.int16)
            bits[mask] += step[mask]


def save(model, path: Path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def engine(model_dir: str, *, backend: bool = True, tp: int = 1, **kw):
    """An offline ``vllm.LLM`` on the CPU build (the ``deltasync`` backend when ``backend``)."""
    from vllm import LLM

    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    args = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                tensor_parallel_size=tp, seed=0, **kw)
    if backend:
        args["weight_transfer_config"] = {"backend": "deltasync"}
    return LLM(**args)


def outputs(llm, prompts=PROMPTS, max_tokens: int = 8, logprobs: int = 20, ignore_eos: bool = False,
            lora_request=None):
    """Greedy token ids and the top-``logprobs`` log-probs of every step (exact floats), per prompt
    (through the LoRA adapter ``lora_request`` names, when given)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, detokenize=False,
                        ignore_eos=ignore_eos)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=lora_request)
    return [completion(r.outputs[0]) for r in res]


def completion(c) -> dict:
    """Token ids and the top log-probs of every step (exact float bits, ``float.hex``, sorted by
    token id) of one vLLM ``CompletionOutput``."""
    lps = [sorted((int(t), float(lp.logprob).hex()) for t, lp in step.items()) for step in (c.logprobs or [])]
    return {"tokens": list(c.token_ids), "logprobs": lps}


def report(obj) -> None:
    sys.stdout.flush()
    print(json.dumps(obj), flush=True)
