"""objective.kind dgpo: Direct Group Preference Optimization (Luo et al., arXiv 2510.08425;
docs/algorithms.md section 10).

Online and sampler-free in its objective: the rollout's clean samples (ODE by default), their
group-normalised advantages, and per group the Bradley-Terry comparison of its better and worse
halves through the implicit reward, -log sigmoid(-(beta / G) sum_i A_i delta_i)
(flowrl.core.group_losses.dgpo_group_loss). Each micro-batch of whole groups is noised at
`timesteps` sigmas drawn inside `sigma_range` (DGPO trains the high-noise end), eps shared within
a group, and makes one optimizer step. Options: the clip against the sampling policy (a sample
whose error ratio exp(err_old - err) has left [1 - c, 1 + c] in its advantage's direction stops
pulling), and the KL to the reference (trainer.kl_beta x the mean squared velocity gap).
"""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from flowrl.core.group_losses import dgpo_group_loss
from flowrl.errors import ConfigError, check_positive
from flowrl.sampling.noise import Stream, sample_seed
from flowrl.sampling.schedules import stratified_sigma
from flowrl.train.ema import EMA
from flowrl.train.experience import SAMPLES, Experience
from flowrl.train.objectives.implicit import flow_errors, group_batches, group_noise
from flowrl.train.parts import Objective, register_objective


def check_sigma_range(field: str, r, cfg) -> None:
    """A training sigma range inside (0, 1] that the adapter acts on."""
    if len(r) != 2 or not 0.0 <= r[0] < r[1] <= 1.0:
        raise ConfigError(f"{field} must be [low, high] with 0 <= low < high <= 1; got {list(r)}")
    low, high = cfg.lora.sigma_range
    if r[0] < low or r[1] > high:
        raise ConfigError(f"{field} {list(r)} must lie inside lora.sigma_range {list(cfg.lora.sigma_range)} (where the adapter acts)")


def draw_sigmas(seed: int, iteration: int, count: int, sigma_range, shift: float) -> list[float]:
    """`count` training sigmas, stratified inside sigma_range (one per stratum, crowding toward the
    noisy end when shift > 1), keyed by (run seed, iteration)."""
    gen = torch.Generator().manual_seed(sample_seed(seed, iteration, Stream.GROUP_SIGMAS))
    return [stratified_sigma(k, count, sigma_range[0], sigma_range[1], shift, gen) for k in range(count)]


@register_objective
class DGPO(Objective):
    name = "dgpo"
    needs = SAMPLES

    def __init__(self, ctx):
        super().__init__(ctx)
        self.opts = ctx.cfg.objective.dgpo
        self.old = EMA(ctx.params, 0.0) if self.opts.clip_range > 0 else None  # the sampling policy's weights

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.objective.dgpo
        check_positive("objective.dgpo.beta", o.beta)
        check_positive("objective.dgpo.timesteps", o.timesteps)
        check_positive("objective.dgpo.sigma_shift", o.sigma_shift)
        check_positive("objective.dgpo.clip_range", o.clip_range, strict=False)
        check_sigma_range("objective.dgpo.sigma_range", o.sigma_range, cfg)
        if not cfg.lora.enabled:
            raise ConfigError("objective.kind dgpo needs lora.enabled=true: its implicit reward compares the policy with the "
                              "network with the adapter disabled")
        if o.guidance_scale is not None and not o.guidance_scale >= 1.0:
            raise ConfigError(f"objective.dgpo.guidance_scale must be >= 1 (1: the conditional velocity alone) or null "
                              f"(model.guidance_scale); got {o.guidance_scale}")

    def update(self, experience: Experience) -> dict:
        ctx, t, o = self.ctx, self.ctx.cfg.trainer, self.opts
        acc, policy = ctx.accelerator, ctx.policy
        if self.old is not None:
            self.old.update(ctx.params)  # decay 0: a copy of the weights that sampled this iteration
        batches = group_batches(experience, acc, ctx.cfg.sampling.batch_size)
        sizes = torch.bincount(experience.prompt_ids[experience.valid], minlength=int(experience.prompt_ids.max()) + 1)
        losses, grad_norms, kls, clipped, deltas = [], [], [], [], []
        policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * len(batches) * o.timesteps, desc=f"iter {experience.iteration} training", leave=False,
                   disable=not ctx.progress, unit="step")
        with policy.guidance(o.guidance_scale):
            for epoch in range(t.inner_epochs):
                sigmas = draw_sigmas(t.seed, experience.iteration * t.inner_epochs + epoch, o.timesteps, o.sigma_range, o.sigma_shift)
                for batch in batches:
                    x0 = batch.x0.to(acc.device)
                    adv = experience.advantages[batch.index].to(acc.device)
                    cond = policy.encode(batch.prompts)
                    for k, sigma in enumerate(sigmas):
                        eps = group_noise(batch.groups, t.seed, experience.iteration, epoch * o.timesteps + k, x0.shape[1:], acc.device)
                        err_old = None
                        if self.old is not None:
                            with torch.no_grad(), self.old.swapped_in(ctx.params):
                                err_old = flow_errors(policy, x0, eps, sigma, cond).err
                        with contextlib.nullcontext() if k == len(sigmas) - 1 else acc.no_sync(policy.net):
                            e = flow_errors(policy, x0, eps, sigma, cond)
                            err = e.err
                            if err_old is not None:  # PPO-style: a sample that moved past the clip stops pulling
                                ratio = torch.exp(err_old - err.detach())
                                stop = torch.where(adv > 0, ratio > 1 + o.clip_range, ratio < 1 - o.clip_range)
                                err = torch.where(stop, err.detach(), err)
                                clipped.append(stop.float().mean().item())
                            delta = err - e.err_ref
                            loss = dgpo_group_loss(delta, adv, batch.groups, o.beta, sizes[batch.groups.unique()]).mean()
                            if t.kl_beta > 0:
                                kl = ((e.v - e.v_ref) ** 2).mean()
                                kls.append(kl.item())
                                loss = loss + t.kl_beta * kl
                            acc.backward(batch.weight * loss / len(sigmas))
                        losses.append(loss.item())
                        deltas.append(delta.detach().abs().mean().item())
                        bar.update(1)
                    grad_norms.append(ctx.optimizer_step())
        bar.close()
        policy.transformer.eval()
        mean = lambda xs: sum(xs) / max(len(xs), 1)
        return {"loss": mean(losses), "kl": mean(kls), "grad_norm": mean(grad_norms), "optimizer_steps": len(grad_norms),
                "trained_transitions": len(losses), "lr": ctx.optimizer.param_groups[0]["lr"],
                "implicit_delta_abs": mean(deltas), "clip_fraction": mean(clipped)}
