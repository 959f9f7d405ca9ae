"""The GRPO objective: clipped ratio against the trainer's own policy, optionally corrected for
the generators' (stale, bf16) sampling policy by truncated importance sampling.

With a behaviour policy ``pi_gen`` (the generator's version, which may lag the trainer by up to
``max_staleness`` versions and runs in bf16), a proximal policy ``pi_old`` (the trainer's weights
when the batch arrives, scored once without gradient) and the policy being optimised ``pi``, the
per-token objective is the decoupled PPO form (Hilton et al. 2021, "Batch size-invariance for
policy optimization", arXiv:2110.00641; used for async RL by AReaL, arXiv:2505.24298) with the
importance weight truncated as in truncated importance sampling (TIS; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training")::

    w_t   = min(pi_old(y_t) / pi_gen(y_t), cap)                (no gradient; 1 without correction)
    r_t   = pi(y_t) / pi_old(y_t)
    J     = mean over response tokens of  w_t * min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)

``A`` is the group-normalised advantage of the sample (torchrl ``MCAdvantage``: ``(R - mean) /
std`` within the prompt's group, computed in the replay buffer).

Why not torchrl's ``GRPOLoss`` (``torchrl.objectives.llm.GRPOLoss``, 0.14.1)? Its clipped
objective (``_compute_policy_objective``) is the same formula, but (a) it needs an
``LLMWrapperBase`` actor (``TransformersWrapper`` with a Hugging Face tokenizer and its
tokens/masks/History tensordict layout), while this recipe trains a bare causal LM with an in-code
tokenizer on fixed-shape token tensors, and (b) it takes the ratio directly against the sampling
log-probs, so it cannot separate the proximal policy from the behaviour policy and truncate the
importance weight on its own, which is the point of the optional correction here. We do use
torchrl where it fits: ``ReplayBuffer`` / ``LazyTensorStorage`` / ``ConsumingSampler`` for the
buffer and ``MCAdvantage`` for group advantages (see :mod:`.buffer`).
"""

from __future__ import annotations

import torch

__all__ = ["truncated_is_weights", "grpo_objective"]


def truncated_is_weights(old_logp: torch.Tensor, gen_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float | None) -> torch.Tensor:
    """Per-token importance weights ``min(exp(old_logp - gen_logp), cap)``, 0 where ``mask`` is off.

    Args:
        old_logp: ``[N, T]`` log-probs of the sampled tokens under the trainer's proximal policy.
        gen_logp: ``[N, T]`` log-probs stored by the generator when it sampled them.
        mask: ``[N, T]`` bool, the response tokens that count.
        cap: truncation (``C`` of TIS); ``None`` returns the mask as weights (no correction).

    Returns:
        ``[N, T]`` float32 weights without gradient.

    Raises:
        ValueError: shapes differ or ``cap <= 0``.
    """
    if old_logp.shape != gen_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(f"shapes differ: old {tuple(old_logp.shape)}, gen {tuple(gen_logp.shape)}, mask {tuple(mask.shape)}")
    if cap is None:
        return mask.float()
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        w = torch.exp((old_logp.float() - gen_logp.float()).masked_fill(~mask, 0.0)).clamp(max=cap)
        return w.masked_fill(~mask, 0.0)


def grpo_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                   clip: tuple[float, float] = (0.8, 1.2), weights: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO loss (to minimise), token mean over the masked tokens.

    Args:
        logp: ``[N, T]`` log-probs under the policy being optimised (with gradient).
        old_logp: ``[N, T]`` proximal log-probs (no gradient).
        advantages: ``[N]`` per-sample advantages.
        mask: ``[N, T]`` bool.
        clip: ratio range ``(1 - eps_low, 1 + eps_high)``.
        weights: ``[N, T]`` per-token weights (:func:`truncated_is_weights`), or ``None``.

    Returns:
        ``(loss, stats)`` with stats ``clip_frac`` (fraction of tokens whose ratio was clipped
        where it mattered) and ``ratio_mean``.
    """
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.to(ratio.dtype)[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(*clip) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if weights is not None:
        surrogate = surrogate * weights
    m = mask.to(surrogate.dtype)
    ntok = m.sum().clamp(min=1.0)
    loss = -(surrogate * m).sum() / ntok
    with torch.no_grad():
        clip_frac = float(((clipped < unclipped).to(m.dtype) * m).sum() / ntok)
        ratio_mean = float((ratio * m).sum() / ntok)
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio_mean}
