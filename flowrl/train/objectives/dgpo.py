"""objective.kind dgpo: Direct Group Preference Optimization (Luo et al., arXiv 2510.08425;
docs/algorithms.md section 10). The defaults are the authors' code (Luo-Yihong/DGPO,
`scripts/train_sd3_dgpo.py` with its GenEval and OCR settings).

Online and sampler-free in its objective: the rollout's clean samples (ODE by default) and their
group-normalised advantages (clipped to +-advantage.clip). Per group, the Bradley-Terry comparison
of its better and worse halves through the implicit reward delta_i = err_theta - err_ref: the code
back-propagates mean_i sigmoid((beta / G) sum_j A_j delta_j).detach() A_i err_i
(flowrl.core.group_losses.dgpo_weighted_error_loss; `loss_form: log_sigmoid` is the paper's -log
sigmoid, beta times stronger). The trained velocity is the conditional one (guidance 1). Per epoch,
`timesteps` distinct sigmas drawn from the first `grid_points` of the rollout's own sampling grid
(by default its first half), shared by every micro-batch, each with fresh group-shared noise; one
optimizer step per epoch over all of them, as the code's gradient accumulation (`stepping:
micro_batch` steps every `sigmas_per_step` sigmas of a micro-batch). Options: the clip against an
"old" model (a sample whose error ratio exp(err_old - err) has left [1 - c, 1 + c] in its
advantage's direction stops pulling; the old model is the code's EMA of the weights, decay min(0.3,
0.001 x steps), which also samples the rollouts after `sample_with_old_after` optimizer steps), and
the KL to the reference (trainer.kl_beta x the mean squared velocity gap, the code's train.beta).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import contextlib
import math

import torch

from flowrl.core.group_losses import dgpo_group_loss, dgpo_weighted_error_loss
from flowrl.core.seeds import Stream, sample_seed
from flowrl.errors import ConfigError, UserError, check_choice, check_positive
from flowrl.runtime.ema import EMA
from flowrl.train.experience import SAMPLES, Experience
from flowrl.train.objectives.implicit import ImplicitRewardObjective, flow_errors
from flowrl.train.objectives.stepping import check_stepping
from flowrl.train.parts import register_objective

LOSS_FORMS = ("reference", "log_sigmoid")
SIGMA_DRAWS = ("grid", "stratified")
CLIP_OLDS = ("ema", "sampling")


def ema_old_decay(steps: int) -> float:
    """The decay of DGPO's "old" model at the optimizer step that follows `steps` earlier ones:
    min(0.3, 0.001 steps), so the first update copies the weights."""
    return min(0.3, 0.001 * steps)


def grid_points(opts, num_steps: int) -> int:
    """How many of the sampling grid's first sigmas the training sigmas are drawn from: the option,
    or the reference's first half (5 of its 10 steps), at least `timesteps` and at most the grid."""
    if opts.grid_points is not None:
        return opts.grid_points
    return min(num_steps, max(opts.timesteps, math.ceil(num_steps / 2)))


@dataclass
class DGPOOptions:
    """objective.kind dgpo: group preference through the implicit reward, on online clean samples
    (docs/algorithms.md section 10). The defaults are the reference code's (Luo-Yihong/DGPO,
    GenEval/OCR settings); squared errors are means over dimensions, as there."""

    beta: float = 100.0  # the implicit reward's scale, s = -beta (err_theta - err_ref) (DGPO's code: 100)
    # reference: back-propagate mean_i sigmoid((beta / G) sum A delta).detach() A_i err_i, as DGPO's code;
    # log_sigmoid (flowrl variant): the paper's -log sigmoid(-(beta / G) sum A delta), whose gradient is beta
    # times larger (trainer.kl_beta and the gradient clip then weigh beta times less)
    loss_form: str = "reference"
    timesteps: int = 4  # distinct training sigmas per epoch, shared by every micro-batch (DGPO: 4)
    # grid: draw them from the first grid_points sigmas of the rollout's own sampling grid (DGPO: 5 GenEval,
    # 7 OCR); stratified (flowrl variant): one per stratum of sigma_range, crowded by sigma_shift
    sigma_draw: str = "grid"
    # null: the reference's share of the grid, its first half (5 of 10 steps), at least `timesteps` points
    grid_points: Optional[int] = None
    sigma_range: list[float] = field(default_factory=lambda: [0.5, 1.0])  # sigma_draw stratified: the range
    sigma_shift: float = 1.0  # sigma_draw stratified: > 1 crowds the sigmas toward the noisy end
    # iteration: one optimizer step per epoch over every micro-batch and sigma, the loss averaged over them (DGPO's
    # code accumulates its 2 batches x 4 timesteps: "update once per epoch"); micro_batch (flowrl variant, the
    # arena's DGPO cell and the default preset): a step every sigmas_per_step sigmas of each micro-batch
    stepping: str = "iteration"
    # stepping micro_batch: an optimizer step every this many sigmas of a micro-batch; 0: one step per micro-batch
    # over all its sigmas (then trainer.gradient_accumulation_steps micro-batches per step)
    sigmas_per_step: int = 2
    # > 0: a sample whose error ratio exp(err_old - err) has left [1 - c, 1 + c] in its advantage's direction
    # stops pulling (DGPO's code: 0.01 GenEval and OCR); 0: off
    clip_range: float = 0.01
    # the "old" weights of the clip: ema (DGPO's code: an average of the weights updated after every optimizer
    # step with decay min(0.3, 0.001 x steps)) or sampling (flowrl variant: the weights that sampled the iteration)
    clip_old: str = "ema"
    # after this many optimizer steps the rollouts sample with the ema weights (DGPO's switch_ema_ref: 500
    # GenEval, 200 OCR); 0: always the current weights. Needs clip_old ema.
    sample_with_old_after: int = 500
    # the trained velocity's guidance: 1, the conditional velocity alone (DGPO's code); > 1 or null
    # (model.guidance_scale) trains the CFG-combined velocity through both branches (flowrl variant)
    guidance_scale: Optional[float] = 1.0
    # flowrl variant: > 0 adds anchor_beta x the mean squared gap between the sampled velocity (model.guidance_scale,
    # both branches) and the base network's at one sigma of the sampling grid below the trained grid_points, drawn once
    # per optimizer step, so the adapter leaves the low-noise steps, where fine texture is drawn, to the base network
    # (docs/monitor.md, "Where the artefacts come from"); 0: off, the reference's
    anchor_beta: float = 0.0
    anchor_samples: int = 4  # anchor_beta: the first this many samples of the step's micro-batch are anchored


@register_objective
class DGPO(ImplicitRewardObjective):
    name = "dgpo"
    options = DGPOOptions
    section = "dgpo"
    needs = SAMPLES

    def __init__(self, ctx):
        super().__init__(ctx)
        o = self.opts
        self.old = EMA(ctx.params, 0.0) if o.clip_range > 0 or o.sample_with_old_after > 0 else None
        self.steps = 0  # optimizer steps so far (the EMA's decay and the sampling switch count them)
        self.anchor_draws, self.anchor_iteration = torch.Generator(), -1  # anchor_beta: this iteration's sigmas and noise
        if o.sigma_draw == "grid":  # the sampling grid's steps (not its final 0): the first grid_points trained, the rest not
            s = ctx.cfg.sampling
            grid, n = ctx.policy.sigmas(s.num_steps, s.schedule, s.shift).tolist()[: s.num_steps], grid_points(o, s.num_steps)
            self.trained_grid, self.untrained_sigmas = grid[:n], grid[n:]
            drawn = self.trained_grid + (self.untrained_sigmas if o.anchor_beta > 0 else [])
            outside = [round(x, 4) for x in drawn if not ctx.policy.adapter_acts_at(x)]
            if outside:
                raise ConfigError(f"objective.dgpo.sigma_draw grid trains (or anchors) the grid's sigmas {outside} outside "
                                  f"lora.sigma_range {list(ctx.cfg.lora.sigma_range)}, where the adapter does not act: widen "
                                  "lora.sigma_range, lower objective.dgpo.grid_points, or use sigma_draw stratified inside it")

    @classmethod
    def trained_sigma_range(cls, cfg, grid: list[float]) -> tuple[float, float] | None:
        """lora.acts_at trained: the grid's trained sigmas and none of the others, (the midpoint between the last
        trained grid sigma and the first untrained one, 1] (the 10-step default's (0.55, 1]); sigma_draw stratified:
        its sigma_range. None (every sigma) when nothing is left untrained, or when anchor_beta trains the rest."""
        o = cfg.objective.dgpo
        if o.sigma_draw == "stratified":
            return None if list(o.sigma_range) == [0.0, 1.0] else (float(o.sigma_range[0]), float(o.sigma_range[1]))
        n = grid_points(o, len(grid))
        if n >= len(grid) or o.anchor_beta > 0:
            return None
        return round((grid[n - 1] + grid[n]) / 2, 6), 1.0

    @staticmethod
    def draws_stratified(opts) -> bool:
        return opts.sigma_draw == "stratified"

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.objective.dgpo
        check_choice("objective.dgpo.sigma_draw", o.sigma_draw, SIGMA_DRAWS)
        super().validate(cfg)
        check_choice("objective.dgpo.loss_form", o.loss_form, LOSS_FORMS)
        check_choice("objective.dgpo.clip_old", o.clip_old, CLIP_OLDS)
        check_positive("objective.dgpo.clip_range", o.clip_range, strict=False)
        check_positive("objective.dgpo.sigmas_per_step", o.sigmas_per_step, strict=False)
        check_stepping("objective.dgpo", o.stepping, o.sigmas_per_step, o.timesteps, cfg.trainer.gradient_accumulation_steps)
        check_positive("objective.dgpo.sample_with_old_after", o.sample_with_old_after, strict=False)
        if o.sample_with_old_after > 0 and o.clip_old != "ema":
            raise ConfigError("objective.dgpo.sample_with_old_after > 0 samples with the ema weights, which needs "
                              f"objective.dgpo.clip_old ema; got clip_old {o.clip_old} (set sample_with_old_after=0)")
        if o.sigma_draw == "grid":
            steps = cfg.sampling.num_steps
            if o.timesteps > steps:
                raise ConfigError(f"objective.dgpo.timesteps must be at most sampling.num_steps ({steps}) with sigma_draw grid; "
                                  f"got {o.timesteps}")
            if o.grid_points is not None and not o.timesteps <= o.grid_points <= steps:
                raise ConfigError(f"objective.dgpo.grid_points must be between objective.dgpo.timesteps ({o.timesteps}) and "
                                  f"sampling.num_steps ({steps}), or null (the first half of the grid); got {o.grid_points}")
            if o.anchor_beta > 0 and grid_points(o, steps) >= steps:
                raise ConfigError("objective.dgpo.anchor_beta > 0 anchors the sampling grid's untrained sigmas, but "
                                  f"objective.dgpo.grid_points trains all {steps} of them: set grid_points below "
                                  "sampling.num_steps, or anchor_beta=0")
        elif o.anchor_beta > 0:
            raise ConfigError("objective.dgpo.anchor_beta > 0 anchors the sampling grid's untrained sigmas, which needs "
                              f"objective.dgpo.sigma_draw grid; got {o.sigma_draw}")
        check_positive("objective.dgpo.anchor_beta", o.anchor_beta, strict=False)
        check_positive("objective.dgpo.anchor_samples", o.anchor_samples)

    @property
    def stepping(self) -> str:
        return self.opts.stepping

    @property
    def sigmas_per_step(self) -> int:
        return self.opts.sigmas_per_step or self.opts.timesteps

    def training_sigmas(self, iteration: int, epoch: int) -> list[float]:
        """sigma_draw grid: `timesteps` distinct sigmas of the first `grid_points` of the rollout's
        sampling grid (DGPO's code: random.sample over them), keyed by (run seed, iteration, epoch)."""
        o, cfg = self.opts, self.ctx.cfg
        if o.sigma_draw == "stratified":
            return super().training_sigmas(iteration, epoch)
        gen = torch.Generator().manual_seed(sample_seed(cfg.trainer.seed, iteration * cfg.trainer.inner_epochs + epoch,
                                                        Stream.GROUP_SIGMAS))
        grid = self.trained_grid
        return [float(grid[i]) for i in torch.randperm(len(grid), generator=gen)[: o.timesteps].tolist()]

    def behaviour_weights(self):
        """After `sample_with_old_after` optimizer steps the ema "old" weights sample (DGPO's switch_ema_ref)."""
        o = self.opts
        if self.old is not None and o.sample_with_old_after > 0 and self.steps > o.sample_with_old_after:
            return self.old.swapped_in(self.ctx.params)
        return contextlib.nullcontext()

    def prepare(self, experience: Experience) -> None:
        if self.old is not None and self.opts.clip_old == "sampling":
            self.old.update(self.ctx.params, decay=0.0)  # a copy of the weights that sampled this iteration

    def anchor(self, experience: Experience, batch, x0: torch.Tensor) -> torch.Tensor | None:
        """anchor_beta x the mean squared gap between the guided velocity (model.guidance_scale) and the base
        network's on the micro-batch's first anchor_samples samples, at one of the sampling grid's untrained
        sigmas with fresh noise, both drawn from this iteration's anchor stream; None when anchor_beta is 0."""
        o = self.opts
        if o.anchor_beta <= 0:
            return None
        if self.anchor_iteration != experience.iteration:
            seed = sample_seed(self.ctx.cfg.trainer.seed, experience.iteration, Stream.DGPO_ANCHOR)
            self.anchor_draws, self.anchor_iteration = torch.Generator().manual_seed(seed), experience.iteration
        sigma = self.untrained_sigmas[int(torch.randint(len(self.untrained_sigmas), (), generator=self.anchor_draws))]
        x0 = x0[: o.anchor_samples]
        eps = torch.randn(x0.shape, generator=self.anchor_draws).to(x0.device)
        with self.ctx.policy.guidance(None):
            errors = flow_errors(self.ctx.policy, x0, eps, sigma, self.ctx.policy.encode(batch.prompts[: o.anchor_samples]))
        return o.anchor_beta * ((errors.v - errors.v_ref) ** 2).mean()

    def after_optimizer_step(self) -> None:
        if self.old is not None and self.opts.clip_old == "ema":  # the steps before this one set the decay, as in the code
            self.old.update(self.ctx.params, decay=ema_old_decay(self.steps))
        self.steps += 1

    def before_forward(self, batch, x0, eps, sigma, cond):
        if self.old is None or self.opts.clip_range <= 0:
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
        if o.loss_form == "log_sigmoid":
            return dgpo_group_loss(delta, adv, batch.groups, o.beta).mean(), own
        return dgpo_weighted_error_loss(err, delta, adv, batch.groups, o.beta).mean(), own

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        state = {"dgpo_steps": {"steps": torch.tensor([self.steps])}}
        return {**state, "dgpo_old": self.old.shadow} if self.old is not None else state

    def load_state_dict(self, state, checkpoint: str) -> None:
        if state.get("dgpo_steps") is not None:
            self.steps = int(state["dgpo_steps"]["steps"][0])
        if self.old is None:
            return
        if state.get("dgpo_old") is None:
            raise UserError(f"--resume: checkpoint '{checkpoint}' has no dgpo_old.safetensors, which objective.dgpo's clip "
                            "and sample_with_old_after need")
        self.old.shadow = {n: t.clone() for n, t in state["dgpo_old"].items()}
