"""Advantage estimators over grouped rewards (docs/algorithms.md section 6).

Every estimator takes rewards [N, K] (K reward channels; [N] is one channel), group ids [N]
and optional channel weights [K], and returns advantages [N] and a mask [N] of the samples
that carry gradient. Groups may have different sizes. Nothing here knows what a sample is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flowrl.registry import Registry

STD_KINDS = ("group", "global", "none")  # what divides the centred rewards: the group std, the batch std, nothing
# advantage.kind -> fn(rewards, group_ids, weights, std=, eps=, clip=) -> AdvantageOutput; a new one is a registered function
ADVANTAGES = Registry("advantage.kind", "Advantage estimators")


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


class Groups(NamedTuple):
    ids: torch.Tensor  # [G] sorted unique ids
    inverse: torch.Tensor  # [N] index of each sample's group
    counts: torch.Tensor  # [G] float


def groups_of(group_ids: torch.Tensor) -> Groups:
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inverse, minlength=ids.numel()).float()
    return Groups(ids, inverse, counts)


def _scatter(values: torch.Tensor, g: Groups, reduce: str) -> torch.Tensor:
    init = {"sum": 0.0, "amax": -float("inf"), "amin": float("inf")}[reduce]
    out = torch.full((g.ids.numel(),), init, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, g.inverse, values, reduce, include_self=reduce == "sum")


def group_mean_std(values: torch.Tensor, g: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and population std, [G] each."""
    mean = _scatter(values, g, "sum") / g.counts
    var = _scatter((values - mean[g.inverse]) ** 2, g, "sum") / g.counts
    return mean, var.sqrt()


def group_degenerate(values: torch.Tensor, g: Groups) -> torch.Tensor:
    """[G] bool: every value in the group is equal. Exact (max == min): the float std of equal
    values can be one rounding step above zero."""
    return _scatter(values, g, "amax") == _scatter(values, g, "amin")


def group_median(values: torch.Tensor, g: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group median [G] (mean of the two middle values for even sizes) and a pivot mask [N]:
    in an odd group exactly one sample, the middle one (lowest index among ties), is the pivot."""
    medians = torch.empty(g.ids.numel(), dtype=values.dtype, device=values.device)
    pivot = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    for k in range(g.ids.numel()):
        idx = (g.inverse == k).nonzero().squeeze(1)
        order = idx[torch.sort(values[idx], stable=True).indices]
        n = order.numel()
        if n % 2:
            medians[k] = values[order[n // 2]]
            pivot[order[n // 2]] = True
        else:
            medians[k] = 0.5 * (values[order[n // 2 - 1]] + values[order[n // 2]])
    return medians, pivot


def _divisor(values: torch.Tensor, g: Groups, group_std: torch.Tensor, std: str, eps: float) -> torch.Tensor:
    """What divides the centred rewards: the group's or the batch's std plus eps, or exactly 1."""
    if std not in STD_KINDS:
        raise ValueError(f"advantage.std must be one of {STD_KINDS}, got {std!r}")
    if std == "none":  # Dr. GRPO: centred, not scaled
        return torch.ones_like(values)
    return (group_std[g.inverse] if std == "group" else values.std(unbiased=False).expand_as(values)) + eps


def unit_scale_per_group(advantages: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Each group's advantages divided by max(1, the group's largest |A|): all within [-1, 1], and a
    group whose advantages sum to zero still does. Clipping at +-1 instead (DiffusionNFT's r) breaks
    the sum in skewed groups: one success among seven failures keeps its pull at 1 while the seven
    pushes add up to more, a net push away from the group's own samples."""
    g = groups_of(group_ids)
    largest = _scatter(advantages.abs(), g, "amax").clamp(min=1.0)
    return advantages / largest[g.inverse]


def _finish(adv, degenerate, g: Groups, clip, extra_mask=None) -> AdvantageOutput:
    dead = degenerate[g.inverse]
    adv = torch.where(dead, torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    mask = ~dead if extra_mask is None else ~dead & extra_mask
    return AdvantageOutput(adv, mask, degenerate, g.ids)


@ADVANTAGES.register(name="grpo")
def grpo_advantages(rewards, group_ids, weights=None, std="group", eps=1e-4, clip=None) -> AdvantageOutput:
    """GRPO (Shao et al., DeepSeekMath; Flow-GRPO eq. 4): A = (r - mean_group) / (std + eps),
    std per group or over the whole batch. Degenerate groups get A = 0 and no gradient."""
    r = combine_channels(rewards, weights)
    g = groups_of(group_ids)
    mean, gstd = group_mean_std(r, g)
    adv = (r - mean[g.inverse]) / _divisor(r, g, gstd, std, eps)
    return _finish(adv, group_degenerate(r, g), g, clip)


@ADVANTAGES.register(name="mc_grpo")
def mc_grpo_advantages(rewards, group_ids, weights=None, std="group", eps=1e-4, clip=None) -> AdvantageOutput:
    """MC-GRPO (median-centred GRPO): the group median is the baseline, robust to one outlier
    that would drag the mean across most of the group. With G + 1 (odd) samples, exactly one is
    the median, has A = 0, and is left out of the backward pass, so G samples carry gradient."""
    r = combine_channels(rewards, weights)
    g = groups_of(group_ids)
    _, gstd = group_mean_std(r, g)
    median, pivot = group_median(r, g)
    adv = (r - median[g.inverse]) / _divisor(r, g, gstd, std, eps)
    adv = torch.where(pivot, torch.zeros_like(adv), adv)
    return _finish(adv, group_degenerate(r, g), g, clip, extra_mask=~pivot)


@ADVANTAGES.register(name="gdpo")
def gdpo_advantages(rewards, group_ids, weights=None, std="group", eps=1e-4, clip=None) -> AdvantageOutput:
    """GDPO (group reward-decoupled normalisation): normalise every reward channel within its
    group, then take the weighted sum, then rescale by the batch std of that sum (our reading
    of its batch-wise normalisation, which keeps the scale fixed as channels are added).
    Unlike GRPO on the summed reward, different channel combinations with equal sums stay apart."""
    r = rewards.float()
    if r.ndim == 1:
        r = r[:, None]
    w = torch.ones(r.shape[1]) if weights is None else weights.float()
    g = groups_of(group_ids)
    total = torch.zeros(r.shape[0], dtype=torch.float32, device=r.device)
    degenerate = torch.ones(g.ids.numel(), dtype=torch.bool, device=r.device)
    for k in range(r.shape[1]):
        mean, gstd = group_mean_std(r[:, k], g)
        flat = group_degenerate(r[:, k], g)
        a_k = (r[:, k] - mean[g.inverse]) / _divisor(r[:, k], g, gstd, std, eps)
        total = total + w[k] * torch.where(flat[g.inverse], torch.zeros_like(a_k), a_k)
        degenerate &= flat
    live = ~degenerate[g.inverse]
    if live.sum() > 1:
        total = total / (total[live].std(unbiased=False) + eps)
    return _finish(total, degenerate, g, clip)


@ADVANTAGES.register(name="rank")
def rank_advantages(rewards, group_ids, weights=None, std="group", eps=1e-4, clip=None) -> AdvantageOutput:
    """Rank-based advantages: the within-group rank of each reward (ties share their mean rank),
    centred and scaled to [-1, 1]. Invariant to any increasing transform of the reward."""
    r = combine_channels(rewards, weights)
    g = groups_of(group_ids)
    adv = torch.zeros_like(r)
    for k in range(g.ids.numel()):
        idx = (g.inverse == k).nonzero().squeeze(1)
        v = r[idx]
        n = v.numel()
        if n < 2:
            continue
        less = (v[None, :] < v[:, None]).sum(1).float()
        equal = (v[None, :] == v[:, None]).sum(1).float()
        rank = less + (equal - 1) / 2  # 0-based average rank
        adv[idx] = (rank - (n - 1) / 2) / ((n - 1) / 2)
    return _finish(adv, group_degenerate(r, g), g, clip)


@ADVANTAGES.register(name="reinforce_ada")
def reinforce_ada_advantages(rewards, group_ids, weights=None, std=None, eps=1e-4, clip=None) -> AdvantageOutput:
    """Reinforce-Ada's global-statistics baseline (arXiv 2510.04996; the authors'
    compute_grpo_outcome_advantage with global_stat_est on, norm_adv_by_std_in_grpo off):
    A = r - the mean reward over every sample of the prompt drawn in the iteration's rounds (the
    fraction of successes, for the pass/fail rewards it assumes), not divided by any std
    (`std` is ignored). Pass every sample drawn, also those the allocator leaves out of the
    loss (allocator.kind reinforce_ada)."""
    r = combine_channels(rewards, weights)
    g = groups_of(group_ids)
    mean, _ = group_mean_std(r, g)
    return _finish(r - mean[g.inverse], group_degenerate(r, g), g, clip)


def multi_granularity_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor | None = None,
                                 eps: float = 1e-8, clip: float | None = 5.0) -> AdvantageOutput:
    """G2RPO's multi-granularity advantage (arXiv 2510.01982, MGAI): a sample has one reward per
    (granularity, channel), rewards [N, L, K]. Each (group, granularity, channel) is normalised
    over its samples with the unbiased std, (r - mean) / (std + eps); the normalised values are
    summed over granularities and (weighted) channels, in advantage space, never as raw
    rewards; the clip applies after the sum. A group equal in every granularity and channel is
    degenerate (A = 0, no gradient); a flat column adds 0 to the sum."""
    r = rewards.float()
    if r.ndim == 2:
        r = r[:, :, None]
    n, levels, channels = r.shape
    w = torch.ones(channels) if weights is None else weights.float()
    g = groups_of(group_ids)
    unbiased = (g.counts / (g.counts - 1).clamp(min=1)).sqrt()
    total = torch.zeros(n, dtype=torch.float32, device=r.device)
    degenerate = torch.ones(g.ids.numel(), dtype=torch.bool, device=r.device)
    for level in range(levels):
        for k in range(channels):
            column = r[:, level, k]
            mean, pop_std = group_mean_std(column, g)
            flat = group_degenerate(column, g)
            a = (column - mean[g.inverse]) / (pop_std[g.inverse] * unbiased[g.inverse] + eps)
            total = total + w[k] * torch.where(flat[g.inverse], torch.zeros_like(a), a)
            degenerate &= flat
    return _finish(total, degenerate, g, clip)


def estimate_advantages(kind: str, rewards, group_ids, weights=None, std="group", eps=1e-4, clip=None) -> AdvantageOutput:
    """The advantages of the estimator registered as `kind`."""
    return ADVANTAGES.get(kind)(rewards, group_ids, weights, std=std, eps=eps, clip=clip)
