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

import torch

from flowrl.core.group_losses import dgpo_group_loss
from flowrl.errors import check_positive
from flowrl.train.ema import EMA
from flowrl.train.experience import SAMPLES, Experience
from flowrl.train.objectives.implicit import ImplicitRewardObjective, flow_errors
from flowrl.train.parts import register_objective


@register_objective
class DGPO(ImplicitRewardObjective):
    name = "dgpo"
    section = "dgpo"
    needs = SAMPLES

    def __init__(self, ctx):
        super().__init__(ctx)
        self.old = EMA(ctx.params, 0.0) if self.opts.clip_range > 0 else None  # the sampling policy's weights

    @classmethod
    def validate(cls, cfg) -> None:
        super().validate(cfg)
        check_positive("objective.dgpo.clip_range", cfg.objective.dgpo.clip_range, strict=False)

    def prepare(self, experience: Experience) -> None:
        if self.old is not None:
            self.old.update(self.ctx.params)  # decay 0: a copy of the weights that sampled this iteration

    def before_forward(self, batch, x0, eps, sigma, cond):
        if self.old is None:
            return None
        with torch.no_grad(), self.old.swapped_in(self.ctx.params):
            return flow_errors(self.ctx.policy, x0, eps, sigma, cond).err

    def loss(self, experience, batch, errors, err_old):
        o, err, own = self.opts, errors.err, {}
        adv = experience.advantages[batch.index].to(err.device)
        if err_old is not None:  # PPO-style: a sample that moved past the clip stops pulling
            ratio = torch.exp(err_old - err.detach())
            stop = torch.where(adv > 0, ratio > 1 + o.clip_range, ratio < 1 - o.clip_range)
            err = torch.where(stop, err.detach(), err)
            own["clip_fraction"] = stop.float().mean().item()
        delta = err - errors.err_ref
        own["implicit_delta_abs"] = delta.detach().abs().mean().item()
        return dgpo_group_loss(delta, adv, batch.groups, o.beta).mean(), own
