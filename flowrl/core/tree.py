"""Rollout trees (BranchGRPO: Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured
Branching in Diffusion Models", arXiv:2509.06040; docs/algorithms.md section 3), modality-free.

A batch of trees is given level by level: `parents[t]` [n_{t+1}] holds, for every node of level
t + 1, the index of its parent in level t; `tree_ids[t]` [n_t] says which tree (prompt) a node of
level t belongs to. Leaves are the nodes of the last level. The same shapes describe denoising
trees (a level per step) and token trees (a level per token).

The *depth* of a node is counted in one of two units (DEPTH_UNITS). "split": the number of splits
above it, so a tree that splits at steps s_1 < ... < s_D has depths 0..D and the edge taken at step
t leads to a node of depth #{s_d <= t}. "step" (the BranchGRPO reference code's): the number of
steps above it, so the edge taken at step t leads to a node of depth t + 1, in 1..T.
"""

from __future__ import annotations

import math

import torch

FUSIONS = ("mean", "prob")
DEPTH_UNITS = ("step", "split")


def fuse_rewards(parents: list[torch.Tensor], leaf_rewards: torch.Tensor, fusion: str = "mean",
                 edge_log_probs: list[torch.Tensor] | None = None, leaf_valid: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Node values for every level, from the leaves up (BranchGRPO's reward fusion).

    'mean': a node's value is the mean of the rewards of all leaves below it (so a child with
    more leaves weighs more than a sibling with fewer). 'prob': a node's value is its children's
    values weighted by softmax_siblings(edge log-prob): the probability-weighted option (our
    reading; with mean-reduced Gaussian log-probs the weights stay close to uniform).
    Every node must have at least one child. With `leaf_valid` [L] bool, invalid leaves take no
    part: they weigh nothing in their ancestors' values, and a node with no valid leaf below it
    gets value 0 (`valid_nodes` marks those). Returns values[t] [n_t] fp32 for t = 0..T
    (values[T] = leaf rewards), computed in fp64."""
    if fusion not in FUSIONS:
        raise ValueError(f"tree fusion must be one of {FUSIONS}, got {fusion!r}")
    if fusion == "prob" and edge_log_probs is None:
        raise ValueError("probability-weighted fusion needs the edge log-probs")
    values = [leaf_rewards.double()]
    # number of valid leaves under each node (every leaf counts when no mask is given)
    leaves = [torch.ones_like(values[0]) if leaf_valid is None else leaf_valid.double()]
    for t in range(len(parents) - 1, -1, -1):
        p = parents[t].long()
        n_parent = int(p.max()) + 1 if p.numel() else 0
        child_v, child_n = values[0], leaves[0]
        count = torch.zeros(n_parent, dtype=torch.float64).index_add_(0, p, child_n)
        if fusion == "mean":
            value = torch.zeros(n_parent, dtype=torch.float64).index_add_(0, p, child_v * child_n) / count
        else:
            lp = edge_log_probs[t].double()
            top = torch.full((n_parent,), -math.inf, dtype=torch.float64).scatter_reduce(0, p, lp, "amax")
            # softmax among siblings, shifted by the sibling max for stability; a child with no valid
            # leaf below it has no value and no weight
            w = torch.exp(lp - top[p]) * (child_n > 0)
            norm = torch.zeros(n_parent, dtype=torch.float64).index_add_(0, p, w)
            value = torch.zeros(n_parent, dtype=torch.float64).index_add_(0, p, w * child_v) / norm
        values.insert(0, torch.where(count > 0, value, torch.zeros_like(value)))
        leaves.insert(0, count)
    return [v.float() for v in values]


def valid_nodes(parents: list[torch.Tensor], leaf_valid: torch.Tensor) -> list[torch.Tensor]:
    """Per level, [n_t] bool: the nodes with at least one valid leaf below them."""
    out = [leaf_valid.bool()]
    for t in range(len(parents) - 1, -1, -1):
        p = parents[t].long()
        n_parent = int(p.max()) + 1 if p.numel() else 0
        out.insert(0, torch.zeros(n_parent, dtype=torch.long).index_add_(0, p, out[0].long()) > 0)
    return out


def depthwise_advantages(values: list[torch.Tensor], tree_ids: list[torch.Tensor], eps: float = 1e-4,
                         valid: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """BranchGRPO's depth-wise advantage: A = (V - mean) / (std + eps) over the nodes of one
    level of one tree (population std); A = 0 where they are all equal (a level before the first
    split has one node per tree). Between splits a level holds the same nodes as its depth, so
    per level equals per depth. Returns advantages[t] [n_t]; the edge into node c of level t
    is trained with advantages[t][c]. With `valid` (per level, from `valid_nodes`) the statistics
    cover the valid nodes only, and invalid nodes get A = 0."""
    out = []
    for t, (v, ids) in enumerate(zip(values, tree_ids)):
        v = v.double()
        uniq, inv = torch.unique(ids, return_inverse=True)
        g = uniq.numel()
        ok = torch.ones_like(v, dtype=torch.bool) if valid is None else valid[t]
        w = ok.double()
        n = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, w)
        mean = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, v * w) / n
        var = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, (v - mean[inv]) ** 2 * w) / n
        hi = torch.full((g,), -math.inf, dtype=torch.float64).scatter_reduce(0, inv, torch.where(ok, v, -math.inf), "amax")
        lo = torch.full((g,), math.inf, dtype=torch.float64).scatter_reduce(0, inv, torch.where(ok, v, math.inf), "amin")
        # exact test: the float std of equal values can be a rounding step above 0
        flat = (hi == lo)[inv] | ~ok
        a = (v - mean[inv]) / (var.sqrt()[inv] + eps)
        out.append(torch.where(flat, torch.zeros_like(a), a).float())
    return out


def width_prune(advantages: torch.Tensor, tree_ids: torch.Tensor, keep_fraction: float) -> torch.Tensor:
    """Gradient-only width pruning: per tree, keep the ceil(keep_fraction x n) nodes with the
    largest |A| (ties: lower index first). Returns a bool mask [n]; the rollout is untouched."""
    keep = torch.zeros(advantages.shape, dtype=torch.bool)
    for tid in torch.unique(tree_ids).tolist():
        idx = (tree_ids == tid).nonzero().squeeze(1)
        k = max(1, math.ceil(keep_fraction * idx.numel() - 1e-9))  # 1e-9: 0.3 x 10 must keep 3, not 4
        order = torch.argsort(advantages[idx].abs(), descending=True, stable=True)[:k]
        keep[idx[order]] = True
    return keep


def level_counts(num_steps: int, splits: dict[int, int], roots: int = 1) -> list[int]:
    """Nodes per level n_0..n_T for trees that split into splits[t] children at step t."""
    counts = [roots]
    for t in range(num_steps):
        counts.append(counts[-1] * splits.get(t, 1))
    return counts


def tree_nfe(num_steps: int, splits: dict[int, int], roots: int = 1) -> int:
    """Network evaluations of a tree rollout: one per node per step (a split evaluates its
    parent once and draws every child from that one Gaussian)."""
    return sum(level_counts(num_steps, splits, roots)[:num_steps])


def step_depths(num_steps: int, split_steps) -> torch.Tensor:
    """[T] long: the depth of the node the edge at step t leads to (splits at steps <= t)."""
    s = torch.as_tensor(sorted(split_steps), dtype=torch.long)
    return torch.searchsorted(s, torch.arange(num_steps), right=True)


def edge_depths(num_steps: int, split_steps, unit: str = "split") -> torch.Tensor:
    """[T] long: the depth, in `unit` (DEPTH_UNITS), of the node the edge at step t leads to:
    step_depths for "split", t + 1 for "step"."""
    if unit not in DEPTH_UNITS:
        raise ValueError(f"tree depth unit must be one of {DEPTH_UNITS}, got {unit!r}")
    return step_depths(num_steps, split_steps) if unit == "split" else torch.arange(1, num_steps + 1)


def trained_depths(num_depths: int, prune_depths=(), window: int = 0, shift_every: int = 1, iteration: int = 0) -> torch.Tensor:
    """[D + 1] bool: which depths (in either unit) carry gradient this iteration (gradient-only
    depth pruning). Depth 0 is never trained: in split units it is everything before the first
    split, where a tree has one node, so A = 0; in step units no edge leads there.
    `prune_depths` are always skipped. With window > 0 only `window` consecutive depths are
    trained, starting at depth 1 and moving one depth deeper every `shift_every` iterations
    until the window touches depth D (as a progressive SDE window moves towards the data)."""
    mask = torch.zeros(num_depths + 1, dtype=torch.bool)
    mask[1:] = True
    for d in prune_depths:
        mask[d] = False
    if window > 0:
        start = min(1 + iteration // max(shift_every, 1), num_depths - window + 1)
        inside = torch.zeros_like(mask)
        inside[start : start + window] = True
        mask &= inside
    return mask
