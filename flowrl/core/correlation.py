"""Rank correlations between two score vectors of the same items (Sol-RL's fidelity check:
do low-precision rewards rank the seeds like full-precision rewards do?). Tensors in, floats
out; ties get the average of the ranks they span, as in scipy.stats.rankdata / spearmanr /
kendalltau (tau-b)."""

from __future__ import annotations

import math

import torch


def rankdata(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of a 1-D tensor in fp64; tied values share the mean of their ranks."""
    x = x.detach().double().flatten()
    n = x.numel()
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    # first index of each run of equal values, and each element's run
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = sorted_x[1:] != sorted_x[:-1]
    run_id = torch.cumsum(new_run.long(), 0) - 1
    starts = torch.nonzero(new_run).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    mean_rank = (starts + ends + 1).double() / 2  # mean of ranks start+1 .. end
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = mean_rank[run_id]
    return ranks


def _check(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    if a.numel() != b.numel():
        raise ValueError(f"correlation needs two score vectors of one length, got {a.numel()} and {b.numel()}")
    return a, b


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation; NaN when either vector is constant or has fewer than 2 items."""
    a, b = _check(a, b)
    if a.numel() < 2:
        return math.nan
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denom if denom > 0 else math.nan


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho: the Pearson correlation of the (tie-averaged) ranks. NaN if either is constant."""
    a, b = _check(a, b)
    return pearson(rankdata(a), rankdata(b))


def kendall_tau(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's tau-b over all pairs: (concordant - discordant) / sqrt((n0 - ties_a)(n0 - ties_b)).
    O(n^2) memory in pairs, fine for pools of a few thousand. NaN if either is constant."""
    a, b = _check(a, b)
    n = a.numel()
    if n < 2:
        return math.nan
    i, j = torch.triu_indices(n, n, offset=1)
    da, db = torch.sign(a[i] - a[j]), torch.sign(b[i] - b[j])
    s = float((da * db).sum())
    untied_a, untied_b = float((da != 0).sum()), float((db != 0).sum())
    denom = math.sqrt(untied_a * untied_b)
    return s / denom if denom > 0 else math.nan


def grouped(fn, a: torch.Tensor, b: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Mean of `fn(a, b)` within each group, over the groups where it is defined (NaN if none)."""
    values = [fn(a[group_ids == g], b[group_ids == g]) for g in torch.unique(group_ids).tolist()]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan
