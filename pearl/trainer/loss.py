"""The GRPO loss with AReaL's decoupled PPO objective: pure torch functions, no I/O.

Shapes: per-trajectory tensors are ``[n]``; per-token tensors are ``[batch, length]`` (or
any shape, all alike), with a boolean ``loss_mask`` that is true for the tokens the loss
counts. ``docs/training.md`` writes the formulas out, with every symbol.

Sources (read, not copied):

- GRPO's group-normalised advantage and its per-token KL (k3 estimator): Shao et al.,
  *DeepSeekMath* (arXiv:2402.03300), section 4.1; the KL estimator is J. Schulman's
  "Approximating KL divergence" (k3). Not dividing by the group's std: Liu et al.,
  *Understanding R1-Zero-Like Training* (Dr. GRPO, arXiv:2503.20783).
- The clipped surrogate: Schulman et al., *Proximal Policy Optimization Algorithms*
  (arXiv:1707.06347); a separate upper clip (``eps_clip_high``, "clip-higher"): Yu et al.,
  *DAPO* (arXiv:2503.14476).
- The decoupled objective (the ratio against a proximal policy, times the capped
  behaviour-to-proximal importance weight): Fu et al., *AReaL* (arXiv:2505.24298), its
  decoupled PPO objective; ``ppo_actor_loss_fn`` in inclusionAI/AReaL ``areal/utils/functional/
  functional.py`` (commit 61d1bbb3, with ``behav_imp_weight_cap``; later versions moved
  the cap into ``rejection_sampling``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-this before exp (no inf, no NaN)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """GRPO's advantage of each trajectory: its reward less its group's mean reward, over
    the group's std plus ``eps`` (or not divided, ``scale_by_std=False``: Dr. GRPO).

    Only the ``valid`` trajectories of a group make its mean and std, and an invalid one
    gets advantage 0 (a trajectory masked out of the loss). The std is the unbiased
    sample std (AReaL's default, ``std_unbiased``); a group with one valid member has std
    0 and advantage 0. Source: DeepSeekMath section 4.1.2 (outcome supervision)."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        members = (group_ids == g) & valid
        r = rewards[members].float()
        if r.numel() == 0:
            continue
        centred = r - r.mean()
        if scale_by_std:
            std = r.std(unbiased=True) if r.numel() > 1 else torch.zeros(())
            centred = centred / (std + eps)
        adv[members] = centred
    return adv


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, as a loss per token: ``max(-A r, -A clip(r, 1 - eps,
    1 + eps_high))`` with ``r = exp(logprobs - old_logprobs)``, and where the clipped term
    is the larger (the ratio was clipped: its gradient is zero there). ``eps_clip_high``
    defaults to ``eps_clip``. Source: PPO (arXiv:1707.06347) eq. 7; AReaL's
    ``ppo_actor_loss_fn`` (``clip_mask``)."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def behaviour_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled loss's importance weight ``exp(proximal - behaviour)`` of each token
    (the proximal policy over the one that generated it), and the tokens it keeps: a
    token whose weight exceeds ``cap`` is masked out (weight 0), as is every token outside
    ``loss_mask``. No gradient flows through it. Source: AReaL ``ppo_actor_loss_fn``
    (``behav_imp_weight``, ``behav_mask``)."""
    log_w = (proximal_logprobs - behaviour_logprobs).detach().clamp(max=MAX_LOG_RATIO)
    weight = torch.exp(log_w)
    kept = loss_mask.bool() if cap is None else loss_mask.bool() & (weight <= cap)
    return torch.where(kept, weight, torch.zeros_like(weight)), kept


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of ``KL(policy || reference)`` per token: ``exp(ref - lp) - (ref -
    lp) - 1`` (non-negative, 0 where the two agree). Source: DeepSeekMath eq. 4."""
    d = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class LossParts:
    """One (micro)batch's share of the loss and the sums its statistics are made of."""

    loss: torch.Tensor  # a scalar with gradient: (sum of per-token terms) / num_tokens
    loss_tokens: int  # tokens of the loss mask
    kept_tokens: int  # of those, tokens the behaviour weight's cap kept
    clipped_tokens: int  # kept tokens whose ratio was clipped
    weight_sum: float  # behaviour weights summed over the kept tokens
    kl_sum: float  # k3 summed over the loss tokens (0 without a reference)


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_tokens: int,
    eps_clip: float,
    eps_clip_high: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossParts:
    """The token-mean loss over ``loss_mask``, divided by ``num_tokens`` (the loss tokens of
    the whole minibatch, so microbatches' losses add up to the minibatch's).

    Decoupled (``proximal_logprobs`` given, AReaL): the ratio is against the proximal
    policy and each token's term is multiplied by its capped behaviour weight. Otherwise
    the ratio is against the behaviour logprobs (standard PPO/GRPO on the engines'
    logprobs), weight 1. With ``ref_logprobs``, ``kl_coef`` times the k3 KL of every loss
    token is added (DeepSeekMath's per-token KL in the objective). The denominator counts
    the loss tokens before the cap, as AReaL's does."""
    mask = loss_mask.bool()
    if proximal_logprobs is None:
        old = behaviour_logprobs
        weight, kept = mask.float(), mask
    else:
        old = proximal_logprobs
        weight, kept = behaviour_weights(
            proximal_logprobs, behaviour_logprobs, mask, behav_imp_weight_cap
        )
    per_token, clipped = clipped_surrogate(
        logprobs, old.detach(), advantages, eps_clip, eps_clip_high
    )
    per_token = torch.where(kept, per_token * weight, torch.zeros_like(per_token))
    kl_sum = 0.0
    if ref_logprobs is not None:
        kl = torch.where(mask, k3_kl(logprobs, ref_logprobs.detach()), torch.zeros_like(per_token))
        kl_sum = float(kl.detach().sum())
        if kl_coef:
            per_token = per_token + kl_coef * kl
    return LossParts(
        loss=per_token.sum() / max(num_tokens, 1),
        loss_tokens=int(mask.sum()),
        kept_tokens=int(kept.sum()),
        clipped_tokens=int((clipped & kept).sum()),
        weight_sum=float(weight[kept].sum()),
        kl_sum=kl_sum,
    )
