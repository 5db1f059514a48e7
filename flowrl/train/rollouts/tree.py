"""rollout.kind tree: BranchGRPO (Li et al., arXiv:2509.06040; docs/algorithms.md section 3).

One tree per prompt the allocator picks (uniform, validated), trees split across processes and
padded with copies of the last one (zero advantage, never trained) so every process runs the same
forwards. The leaves are scored on the one reward path (reward.on_invalid: drop leaves invalid
leaves out of the fusion and the advantages), their rewards fused up the tree, and every edge
trained with the depth-wise advantage of the node it leads to; both only involve one tree, so
each process does its own. The defaults are the reference code's (docs/algorithms.md section 3
lists them, and flowrl's variant of each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from functools import partial
from typing import NamedTuple

import torch

from flowrl.core.allocation import successes
from flowrl.core.losses import gaussian_kl
from flowrl.core.seeds import Stream, sample_seed
from flowrl.core.tree import (DEPTH_UNITS, depthwise_advantages, edge_depths, fuse_rewards, level_counts, trained_depths,
                              valid_nodes, width_prune)
from flowrl.errors import ConfigError, check_choice, check_positive
from flowrl.runtime.shards import ProcessShard, gather_real
from flowrl.sampling.rollout import SamplerSpec, policy_precision
from flowrl.sampling.tree import (SPLIT_LOGPROB_STDS, SplitNoise, TreeTrajectory, edge_children, parent_batches, tree_edge_rows,
                                  tree_edges, tree_rollout, tree_spec)
from flowrl.train.experience import SAMPLES, TRANSITIONS, WHOLE_GROUPS, Experience, SampleBatch, TransitionBatch
from flowrl.train.parts import Rollout, register_rollout
from flowrl.train.rollouts.common import (group_advantages, group_spread, one_group_per_prompt, require_some_valid, step_kl,
                                          steps_without_noise, training_spec)
from flowrl.train.scoring import Scores, Scoring


class TreeBatch(NamedTuple):
    """One iteration's trees on this process and what training needs of them: tensors and the
    sampler's spec only, so that it travels between processes (run.async_rollouts)."""

    iteration: int
    tree: TreeTrajectory  # this process's trees (may end with padding copies)
    scores: Scores  # the leaves' rewards: every process's real leaves in tree order, and this process's
    advantages: list[torch.Tensor]  # per level [n_t]: depth-wise, clipped; 0 on padding trees
    real: torch.Tensor  # [n_local_trees] bool: False for padding copies
    prompt_ids: torch.Tensor  # [n_trees x G] pool index of each real leaf
    num_trees: int  # real trees over all processes
    spec: SamplerSpec  # the sampler the trees were drawn with (training re-evaluates edges with it)


def tree_edge_steps(policy, tree: TreeTrajectory, spec: SamplerSpec, t: int, parents: slice):
    """The StepOutput of `tree_edges` alone: a TransitionBatch's `evaluate` over one parent batch."""
    return tree_edges(policy, tree, spec, t, parents)[0]


def rows_kl(out, ref, keep, reduction: str) -> torch.Tensor:
    """The exact KL between two evaluations of `tree_edge_rows` (one std per row), per kept edge."""
    return gaussian_kl(out.mean[keep], ref.mean[keep], out.std[keep], reduction)


LEAF_REWARDS = ("clean_prediction", "final_latent")
EDGE_ORDERS = ("shuffled", "by_step")


@dataclass
class TreeOptions:
    """BranchGRPO trees (rollout.kind: tree; docs/algorithms.md section 3). One tree per prompt;
    leaves per prompt = the product of the branching factors, and must equal data.group_size.
    Depths, in depth_unit: "step", the edge at step t leads to depth t + 1; "split", depth d is
    the segment after the d-th split (the edges at steps split_steps[d-1] .. split_steps[d]-1, to
    the end for the last). Edges before the first split are never trained (one node per tree:
    A = 0). Pruning masks gradient only; the rollout is the same. Every default is the reference
    code's; flowrl's variants are named values."""

    split_steps: list[int] = field(default_factory=lambda: [0, 3, 6, 9])
    branching: list[int] = field(default_factory=lambda: [2])  # one factor for all splits, or one per split
    # sde: every step stochastic and trained (BranchGRPO) | ode: only the split steps |
    # window: BranchGRPO-Mix, SDE inside sampling.window (and at the splits), ODE elsewhere
    between: str = "sde"
    fusion: str = "mean"  # mean (of the leaves below) | prob (children weighted by softmax of sibling edge log-probs)
    width_keep: float = 1.0  # per tree, train only this fraction of last-depth edges, the largest |A| first
    prune_depths: list[int] = field(default_factory=list)  # depths (in depth_unit, from 1) whose edges are never trained
    depth_window: int = 0  # > 0: train only this many consecutive depths (in depth_unit), from depth 1 sliding deeper
    depth_window_shift_every: int = 10  # iterations per one-depth shift of depth_window
    # a split's children are drawn at mean + split_noise_scale x std x eps (the reference launch script's
    # --tree_split_noise_scale 4.0; the argument's own default is 0.3); 1: the step's own transition
    split_noise_scale: float = 4.0
    # the std of a split edge's log-prob: unscaled (the reference code's: the step's std, whatever the noise was
    # scaled by) | scaled (flowrl's: split_noise_scale x std, the density the children were drawn from)
    split_logprob_std: str = "unscaled"
    # what a leaf's reward scores: clean_prediction (the reference code's: x_{T-1} - sigma_{T-1} v, the last step's
    # prediction of the clean sample from its input) | final_latent (flowrl's: the leaf itself, the last step's sample)
    leaf_reward: str = "clean_prediction"
    # the unit of prune_depths and depth_window: step (the reference code's: the edge at step t leads to depth t + 1,
    # depths 1..sampling.num_steps) | split (flowrl's: depth d is the segment after the d-th split, depths 1..splits)
    depth_unit: str = "step"
    # shuffled (the reference code's): every trained edge of this process's trees in one order, shuffled by (trainer.seed,
    # iteration), an optimizer step every edges_per_step of them, each step's edges in forwards of at most
    # sampling.batch_size rows with one sigma per row | by_step (flowrl's): one micro-batch and optimizer step group per
    # (trained step, sampling batch of parents), the sampling forward again
    edge_order: str = "shuffled"
    edges_per_step: int = 12  # shuffled: edges per optimizer step (the reference: gradient_accumulation_steps 12)

    def split_noise(self) -> SplitNoise:
        """How the splits' children are drawn and scored."""
        return SplitNoise(float(self.split_noise_scale), self.split_logprob_std)

    def splits(self) -> dict[int, int]:
        """split step -> branching factor."""
        b = self.branching
        factors = b if len(b) == len(self.split_steps) else [b[0]] * len(self.split_steps)
        return dict(zip(self.split_steps, factors))


@register_rollout
class TreeRollout(Rollout):
    name = "tree"
    options = TreeOptions
    runs_ahead = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scoring = Scoring(ctx.policy, ctx.reward_runner, ctx.accelerator)

    @classmethod
    def provides(cls, cfg) -> set[str]:
        # the edges for GRPO; the leaves, one tree per prompt on one process, as whole groups of clean samples
        return {TRANSITIONS, SAMPLES, WHOLE_GROUPS}

    @classmethod
    def validate(cls, cfg) -> None:
        validate_tree(cfg)

    def spec(self, iteration: int) -> SamplerSpec:
        """between=sde: every step stochastic; window (BranchGRPO-Mix): the flat SDE window of
        this iteration; ode: none. Split steps are stochastic in every case."""
        spec = training_spec(self.ctx.cfg, iteration, self.ctx.policy, self.ctx.plan)  # sampling.window is 'all' unless between=window (validated)
        if self.ctx.cfg.rollout.tree.between == "ode":
            spec.sde_steps = torch.zeros_like(spec.sde_steps)
        return tree_spec(spec, self.ctx.cfg.rollout.tree.splits())

    def sample(self, iteration: int) -> TreeBatch:
        """This process's trees of `iteration`, their leaves scored, and depth-wise advantages; the
        allocator sees the outcomes."""
        ctx = self.ctx
        cfg = ctx.cfg
        g, bs, tr = cfg.data.group_size, cfg.sampling.batch_size, cfg.rollout.tree
        ids, seeds, shard = one_group_per_prompt(ctx, iteration)  # tree k's root noise: the flat group's first sample's
        n = len(ids)
        local_ids = shard.take(ids)
        spec = self.spec(iteration)
        tree = tree_rollout(ctx.policy, [ctx.prompts[i] for i in local_ids], shard.take(seeds), spec, tr.splits(), bs,
                            prompt_ids=local_ids, progress=ctx.progress, desc=f"iter {iteration} tree sampling",
                            split_noise=tr.split_noise())
        scored = tree.clean if tr.leaf_reward == "clean_prediction" else tree.leaves
        on_batch = self.scoring.start([tree.prompts[i] for i in tree.tree_ids[-1].tolist()])
        for batch in parent_batches(len(tree.leaves), bs):
            on_batch(batch, scored[batch])
        scores = self.scoring.finish(n * g)  # process-major = tree order; padding last
        require_some_valid(scores.valid, iteration)

        real = shard.positions < n
        values = fuse_rewards(tree.parents, scores.local_rewards.float().cpu() @ ctx.reward_fn.channel_weights, tr.fusion,
                              tree.log_probs, scores.local_valid)
        node_valid = valid_nodes(tree.parents, scores.local_valid)
        clip = cfg.advantage.clip
        advantages = [torch.where(real[t_ids], a.clamp(-clip, clip), torch.zeros_like(a))
                      for a, t_ids in zip(depthwise_advantages(values, tree.tree_ids, cfg.advantage.eps, node_valid), tree.tree_ids)]
        prompt_ids = torch.tensor(ids[:n]).repeat_interleave(g)
        weights = ctx.reward_fn.channel_weights
        ctx.allocator.observe(prompt_ids[scores.valid], successes(scores.rewards[scores.valid] @ weights, cfg.allocator.success_threshold))
        return TreeBatch(iteration, tree, scores, advantages, real, prompt_ids, n, spec)

    def experience(self, batch: TreeBatch) -> Experience:
        """The trained edges of `batch` (pruning and the depth window applied here, on the trainer's
        plan) in micro-batches over this process's policy; for an objective that trains on clean
        samples, the leaves (`leaf_experience`)."""
        if self.ctx.objective_needs == SAMPLES:
            return self.leaf_experience(batch)
        ctx = self.ctx
        acc, g, weights = ctx.accelerator, ctx.cfg.data.group_size, ctx.reward_fn.channel_weights
        tree, scores, n, iteration = batch.tree, batch.scores, batch.num_trees, batch.iteration
        edges = self.edge_masks(tree, batch.advantages, iteration)
        keep = self.keep(tree, edges, batch.real)
        if ctx.cfg.rollout.tree.edge_order == "shuffled":
            groups = self.shuffled_micro_batches(tree, batch.spec, batch.advantages, keep, edges, iteration)
        else:
            groups = self.micro_batches(tree, batch.spec, batch.advantages, keep)
        leaf_adv = gather_real(acc, batch.advantages[-1], n * g)
        by_tree = (scores.rewards @ weights).view(n, g)
        local_kept = torch.tensor([sum(int(k.sum()) for k in keep if k is not None)])
        metrics = {
            "adv_abs_mean": leaf_adv.abs().mean().item(),
            "degenerate_groups": (by_tree.amax(1) == by_tree.amin(1)).float().mean().item(),
            "trees": n,
            "nfe_per_leaf": tree.nfe / len(tree.leaves),
            "trained_steps": sum(k is not None for k in keep),
            # kept edges per inner epoch over all processes (the objective counts its own process)
            "trained_transitions": int(gather_real(acc, local_kept, acc.num_processes).sum()),
            "training_forwards": sum(len(g) for g in groups),  # micro-batches per inner epoch, this process
            **self.depth_metrics(tree, batch.advantages, n),
            **group_spread(by_tree.flatten(), batch.prompt_ids, scores.valid),
            "time_reward": scores.reward_time,
            "time_reward_wait": scores.reward_wait,
        }
        return Experience(iteration, scores.rewards, batch.prompt_ids, scores.valid, leaf_adv, policy_precision(ctx.policy),
                          transitions=groups, weigh_by_transition=True, metrics=metrics)

    def leaf_experience(self, batch: TreeBatch) -> Experience:
        """The leaves as groups of clean samples, for DGPO, AWM, DPO, NFT and GDRO: each tree's
        data.group_size leaves are its prompt's group, each leaf the sample its reward scored
        (rollout.tree.leaf_reward), with the advantage a flat group's samples would get from the
        same rewards (advantage.kind, per prompt) and a flat group's seeds (tree k's leaf j is the
        iteration's sample k x G + j: the objective's own noise is keyed by them). Padding trees'
        leaves point past the real samples, as a flat rollout's padding copies do."""
        ctx = self.ctx
        cfg, acc, weights = ctx.cfg, ctx.accelerator, ctx.reward_fn.channel_weights
        g, bs, tree, scores, n = cfg.data.group_size, cfg.sampling.batch_size, batch.tree, batch.scores, batch.num_trees
        advantages, _, adv_metrics = group_advantages(cfg, scores.rewards, batch.prompt_ids, scores.valid, weights, batch.iteration)
        positions = ProcessShard(n, acc.num_processes, acc.process_index).positions  # each local tree's place among all trees
        leaf = torch.arange(g).repeat(len(positions))
        first = positions.repeat_interleave(g) * g  # the tree's first leaf among the iteration's samples
        index = torch.where(first < n * g, first + leaf, torch.full_like(leaf, n * g))
        seeds = torch.tensor([sample_seed(cfg.trainer.seed, batch.iteration, int(k)) for k in (first + leaf).tolist()])
        scored = tree.clean if cfg.rollout.tree.leaf_reward == "clean_prediction" else tree.leaves
        owner = tree.tree_ids[-1].tolist()
        samples = [SampleBatch(scored[rows].float(), [tree.prompts[i] for i in owner[rows]],
                               seeds[rows], index[rows])
                   for rows in (slice(lo, lo + bs) for lo in range(0, len(owner), bs))]
        metrics = {**adv_metrics, "trees": n, "sampled": n * g, "nfe_per_leaf": tree.nfe / len(tree.leaves),
                   "time_reward": scores.reward_time, "time_reward_wait": scores.reward_wait}
        return Experience(batch.iteration, scores.rewards, batch.prompt_ids, scores.valid, advantages, policy_precision(ctx.policy),
                          samples=samples, metrics=metrics, reward_totals=scores.rewards @ weights)

    @staticmethod
    def keep(tree: TreeTrajectory, edges: list[torch.Tensor | None], real: torch.Tensor) -> list[torch.Tensor | None]:
        """Per step t, the mask over level t + 1 of the edges that carry gradient, or None where
        the step is not trained at all: the `edge_masks` without the padding trees' edges."""
        return [None if m is None else m & real[tree.tree_ids[t + 1]] for t, m in enumerate(edges)]

    def edge_masks(self, tree: TreeTrajectory, advantages: list[torch.Tensor], iteration: int) -> list[torch.Tensor | None]:
        """Per step t, the mask over level t + 1 of the edges trained this iteration, padding trees
        included, or None where the step is not trained at all: ODE steps, steps before the first
        split, pruned depths and depths outside the sliding depth window (in depth_unit). Width
        pruning keeps, per tree, the last split's edges with the largest |A| (the split edges of the
        last split and every edge after it)."""
        tr = self.ctx.cfg.rollout.tree
        splits = len(tree.splits)
        depth = edge_depths(tree.num_steps, tree.splits, tr.depth_unit)
        trained = trained_depths(tree.num_steps if tr.depth_unit == "step" else splits, tr.prune_depths, tr.depth_window,
                                 tr.depth_window_shift_every, self.ctx.plan.step(iteration))
        width = width_prune(advantages[-1], tree.tree_ids[-1], tr.width_keep) if tr.width_keep < 1 else None
        masks: list[torch.Tensor | None] = []
        for t in range(tree.num_steps):
            after = int(tree.depth_of_step[t])  # splits at or before step t
            if not bool(tree.stochastic[t]) or after == 0 or not bool(trained[depth[t]]):
                masks.append(None)
                continue
            k = torch.ones(len(tree.levels[t + 1]), dtype=torch.bool)
            if width is not None and after == splits:
                k &= width  # after the last split, level t + 1 holds the leaves' ancestors one to one, in leaf order
            masks.append(k)
        return masks

    def micro_batches(self, tree: TreeTrajectory, spec: SamplerSpec, advantages: list[torch.Tensor],
                      keep: list[torch.Tensor | None]) -> list[list[TransitionBatch]]:
        """One micro-batch (and accumulation group) per (trained step, sampling batch of parents):
        the forward of the sampling batch again, so the first ratio is exactly 1. Alone, a
        micro-batch whose edges are all pruned is skipped (pruning saves its forward); with
        several processes it stays, with a zero backward, so all run the same backwards."""
        policy, bs = self.ctx.policy, self.ctx.cfg.sampling.batch_size
        skip_empty = self.ctx.accelerator.num_processes == 1
        kl = step_kl(spec.reduction)
        groups = []
        for t, k in enumerate(keep):
            if k is None:
                continue
            for parents in parent_batches(len(tree.levels[t]), bs):
                children = edge_children(tree, t, parents)
                if skip_empty and not bool(k[children].any()):
                    continue
                groups.append([TransitionBatch(partial(tree_edge_steps, policy, tree, spec, t, parents),
                                               tree.log_probs[t][children], advantages[t + 1][children], kl, k[children],
                                               kl_scale=spec.reference_kl_scale(t), step=t)])
        return groups

    def shuffled_micro_batches(self, tree: TreeTrajectory, spec: SamplerSpec, advantages: list[torch.Tensor],
                               keep: list[torch.Tensor | None], edges: list[torch.Tensor | None],
                               iteration: int) -> list[list[TransitionBatch]]:
        """The reference code's order: the `edges` of this process's trees (a padding tree's too, never
        kept, so that every process runs the same backwards) shuffled by (trainer.seed, iteration), then
        one accumulation group per edges_per_step of them, in micro-batches of at most
        sampling.batch_size edges, each one forward with one sigma per row (`tree_edge_rows`)."""
        cfg, policy = self.ctx.cfg, self.ctx.policy
        if all(m is None for m in edges):
            return []
        steps = torch.cat([torch.full((int(m.sum()),), t) for t, m in enumerate(edges) if m is not None])
        children = torch.cat([m.nonzero().squeeze(1) for m in edges if m is not None])
        gen = torch.Generator().manual_seed(sample_seed(cfg.trainer.seed, iteration, Stream.EDGE_ORDER))
        order = torch.randperm(len(steps), generator=gen)
        steps, children = steps[order], children[order]
        per_step, bs, kl = cfg.rollout.tree.edges_per_step, cfg.sampling.batch_size, partial(rows_kl, reduction=spec.reduction)
        groups = []
        for first in range(0, len(steps), per_step):
            group = []
            for lo in range(first, min(first + per_step, len(steps)), bs):
                hi = min(lo + bs, first + per_step, len(steps))
                s, c = steps[lo:hi], children[lo:hi]
                rows = list(zip(s.tolist(), c.tolist()))
                group.append(TransitionBatch(
                    partial(tree_edge_rows, policy, tree, spec, s, c), torch.stack([tree.log_probs[t][i] for t, i in rows]),
                    torch.stack([advantages[t + 1][i] for t, i in rows]), kl, torch.stack([keep[t][i] for t, i in rows]),
                    kl_scale=torch.tensor([spec.reference_kl_scale(t) for t, _ in rows]),
                    step=int(s[0]) if bool((s == s[0]).all()) else None))
            groups.append(group)
        return groups

    def depth_metrics(self, tree: TreeTrajectory, advantages: list[torch.Tensor], n: int) -> dict:
        acc, out = self.ctx.accelerator, {}
        counts = level_counts(tree.num_steps, tree.splits)
        for d, s in enumerate(sorted(tree.splits), start=1):
            a = gather_real(acc, advantages[s + 1], n * counts[s + 1])  # real trees only
            out[f"adv_abs_mean/depth{d}"] = a.abs().mean().item()
            out[f"adv_std/depth{d}"] = a.std(unbiased=False).item()
        return out


def validate_tree(cfg) -> None:
    s, tr = cfg.sampling, cfg.rollout.tree
    steps = list(tr.split_steps)
    if not steps or sorted(set(steps)) != steps or steps[0] < 0 or steps[-1] >= s.num_steps:
        raise ConfigError(f"rollout.tree.split_steps must be strictly increasing steps in [0, {s.num_steps - 1}] "
                          f"(sampling.num_steps is {s.num_steps}); got {steps}")
    if len(tr.branching) not in (1, len(steps)) or min(tr.branching) < 2:
        raise ConfigError(f"rollout.tree.branching must be one factor >= 2 or one per split step ({len(steps)}); got {list(tr.branching)}")
    leaves = 1
    for b in tr.splits().values():
        leaves *= b
    if cfg.data.group_size != leaves:
        raise ConfigError(f"data.group_size must equal the tree's leaves per prompt ({leaves}, the product of "
                          f"rollout.tree.branching over the splits) when rollout.kind is tree; got {cfg.data.group_size}")
    flat_steps = steps_without_noise(cfg, steps)
    if flat_steps:
        raise ConfigError(f"rollout.tree.split_steps {flat_steps} have no noise under sampling.sampler '{s.sampler}' "
                          "(a split needs a stochastic step to branch); choose earlier steps")
    check_choice("rollout.tree.between", tr.between, ("sde", "ode", "window"))
    if tr.between == "window" and s.window.strategy == "all":
        raise ConfigError("rollout.tree.between 'window' (BranchGRPO-Mix) needs sampling.window.strategy fixed, random "
                          "or progressive; with 'all' use between=sde")
    if tr.between != "window" and s.window.strategy != "all":
        raise ConfigError(f"sampling.window.strategy must be all when rollout.tree.between is '{tr.between}'; "
                          "set rollout.tree.between=window to use an SDE window with trees")
    check_choice("rollout.tree.fusion", tr.fusion, ("mean", "prob"))
    if not 0 < tr.width_keep <= 1:
        raise ConfigError(f"rollout.tree.width_keep must be in (0, 1]; got {tr.width_keep}")
    check_positive("rollout.tree.split_noise_scale", tr.split_noise_scale)
    check_choice("rollout.tree.split_logprob_std", tr.split_logprob_std, SPLIT_LOGPROB_STDS)
    check_choice("rollout.tree.leaf_reward", tr.leaf_reward, LEAF_REWARDS)
    check_choice("rollout.tree.depth_unit", tr.depth_unit, DEPTH_UNITS)
    # the depths an edge after the first split can lead to, in depth_unit
    by_step = tr.depth_unit == "step"
    depths, unit = (s.num_steps, "sampling.num_steps, depth_unit step") if by_step else (len(steps), "one per split, depth_unit split")
    if any(not 1 <= d <= depths for d in tr.prune_depths):
        raise ConfigError(f"rollout.tree.prune_depths must name depths between 1 and {depths} ({unit}); got {list(tr.prune_depths)}")
    trainable = set(range(steps[0] + 1 if by_step else 1, depths + 1))
    if trainable <= set(tr.prune_depths):
        raise ConfigError(f"rollout.tree.prune_depths prunes every depth after the first split ({min(trainable)} to {depths}), so "
                          "nothing would be trained; leave at least one out")
    if not 0 <= tr.depth_window <= depths:
        raise ConfigError(f"rollout.tree.depth_window must be between 0 (off) and {depths} ({unit}); got {tr.depth_window}")
    check_positive("rollout.tree.depth_window_shift_every", tr.depth_window_shift_every)
    check_choice("rollout.tree.edge_order", tr.edge_order, EDGE_ORDERS)
    check_positive("rollout.tree.edges_per_step", tr.edges_per_step)
    if tr.edge_order == "shuffled" and cfg.trainer.gradient_accumulation_steps != 1:
        raise ConfigError("trainer.gradient_accumulation_steps must be 1 when rollout.tree.edge_order is shuffled (rollout.tree."
                          f"edges_per_step sets the edges per optimizer step); got {cfg.trainer.gradient_accumulation_steps}")
    if cfg.allocator.kind != "uniform":
        raise ConfigError(f"allocator.kind must be uniform when rollout.kind is tree (a tree fixes each prompt's rollouts); got '{cfg.allocator.kind}'")
    if cfg.advantage.kind != "grpo" or cfg.advantage.std != "group":
        raise ConfigError(f"advantage.kind must be grpo and advantage.std group when rollout.kind is tree (trees use "
                          f"BranchGRPO's depth-wise advantages within each tree); got kind '{cfg.advantage.kind}', std '{cfg.advantage.std}'")
