"""rollout.kind flat: G independent chains per prompt (Flow-GRPO, DanceGRPO, DiffusionNFT), in
allocation stages: the allocator picks (prompt, count), the chains are sampled from seeds keyed
by (run seed, iteration, index), scored while later batches sample, and the allocator sees the
outcomes before the next stage. Advantages are normalised per group (docs/algorithms.md section 6).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flowrl.core.allocation import allocate_in_stages, spending_by_bucket, successes
from flowrl.core.seeds import sample_seed
from flowrl.runtime.shards import ProcessShard
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.train.experience import FIXED_STEPS, SAMPLES, STEP_MEANS, TRANSITIONS, WHOLE_GROUPS, Experience
from flowrl.train.parts import Rollout, register_rollout
from flowrl.train.rollouts.common import (Stage, check_trained_sigmas, group_advantages, stage_experience, stage_share, training_spec)
from flowrl.train.scoring import Scoring


@register_rollout
class FlatRollout(Rollout):
    name = "flat"
    shards = True
    runs_ahead = True
    splits_batches = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scoring = Scoring(ctx.policy, ctx.reward_runner, ctx.accelerator)
        # each pool prompt's kind by the reward (the shapes categories), for where the rollouts went
        self.buckets = ctx.reward_fn.buckets(ctx.prompts) if ctx.reward_fn is not None else None
        if ctx.objective_needs == TRANSITIONS:  # the loaded pipeline's grid (the config checked shifted_linear ones)
            check_trained_sigmas(ctx.cfg, training_spec(ctx.cfg, 0, ctx.policy).sigmas)

    @classmethod
    def provides(cls, cfg) -> set[str]:
        transitions = {TRANSITIONS, STEP_MEANS} if cfg.sampling.sampler != "ode" else set()
        fixed = {FIXED_STEPS} if transitions and cfg.sampling.window.strategy == "fixed" else set()
        return {SAMPLES, WHOLE_GROUPS} | transitions | fixed

    @classmethod
    def missing_reason(cls, cfg, data: str) -> str:
        return f"with sampling.sampler '{cfg.sampling.sampler}' (no log-probabilities; choose flow_grpo, dance_grpo or cps)"

    def sample_stage(self, prompt_ids: list[int], seeds: list[int], spec: SamplerSpec, desc: str, iteration: int,
                     policy=None, initial_seeds: list[int] | None = None) -> Stage:
        """Sample one stage, split across processes, and gather its rewards (with `policy`,
        default the trained one; two-stage exploration passes its low-precision copy; `initial_seeds`:
        whose initial noise each chain starts from, where not its own)."""
        ctx = self.ctx
        acc, n = ctx.accelerator, len(prompt_ids)
        shard = ProcessShard(n, acc.num_processes, acc.process_index)
        local_ids, local_seeds = shard.take(prompt_ids), shard.take(seeds)
        local_prompts = [ctx.prompts[i] for i in local_ids]
        on_batch = self.scoring.start(local_prompts)
        traj = rollout(policy if policy is not None else ctx.policy, local_prompts, local_seeds, spec, ctx.cfg.sampling.batch_size,
                       prompt_ids=local_ids, group_ids=local_ids, policy_version=iteration, progress=ctx.progress, desc=desc,
                       on_batch=on_batch, initial_seeds=None if initial_seeds is None else shard.take(initial_seeds))
        scores = self.scoring.finish(n)
        return Stage(traj, scores.rewards, torch.tensor(prompt_ids[:n]), shard.positions, scores.reward_time, scores.reward_wait,
                     scores.valid)

    def sample_allocated(self, iteration: int, spec: SamplerSpec) -> list[Stage]:
        """The iteration's rollouts in allocation stages: the allocator decides, we sample, it
        sees the outcomes, repeat (flowrl/core/allocation.py, `allocate_in_stages`)."""
        ctx = self.ctx
        stages: list[Stage] = []
        group_seed: dict[int, int] = {}  # sampling.initial_noise per_group: a prompt's first sample's seed, its group's noise

        def sample_stage(ids: torch.Tensor, offset: int) -> torch.Tensor:
            seeds = [sample_seed(ctx.cfg.trainer.seed, iteration, offset + j) for j in range(len(ids))]
            initial = None
            if ctx.cfg.sampling.initial_noise == "per_group":
                initial = [group_seed.setdefault(p, s) for p, s in zip(ids.tolist(), seeds)]
            desc = f"iter {iteration} sampling" + (f" (stage {len(stages) + 1})" if stages else "")
            stages.append(self.sample_stage(ids.tolist(), seeds, spec, desc, iteration, initial_seeds=initial))
            return successes(torch.cat([st.rewards for st in stages]) @ ctx.reward_fn.channel_weights, ctx.cfg.allocator.success_threshold)

        allocate_in_stages(ctx.allocator, iteration, sample_stage)
        return stages

    def sample(self, iteration: int) -> "FlatBatch":
        """The iteration's stages, their rewards and advantages; the allocator sees the outcomes."""
        ctx = self.ctx
        spec = training_spec(ctx.cfg, iteration, ctx.policy, ctx.plan)
        weights = ctx.reward_fn.channel_weights
        stages = self.sample_allocated(iteration, spec)
        rewards = torch.cat([st.rewards for st in stages])
        prompt_ids = torch.cat([st.prompt_ids for st in stages])
        valid = torch.cat([st.valid for st in stages])
        advantages, adv, adv_metrics = group_advantages(ctx.cfg, rewards, prompt_ids, valid, weights, iteration)
        ctx.allocator.observe(prompt_ids[valid], successes(rewards[valid] @ weights, ctx.cfg.allocator.success_threshold))
        sizes = torch.bincount(prompt_ids, minlength=len(ctx.prompts))
        sizes = sizes[sizes > 0]
        metrics = {
            **adv_metrics,
            "allocation_stages": len(stages),
            "prompts_trained": len(adv.group_ids),
            **(spending_by_bucket(prompt_ids, adv.group_ids, adv.degenerate, self.buckets) if self.buckets else {}),
            "group_size_min": int(sizes.min()),
            "group_size_max": int(sizes.max()),
            "group_size_histogram": {str(int(k)): int(v) for k, v in zip(*torch.unique(sizes, return_counts=True))},
            "trained_steps": len(spec.trained_steps()),
            "sampled": len(rewards),  # chains drawn by the sampler this iteration (an offline store draws none)
            # rewards run on a worker thread while later batches sample: time_reward overlaps the
            # sampling time, and only time_reward_wait (after the last batch) is not hidden
            "time_reward": sum(st.reward_time for st in stages),
            "time_reward_wait": sum(st.reward_wait for st in stages),
        }
        return FlatBatch(iteration, spec, stages, rewards, prompt_ids, valid, advantages, metrics)

    def experience(self, batch: "FlatBatch") -> Experience:
        # the pool's coverage after this batch's outcomes, from this process's allocator (which has
        # taken a producer's state, or replayed several producers' observations, when asynchronous)
        batch.metrics.update(self.ctx.allocator.coverage())
        return flat_experience(self.ctx, batch, with_transitions=TRANSITIONS in self.provides(self.ctx.cfg))


    def split(self, batch: "FlatBatch", num_processes: int, process_index: int) -> "FlatBatch":
        return split_flat_batch(batch, num_processes, process_index)


def split_flat_batch(batch: "FlatBatch", num_processes: int, process_index: int) -> "FlatBatch":
    """A FlatBatch drawn whole, as process `process_index`'s share (flat and two-stage rollouts)."""
    return dataclasses.replace(batch, stages=[stage_share(st, num_processes, process_index) for st in batch.stages])


def flat_experience(ctx, b: "FlatBatch", with_transitions: bool) -> Experience:
    """The Experience of a FlatBatch on this process's policy (flat and two-stage rollouts)."""
    return stage_experience(ctx, b.iteration, b.stages, b.spec, b.rewards, b.prompt_ids, b.valid, b.advantages, b.metrics,
                            with_transitions=with_transitions)


@dataclass
class FlatBatch:
    """What `FlatRollout.sample` drew: tensors and the sampler's spec only, so that it travels
    between processes (run.async_rollouts) and any policy can evaluate its transitions."""

    iteration: int
    spec: SamplerSpec
    stages: list[Stage]
    rewards: torch.Tensor
    prompt_ids: torch.Tensor
    valid: torch.Tensor
    advantages: torch.Tensor
    metrics: dict
