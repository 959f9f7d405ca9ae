"""Episodes as the rollout service takes them (validation of untrusted JSON) and as a trainer uses
them (one padded ``TensorDict``); the schema is in the package docstring."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ...errors import EpisodeError
from ._config import INT32_LIMIT, RolloutServiceConfig, is_number

_EPISODE_KEYS = {"prompt", "completion", "logprobs", "reward", "policy_version", "advantage", "group", "worker"}
_REQUIRED_KEYS = ("prompt", "completion", "logprobs", "reward", "policy_version")
#: Log-probs may exceed 0 by this much (float rounding of log_softmax); anything larger is an error.
_LOGPROB_TOLERANCE = 1e-4



#: The largest finite float32 (log-probabilities are stored as float32).
_FLOAT32_MAX = 3.4028234663852886e38


def is_int(x: Any) -> bool:
    return type(x) is int  # bool is an int subclass: excluded on purpose


def _check_tokens(v: Any, where: str, lo_len: int, hi_len: int, vocab: int) -> list[int]:
    if not isinstance(v, list):
        raise EpisodeError(f"{where} must be a list of token ids, got {type(v).__name__}")
    if not lo_len <= len(v) <= hi_len:
        raise EpisodeError(f"{where} has {len(v)} tokens; allowed {lo_len} to {hi_len}")
    for i, t in enumerate(v):
        if not is_int(t) or not 0 <= t < vocab:
            raise EpisodeError(f"{where}[{i}] is {t!r:.40}; token ids are integers in [0, {vocab})")
    return v


def validate_episodes(batch: Any, config: RolloutServiceConfig) -> list[dict[str, Any]]:
    """Validate an untrusted batch ``{"episodes": [episode, ...]}`` (parsed JSON).

    Args:
        batch: the parsed request body.
        config: the limits.

    Returns:
        The episodes (the same dicts), each checked.

    Raises:
        EpisodeError: the first rule broken, e.g. ``episodes[3].logprobs has 7 values for 8
            completion tokens``. See the module docstring for the schema.
    """
    if not isinstance(batch, dict) or set(batch) != {"episodes"}:
        raise EpisodeError('the body must be a JSON object {"episodes": [...]} and nothing else')
    eps = batch["episodes"]
    if not isinstance(eps, list) or not 1 <= len(eps) <= config.max_episodes_per_post:
        n = len(eps) if isinstance(eps, list) else type(eps).__name__
        raise EpisodeError(f"episodes must be a list of 1 to {config.max_episodes_per_post} episodes, got {n}")
    vocab = config.vocab_size or INT32_LIMIT
    for i, ep in enumerate(eps):
        w = f"episodes[{i}]"
        if not isinstance(ep, dict):
            raise EpisodeError(f"{w} must be an object, got {type(ep).__name__}")
        missing = [k for k in _REQUIRED_KEYS if k not in ep]
        if missing:
            raise EpisodeError(f"{w} lacks {missing}")
        unknown = sorted(set(ep) - _EPISODE_KEYS)
        if unknown:
            raise EpisodeError(f"{w} has unknown fields {str(unknown)[:200]}; allowed: {sorted(_EPISODE_KEYS)}")
        _check_tokens(ep["prompt"], f"{w}.prompt", 0, config.max_prompt_tokens, vocab)
        comp = _check_tokens(ep["completion"], f"{w}.completion", 1, config.max_completion_tokens, vocab)
        lp = ep["logprobs"]
        if not isinstance(lp, list) or len(lp) != len(comp):
            n = len(lp) if isinstance(lp, list) else type(lp).__name__
            raise EpisodeError(f"{w}.logprobs has {n} values for {len(comp)} completion tokens; one per token")
        for j, x in enumerate(lp):  # stored as float32: a value beyond its range would become -inf
            if not is_number(x) or x > _LOGPROB_TOLERANCE or x < -_FLOAT32_MAX:
                raise EpisodeError(f"{w}.logprobs[{j}] is {x!r:.40}; log-probabilities are finite numbers in "
                                   f"[-{_FLOAT32_MAX:.7g}, 0] (float32)")
        if not is_number(ep["reward"]):
            raise EpisodeError(f"{w}.reward is {ep['reward']!r:.40}; a finite number")
        pv = ep["policy_version"]
        if not is_int(pv) or not 0 <= pv < 10**12:
            raise EpisodeError(f"{w}.policy_version is {pv!r:.40}; an integer in [0, 10**12)")
        if "advantage" in ep and not is_number(ep["advantage"]):
            raise EpisodeError(f"{w}.advantage is {ep['advantage']!r:.40}; a finite number")
        for k in ("group", "worker"):
            if k in ep and not ((is_int(ep[k]) and abs(ep[k]) < 2**63) or (isinstance(ep[k], str) and len(ep[k]) <= 128)):
                raise EpisodeError(f"{w}.{k} must be an integer or a string of at most 128 characters")
            if isinstance(ep.get(k), str) and not ep[k].isascii():
                try:  # a lone surrogate ("\ud800" in JSON) parses, but no response could carry it back
                    ep[k].encode("utf-8")
                except UnicodeEncodeError:
                    raise EpisodeError(f"{w}.{k} is not valid Unicode (a lone surrogate): {ep[k]!a:.60}") from None
    return eps


def collate_episodes(episodes: Sequence[dict[str, Any]], *, pad_id: int = 0):
    """Pad a list of sampled episodes into one ``TensorDict`` of batch size ``[N]``.

    Returns:
        ``TensorDict`` with ``input_ids`` int64 ``[N, L]`` (prompt then completion, right-padded
        with ``pad_id``), ``attention_mask`` bool ``[N, L]``, ``completion_mask`` bool ``[N, L]``
        (true on completion tokens), ``logprobs`` float32 ``[N, L]`` (the rollout log-prob at each
        completion token's position, 0 elsewhere), ``reward``, ``advantage`` (NaN where none was
        posted) float32 ``[N]``, ``policy_version`` and ``lag`` int64 ``[N]``. ``L`` is the longest
        prompt + completion.
    """
    from tensordict import TensorDict

    n = len(episodes)
    length = max(len(e["prompt"]) + len(e["completion"]) for e in episodes)
    ids = torch.full((n, length), pad_id, dtype=torch.int64)
    attn = torch.zeros((n, length), dtype=torch.bool)
    cmask = torch.zeros((n, length), dtype=torch.bool)
    lps = torch.zeros((n, length), dtype=torch.float32)
    for i, e in enumerate(episodes):
        p, c = len(e["prompt"]), len(e["completion"])
        ids[i, :p + c] = torch.tensor(e["prompt"] + e["completion"], dtype=torch.int64)
        attn[i, :p + c] = True
        cmask[i, p:p + c] = True
        lps[i, p:p + c] = torch.tensor(e["logprobs"], dtype=torch.float32)
    f = lambda k, d=math.nan: torch.tensor([float(e.get(k, d)) for e in episodes], dtype=torch.float32)  # noqa: E731
    return TensorDict({
        "input_ids": ids, "attention_mask": attn, "completion_mask": cmask, "logprobs": lps,
        "reward": f("reward"), "advantage": f("advantage"),
        "policy_version": torch.tensor([e["policy_version"] for e in episodes], dtype=torch.int64),
        "lag": torch.tensor([e.get("lag", 0) for e in episodes], dtype=torch.int64),
    }, batch_size=[n])
