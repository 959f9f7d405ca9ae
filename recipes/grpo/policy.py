"""The policy: building it, its supervised warm start (cached), sampling and token log-probs.

Sequences are laid out the same way everywhere (generators, trainer, warm start): the prompt
left-padded to ``Lp`` tokens, then the response right-padded to ``T`` tokens. ``response_mask``
marks the response tokens that count (up to and including the first end-of-sequence). Position
ids follow the attention mask, so left padding does not shift positions.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from .config import GRPOConfig, attention_shape
from .task import CharTokenizer, HFTokenizer, SortTask, Tokenizer

__all__ = [
    "build_tokenizer", "build_policy", "encode_prompts", "group_prompts", "score", "sample", "pad_responses", "sft_batch", "sft_loss", "response_logprobs", "warm_start", "warm_start_path",
    "policy_key", "load_warm_start", "max_new_tokens", "evaluate",
]


def build_tokenizer(cfg: GRPOConfig) -> Tokenizer:
    """The checkpoint's tokenizer with ``model_path``, else the in-code character tokenizer."""
    return HFTokenizer(cfg.model_path) if cfg.model_path else CharTokenizer()


def build_policy(cfg: GRPOConfig, tok: Tokenizer, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                 load_weights: bool = True) -> nn.Module:
    """The policy model.

    Args:
        cfg: run configuration (``model_path`` or the built-in Qwen3 dimensions).
        tok: the tokenizer (vocabulary size and special ids of the built-in model).
        dtype: parameter dtype (fp32 master weights for the trainer, bf16 for generators).
        seed: initialisation seed of the built-in model.
        load_weights: with ``model_path``, load the checkpoint's weights; ``False`` builds the
            architecture from its config only (generators receive their weights through the store).

    Returns:
        A ``transformers`` causal LM in eval mode (Qwen3 has no dropout; eval keeps generation and
        scoring identical).
    """
    if cfg.model_path:
        from transformers import AutoConfig, AutoModelForCausalLM

        if load_weights:
            model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype)
        else:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model_path)).to(dtype)
        return model.eval()
    from torch_deltasync.testing import tiny_qwen3

    heads, kv_heads, head_dim = attention_shape(cfg.hidden_size)
    model = tiny_qwen3(
        "tiny", seed=seed, dtype=dtype, vocab_size=tok.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=3 * cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max(64, 4 * cfg.digits + 8), pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    return model.eval()


def encode_prompts(tok: Tokenizer, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids ``[N, Lp]`` (int64) and their attention mask ``[N, Lp]`` (int64)."""
    rows = [([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(p) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def _response_mask(response: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``True`` for response tokens up to and including the first ``eos_id`` (bool ``[N, T]``)."""
    is_eos = (response == eos_id).long()
    before = is_eos.cumsum(-1) - is_eos  # eos tokens strictly before position t
    return before == 0


def group_prompts(task: SortTask, tok: Tokenizer, rng: random.Random, prompts: int, group_size: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """A rollout batch's prompts: ``prompts`` fresh problems of ``task``, each repeated
    ``group_size`` times in a row (one GRPO group), as :func:`encode_prompts` ids and mask
    (``[prompts * group_size, Lp]`` int64 each) plus every row's answer."""
    problems = [task.problem(rng) for _ in range(prompts)]
    pids, pmask = encode_prompts(tok, [p for p, _ in problems for _ in range(group_size)])
    return pids, pmask, [a for _, a in problems for _ in range(group_size)]


def score(task: SortTask, tok: Tokenizer, response_ids: torch.Tensor, answers: Sequence[str]) -> torch.Tensor:
    """``[N]`` float32 rewards of the decoded responses (``[N, T]`` ids, decoded up to end-of-sequence)
    against their answers (:meth:`SortTask.reward`)."""
    return torch.tensor([task.reward(tok.decode(r.tolist()), a) for r, a in zip(response_ids, answers)],
                        dtype=torch.float32)


@torch.no_grad()
def sample(model: nn.Module, tok: Tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
           max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one completion per prompt row with Hugging Face ``generate``.

    Args:
        prompt_ids, prompt_mask: ``[N, Lp]`` from :func:`encode_prompts`.
        max_new_tokens: response length ``T``.
        temperature: sampling temperature (top-k / top-p off, so the log-probs below are exactly
            the distribution the tokens were drawn from).
        greedy: argmax decoding (evaluation).

    Returns:
        ``(response_ids [N, T] int64, response_mask [N, T] bool, logprobs [N, T] float32)``: the
        log-probability of each sampled token under the tempered distribution (0 where masked).
    """
    kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=None, top_p=None)
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
        pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, output_scores=True, return_dict_in_generate=True,
        **kwargs,
    )
    resp = out.sequences[:, prompt_ids.shape[1]:]
    n, t = resp.shape
    ids = torch.full((n, max_new_tokens), tok.pad_id, dtype=torch.long)
    ids[:, :t] = resp
    scores = torch.stack(out.scores, 1).float()  # [N, t, V], already divided by the temperature
    lp = torch.zeros((n, max_new_tokens), dtype=torch.float32)
    lp[:, :t] = torch.log_softmax(scores, -1).gather(-1, resp[..., None]).squeeze(-1)
    mask = _response_mask(ids, tok.eos_id)
    mask[:, t:] = False
    return ids, mask, lp.masked_fill(~mask, 0.0)


def pad_responses(tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], *, max_new_tokens: int,
                  eos_id: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Responses an engine sampled (token ids and their natural-log probabilities under the
    distribution they were drawn from, after temperature; one list each per rollout) in
    :func:`sample`'s layout.

    Returns:
        ``(response_ids [N, T] int64, response_mask [N, T] bool, logprobs [N, T] float32)`` with
        ``T = max_new_tokens``: ids padded with ``pad_id``; the mask up to and including the first
        ``eos_id`` (at most ``T`` tokens); log-probs 0 where masked.

    Raises:
        ValueError: a response longer than ``T``, or with fewer log-probs than counted tokens, or
            ``tokens`` and ``logprobs`` of different lengths.
    """
    n, T = len(tokens), max_new_tokens
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    mask = torch.zeros((n, T), dtype=torch.bool)
    lps = torch.zeros((n, T), dtype=torch.float32)
    for i, (toks, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        k = toks.index(eos_id) + 1 if eos_id in toks else len(toks)
        if len(toks) > T or len(lp) < k:
            raise ValueError(f"response {i}: {len(toks)} tokens (at most {T}) with {len(lp)} log-probs")
        ids[i, :len(toks)] = torch.tensor(list(toks), dtype=torch.long)
        mask[i, :k] = True
        lps[i, :k] = torch.tensor(list(lp[:k]), dtype=torch.float32)
    return ids, mask, lps


def response_logprobs(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      response_ids: torch.Tensor, response_mask: torch.Tensor, *,
                      temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities ``[N, T]`` (float32, 0 where masked) of the response tokens under ``model``.

    One forward pass over ``prompt + response``; logits at position ``Lp - 1 + t`` score response
    token ``t``. Differentiable (call under ``torch.no_grad()`` for reference values).
    """
    lp_len = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask.long()], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    logits = logits[:, lp_len - 1: -1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, response_ids[..., None]).squeeze(-1)
    return lp.masked_fill(~response_mask, 0.0)


# --- supervised warm start -------------------------------------------------------------------------


def sft_loss(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
             response_mask: torch.Tensor) -> torch.Tensor:
    """Supervised loss of a :func:`sft_batch`: the mean negative log-likelihood of the response
    tokens (scalar, differentiable; temperature 1)."""
    lp = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)
    return -(lp.sum() / response_mask.sum())


def policy_key(cfg: GRPOConfig) -> str:
    """Digest of everything the warm-start weights depend on (the cache key)."""
    fields = {k: getattr(cfg, k) for k in ("model_path", "hidden_size", "num_layers", "digits", "warmstart_steps",
                                          "warmstart_lr", "warmstart_noise", "warmstart_batch", "seed")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def sft_batch(task: SortTask, tok: Tokenizer, rng: random.Random, n: int, noise: float = 0.0,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` supervised examples of ``task``: ``(prompt_ids, prompt_mask)`` from :func:`encode_prompts`
    and the answers (each digit replaced at random with probability ``noise``) plus end-of-sequence,
    right-padded: ``response_ids`` ``[n, T]`` int64 and ``response_mask`` ``[n, T]`` bool."""
    prompts, answers = zip(*(task.problem(rng) for _ in range(n)))
    answers = [task.noisy_answer(a, rng, noise) for a in answers]
    pids, pmask = encode_prompts(tok, prompts)
    rows = [tok.encode(a) + [tok.eos_id] for a in answers]
    t = max(len(r) for r in rows)
    rids = torch.full((n, t), tok.pad_id, dtype=torch.long)
    rmask = torch.zeros((n, t), dtype=torch.bool)
    for i, r in enumerate(rows):
        rids[i, :len(r)] = torch.tensor(r)
        rmask[i, :len(r)] = True
    return pids, pmask, rids, rmask


def evaluate(model: nn.Module, tok: Tokenizer, task: SortTask, *, n: int = 256, seed: int = 12345,
             temperature: float = 1.0) -> dict[str, float]:
    """Mean reward of greedy and of sampled answers on ``n`` fresh prompts."""
    rng = random.Random(seed)
    prompts, answers = zip(*(task.problem(rng) for _ in range(n)))
    pids, pmask = encode_prompts(tok, prompts)
    out = {}
    for name, greedy in (("greedy", True), ("sampled", False)):
        ids, _, _ = sample(model, tok, pids, pmask, max_new_tokens=_max_new_tokens(task, tok),
                           temperature=temperature, greedy=greedy)
        out[f"reward_{name}"] = sum(task.reward(tok.decode(r.tolist()), a) for r, a in zip(ids, answers)) / n
    return out


def _max_new_tokens(task: SortTask, tok: Tokenizer) -> int:
    # The character tokenizer needs one token per digit; BPE tokenizers need at most as many.
    return task.max_new_tokens if isinstance(tok, CharTokenizer) else 2 * task.max_new_tokens


def max_new_tokens(cfg: GRPOConfig, tok: Tokenizer) -> int:
    """Response length ``T`` for this run."""
    return _max_new_tokens(SortTask(digits=cfg.digits), tok)


def warm_start_path(cfg: GRPOConfig) -> Path:
    """Where :func:`warm_start` caches the warm-started weights: ``<run>/warmstart/model.safetensors``."""
    return cfg.run_dir / "warmstart" / "model.safetensors"


def warm_start(cfg: GRPOConfig, tok: Tokenizer, *, progress: bool = True,
               should_stop: Callable[[], bool] | None = None) -> tuple[Path, dict]:
    """Supervised warm start on a noisy demonstrator, cached under ``<run>/warmstart``.

    Trains the fp32 policy for ``cfg.warmstart_steps`` Adam steps (one-cycle schedule up to
    ``cfg.warmstart_lr``) on prompts whose answers have each digit replaced at random with
    probability ``cfg.warmstart_noise``; the loss covers the answer and end-of-sequence tokens.
    A second run with the same :func:`policy_key` loads the cached weights instead.

    The cache is ``model.safetensors`` (the key in its metadata, ``policy_key``) and ``meta.json``
    (the key, the sha256 of the weights file, the evaluation), each written to a temporary file
    and renamed over its name, weights first. A cache that cannot be read or whose two files do not
    match (a run killed while writing it, a file damaged since) is rebuilt, and ``info["rebuilt"]``
    says why (the folder and the reason).

    Args:
        should_stop: asked before every step; ``True`` stops the warm start at once (nothing is
            cached) with ``KeyboardInterrupt`` (e.g. an asyncio run whose Ctrl-C cancels the task
            this runs in, which it cannot notice before it returns).

    Returns:
        ``(path, info)``: the safetensors file (``safetensors.torch.save_model`` layout, tied
        weights stored once) and ``{"cached", "seconds", "reward_greedy", "reward_sampled"}``, plus
        ``"rebuilt"`` (the reason) when a damaged cache was replaced.
    """
    from safetensors.torch import save_model

    path = warm_start_path(cfg)
    folder, meta_path = path.parent, path.parent / "meta.json"
    key = policy_key(cfg)
    meta, damaged = _cached_warm_start(path, meta_path, key)
    if meta is not None:
        return path, {**meta["info"], "cached": True, "seconds": 0.0}
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = build_policy(cfg, tok, seed=cfg.seed)
    task = SortTask(digits=cfg.digits)
    rng = random.Random(cfg.seed)
    if cfg.warmstart_steps:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.warmstart_lr, total_steps=cfg.warmstart_steps,
                                                    pct_start=0.1)
        bar = _bar(cfg.warmstart_steps, "warm start", progress)
        for _ in range(cfg.warmstart_steps):
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt("the warm start was stopped")
            pids, pmask, rids, rmask = sft_batch(task, tok, rng, cfg.warmstart_batch, cfg.warmstart_noise)
            loss = sft_loss(model, pids, pmask, rids, rmask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update()
        if bar is not None:
            bar.close()
        model.eval()
    info = evaluate(model, tok, task, temperature=cfg.temperature)
    meta_path.unlink(missing_ok=True)  # the weights change first: a cache never pairs them with an older meta.json
    for leftover in folder.glob("*.tmp-*"):  # of a run killed while writing the cache (the folder is this run's)
        leftover.unlink(missing_ok=True)
    _write_atomically(path, lambda tmp: save_model(model, str(tmp), metadata={"policy_key": key}))
    meta = {"key": key, "sha256": _sha256(path), "config": cfg.to_dict(), "info": info}
    _write_atomically(meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    info.update(cached=False, seconds=time.perf_counter() - t0)
    if damaged is not None:
        info["rebuilt"] = f"the cache in {folder} was unusable: {damaged}"
    return path, info


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it over ``path``: a reader
    (or a later run) sees the old file or the whole new one, never a part."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _cached_warm_start(path: Path, meta_path: Path, key: str) -> tuple[dict | None, str | None]:
    """``(meta, None)`` for a usable cache of ``key``; ``(None, None)`` when there is none, or one of
    other settings (a plain rebuild); ``(None, why)`` when it is unreadable or its files disagree."""
    if not meta_path.exists() and not path.exists():
        return None, None
    if not meta_path.exists():  # (a run killed between writing the weights and the record)
        return None, f"{meta_path.name} is missing"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        return None, f"{meta_path.name} is unreadable: {type(e).__name__}: {e}"
    if not isinstance(meta, dict) or not isinstance(meta.get("info"), dict):
        return None, f"{meta_path.name} is not a warm-start record"
    if meta.get("key") != key:
        return None, None  # other settings
    if not path.exists():
        return None, f"{path.name} is missing"
    if "sha256" not in meta:
        return None, f"{meta_path.name} has no sha256 of the weights (written by an older version)"
    if meta.get("sha256") != _sha256(path):
        return None, f"{path.name} does not match the sha256 in {meta_path.name}"
    return meta, None


def load_warm_start(model: nn.Module, path: str | Path, key: str | None = None) -> None:
    """Load :func:`warm_start`'s weights into ``model``.

    Args:
        key: the run's :func:`policy_key`; when given, the file must have been written for it.

    Raises:
        RuntimeError: the file is not a safetensors file, is for other settings than ``key``, or does
            not match the model (``safetensors.torch.load_model(strict=True)``).
    """
    from safetensors import safe_open
    from safetensors.torch import load_model

    try:
        with safe_open(str(path), "pt") as f:
            stored = (f.metadata() or {}).get("policy_key")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: a damaged or missing file
        raise RuntimeError(f"the warm start {path} is unreadable ({type(e).__name__}: {e}); delete it to "
                           "rebuild it") from None
    if key is not None and stored != key:
        raise RuntimeError(f"the warm start {path} was written for other settings (policy key {stored!r}, this "
                           f"run's is {key!r}); delete it to rebuild it")
    load_model(model, str(path), strict=True)


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=False)
