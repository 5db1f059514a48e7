"""Branching rollout trees (BranchGRPO: Li et al., arXiv:2509.06040; docs/algorithms.md section 3).

One root per prompt. At a split step every node evaluates the network once and draws `b`
children from that one SDE transition, its noise scaled by `SplitNoise` (the reference code
draws a split's children 4 stds from the mean and scores them with the unscaled std; scale 1 is
the step function's own transition). Between splits each node advances alone, by ODE or SDE as
the spec says. All nodes of one level go through the network together, in batches of
`batch_size` (the reference runs one node per forward); training re-evaluates edges with exactly
those batches (`tree_edges`), so the first importance ratio is 1, or any edges together with one
sigma per row (`tree_edge_rows`). The last step's clean prediction x_{T-1} - sigma_{T-1} v of
every leaf is kept (`TreeTrajectory.clean`): the reference code scores it, not the leaf.

Noise of the edge into a node is keyed by (path_seed(tree seed, node path), step): a leaf is
reproducible from (seed, path) whatever else is in the batch, and the leftmost path (path 0)
draws exactly the noise of a flat rollout of the tree's seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from flowrl.core.tree import step_depths, tree_nfe
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, StepOutput, Trajectory
from flowrl.sampling.steps import gaussian_log_prob, predicted_x0

SPLIT_LOGPROB_STDS = ("unscaled", "scaled")


def path_seed(seed: int, path: int) -> int:
    """The noise seed of the node reached by `path` (a mixed-radix number: at each split
    path = parent_path x b + child index). Path 0 keeps the tree's own seed, so the leftmost
    chain of a tree is the flat rollout of that seed. Paths are unique within one level, and
    the step is part of the noise key, so no two edges of a tree share noise."""
    return int(seed) if path == 0 else (int(seed) * 0x2545F491 + path * 0x9E3779B9) % (2**62)


def parent_batches(n: int, batch_size: int) -> list[slice]:
    """The batches of one level's nodes that share a forward, when sampling and when training."""
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


@dataclass(frozen=True)
class SplitNoise:
    """The transition of a split's children (BranchGRPO, Li et al., arXiv:2509.06040): x' = mean +
    (scale x std) eps, with the step's own mean and std. Its log-prob takes the std `logprob_std`
    names: "scaled", scale x std (the density the children were drawn from), or "unscaled", the
    step's own std (the reference code's: its log-prob describes a Gaussian `scale` times narrower
    than the one sampled). Sampling and training both go through `step`, so either way the first
    importance ratio is 1. With scale 1 it is the step function's own transition."""

    scale: float = 1.0
    logprob_std: str = "scaled"

    def step(self, spec: SamplerSpec, t: int, x, v, noise=None, x_next=None) -> StepOutput:
        if self.scale == 1.0:
            return spec.step(t, x, v, noise=noise, x_next=x_next)
        out = spec.step(t, x, v, noise=None if noise is None else noise * self.scale, x_next=x_next)
        if self.logprob_std == "unscaled" or (spec.kind == "cps" and spec.cps_logprob == "reference"):
            return out  # cps's reference log-prob, -mean((x' - mean)^2), has no std to scale
        std = out.std * self.scale
        return out._replace(std=std, log_prob=gaussian_log_prob(out.next_x, out.mean, std, spec.reduction))


def edge_step(spec: SamplerSpec, t: int, x, v, splits: dict[int, int], split_noise: SplitNoise, noise=None,
              x_next=None) -> StepOutput:
    """The transition of the edges at step t: a split's (`SplitNoise`) or the spec's own step."""
    if t in splits:
        return split_noise.step(spec, t, x, v, noise=noise, x_next=x_next)
    return spec.step(t, x, v, noise=noise, x_next=x_next)


@dataclass
class TreeTrajectory:
    """A batch of trees, level by level (level t holds the latents at sigmas[t]). Nodes of a
    level are ordered tree by tree, and children follow the order of their parents."""

    levels: list[torch.Tensor]  # T + 1 tensors [n_t, *latent] fp32, on the CPU
    parents: list[torch.Tensor]  # T tensors [n_{t+1}]: index of each node's parent in level t
    log_probs: list[torch.Tensor]  # T tensors [n_{t+1}]: behaviour log-prob of the edge into each node (0: ODE edge)
    tree_ids: list[torch.Tensor]  # T + 1 tensors [n_t]: index of the node's tree (into prompts / seeds)
    paths: list[torch.Tensor]  # T + 1 tensors [n_t]: path id of each node within its tree
    sigmas: torch.Tensor
    stochastic: torch.Tensor  # [T] bool: steps whose edges are Gaussian (splits always are)
    splits: dict[int, int]
    prompts: list[str]  # per tree
    prompt_ids: torch.Tensor  # [n_trees]
    seeds: torch.Tensor  # [n_trees]
    nfe: int = 0  # network evaluations (rows through policy.velocity), counted while sampling
    clean: torch.Tensor | None = None  # [n_T, *latent] fp32: each leaf's x_{T-1} - sigma_{T-1} v, its last step's clean prediction
    split_noise: SplitNoise = SplitNoise()  # how the splits' children were drawn and scored

    @property
    def num_steps(self) -> int:
        return len(self.parents)

    @property
    def num_trees(self) -> int:
        return len(self.prompts)

    @property
    def leaves(self) -> torch.Tensor:
        return self.levels[-1]

    @property
    def depth_of_step(self) -> torch.Tensor:
        """[T] long: depth of the nodes the edges at step t lead to."""
        return step_depths(self.num_steps, self.splits)

    def ancestors(self, level: int) -> torch.Tensor:
        """[T + 1, n_level] long: index of each level-`level` node's ancestor at every level
        (for t > level: -1)."""
        n = len(self.levels[level])
        out = torch.full((self.num_steps + 1, n), -1, dtype=torch.long)
        out[level] = torch.arange(n)
        for t in range(level - 1, -1, -1):
            out[t] = self.parents[t][out[t + 1]]
        return out

    def leaf_trajectory(self) -> Trajectory:
        """Every leaf's chain as a flat `Trajectory` (shared prefixes copied): latents [L, T + 1],
        the behaviour log-prob of each edge on the chain, and the leaf's path in `extras`."""
        anc = self.ancestors(self.num_steps)
        latents = torch.stack([self.levels[t][anc[t]] for t in range(self.num_steps + 1)], dim=1)
        log_probs = torch.stack([self.log_probs[t][anc[t + 1]] for t in range(self.num_steps)], dim=1)
        tree = self.tree_ids[-1]
        return Trajectory(
            latents=latents, log_probs=log_probs, sigmas=self.sigmas.clone(), trained=self.stochastic.clone(),
            prompts=[self.prompts[i] for i in tree.tolist()], prompt_ids=self.prompt_ids[tree], group_ids=self.prompt_ids[tree],
            seeds=self.seeds[tree], extras={"paths": self.paths[-1].clone()},
        )


def tree_spec(spec: SamplerSpec, splits: dict[int, int]) -> SamplerSpec:
    """The flat spec with every split step made stochastic: a split needs noise to branch."""
    sde = spec.sde_steps.clone()
    for t in splits:
        sde[t] = True
    return dataclasses.replace(spec, sde_steps=sde)


def edge_children(tree: TreeTrajectory, t: int, parent_slice: slice) -> torch.Tensor:
    """Indices (into level t + 1) of the children of the level-t nodes in `parent_slice`."""
    p = tree.parents[t]
    return ((p >= parent_slice.start) & (p < parent_slice.stop)).nonzero().squeeze(1)


@torch.no_grad()
def tree_rollout(policy, prompts: Sequence[str], seeds: Sequence[int], spec: SamplerSpec, splits: dict[int, int],
                 batch_size: int, prompt_ids: Sequence[int] | None = None, progress: bool = False,
                 desc: str = "tree sampling", split_noise: SplitNoise = SplitNoise()) -> TreeTrajectory:
    """Sample one tree per prompt: splits[t] children at step t (drawn as `split_noise` says), one
    child elsewhere."""
    spec = tree_spec(spec, splits)
    shape = policy.latent_shape()
    n_trees = len(prompts)
    # encode (and cache) each distinct prompt alone: a text encoder's output can move in the last
    # bit with the other prompts in its batch, and a level batch mixes prompts; one prompt per
    # call keeps a tree reproducible from (seed, prompt, config) whatever was encoded before
    for p in dict.fromkeys(prompts):
        policy.encode([p])
    seeds = [int(s) for s in seeds]
    x = seeded_noise(seeds, INITIAL, shape, policy.device)
    levels, parents, log_probs = [x.cpu()], [], []
    tree_ids, paths = [torch.arange(n_trees)], [torch.zeros(n_trees, dtype=torch.long)]
    nfe, clean = 0, None
    bar = tqdm(total=tree_nfe(spec.num_steps, splits, n_trees), desc=desc, disable=not progress, leave=False, unit="nfe")
    for t in range(spec.num_steps):
        level, ids, path = levels[-1], tree_ids[-1], paths[-1]
        vs = []
        for batch in parent_batches(len(level), batch_size):
            vs.append(policy.velocity(level[batch].to(policy.device), float(spec.sigmas[t]),
                                      policy.encode([prompts[j] for j in ids[batch].tolist()])))
            nfe += batch.stop - batch.start
            bar.update(batch.stop - batch.start)
        v = torch.cat(vs)
        b = splits.get(t, 1)
        parent = torch.arange(len(level)).repeat_interleave(b)
        child_path = path.repeat_interleave(b) * b + torch.arange(b).repeat(len(level))
        child_tree = ids.repeat_interleave(b)
        noise = None
        if spec.is_stochastic(t):
            child_seeds = [path_seed(seeds[k], p) for k, p in zip(child_tree.tolist(), child_path.tolist())]
            noise = seeded_noise(child_seeds, t, shape, policy.device)
        x = level.to(policy.device)[parent]
        out = edge_step(spec, t, x, v[parent], splits, split_noise, noise=noise)
        if t == spec.num_steps - 1:
            clean = predicted_x0(x, v[parent], float(spec.sigmas[t])).cpu()
        levels.append(out.next_x.cpu())
        parents.append(parent)
        log_probs.append(out.log_prob.cpu())
        tree_ids.append(child_tree)
        paths.append(child_path)
    bar.close()
    return TreeTrajectory(
        levels, parents, log_probs, tree_ids, paths, spec.sigmas.clone(),
        torch.tensor([spec.is_stochastic(t) for t in range(spec.num_steps)]), dict(splits), list(prompts),
        torch.as_tensor(list(prompt_ids) if prompt_ids is not None else range(n_trees), dtype=torch.long),
        torch.as_tensor(seeds, dtype=torch.long), nfe, clean, split_noise,
    )


def tree_edges(policy, tree: TreeTrajectory, spec: SamplerSpec, t: int, parent_slice: slice) -> tuple[StepOutput, torch.Tensor]:
    """Re-evaluate, under the current policy and with grad, the edges out of the level-t nodes
    in `parent_slice` (one of `parent_batches`, so the forward repeats the sampling forward bit
    for bit): one forward for the parents, then every child's log-prob from the same step
    function given the stored child latent. Returns (StepOutput over the children, their
    indices into level t + 1)."""
    spec = tree_spec(spec, tree.splits)
    level = tree.levels[t][parent_slice].to(policy.device)
    ids = tree.tree_ids[t][parent_slice].tolist()
    v = policy.velocity(level, float(spec.sigmas[t]), policy.encode([tree.prompts[j] for j in ids]))
    children = edge_children(tree, t, parent_slice)
    local_parent = (tree.parents[t][children] - parent_slice.start).to(policy.device)
    out = edge_step(spec, t, level[local_parent], v[local_parent], tree.splits, tree.split_noise,
                    x_next=tree.levels[t + 1][children].to(policy.device))
    return out, children


def tree_edge_rows(policy, tree: TreeTrajectory, spec: SamplerSpec, steps: torch.Tensor, children: torch.Tensor) -> StepOutput:
    """Re-evaluate, under the current policy and with grad, the edges into node children[i] of level
    steps[i] + 1, whatever their steps: one forward with one sigma per row (each edge its own row,
    a split parent's once per child, as the reference code trains edge by edge), then each row's
    log-prob from its own step's function. Returns the StepOutput over the rows in their order,
    with one std per row ([E, 1, ...])."""
    spec = tree_spec(spec, tree.splits)
    rows = list(zip(steps.tolist(), children.tolist()))
    x = torch.stack([tree.levels[t][tree.parents[t][c]] for t, c in rows]).to(policy.device)
    x_next = torch.stack([tree.levels[t + 1][c] for t, c in rows]).to(policy.device)
    prompts = [tree.prompts[int(tree.tree_ids[t + 1][c])] for t, c in rows]
    v = policy.velocity(x, spec.sigmas[steps], policy.encode(prompts))
    outs, order = [], []
    for t in torch.unique(steps).tolist():
        idx = (steps == t).nonzero().squeeze(1)
        dev = idx.to(policy.device)
        outs.append(edge_step(spec, t, x[dev], v[dev], tree.splits, tree.split_noise, x_next=x_next[dev]))
        order.append(idx)
    back = torch.argsort(torch.cat(order)).to(policy.device)  # the inverse of the rows' grouping by step

    def rows_of(name: str) -> torch.Tensor:
        return torch.cat([getattr(o, name) for o in outs])[back]

    std = torch.cat([o.std.reshape(1).expand(len(i)) for o, i in zip(outs, order)])[back]
    return StepOutput(rows_of("next_x"), rows_of("mean"), std.view(-1, *[1] * (x.ndim - 1)), rows_of("log_prob"))
