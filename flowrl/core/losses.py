"""Policy-gradient losses over per-transition log-probs (image steps or text tokens alike)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar
    ratio: torch.Tensor  # [B] detached
    clipped: torch.Tensor  # [B] bool, detached: where the clipped branch was taken


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate (Schulman et al. 2017), as used by GRPO:
    mean( max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)) ), r = exp(logp - logp_old)."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped).mean()
    return PolicyLoss(loss, ratio.detach(), (clipped > unclipped).detach())


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Exact KL( N(mean, std^2 I) || N(ref_mean, std^2 I) ) = ||mean - ref_mean||^2 / (2 std^2),
    per sample [B]; 'sum' over dimensions is exact, 'mean' matches a mean-reduced log-prob."""
    per_dim = (mean - ref_mean) ** 2 / (2 * std**2)
    dims = tuple(range(1, per_dim.ndim))
    return per_dim.sum(dims) if reduction == "sum" else per_dim.mean(dims)
