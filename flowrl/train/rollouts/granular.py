"""rollout.kind granular: G2RPO (arXiv 2510.01982; docs/algorithms.md section 12).

Each prompt the allocator picks (uniform, validated) gets one anchor, data.group_size branches at
every branch step and an ODE tail per granularity (flowrl/sampling/granular.py). Prompts are split
across processes and padded with copies of the last one (zero advantage). The tails are scored on
the one reward path; the core's multi-granularity estimator turns a sample's rewards at every
granularity into one advantage per (prompt, branch step, sample); and only the branch transitions
are trained, each branch step's prompts in the anchor's sampling batches (one forward per batch,
the G samples share it), so the first importance ratio is exactly 1. Every branch transition of an
optimizer step weighs the same (the reference: the mean over G of each prompt's, averaged over its
processes), and the branch steps are trained in increasing order, as the reference
(rollout.granular.step_order).
"""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass, field
from functools import partial

import torch

from flowrl.core.advantages import AdvantageOutput, multi_granularity_advantages
from flowrl.core.allocation import successes
from flowrl.errors import ConfigError, check_choice
from flowrl.sampling.granular import (TAIL_ENDS, TAIL_GRIDS, GranularBatch, branch_edges, default_branch_steps, granular_nfe,
                                      granular_rollout, sequential_calls)
from flowrl.sampling.rollout import SamplerSpec, policy_precision
from flowrl.sampling.tree import parent_batches
from flowrl.train.experience import TRANSITIONS, Experience, TransitionBatch
from flowrl.train.parts import Rollout, register_rollout
from flowrl.train.rollouts.common import (one_group_per_prompt, require_some_valid, step_kl, steps_without_noise, training_spec)
from flowrl.train.scoring import Scoring


STEP_ORDERS = ("increasing", "shuffled")


def branch_steps_of(cfg) -> list[int]:
    return list(cfg.rollout.granular.branch_steps) or default_branch_steps(cfg.sampling.num_steps)


def granular_advantages(rewards: torch.Tensor, valid: torch.Tensor, n: int, M: int, L: int, G: int, weights: torch.Tensor,
                        clip: float) -> tuple[torch.Tensor, torch.Tensor, AdvantageOutput]:
    """MGAI over scored tails: `rewards` [n * M * L * G, K] and `valid` [n * M * L * G] in (prompt,
    branch step, granularity, sample) order. A sample is (prompt, branch step, i), its group the G
    samples of its (prompt, branch step); it is left out when any of its tails is invalid. Returns
    advantages [n, M, G] (0 for left-out samples), each sample's rewards [n * M * G, L, K] and the
    estimator's output over the valid samples."""
    K = rewards.shape[1]
    per_sample = rewards.view(n, M, L, G, K).permute(0, 1, 3, 2, 4).reshape(n * M * G, L, K)
    ok = valid.view(n, M, L, G).all(2).reshape(-1)
    cells = torch.arange(n * M).repeat_interleave(G)
    advantages = torch.zeros(n * M * G)
    out = multi_granularity_advantages(per_sample[ok], cells[ok], weights, clip=clip)
    advantages[ok] = out.advantages
    return advantages.view(n, M, G), per_sample, out


@dataclass
class GranularOptions:
    """G2RPO (rollout.kind: granular; docs/algorithms.md section 12): per prompt one ODE anchor, at
    each branch step data.group_size one-step SDE branches from it, each finished by ODE tails at
    every granularity; advantages normalised per (prompt, branch step, granularity, channel) and
    summed. Only the branch transitions are trained."""

    branch_steps: list[int] = field(default_factory=list)  # empty: the first half of sampling.num_steps
    granularities: list[int] = field(default_factory=lambda: [1, 2])  # ODE tail strides (the paper reports [1, 2, 3])
    # the tails' sigma indices from a branch at step k: reference (the reference's: k + 1, k + 2, then every g-th
    # from k + 2) | from_branch (flowrl's earlier grid: every g-th from k + 1)
    tail_grid: str = "reference"
    # a tail whose stride misses sigma 0: zero (flowrl's fix: one more, shorter step to sigma 0) | x0_prediction
    # (the reference's: its image is the x0-prediction from the index before the stride's last, often sigma ~0.4)
    tail_end: str = "zero"
    clip: float = 5.0  # the multi-granularity advantage is clipped to +-clip after the sum

    RANGES: ClassVar[dict] = {"clip": "> 0"}
    # true: one optimizer step per branch step, as the reference | false: one per iteration (each branch
    # step's mean loss weighing 1 / |M|, as one version of the reference's two-reward script)
    step_per_branch: bool = True
    # the order the branch steps are trained in: increasing (the reference's) | shuffled (per inner epoch, flowrl's earlier order)
    step_order: str = "increasing"


@register_rollout
class GranularRollout(Rollout):
    name = "granular"
    options = GranularOptions
    runs_ahead = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scoring = Scoring(ctx.policy, ctx.reward_runner, ctx.accelerator)

    @classmethod
    def provides(cls, cfg) -> set[str]:
        return {TRANSITIONS}

    @classmethod
    def missing_reason(cls, cfg, data: str) -> str:
        return "(its training data are the branch transitions, not whole samples)"

    @classmethod
    def validate(cls, cfg) -> None:
        validate_granular(cfg)

    def spec(self, iteration: int) -> SamplerSpec:
        """The SDE on the branch steps only (the anchor and the tails are ODE)."""
        spec = training_spec(self.ctx.cfg, iteration, self.ctx.policy, self.ctx.plan)
        spec.sde_steps = torch.zeros_like(spec.sde_steps)
        spec.sde_steps[branch_steps_of(self.ctx.cfg)] = True
        return spec

    def sample(self, iteration: int) -> "GranularSample":
        """This process's anchors, branches and scored tails of `iteration`, with the multi-granularity
        advantages; the allocator sees the outcomes."""
        ctx = self.ctx
        cfg, weights = ctx.cfg, ctx.reward_fn.channel_weights
        G, bs, gr = cfg.data.group_size, cfg.sampling.batch_size, cfg.rollout.granular
        ids, seeds, shard = one_group_per_prompt(ctx, iteration)
        n = len(ids)
        local_ids = shard.take(ids)
        spec = self.spec(iteration)
        batch = granular_rollout(ctx.policy, [ctx.prompts[i] for i in local_ids], shard.take(seeds), spec, branch_steps_of(cfg),
                                 list(gr.granularities), G, bs, prompt_ids=local_ids, progress=ctx.progress,
                                 desc=f"iter {iteration} granular sampling", tail_grid=gr.tail_grid, tail_end=gr.tail_end)
        P, M, L = len(local_ids), len(batch.branch_steps), len(batch.granularities)
        shape = batch.finals.shape[4:]
        flat_finals = batch.finals.reshape(-1, *shape)  # (p, m, l, i) order
        tail_prompts = [batch.prompts[p] for p in range(P) for _ in range(M * L * G)]
        on_batch = self.scoring.start(tail_prompts)
        for b in parent_batches(len(flat_finals), bs):
            on_batch(b, flat_finals[b])
        scores = self.scoring.finish(n * M * L * G)  # process-major = prompt order; padding last
        require_some_valid(scores.valid, iteration)

        # samples are (prompt, branch step, i); each has a reward per (granularity, channel)
        by_step, rewards, adv = granular_advantages(scores.rewards, scores.valid, n, M, L, G, weights, gr.clip)
        valid = scores.valid.view(n, M, L, G).all(2).reshape(-1)  # a sample with any invalid tail is left out
        advantages = by_step.reshape(-1)
        real = shard.positions < n
        local = torch.zeros(P, M, G)
        mine = shard.positions[real]
        local[real] = by_step[mine]

        prompt_ids = torch.tensor(ids[:n]).repeat_interleave(M * G)
        mean_rewards = rewards.mean(1)  # [N, K]: each sample's reward averaged over its granularities
        ctx.allocator.observe(prompt_ids[valid], successes(mean_rewards[valid] @ weights, cfg.allocator.success_threshold))
        T, tails = spec.num_steps, (gr.tail_grid, gr.tail_end)
        metrics = {
            "adv_abs_mean": advantages[valid].abs().mean().item(),
            "degenerate_groups": adv.degenerate.float().mean().item(),
            "prompts": n,
            "nfe_per_prompt": granular_nfe(T, batch.branch_steps, batch.granularities, G, *tails),
            "sequential_calls_per_prompt": sequential_calls(T, batch.branch_steps, batch.granularities, *tails),
            "network_calls": batch.calls,  # batched calls on this process
            "decodes": n * M * L * G,  # = reward calls (rows scored), all processes
            "trained_steps": M,
            "time_reward": scores.reward_time,
            "time_reward_wait": scores.reward_wait,
        }
        for m, k in enumerate(batch.branch_steps):
            metrics[f"adv_abs_mean/step{k}"] = by_step[:, m].abs().mean().item()
            metrics[f"adv_std/step{k}"] = by_step[:, m].std(unbiased=False).item()
        return GranularSample(iteration, batch, spec, local, real, mean_rewards, prompt_ids, valid, advantages,
                              policy_precision(ctx.policy), metrics)

    def experience(self, sample: "GranularSample") -> Experience:
        """The branch transitions of `sample` in micro-batches over this process's policy."""
        s, cfg = sample, self.ctx.cfg
        groups = self.micro_batches(s.batch, s.spec, s.local_advantages, s.real)
        metrics = {**s.metrics, "training_forwards": sum(len(g) for g in groups)}  # micro-batches per inner epoch, this process
        return Experience(s.iteration, s.rewards, s.prompt_ids, s.valid, s.advantages, s.precision, transitions=groups,
                          weigh_by_transition=True, shuffle=cfg.rollout.granular.step_order == "shuffled", metrics=metrics,
                          reward_totals=s.rewards @ self.ctx.reward_fn.channel_weights)

    def micro_batches(self, batch: GranularBatch, spec: SamplerSpec, local_adv: torch.Tensor, real: torch.Tensor):
        """One micro-batch per (branch step, sampling batch of anchors); accumulation groups of one
        branch step each, in increasing step order (rollout.granular.step_per_branch), or one group
        for the iteration."""
        policy, bs, G = self.ctx.policy, self.ctx.cfg.sampling.batch_size, batch.group_size
        kl = step_kl(spec.reduction)
        per_step = []
        for m in range(len(batch.branch_steps)):
            step = []
            for b in parent_batches(len(batch.prompts), bs):
                step.append(TransitionBatch(partial(branch_edges, policy, batch, spec, m, b),
                                            batch.log_probs[b, m].reshape(-1), local_adv[b, m].reshape(-1), kl,
                                            real[b].repeat_interleave(G), kl_scale=spec.reference_kl_scale(int(batch.branch_steps[m])),
                                            step=int(batch.branch_steps[m])))
            per_step.append(step)
        if self.ctx.cfg.rollout.granular.step_per_branch:
            return per_step
        return [[mb for step in per_step for mb in step]]


@dataclass
class GranularSample:
    """What `GranularRollout.sample` drew: tensors and the sampler's spec only, so that it travels
    between processes (run.async_rollouts)."""

    iteration: int
    batch: GranularBatch  # this process's anchors, branches and tails
    spec: SamplerSpec
    local_advantages: torch.Tensor  # [P, M, G] this process's, 0 on padding prompts
    real: torch.Tensor  # [P] bool: False for padding copies
    rewards: torch.Tensor  # [N, K] each sample's reward averaged over its granularities
    prompt_ids: torch.Tensor  # [N]
    valid: torch.Tensor  # [N] bool
    advantages: torch.Tensor  # [N]
    precision: str
    metrics: dict


def validate_granular(cfg) -> None:
    s, gr = cfg.sampling, cfg.rollout.granular
    steps = branch_steps_of(cfg)
    if sorted(set(steps)) != steps or steps[0] < 0 or steps[-1] >= s.num_steps:
        raise ConfigError(f"rollout.granular.branch_steps must be strictly increasing steps in [0, {s.num_steps - 1}] "
                          f"(sampling.num_steps is {s.num_steps}); got {list(gr.branch_steps)}")
    if not gr.granularities or sorted(set(gr.granularities)) != list(gr.granularities) or gr.granularities[0] < 1:
        raise ConfigError(f"rollout.granular.granularities must be strictly increasing strides >= 1; got {list(gr.granularities)}")
    check_choice("rollout.granular.tail_grid", gr.tail_grid, TAIL_GRIDS)
    check_choice("rollout.granular.tail_end", gr.tail_end, TAIL_ENDS)
    check_choice("rollout.granular.step_order", gr.step_order, STEP_ORDERS)
    flat_steps = steps_without_noise(cfg, steps)
    if flat_steps:
        raise ConfigError(f"rollout.granular.branch_steps {flat_steps} have no noise under sampling.sampler '{s.sampler}' "
                          "(a branch needs a stochastic step); choose flow_grpo, dance_grpo or cps, or earlier steps")
    if s.window.strategy != "all":
        raise ConfigError("sampling.window.strategy must be all when rollout.kind is granular (rollout.granular.branch_steps "
                          "choose the stochastic steps)")
    if cfg.allocator.kind != "uniform":
        raise ConfigError(f"allocator.kind must be uniform when rollout.kind is granular (each prompt has one group per branch "
                          f"step); got '{cfg.allocator.kind}'")
    if cfg.advantage.kind != "grpo":
        raise ConfigError(f"advantage.kind must be grpo when rollout.kind is granular (its advantage is the multi-granularity "
                          f"sum of group-normalised rewards, rollout.granular.clip); got '{cfg.advantage.kind}'")
