"""objective.kind gdro: Group-level Direct Reward Optimization (arXiv 2601.02036; docs/algorithms.md
section 10).

Trains from groups of clean samples and their rewards with no sampler and no log-probs: offline
from a group store (rollout.kind offline) or online from any rollout's clean samples. Per micro-
batch of whole groups and per training sigma (shared, with eps shared within a group): the
implicit rewards s = -beta (err_theta - err_ref), the listwise loss between softmax(r / tau) and
softmax(s) (flowrl.core.group_losses.listwise_group_loss, top-1 or Plackett-Luce), with the errors
summed over dimensions as the paper's ||.||^2 (`error_reduction: mean` is a flowrl variant whose beta
is D times weaker), plus gamma x
plain flow matching on each group's best sample (without it the paper reports collapse). Groups
with no preference (all advantages 0: tied rewards) are left out. Tied rewards are ordered by
keys drawn from (run seed, iteration): stable within a run, reproducible on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from flowrl.core.group_losses import LISTWISE_FORMS, group_best, listwise_group_loss
from flowrl.core.seeds import Stream, sample_seed
from flowrl.errors import UserError, check_choice, check_positive
from flowrl.train.experience import SAMPLES, Experience
from flowrl.train.objectives.implicit import ImplicitRewardObjective
from flowrl.train.parts import register_objective

ERROR_REDUCTIONS = ("sum", "mean")


@dataclass
class GDROOptions:
    """objective.kind gdro: listwise group loss on the implicit reward, offline from a group store
    (data.offline) or online from clean samples (docs/algorithms.md section 10)."""

    form: str = "top1"  # top1 | plackett_luce
    tau: float = 0.05  # temperature of the reward's soft ranking softmax(r / tau) (GDRO: 0.05)
    # s = -beta (err_theta - err_ref) (GDRO: 6 GenEval, 12 OCR) with squared errors summed over dimensions
    # (error_reduction sum: the paper's ||.||^2) or averaged (mean, a flowrl variant: beta is then D times weaker)
    beta: float = 6.0
    error_reduction: str = "sum"
    gamma: float = 1.0  # weight of plain flow matching (a mean over dimensions) on each group's best sample
    timesteps: int = 2  # sigmas per micro-batch and epoch, shared by its samples
    sigma_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    sigma_shift: float = 1.0
    guidance_scale: Optional[float] = None


@register_objective
class GDRO(ImplicitRewardObjective):
    name = "gdro"
    options = GDROOptions
    section = "gdro"
    needs = SAMPLES

    @classmethod
    def validate(cls, cfg) -> None:
        super().validate(cfg)
        o = cfg.objective.gdro
        check_choice("objective.gdro.form", o.form, LISTWISE_FORMS)
        check_positive("objective.gdro.tau", o.tau)
        check_positive("objective.gdro.gamma", o.gamma, strict=False)
        check_choice("objective.gdro.error_reduction", o.error_reduction, ERROR_REDUCTIONS)

    def prepare(self, experience: Experience) -> None:
        if experience.reward_totals is None:
            raise UserError(f"objective.kind gdro needs the rewards of every sample, which rollout.kind "
                            f"'{self.ctx.cfg.rollout.kind}' does not report; use rollout.kind offline or flat")
        gen = torch.Generator().manual_seed(sample_seed(self.ctx.cfg.trainer.seed, experience.iteration, Stream.TIE_BREAK))
        self.tie_keys = torch.rand(len(experience.reward_totals), generator=gen)

    def loss(self, experience, batch, errors, before):
        o = self.opts
        r, keys = experience.reward_totals[batch.index].to(errors.err.device), self.tie_keys[batch.index]
        best = group_best(r, batch.groups, keys)
        # the paper's squared norms sum over the D dimensions; flow_errors gives their means
        dims = errors.v[0].numel() if o.error_reduction == "sum" else 1
        s = -o.beta * dims * (errors.err - errors.err_ref)
        listwise = listwise_group_loss(s, r, batch.groups, o.tau, o.form, keys).mean()
        fm = errors.err[best].mean()
        return listwise + o.gamma * fm, {"listwise_loss": listwise.item(), "best_fm_loss": fm.item(),
                                         "implicit_reward_best_gap": (s[best].mean() - s.mean()).item()}
