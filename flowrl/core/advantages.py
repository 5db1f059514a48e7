"""Advantage estimators over grouped rewards.

Inputs are rewards [N, K] (K reward channels), group ids [N] and optional channel weights
[K]; outputs are advantages [N] and a mask [N] of the samples that carry gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

STD_KINDS = ("group", "global")


class AdvantageOutput(NamedTuple):
    advantages: torch.Tensor  # [N] fp32
    mask: torch.Tensor  # [N] bool: samples that carry gradient
    degenerate: torch.Tensor  # [G] bool per group (in sorted group-id order): all rewards equal
    group_ids: torch.Tensor  # [G] the sorted unique group ids the `degenerate` flags refer to


def combine_channels(rewards: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum over reward channels: [N, K] -> [N]."""
    rewards = rewards.float()
    if rewards.ndim == 1:
        return rewards
    if weights is None:
        weights = torch.ones(rewards.shape[1], dtype=torch.float32, device=rewards.device)
    return rewards @ weights.to(rewards)


def group_stats(values: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample group mean and (population) std of `values` [N], plus the unique ids."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = uniq.numel()
    counts = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, inverse, torch.ones_like(values))
    sums = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, inverse, values)
    means = sums / counts
    sq = torch.zeros(n_groups, dtype=torch.float32, device=values.device).index_add_(0, inverse, (values - means[inverse]) ** 2)
    stds = (sq / counts).sqrt()
    return means[inverse], stds[inverse], uniq, inverse, stds


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    weights: torch.Tensor | None = None,
    std: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
) -> AdvantageOutput:
    """GRPO (Shao et al., DeepSeekMath; Flow-GRPO eq. 4): A = (r - mean_group) / (std + eps),
    std per group or over the whole batch. Groups whose rewards are all equal are degenerate:
    their advantages are 0 and they carry no gradient."""
    if std not in STD_KINDS:
        raise ValueError(f"advantage.std must be one of {STD_KINDS}, got {std!r}")
    r = combine_channels(rewards, weights)
    mean, group_std, uniq, inverse, stds_per_group = group_stats(r, group_ids)
    scale = group_std if std == "group" else r.std(unbiased=False).expand_as(r)
    adv = (r - mean) / (scale + eps)
    # exact test (max == min): a float std of equal values can be one rounding step above 0
    n_groups = uniq.numel()
    gmax = torch.full((n_groups,), -float("inf"), device=r.device).scatter_reduce(0, inverse, r, "amax")
    gmin = torch.full((n_groups,), float("inf"), device=r.device).scatter_reduce(0, inverse, r, "amin")
    degenerate = gmax == gmin
    adv = torch.where(degenerate[inverse], torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return AdvantageOutput(adv, ~degenerate[inverse], degenerate, uniq)
