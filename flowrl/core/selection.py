"""Candidate selection: pick k of M candidates by their rewards [M] (docs/algorithms.md sections 5 and 8;
Sol-RL's contrastive subsets, D3S's maximum-variance subset)."""

from __future__ import annotations

import torch

from flowrl.registry import Registry

# selection.kind -> fn(rewards [M], k, generator=None) -> indices [k]; a new selection is a registered function
SELECTIONS = Registry("selection.kind", "Selections")  # which k of M candidates a group keeps


def _check(rewards: torch.Tensor, k: int) -> torch.Tensor:
    r = rewards.float().flatten()
    if not 0 < k <= r.numel():
        raise ValueError(f"selection size k must be in [1, {r.numel()}], got {k}")
    return r


@SELECTIONS.register(name="best_worst")
def best_worst(rewards: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The ceil(k/2) highest and floor(k/2) lowest rewards (Sol-RL's contrastive default)."""
    r = _check(rewards, k)
    order = torch.argsort(r, descending=True, stable=True)
    top = order[: (k + 1) // 2]
    bottom = order[r.numel() - k // 2 :] if k // 2 else order[:0]
    return torch.cat([top, bottom])


@SELECTIONS.register(name="max_variance")
def max_variance(rewards: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The k-subset with the largest reward variance (D3S: maximising Var(A) bounds the policy
    gradient norm from above). A maximum-variance subset of scalars is always some j highest
    plus k - j lowest values, so checking the k + 1 splits is exact."""
    r = _check(rewards, k)
    order = torch.argsort(r, descending=True, stable=True)
    best, best_var = None, -1.0
    for j in range(k + 1):
        idx = torch.cat([order[:j], order[r.numel() - (k - j) :] if k - j else order[:0]])
        var = r[idx].var(unbiased=False).item() if k > 1 else 0.0
        if var > best_var + 1e-12:
            best, best_var = idx, var
    return best


@SELECTIONS.register(name="mean_deviation")
def mean_deviation(rewards: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The k candidates farthest from the pool mean, |r - mean(r)|."""
    r = _check(rewards, k)
    return torch.argsort((r - r.mean()).abs(), descending=True, stable=True)[:k]


@SELECTIONS.register(name="random")
def random_subset(rewards: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    r = _check(rewards, k)
    return torch.randperm(r.numel(), generator=generator)[:k]


def select(kind: str, rewards: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices [k] into `rewards` chosen by the selection registered as `kind` (`generator`: for the random ones)."""
    return SELECTIONS.get(kind)(rewards, k, generator)


def select_per_group(kind: str, rewards: torch.Tensor, group_ids: torch.Tensor, k: dict[int, int],
                     valid: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted indices into the pool `rewards` [N]: `select(kind, ...)` of k[g] candidates within
    each group g of `group_ids` [N]. Only `valid` candidates are chosen while a group has k[g]
    of them; a group with fewer takes all its valid ones and fills up with invalid ones."""
    r = rewards.float().flatten()
    ok = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.bool().flatten()
    picked = []
    for g in torch.unique(group_ids).tolist():
        idx = torch.nonzero(group_ids == g).flatten()
        good, bad = idx[ok[idx]], idx[~ok[idx]]
        need = k[g]
        if need > idx.numel():
            raise ValueError(f"group {g} has {idx.numel()} candidates, fewer than the {need} to select")
        if good.numel() >= need:
            picked.append(good[select(kind, r[good], need, generator)])
        else:
            picked.append(torch.cat([good, bad[: need - good.numel()]]))
    return torch.sort(torch.cat(picked)).values
