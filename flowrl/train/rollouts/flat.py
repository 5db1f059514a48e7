"""rollout.kind flat: G independent chains per prompt (Flow-GRPO, DanceGRPO, DiffusionNFT), in
allocation stages: the allocator picks (prompt, count), the chains are sampled from seeds keyed
by (run seed, iteration, index), scored while later batches sample, and the allocator sees the
outcomes before the next stage. Advantages are normalised per group (docs/algorithms.md section 6).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from flowrl.core.advantages import AdvantageOutput, estimate_advantages
from flowrl.core.losses import gaussian_kl
from flowrl.errors import ConfigError, UserError
from flowrl.sampling.noise import sample_seed
from flowrl.sampling.rollout import SamplerSpec, Trajectory, rollout, transition
from flowrl.sampling.schedules import shifted_sigmas, window_mask
from flowrl.sampling.steps import transition_std
from flowrl.train.experience import SAMPLES, TRANSITIONS, Experience, ProcessShard, SampleBatch, TransitionBatch, advantages_at
from flowrl.train.parts import Rollout, register_rollout
from flowrl.train.scoring import Scoring


class Stage(NamedTuple):
    """One allocation stage: this process's trajectory and the gathered, unpadded rewards."""

    traj: Trajectory  # this process's slice (may end with padding copies)
    rewards: torch.Tensor  # [n, K] every process's real samples, in stage order
    prompt_ids: torch.Tensor  # [n] pool indices of the real samples
    positions: torch.Tensor  # [n_local] stage positions of this process's samples (>= n: padding)
    reward_time: float  # seconds inside reward calls (overlapping the sampling of later batches)
    reward_wait: float  # seconds spent waiting for rewards after the last batch was sampled
    valid: torch.Tensor  # [n] bool: False where the reward output was invalid (reward.on_invalid: drop)


def training_spec(cfg, iteration: int, policy, plan=None) -> SamplerSpec:
    """The training sampler of `iteration`: the policy's sigmas under sampling.schedule and this
    iteration's SDE window (a progressive window moves on the run's schedule plan, ctx.plan)."""
    s, w = cfg.sampling, cfg.sampling.window
    mask = window_mask(w.strategy, s.num_steps, w.size, w.start, iteration, cfg.trainer.seed, w.shift_every,
                       None if plan is None else plan.step(iteration), w.stride, w.at_end)
    return SamplerSpec(policy.sigmas(s.num_steps, s.schedule, s.shift), mask, s.sampler, s.noise_level, s.logprob_reduction,
                       s.cps_logprob)


def check_trained_sigmas(cfg, sigmas: torch.Tensor) -> None:
    """A restricted adapter (lora.sigma_range) must act at every step of the fixed SDE window, or
    those steps carry no gradient."""
    r, w = cfg.lora.sigma_range, cfg.sampling.window
    if list(r) == [0.0, 1.0] or w.strategy != "fixed":
        return
    trained = sigmas[w.start : w.start + w.size].tolist()
    if not all(r[0] < x <= r[1] for x in trained):
        raise ConfigError(f"lora.sigma_range {list(r)} must hold the sigmas of every trained step "
                          f"({', '.join(f'{x:.3g}' for x in trained)}: sampling.window steps {w.start}-{w.start + w.size - 1})")


def step_kl(reduction: str):
    """The exact KL between two Gaussian transitions of one step (same std), per kept transition."""
    return lambda out, ref, keep: gaussian_kl(out.mean[keep], ref.mean[keep], out.std, reduction)


def successes(cfg, total_rewards: torch.Tensor) -> torch.Tensor:
    """Pass/fail for the allocator: above allocator.success_threshold, or above the mean of the
    iteration's rewards so far when no threshold is set (continuous rewards)."""
    threshold = cfg.allocator.success_threshold
    return total_rewards > (total_rewards.mean() if threshold is None else threshold)


def require_some_valid(valid: torch.Tensor, iteration: int) -> None:
    if not valid.any():
        raise UserError(f"every reward output of iteration {iteration} was invalid (NaN, inf or misshapen); see reward.on_invalid")


def one_group_per_prompt(ctx, iteration: int) -> tuple[list[int], list[int], ProcessShard]:
    """For rollouts that fix each prompt's samples (trees, granular): the prompts the uniform
    allocator picks, one group of data.group_size each; each group's seed (that of a flat group's
    first sample, index k x G); and their split over processes."""
    g = ctx.cfg.data.group_size
    ids = torch.repeat_interleave(torch.arange(len(ctx.prompts)), ctx.allocator.first_stage(iteration) // g).tolist()
    seeds = [sample_seed(ctx.cfg.trainer.seed, iteration, k * g) for k in range(len(ids))]
    return ids, seeds, ProcessShard(len(ids), ctx.accelerator.num_processes, ctx.accelerator.process_index)


def steps_without_noise(cfg, steps) -> list[int]:
    """Those of `steps` whose transition has no noise under sampling.sampler (on the shifted grid,
    which the config check can compute without loading the model)."""
    s = cfg.sampling
    sigmas = shifted_sigmas(s.num_steps, s.shift).tolist()
    return [t for t in steps if transition_std(s.sampler, sigmas[t], sigmas[t + 1], s.noise_level, sigmas[1]) <= 0]


def group_advantages(cfg, rewards: torch.Tensor, prompt_ids: torch.Tensor, valid: torch.Tensor,
                     weights: torch.Tensor, iteration: int) -> tuple[torch.Tensor, AdvantageOutput, dict]:
    """Advantages [N] of the valid samples by advantage.kind (0 for invalid ones: they take no
    part), the estimator's output, and its metrics columns."""
    require_some_valid(valid, iteration)
    a = cfg.advantage
    adv = estimate_advantages(a.kind, rewards[valid], prompt_ids[valid], weights, a.std, a.eps, a.clip)
    advantages = torch.zeros(len(valid))
    advantages[valid] = adv.advantages.float()
    metrics = {"adv_abs_mean": adv.advantages.abs().mean().item(), "degenerate_groups": adv.degenerate.float().mean().item(),
               "nonzero_advantage_samples": int((adv.mask & (adv.advantages != 0)).sum())}
    return advantages, adv, metrics


@register_rollout
class FlatRollout(Rollout):
    name = "flat"
    shards = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.scoring = Scoring(ctx.policy, ctx.reward_runner, ctx.accelerator)
        if ctx.objective_needs == TRANSITIONS:  # the loaded pipeline's grid (the config checked shifted_linear ones)
            check_trained_sigmas(ctx.cfg, training_spec(ctx.cfg, 0, ctx.policy).sigmas)

    @classmethod
    def provides(cls, cfg) -> set[str]:
        return {SAMPLES} | ({TRANSITIONS} if cfg.sampling.sampler != "ode" else set())

    @classmethod
    def missing_reason(cls, cfg, data: str) -> str:
        return f"with sampling.sampler '{cfg.sampling.sampler}' (no log-probabilities; choose flow_grpo, dance_grpo or cps)"

    def sample_stage(self, prompt_ids: list[int], seeds: list[int], spec: SamplerSpec, desc: str, iteration: int,
                     policy=None) -> Stage:
        """Sample one stage, split across processes, and gather its rewards (with `policy`,
        default the trained one; two-stage exploration passes its low-precision copy)."""
        ctx = self.ctx
        acc, n = ctx.accelerator, len(prompt_ids)
        shard = ProcessShard(n, acc.num_processes, acc.process_index)
        local_ids, local_seeds = shard.take(prompt_ids), shard.take(seeds)
        local_prompts = [ctx.prompts[i] for i in local_ids]
        on_batch = self.scoring.start(local_prompts)
        traj = rollout(policy if policy is not None else ctx.policy, local_prompts, local_seeds, spec, ctx.cfg.sampling.batch_size,
                       prompt_ids=local_ids, group_ids=local_ids, policy_version=iteration, progress=ctx.progress, desc=desc,
                       on_batch=on_batch)
        scores = self.scoring.finish(n)
        return Stage(traj, scores.rewards, torch.tensor(prompt_ids[:n]), shard.positions, scores.reward_time, scores.reward_wait,
                     scores.valid)

    def sample_allocated(self, iteration: int, spec: SamplerSpec) -> list[Stage]:
        """The iteration's rollouts in allocation stages: the allocator decides, we sample, it
        sees the outcomes, repeat."""
        ctx = self.ctx
        stages: list[Stage] = []
        n_prompts = len(ctx.prompts)
        totals = torch.zeros(n_prompts, dtype=torch.long)
        extra = ctx.allocator.first_stage(iteration)
        while int(extra.sum()) > 0:
            ids = torch.repeat_interleave(torch.arange(n_prompts), extra).tolist()
            offset = int(totals.sum())
            seeds = [sample_seed(ctx.cfg.trainer.seed, iteration, offset + j) for j in range(len(ids))]
            desc = f"iter {iteration} sampling" + (f" (stage {len(stages) + 1})" if stages else "")
            stages.append(self.sample_stage(ids, seeds, spec, desc, iteration))
            totals += extra
            seen = torch.cat([st.prompt_ids for st in stages])
            ok = successes(ctx.cfg, torch.cat([st.rewards for st in stages]) @ ctx.reward_fn.channel_weights)
            successes_per_prompt = torch.bincount(seen, weights=ok.double(), minlength=n_prompts).long()
            extra = ctx.allocator.next_stage(totals, successes_per_prompt, totals - successes_per_prompt)
        return stages

    def collect(self, iteration: int) -> Experience:
        ctx = self.ctx
        spec = training_spec(ctx.cfg, iteration, ctx.policy, ctx.plan)
        weights = ctx.reward_fn.channel_weights
        stages = self.sample_allocated(iteration, spec)
        rewards = torch.cat([st.rewards for st in stages])
        prompt_ids = torch.cat([st.prompt_ids for st in stages])
        valid = torch.cat([st.valid for st in stages])
        advantages, _, adv_metrics = group_advantages(ctx.cfg, rewards, prompt_ids, valid, weights, iteration)
        ctx.allocator.observe(prompt_ids[valid], successes(ctx.cfg, rewards[valid] @ weights))
        sizes = torch.bincount(prompt_ids, minlength=len(ctx.prompts))
        sizes = sizes[sizes > 0]
        metrics = {
            **adv_metrics,
            "allocation_stages": len(stages),
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
        return stage_experience(self.ctx, iteration, stages, spec, rewards, prompt_ids, valid, advantages, metrics,
                                with_transitions=TRANSITIONS in self.provides(ctx.cfg))


def stage_experience(ctx, iteration: int, stages: list[Stage], spec: SamplerSpec, rewards, prompt_ids, valid, advantages,
                     metrics: dict, with_transitions: bool) -> Experience:
    """An Experience over this process's share of `stages` (in order, their real samples making
    up the per-sample arrays): one accumulation group per sampling batch, holding a micro-batch
    per trained step (exactly the sampling batches, so the first forward reproduces the behaviour
    log-probs bit for bit), and the batch's clean samples."""
    bs, policy = ctx.cfg.sampling.batch_size, ctx.policy
    trained_steps = spec.trained_steps() if with_transitions else []
    transitions, samples, offset = [], [], 0
    for st in stages:
        n = len(st.prompt_ids)
        index = torch.where(st.positions < n, offset + st.positions, torch.full_like(st.positions, len(advantages)))
        offset += n
        traj = st.traj
        for start in range(0, len(traj), bs):
            c = slice(start, start + bs)
            local_adv = advantages_at(advantages, index[c])
            transitions.append([
                TransitionBatch(lambda traj=traj, c=c, step=step: transition(policy, traj, spec, c, step, policy.encode(traj.prompts[c])),
                                traj.log_probs[c, step], local_adv, step_kl(spec.reduction))
                for step in trained_steps
            ])
            samples.append(SampleBatch(traj.final[c], traj.prompts[c], traj.seeds[c], index[c]))
    return Experience(iteration, rewards, prompt_ids, valid, advantages, stages[0].traj.precision,
                      transitions=transitions if with_transitions else None, samples=samples, metrics=metrics,
                      reward_totals=rewards @ ctx.reward_fn.channel_weights)
