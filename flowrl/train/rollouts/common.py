"""What the rollouts share (flat, tree, granular, two-stage, offline) and the text trainer borrows:
the training sampler of an iteration, per-group advantages, the allocator's pass/fail, the stage of
an allocation loop and the Experience built from stages. Each rollout module holds its own rollout
only; nothing outside flowrl/train/rollouts imports from them, only from here.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from flowrl.core.advantages import AdvantageOutput, estimate_advantages
from flowrl.core.losses import gaussian_kl
from flowrl.core.seeds import sample_seed
from flowrl.errors import ConfigError, UserError
from flowrl.runtime.shards import ProcessShard
from flowrl.sampling.noise import seeded_noise
from flowrl.sampling.rollout import SamplerSpec, Trajectory, transition
from flowrl.sampling.schedules import shifted_sigmas, window_mask
from flowrl.sampling.steps import transition_std
from flowrl.train.experience import Experience, SampleBatch, TransitionBatch, advantages_at


class Stage(NamedTuple):
    """One allocation stage: this process's trajectory and the gathered, unpadded rewards."""

    traj: Trajectory  # this process's slice (may end with padding copies)
    rewards: torch.Tensor  # [n, K] every process's real samples, in stage order
    prompt_ids: torch.Tensor  # [n] pool indices of the real samples
    positions: torch.Tensor  # [n_local] stage positions of this process's samples (>= n: padding)
    reward_time: float  # seconds inside reward calls (overlapping the sampling of later batches)
    reward_wait: float  # seconds spent waiting for rewards after the last batch was sampled
    valid: torch.Tensor  # [n] bool: False where the reward output was invalid (reward.on_invalid: drop)


def stage_share(stage: Stage, num_processes: int, process_index: int) -> Stage:
    """A stage sampled whole (by one producer process) as process `process_index` of `num_processes`
    would have sampled its share: its contiguous slice of the samples, padded with copies of the
    last one (ProcessShard), the gathered rewards unchanged."""
    shard = ProcessShard(len(stage.prompt_ids), num_processes, process_index)
    return stage._replace(traj=stage.traj.subset(shard.take(list(range(len(stage.prompt_ids))))), positions=shard.positions)


def training_spec(cfg, iteration: int, policy, plan=None) -> SamplerSpec:
    """The training sampler of `iteration`: the policy's sigmas under sampling.schedule and this
    iteration's SDE window (a progressive window moves on the run's schedule plan, ctx.plan); with
    the window 'all', the trained steps end at sampling.window.trained_fraction."""
    s, w = cfg.sampling, cfg.sampling.window
    mask = window_mask(w.strategy, s.num_steps, w.size, w.start, iteration, cfg.trainer.seed, w.shift_every,
                       None if plan is None else plan.step(iteration), w.stride, w.at_end, w.choices)
    # strategy all: Flow-GRPO trains the first int(T x timestep_fraction) steps, in order from step 0
    trained_before = int(s.num_steps * w.trained_fraction) if w.strategy == "all" else None
    return SamplerSpec(policy.sigmas(s.num_steps, s.schedule, s.shift), mask, s.sampler, s.noise_level, s.logprob_reduction,
                       s.cps_logprob, trained_before)


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


def gaussian_step_kl(out, ref, keep, reduction: str) -> torch.Tensor:
    """The exact KL between two Gaussian transitions of one step (same std), per kept transition."""
    return gaussian_kl(out.mean[keep], ref.mean[keep], out.std, reduction)


def step_kl(reduction: str):
    """`gaussian_step_kl` under sampling.logprob_reduction: a TransitionBatch's `kl`."""
    return partial(gaussian_step_kl, reduction=reduction)


def recompute_transition(policy, traj: Trajectory, spec: SamplerSpec, rows: slice, step: int):
    """The `step` transition of `rows` of a flat trajectory under the policy's current weights
    (with grad): a TransitionBatch's `evaluate`."""
    return transition(policy, traj, spec, rows, step, policy.encode(traj.prompts[rows]))


def behaviour_mean(policy, traj: Trajectory, spec: SamplerSpec, rows: slice, step: int) -> torch.Tensor:
    """The mean of the sampling step `step` of `rows`: x_next - s eps, its noise eps drawn again
    from the samples' (seed, step) generators, as the rollout drew it."""
    x_next = traj.latents[rows, step + 1].to(policy.device)
    eps = seeded_noise(traj.seeds[rows].tolist(), step, tuple(x_next.shape[1:]), policy.device)
    return x_next - spec.std(step) * eps


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


def spread(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[float, float]:
    """(mean within-group std, mean within-group max - min) of `values`."""
    stds, ranges = [], []
    for g in torch.unique(group_ids).tolist():
        v = values[group_ids == g].double()
        stds.append(float(v.std(unbiased=False)) if v.numel() > 1 else 0.0)
        ranges.append(float(v.max() - v.min()))
    return sum(stds) / len(stds), sum(ranges) / len(ranges)


def group_spread(totals: torch.Tensor, prompt_ids: torch.Tensor, valid: torch.Tensor) -> dict:
    """How far apart a group's rewards are (what a group objective's preferences are made of), over
    the valid samples: the mean within-group std and max - min of the channel-weighted rewards."""
    std, width = spread(totals[valid].float(), prompt_ids[valid])
    return {"group_reward_std": std, "group_reward_range": width}


def group_advantages(cfg, rewards: torch.Tensor, prompt_ids: torch.Tensor, valid: torch.Tensor,
                     weights: torch.Tensor, iteration: int) -> tuple[torch.Tensor, AdvantageOutput, dict]:
    """Advantages [N] of the valid samples by advantage.kind (0 for invalid ones: they take no
    part), the estimator's output, and its metrics columns (with the groups' reward spread)."""
    require_some_valid(valid, iteration)
    a = cfg.advantage
    adv = estimate_advantages(a.kind, rewards[valid], prompt_ids[valid], weights, a.std, a.eps, a.clip)
    advantages = torch.zeros(len(valid))
    advantages[valid] = adv.advantages.float()
    metrics = {"adv_abs_mean": adv.advantages.abs().mean().item(), "degenerate_groups": adv.degenerate.float().mean().item(),
               "nonzero_advantage_samples": int((adv.mask & (adv.advantages != 0)).sum()),
               **group_spread(rewards.float() @ weights, prompt_ids, valid)}
    return advantages, adv, metrics


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
                TransitionBatch(partial(recompute_transition, policy, traj, spec, c, step), traj.log_probs[c, step], local_adv,
                                step_kl(spec.reduction), behaviour_mean=partial(behaviour_mean, policy, traj, spec, c, step),
                                dt=float(spec.sigmas[step] - spec.sigmas[step + 1]), index=index[c],
                                kl_scale=spec.reference_kl_scale(step), step=step)
                for step in trained_steps
            ])
            samples.append(SampleBatch(traj.final[c], traj.prompts[c], traj.seeds[c], index[c]))
    return Experience(iteration, rewards, prompt_ids, valid, advantages, stages[0].traj.precision,
                      transitions=transitions if with_transitions else None, samples=samples, metrics=metrics,
                      reward_totals=rewards @ ctx.reward_fn.channel_weights)
