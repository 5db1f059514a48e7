"""objective.kind gdro: Group-level Direct Reward Optimization (arXiv 2601.02036; docs/algorithms.md
section 10).

Trains from groups of clean samples and their rewards with no sampler and no log-probs: offline
from a group store (rollout.kind offline) or online from any rollout's clean samples. Per micro-
batch of whole groups and per training sigma (shared, with eps shared within a group): the
implicit rewards s = -beta (err_theta - err_ref), the listwise loss between softmax(r / tau) and
softmax(s) (flowrl.core.group_losses.listwise_group_loss, top-1 or Plackett-Luce), plus gamma x
plain flow matching on each group's best sample (without it the paper reports collapse). Groups
whose rewards are all equal carry no preference and are left out. Tied rewards are ordered by
keys drawn from (run seed, iteration): stable within a run, reproducible on resume.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from flowrl.core.advantages import group_degenerate, groups_of
from flowrl.core.group_losses import LISTWISE_FORMS, group_best, listwise_group_loss
from flowrl.errors import ConfigError, UserError, check_choice, check_positive
from flowrl.sampling.noise import Stream, sample_seed
from flowrl.train.experience import SAMPLES, Experience
from flowrl.train.objectives.dgpo import check_sigma_range, draw_sigmas
from flowrl.train.objectives.implicit import flow_errors, group_batches, group_noise
from flowrl.train.parts import Objective, register_objective


@register_objective
class GDRO(Objective):
    name = "gdro"
    needs = SAMPLES

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.objective.gdro
        check_choice("objective.gdro.form", o.form, LISTWISE_FORMS)
        check_positive("objective.gdro.tau", o.tau)
        check_positive("objective.gdro.beta", o.beta)
        check_positive("objective.gdro.gamma", o.gamma, strict=False)
        check_positive("objective.gdro.timesteps", o.timesteps)
        check_positive("objective.gdro.sigma_shift", o.sigma_shift)
        check_sigma_range("objective.gdro.sigma_range", o.sigma_range, cfg)
        if not cfg.lora.enabled:
            raise ConfigError("objective.kind gdro needs lora.enabled=true: its implicit reward compares the policy with the "
                              "network with the adapter disabled")
        if o.guidance_scale is not None and not o.guidance_scale >= 1.0:
            raise ConfigError(f"objective.gdro.guidance_scale must be >= 1 (1: the conditional velocity alone) or null "
                              f"(model.guidance_scale); got {o.guidance_scale}")

    def update(self, experience: Experience) -> dict:
        ctx, t, o = self.ctx, self.ctx.cfg.trainer, self.ctx.cfg.objective.gdro
        acc, policy = ctx.accelerator, ctx.policy
        if experience.reward_totals is None:
            raise UserError(f"objective.kind gdro needs the rewards of every sample, which rollout.kind '{ctx.cfg.rollout.kind}' "
                            "does not report; use rollout.kind offline or flat")
        r = experience.reward_totals
        tie_keys = torch.rand(len(r), generator=torch.Generator().manual_seed(sample_seed(t.seed, experience.iteration, Stream.TIE_BREAK)))
        batches = group_batches(experience, acc, ctx.cfg.sampling.batch_size)
        listwise, fm, losses, grad_norms, kls, gaps, trained_groups = [], [], [], [], [], [], 0
        policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * len(batches) * o.timesteps, desc=f"iter {experience.iteration} training", leave=False,
                   disable=not ctx.progress, unit="step")
        with policy.guidance(o.guidance_scale):
            for epoch in range(t.inner_epochs):
                sigmas = draw_sigmas(t.seed, experience.iteration * t.inner_epochs + epoch, o.timesteps, o.sigma_range, o.sigma_shift)
                for batch in batches:
                    rb, kb = r[batch.index], tie_keys[batch.index]
                    g = groups_of(batch.groups)
                    live = ~group_degenerate(rb, g)[g.inverse]  # groups with a preference
                    weight = batch.weight if bool(live.any()) else 0.0
                    keep = live if bool(live.any()) else torch.ones_like(live)  # an all-tied batch still runs, at weight 0
                    x0 = batch.x0[keep].to(acc.device)
                    groups, rb, kb = batch.groups[keep], rb[keep], kb[keep]
                    trained_groups += int(groups.unique().numel()) if weight else 0
                    cond = policy.encode([p for p, k in zip(batch.prompts, keep.tolist()) if k])
                    best = group_best(rb, groups, kb)
                    for k, sigma in enumerate(sigmas):
                        eps = group_noise(groups, t.seed, experience.iteration, epoch * o.timesteps + k, x0.shape[1:], acc.device)
                        with contextlib.nullcontext() if k == len(sigmas) - 1 else acc.no_sync(policy.net):
                            e = flow_errors(policy, x0, eps, sigma, cond)
                            s = -o.beta * (e.err - e.err_ref)
                            list_loss = listwise_group_loss(s, rb.to(s.device), groups, o.tau, o.form, kb).mean()
                            fm_loss = e.err[best].mean()
                            loss = list_loss + o.gamma * fm_loss
                            if t.kl_beta > 0:
                                kl = ((e.v - e.v_ref) ** 2).mean()
                                kls.append(kl.item())
                                loss = loss + t.kl_beta * kl
                            acc.backward(weight * loss / len(sigmas))
                        listwise.append(list_loss.item()), fm.append(fm_loss.item()), losses.append(loss.item())
                        gaps.append((s[best].mean() - s.mean()).item())
                        bar.update(1)
                    grad_norms.append(ctx.optimizer_step())
        bar.close()
        policy.transformer.eval()
        mean = lambda xs: sum(xs) / max(len(xs), 1)
        return {"loss": mean(losses), "listwise_loss": mean(listwise), "best_fm_loss": mean(fm), "kl": mean(kls),
                "grad_norm": mean(grad_norms), "optimizer_steps": len(grad_norms), "trained_transitions": len(losses),
                "lr": ctx.optimizer.param_groups[0]["lr"], "implicit_reward_best_gap": mean(gaps), "trained_groups": trained_groups}
