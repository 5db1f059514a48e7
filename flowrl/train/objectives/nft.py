"""objective.kind nft: DiffusionNFT (Zheng et al., arXiv:2509.16117; docs/algorithms.md section 4).
The defaults are the reference code's (NVlabs/DiffusionNFT, scripts/train_nft_sd3.py).

Flow matching on the clean samples, pulled toward the better-than-group ones and pushed from the
worse (flowrl.core.nft_loss). Each sample batch is noised afresh at `objective.nft.timesteps`
sigmas per sample, and the epoch's batches and sigmas accumulate into one optimizer step (the
reference's; `stepping: micro_batch` steps per batch), for `trainer.inner_epochs` passes. With
`sigma_draw: grid` (the reference) each sample walks its own random permutation of the sampling
grid's sigmas (those where the adapter acts); with `stratified` the batch shares one sigma per
stratum of lora.sigma_range. With `r_scale: adv_clip` (the reference) r = 0.5 + 0.5 A / A_max and
the loss is multiplied by A_max / beta. The old policy v_old is, with `old_policy: sampling`,
the weights that sampled the iteration, which stay fixed through its steps, so the loss's
minimiser v_old + (2r - 1)(u - v_old) / beta bounds how far an iteration can move, and are
soft-updated after it; with `current`, the weights before each step (its detached prediction:
the gradient is then (2r - 1) beta times the plain flow-matching gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import contextlib

import torch
from tqdm.auto import tqdm

from flowrl.core import nft_loss, optimality_probability
from flowrl.core.advantages import unit_scale_per_group
from flowrl.core.seeds import Stream, sample_seed
from flowrl.errors import ConfigError, UserError, check_choice, check_positive
from flowrl.runtime.ema import EMA
from flowrl.sampling.noise import FORWARD_NOISING, seeded_noise
from flowrl.sampling.schedules import stratified_sigma
from flowrl.sampling.steps import flow_matching_target, forward_noise
from flowrl.train.experience import SAMPLES, WHOLE_GROUPS, Experience, advantages_at
from flowrl.train.objectives.stepping import check_stepping, step_plan, step_shares
from flowrl.train.parts import Objective, register_objective

OLD_POLICIES = ("current", "sampling")
DECAY_CLOCKS = ("optimizer_steps", "iterations")
R_SCALES = ("adv_clip", "clip", "group_max")
SIGMA_DRAWS = ("grid", "stratified")


def trained_timesteps(opts, num_steps: int) -> int:
    """objective.nft.timesteps, or for 0 the reference's int(0.99 x num_steps) (stratified: 2)."""
    if opts.timesteps:
        return opts.timesteps
    return max(1, int(0.99 * num_steps)) if opts.sigma_draw == "grid" else 2


def old_policy_decay(n: float, uphold: float, uprate: float, flat: int = 0) -> float:
    """DiffusionNFT's old-policy decay after n counted steps (its `return_decay`): 0 while n < flat,
    then min(uprate (n - flat), uphold)."""
    return 0.0 if n < flat else min(uprate * (n - flat), uphold)


@dataclass
class NFTOptions:
    """objective.kind nft: DiffusionNFT's negative-aware flow matching on the clean samples (any
    sampler, ode too; docs/algorithms.md section 4). The defaults are the reference code's
    (NVlabs/DiffusionNFT, scripts/train_nft_sd3.py); each other value is a named flowrl variant."""

    # grid: each sample trains at its own random permutation of the sampling grid's sigmas, the first
    # `timesteps` of it (the reference); stratified (flowrl variant): `timesteps` sigmas per batch, one per
    # stratum of lora.sigma_range, shared by the batch's samples
    sigma_draw: str = "grid"
    # sigmas trained per sample and iteration; 0: int(0.99 x sampling.num_steps), the reference's
    # timestep_fraction 0.99 (9 of 10 steps; with sigma_draw stratified, 0 means 2)
    timesteps: int = 0
    beta: float = 1.0  # the implicit policies' step, v_old +- beta (v - v_old)
    # sigma_draw stratified: time shift of its sigmas (1: uniform strata over lora.sigma_range)
    sigma_shift: float = 1.0
    # v_old is "sampling" (the weights that sampled the iteration, fixed through its steps, then soft-updated:
    # old <- d old + (1 - d) new with d = 0 while n < old_decay_flat, else min(old_decay, old_decay_rate x (n -
    # old_decay_flat)): the reference's "old" adapter and its return_decay) or "current" (flowrl variant: the weights
    # before each optimizer step). The defaults are its decay type 1; its type 2 (the OCR config: flat, then a
    # steep rise) is old_decay 0.999, old_decay_rate 0.0075, old_decay_flat 75; its type 0 is old_decay 0
    old_policy: str = "sampling"
    old_decay: float = 0.5
    old_decay_rate: float = 0.001
    old_decay_flat: int = 0  # n below this: d = 0 (the old policy is the trained weights)
    # what n counts: optimizer_steps (the reference's global_step: the steps taken so far, this iteration's
    # included, on the budget's nominal clock) | iterations (flowrl's earlier count, which the arena's nft and
    # sol_rl cells were measured with: the iterations before this one, 0 at the first)
    old_decay_clock: str = "optimizer_steps"
    adaptive_weight: bool = True  # the reference's per-sample normalisation of the x0-prediction error
    # false keeps the positive half of the loss only (reward-weighted flow matching on the better-than-group
    # samples, no push away from the worse ones)
    negatives: bool = True
    # adv_clip (the reference): r = 0.5 + 0.5 A / advantage.clip and the loss times advantage.clip / beta, so
    # the gradient at v = v_old is A times plain flow matching's; clip (flowrl variant, the paper's text):
    # r = 0.5 + 0.5 clip(A, -1, 1), loss unscaled; group_max (flowrl variant): A scaled per group by
    # max(1, max |A|), loss unscaled (each group's pulls and pushes still cancel, sum (2r - 1) = 0)
    r_scale: str = "adv_clip"
    # the guidance of the velocity the loss trains (and of v_old and the KL reference): 1, the conditional
    # velocity alone (the reference trains and samples without CFG); None: model.guidance_scale
    guidance_scale: Optional[float] = 1.0
    # iteration: one optimizer step per epoch over every batch and sigma, the loss averaged over them (the
    # reference: loss / (gradient_accumulation_steps x num_train_timesteps), one step per epoch); micro_batch
    # (flowrl variant, the arena's nft and sol_rl cells): a step per sampling batch over its sigmas (then
    # trainer.gradient_accumulation_steps batches per step)
    stepping: str = "iteration"


@register_objective
class NFT(Objective):
    name = "nft"
    options = NFTOptions
    defaults = {"trainer.kl_beta": 1e-4}  # the reference's train.beta (the schema's 0.04 is Flow-GRPO's)
    needs = SAMPLES

    def __init__(self, ctx):
        super().__init__(ctx)
        self.opts = ctx.cfg.objective.nft
        # the old policy when it is not the current weights: it samples, and gives v_old
        self.old = EMA(ctx.params, self.opts.old_decay) if self.opts.old_policy == "sampling" else None

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.objective.nft
        check_choice("objective.nft.sigma_draw", o.sigma_draw, SIGMA_DRAWS)
        check_positive("objective.nft.timesteps", o.timesteps, strict=False)
        if o.sigma_draw == "grid" and o.timesteps > cfg.sampling.num_steps:
            raise ConfigError(f"objective.nft.timesteps must be at most sampling.num_steps ({cfg.sampling.num_steps}) with "
                              f"objective.nft.sigma_draw grid (each sample trains distinct grid sigmas); got {o.timesteps}")
        check_positive("objective.nft.beta", o.beta)
        check_positive("objective.nft.sigma_shift", o.sigma_shift)
        check_choice("objective.nft.r_scale", o.r_scale, R_SCALES)
        if o.guidance_scale is not None and not o.guidance_scale >= 1.0:
            raise ConfigError(f"objective.nft.guidance_scale must be >= 1 (1: the conditional velocity alone) or null "
                              f"(model.guidance_scale); got {o.guidance_scale}")
        check_choice("objective.nft.old_policy", o.old_policy, OLD_POLICIES)
        check_stepping("objective.nft", o.stepping, 0, 0, cfg.trainer.gradient_accumulation_steps)
        if not 0.0 <= o.old_decay < 1.0 or o.old_decay_rate < 0:
            raise ConfigError(f"objective.nft.old_decay must be in [0, 1) and objective.nft.old_decay_rate >= 0; "
                              f"got {o.old_decay} and {o.old_decay_rate}")
        check_positive("objective.nft.old_decay_flat", o.old_decay_flat, strict=False)
        check_choice("objective.nft.old_decay_clock", o.old_decay_clock, DECAY_CLOCKS)
        if cfg.trainer.inner_epochs != 1 and o.old_policy == "current":
            raise ConfigError(f"trainer.inner_epochs must be 1 with objective.kind nft and objective.nft.old_policy current "
                              f"(v_old is then the weights before each step, not the policy that sampled); got {cfg.trainer.inner_epochs}")

    @classmethod
    def requires(cls, cfg) -> dict[str, str]:
        return {WHOLE_GROUPS: "objective.nft.r_scale group_max"} if cfg.objective.nft.r_scale == "group_max" else {}

    def behaviour_weights(self):
        return self.old.swapped_in(self.ctx.params) if self.old is not None else contextlib.nullcontext()

    def optimality(self, experience: Experience) -> torch.Tensor:
        """The advantages that DiffusionNFT's r is made of (r = 0.5 + 0.5 clip(A', -1, 1)): with
        r_scale adv_clip A' = A / advantage.clip (the reference's A / A_max), with clip A itself,
        with group_max each group's A divided by max(1, its largest |A|) (pulls and pushes still cancel)."""
        adv = experience.advantages.clone()
        if self.opts.r_scale == "adv_clip":
            return adv / self.ctx.cfg.advantage.clip
        if self.opts.r_scale == "group_max":
            valid = experience.valid
            adv[valid] = unit_scale_per_group(adv[valid], experience.prompt_ids[valid])
        return adv

    def loss_scale(self) -> float:
        """The reference multiplies its loss by A_max / beta (r_scale adv_clip); the variants by 1."""
        return self.ctx.cfg.advantage.clip / self.opts.beta if self.opts.r_scale == "adv_clip" else 1.0

    def loss(self, v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor,
             sigma: float | torch.Tensor) -> torch.Tensor:
        """The batch's DiffusionNFT loss (without the KL): the mean over samples of nft_loss, times
        `loss_scale`, with the adaptive weight at each sample's sigma when objective.nft.adaptive_weight."""
        o = self.opts
        per_sample = nft_loss(v, v_old, target, r, o.beta, sigma=sigma if o.adaptive_weight else None, negatives=o.negatives)
        return self.loss_scale() * per_sample.mean()

    def grid(self) -> torch.Tensor:
        """sigma_draw grid: the sampling grid's sigmas (without the final 0) where the adapter acts."""
        s, policy = self.ctx.cfg.sampling, self.ctx.policy
        sigmas = policy.sigmas(s.num_steps, s.schedule, s.shift)[:-1].double()
        low, high = policy.lora_sigma_range or (0.0, 1.0)
        return sigmas[(sigmas > low) & (sigmas <= high)]

    def batch_sigmas(self, n: int, k_steps: int, gen: torch.Generator) -> list[float | torch.Tensor]:
        """The sigmas of one batch of n samples, one entry per training step: with sigma_draw grid a
        tensor [n] (sample i at step k: the k-th entry of its own random permutation of the grid),
        with stratified one float per step shared by the batch."""
        o = self.opts
        if o.sigma_draw == "stratified":
            low, high = self.ctx.policy.lora_sigma_range or (0.0, 1.0)
            return [stratified_sigma(k, k_steps, low, high, o.sigma_shift, gen) for k in range(k_steps)]
        grid = self.grid()
        order = torch.stack([torch.randperm(len(grid), generator=gen) for _ in range(n)])  # [n, len(grid)]
        return [grid[order[:, k]].float() for k in range(self.sigmas_per_batch(k_steps))]

    def sigmas_per_batch(self, k_steps: int) -> int:
        """How many sigmas `batch_sigmas` gives: k_steps, or with sigma_draw grid at most the grid's length."""
        return k_steps if self.opts.sigma_draw == "stratified" else min(k_steps, len(self.grid()))

    def update(self, experience: Experience) -> dict:
        ctx, t, o = self.ctx, self.ctx.cfg.trainer, self.opts
        acc, policy = ctx.accelerator, ctx.policy
        k_steps = trained_timesteps(o, ctx.cfg.sampling.num_steps)
        gen = torch.Generator().manual_seed(sample_seed(t.seed, experience.iteration, Stream.NFT_ORDER))
        advantages = self.optimality(experience)
        batches = [(b, optimality_probability(advantages_at(advantages, b.index))) for b in experience.samples]
        losses, grad_norms, kls, sigmas = [], [], [], []
        needs_old = o.negatives or o.beta != 1.0  # the positive half alone at beta 1 trains v+ = v: no v_old
        policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * len(batches) * k_steps, desc=f"iter {experience.iteration} training", leave=False,
                   disable=not ctx.progress, unit="step")
        # the pairs of one optimizer step share its weight: its gradient is their mean (the reference's accumulation)
        shares = step_shares(step_plan(len(batches), self.sigmas_per_batch(k_steps), o.stepping, 0, t.gradient_accumulation_steps))
        with policy.guidance(o.guidance_scale):  # the velocity the loss trains
            for epoch in range(t.inner_epochs):
                for position, bi in enumerate(torch.randperm(len(batches), generator=gen).tolist()):
                    batch, r = batches[bi]
                    x0 = batch.x0.to(acc.device, torch.float32)  # a low-precision explorer's samples too
                    cond = policy.encode(batch.prompts)
                    seeds = batch.seeds.tolist()
                    steps = self.batch_sigmas(len(x0), k_steps, gen)
                    for k, sigma in enumerate(steps):
                        sigmas.append(sigma if isinstance(sigma, float) else float(sigma.double().mean()))
                        rows = sigma if isinstance(sigma, float) else sigma.to(acc.device).reshape(-1, *[1] * (x0.ndim - 1))
                        eps = seeded_noise(seeds, FORWARD_NOISING - epoch * k_steps - k, x0.shape[1:], acc.device)
                        x_t = forward_noise(x0, eps, rows)
                        v_old = None
                        if self.old is not None and needs_old:  # before the forward with grad: the swap writes the weights in place
                            with torch.no_grad(), self.old.swapped_in(ctx.params):
                                v_old = policy.velocity(x_t, sigma, cond)
                        share, steps_now = shares[(position, k)]
                        with contextlib.nullcontext() if steps_now else acc.no_sync(policy.net):
                            v = policy.velocity(x_t, sigma, cond)
                            loss = self.loss(v, v.detach() if v_old is None else v_old, flow_matching_target(x0, eps),
                                             r.to(acc.device), sigma)
                            if t.kl_beta > 0:  # anchor to the reference: the velocity's squared distance to the base network's
                                with torch.no_grad(), policy.reference():
                                    v_ref = policy.velocity(x_t, sigma, cond)
                                kl = ((v - v_ref) ** 2).mean()
                                kls.append(kl.item())
                                loss = loss + t.kl_beta * kl
                            acc.backward(loss / share)
                        losses.append(loss.item())
                        bar.update(1)
                        if steps_now:
                            grad_norms.append(ctx.optimizer_step())
        bar.close()
        policy.transformer.eval()
        if self.old is not None:
            self.old.update(ctx.params, decay=self.old_decay_after(experience.iteration, len(grad_norms)))
        return {"loss": sum(losses) / max(len(losses), 1), "kl": sum(kls) / max(len(kls), 1),
                "grad_norm": sum(grad_norms) / max(len(grad_norms), 1), "optimizer_steps": len(grad_norms),
                "trained_transitions": len(losses), "lr": ctx.optimizer.param_groups[0]["lr"],
                "nft_sigma_mean": sum(sigmas) / max(len(sigmas), 1)}

    def old_decay_after(self, iteration: int, steps: int) -> float:
        """The old policy's decay d after `iteration`, which took `steps` optimizer steps: with the
        optimizer_steps clock n = (i + 1) x steps, i the iteration on the budget's nominal clock (the
        reference's global_step, counted after the epoch's steps), with the iterations clock n = i."""
        o, i = self.opts, self.ctx.plan.progress(iteration)
        n = (i + 1) * steps if o.old_decay_clock == "optimizer_steps" else i
        return old_policy_decay(n, o.old_decay, o.old_decay_rate, o.old_decay_flat)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"nft_old": self.old.shadow} if self.old is not None else {}

    def load_state_dict(self, state, checkpoint: str) -> None:
        if self.old is None:
            return
        if state.get("nft_old") is None:
            raise UserError(f"--resume: checkpoint '{checkpoint}' has no nft_old.safetensors, which objective.nft.old_policy sampling needs")
        self.old.shadow = {n: t.clone() for n, t in state["nft_old"].items()}
