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


def divergence_masked_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                                  divergence: torch.Tensor, threshold: float) -> PolicyLoss:
    """Flow-DPPO's trust region (arXiv 2606.11025, its asymmetric mask; Tencent-Hunyuan/UniRL
    `_flowdppo_kl_adv_loss`, Flow-Factory's DPPO trainer) in place of PPO's ratio clip: the
    unclipped surrogate -A r, r = exp(logp - logp_old), with a transition left out (detached mask)
    only when its divergence from the behaviour step has reached `threshold` AND the update moves
    its ratio further in its advantage's direction (r > 1 with A > 0, or r < 1 with A < 0). A
    corrective move always passes, and so does r == 1 or A == 0. Mean over the rows [B], masked
    rows counting as 0 (`where`, not a product: an overflowing r in a masked row gives no NaN).
    `clipped` in the result marks the removed rows."""
    ratio = torch.exp(log_prob - old_log_prob)
    pushing = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    removed = ((divergence >= threshold) & pushing).detach()
    loss = torch.where(removed, torch.zeros_like(ratio), -advantages * ratio).mean()
    return PolicyLoss(loss, ratio.detach(), removed)


def ratio_norm_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                         std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's RatioNorm (Wang et al., arXiv 2510.22319; its code's `rationorm` branch): for a
    Gaussian step x' = mu_old + s eps with dimension-averaged log-probs, the plain log-ratio is
    mean(eps d) / s - mean(d^2) / (2 s^2), d = mu - mu_old: biased below 0 and scaled by 1 / s,
    which differs from step to step. RatioNorm uses s (logp - logp_old) + mean(d^2) / (2 s) =
    mean(eps d) instead: centred, and on one scale at every step. The d^2 term keeps its gradient.
    Per row [B]; `std` is the step's s (a scalar or broadcastable)."""
    d2 = (mean - old_mean).square().flatten(1).mean(1)
    return std * (log_prob - old_log_prob) + d2 / (2 * std)


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Exact KL( N(mean, std^2 I) || N(ref_mean, std^2 I) ) = ||mean - ref_mean||^2 / (2 std^2),
    per sample [B]; 'sum' over dimensions is exact, 'mean' matches a mean-reduced log-prob."""
    per_dim = (mean - ref_mean) ** 2 / (2 * std**2)
    dims = tuple(range(1, per_dim.ndim))
    return per_dim.sum(dims) if reduction == "sum" else per_dim.mean(dims)


def optimality_probability(advantages: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """DiffusionNFT's r in [0, 1] from group-normalised advantages: 0.5 + 0.5 clip(A / scale, -1, 1)
    (Zheng et al. 2025, arXiv 2509.16117); 0.5 means "neither better nor worse than the group"."""
    return 0.5 + 0.5 * torch.clamp(advantages / scale, -1.0, 1.0)


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor, beta: float = 1.0,
             sigma: torch.Tensor | float | None = None, negatives: bool = True) -> torch.Tensor:
    """DiffusionNFT's negative-aware flow-matching loss, per sample [B] (Zheng et al. 2025, eq. for
    L(theta)): r ||v+ - u||^2 + (1 - r) ||v- - u||^2 with the implicit positive and negative policies
    v+ = (1 - beta) v_old + beta v and v- = (1 + beta) v_old - beta v. Its minimiser is
    v_old + (2r - 1)(u - v_old) / beta: toward the sample's target velocity u for better-than-group
    samples, away from it for worse ones, and no move at r = 0.5. Squared errors are means over
    the non-batch dimensions (the model's prediction scale, independent of resolution).

    With `sigma` (the noise level of x_t, a float or [B]) each term gets the paper's adaptive
    weighting: the x0-prediction error, sigma^2 ||v -/+ u||^2, divided by its own detached mean
    absolute value, sigma mean|v -/+ u|, so every sample's step has the same size whatever its
    error. (The two terms' normalisers differ away from v_old, which moves the minimiser toward r's
    side; at v = v_old they are equal and the gradient is (2r - 1) beta times a unit-size step.)

    `negatives=False` keeps the positive half only: max(2r - 1, 0) ||v+ - u||^2, reward-weighted
    flow matching on the better-than-group samples (in the spirit of online rejection-sampling
    fine-tuning). Its per-sample minimiser is v+ = u for every r > 0.5, nothing moves at r <= 0.5,
    and at beta = 1, v+ = v and v_old drops out. It pushes nothing away, yet on the shapes model it
    collapsed faster than the full loss (BENCHMARKS.md): the pulls share plain flow matching on
    the model's own samples, which the full loss's pushes cancel."""
    v_pos = (1 - beta) * v_old + beta * v
    if not negatives:
        return torch.clamp(2 * r.to(v.dtype) - 1, min=0) * _nft_term(v_pos, target, sigma)
    v_neg = (1 + beta) * v_old - beta * v
    r = r.to(v.dtype)
    return r * _nft_term(v_pos, target, sigma) + (1 - r) * _nft_term(v_neg, target, sigma)


def _nft_term(pred: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor | float | None) -> torch.Tensor:
    """Per-sample squared error [B] of one implicit policy, with the adaptive weighting when sigma is given."""
    dims = tuple(range(1, pred.ndim))
    err = pred - target
    if sigma is None:
        return (err**2).mean(dims)
    s = torch.as_tensor(sigma, dtype=pred.dtype, device=pred.device).reshape(-1)
    scale = (s * err.detach().abs().mean(dims)).clamp(min=1e-5)
    return s**2 * (err**2).mean(dims) / scale
