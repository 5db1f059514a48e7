"""Policy-gradient losses over sequences of tokens (docs/algorithms.md section 13): the clipped
surrogate per token with an asymmetric clip, token- or sequence-level ratios, the aggregation
modes that tell GRPO, DAPO and Dr. GRPO apart, the k3 KL estimator, and overlong masking.

Everything is [N, T] log-probs with a [N, T] mask of the completion's tokens; one advantage per
sequence [N]. Modality-free: the tokens could be anything sampled step by step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# how per-token losses become one number (TRL's loss_type, verl's loss_agg_mode):
# seq_mean_token_mean: GRPO (Shao et al. 2024): mean over a sequence's tokens, then over sequences
# token_mean: DAPO (Yu et al. 2025): every active token of the batch weighs the same
# seq_mean_token_sum_norm: Dr. GRPO (Liu et al. 2025): token sum over a constant (max completion length)
# seq_mean_token_sum: the sequence's token sum, then the mean over sequences
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum")
RATIO_LEVELS = ("token", "sequence")  # sequence: GSPO (Zheng et al. 2025), exp(mean_t(logp - logp_old))


class TokenPolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar
    ratio: torch.Tensor  # [N, T] detached (sequence level: the sequence's ratio on each of its tokens)
    clipped_low: torch.Tensor  # [N, T] bool: the ratio was clipped at 1 - eps_low (negative advantage)
    clipped_high: torch.Tensor  # [N, T] bool: clipped at 1 + eps_high (positive advantage)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None = None) -> torch.Tensor:
    """One scalar from per-token values [N, T] over the tokens where mask [N, T] is true."""
    m = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    sums = (per_token * m).sum(1)
    if mode == "seq_mean_token_mean":
        return (sums / m.sum(1).clamp(min=1)).mean()
    if mode == "seq_mean_token_sum":
        return sums.mean()
    if mode == "seq_mean_token_sum_norm":
        if not norm_length:
            raise ValueError("seq_mean_token_sum_norm needs norm_length (the maximum completion length)")
        return sums.mean() / norm_length
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got '{mode}'")


def token_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      clip_low: float = 0.2, clip_high: float | None = None, aggregation: str = "seq_mean_token_mean",
                      ratio_level: str = "token", norm_length: int | None = None) -> TokenPolicyLoss:
    """PPO's clipped surrogate per token, max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), with
    DAPO's clip-higher when clip_high > clip_low. At the sequence level (GSPO) r is
    exp(mean over the sequence's tokens of (logp - logp_old)), the same on every token; its
    gradient still flows through each token's log-prob."""
    clip_high = clip_low if clip_high is None else clip_high
    m = mask.to(log_prob.dtype)
    delta = (log_prob - old_log_prob) * m
    if ratio_level == "token":
        ratio = torch.exp(delta)
    elif ratio_level == "sequence":
        seq = delta.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        ratio = torch.exp(seq).expand_as(log_prob)
    else:
        raise ValueError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)}; got '{ratio_level}'")
    adv = advantages.to(log_prob.dtype).unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    taken = (clipped > unclipped) & mask.bool()
    loss = aggregate(per_token, mask, aggregation, norm_length)
    return TokenPolicyLoss(loss, ratio.detach(), (taken & (ratio < 1)).detach(), (taken & (ratio > 1)).detach())


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(r) - r - 1 with
    r = logp_ref - logp_theta; unbiased, never negative, 0 where the two agree."""
    r = ref_log_prob - log_prob
    return torch.exp(r) - r - 1


def overlong_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong masking: a completion cut at the length limit carries no loss."""
    return mask & ~truncated.bool().unsqueeze(1)
