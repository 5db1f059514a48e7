"""objective.kind awm: Advantage Weighted Matching (Xue et al., arXiv 2509.25050; docs/algorithms.md
section 14). The defaults are the authors' code (scxue/advantage_weighted_matching,
scripts/train_sd3_awm.py with config/dgx_awm.py's GenEval settings); Flow-Factory's readings are
named options.

Flow matching on the rollout's clean samples, weighted by their advantages: each training
micro-batch draws K indices of the sampling grid (one per stratum, shared by its samples), noises
every sample afresh at those sigmas, and scores the velocity's squared error m (float64, the mean
over elements) through a weighting l = w(m, t) (generalised Huber by default). The surrogate
log-prob is -l; its ratio to the same quantity before the update (1 on-policy: the old value is
the same forward, detached) enters a PPO clip, so the gradient is mean A dl/dtheta: better-than-
group samples are matched more closely, worse ones less. A KL to the base network and one to an
EMA of the weights (both mean squared velocity gaps) anchor it. All micro-batches accumulate into
one optimizer step per iteration (per inner epoch), as the reference's gradient accumulation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm.auto import tqdm

from flowrl.core.seeds import Stream, sample_seed
from flowrl.errors import ConfigError, UserError, check_choice, check_range
from flowrl.runtime.ema import EMA
from flowrl.sampling.noise import FORWARD_NOISING, seeded_noise
from flowrl.sampling.steps import flow_matching_target, forward_noise
from flowrl.train.experience import SAMPLES, Experience, advantages_at
from flowrl.train.parts import Objective, register_objective

WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
TIME_TYPES = ("discrete", "discrete_wo_init", "discrete_with_init")
ADVANTAGE_SCALES = ("reference", "clip")
KL_TERMS = ("nested", "independent")
ORDER_STREAM = Stream.NFT_ORDER  # the clean-sample objectives' stream of batch orders and sigmas (one runs at a time)


@dataclass
class AWMOptions:
    """objective.kind awm: advantage-weighted flow matching on the clean samples (any sampler, ode
    too). The defaults are the authors' code's GenEval settings; each other value is a named variant."""

    # K: sigmas trained per micro-batch and inner epoch, one per stratum of the index range; 0: the reference's 6 of
    # its 14 sampling steps, scaled to sampling.num_steps (round(6 x num_steps / 14), at least 1: 4 at 10 steps)
    timesteps: int = 0
    # the index range's end: indices up to floor(timestep_fraction x sampling.num_steps) of the sampling grid
    timestep_fraction: float = 0.9
    # discrete_wo_init (the reference's): the range starts at index 1 (sigma 1 never trained) | discrete: at 0 |
    # discrete_with_init: index 0 always, and K - 1 strata from 1
    time_type: str = "discrete_wo_init"
    # l = w(m, t) of the velocity's mean squared error m at sigma t: ghuber (t / p) ((m + 1e-10)^p - 1e-10^p) with
    # p = ghuber_power (the reference's) | huber t (sqrt(m + 1e-10) - 1e-5) | uniform m | t t m | t2 t^2 m
    weighting: str = "ghuber"
    ghuber_power: float = 0.25
    clip_range: float = 1.0  # the ratio's clip [1 - c, 1 + c] (the reference's 1: ratios in [0, 2])
    # reference: A clipped to +-advantage.clip and divided by it (the authors' +-5 then x 1/5: A in [-1, 1]) |
    # clip (Flow-Factory's): A clipped to +-1, not rescaled
    advantage_scale: str = "reference"
    beta: Optional[float] = 0.001  # x the mean squared velocity gap to the base network (GenEval 0.001); null: trainer.kl_beta
    beta_ema: float = 1.0  # x the mean squared velocity gap to the EMA of the weights
    # nested (the reference's code): the EMA term is added only when beta > 0 | independent (Flow-Factory): each
    # term whenever its own weight is > 0
    kl_terms: str = "nested"
    # the EMA of the KL, updated once per iteration after its steps: ema <- d ema + (1 - d) theta, d = min(ema_decay_max,
    # ema_decay_rate x n), n the optimizer steps taken so far, this iteration's included (on the budget's nominal
    # clock): the reference's "linear" schedule on its global_step, read after the epoch's step
    ema_decay_max: float = 0.3
    ema_decay_rate: float = 0.001
    # the trained velocity's guidance: 1, the conditional velocity alone (the reference); null: model.guidance_scale
    guidance_scale: Optional[float] = 1.0


def trained_timesteps(opts, num_steps: int) -> int:
    """objective.awm.timesteps, or for 0 the reference's 6 of 14 steps scaled to `num_steps`."""
    return opts.timesteps or max(1, round(6 * num_steps / 14))


def awm_weighting(m: torch.Tensor, t: float | torch.Tensor, kind: str, power: float = 0.25) -> torch.Tensor:
    """l = w(m, t): the weighted matching error of squared error `m` at sigma `t` (the reference's
    `awm_weighting`)."""
    if kind == "ghuber":
        return (t / power) * ((m + 1e-10) ** power - 1e-10**power)
    if kind == "huber":
        return t * (torch.sqrt(m + 1e-10) - 1e-5)
    return {"uniform": 1.0, "t": t, "t2": t * t}[kind] * m


def awm_indices(num_steps: int, k: int, fraction: float, time_type: str, gen: torch.Generator) -> torch.Tensor:
    """K indices of a num_steps grid, one per stratum of [start, floor(fraction x num_steps)]: stratum j
    of boundaries linspace(start, end, K + 1) gives floor(b_j) + floor(U (floor(b_j+1) - floor(b_j)));
    discrete_with_init puts index 0 first and draws K - 1 from [1, end]."""
    end = int(fraction * num_steps)
    start = 0 if time_type == "discrete" else 1
    strata = k - 1 if time_type == "discrete_with_init" else k
    bounds = torch.linspace(start, end, strata + 1, dtype=torch.float64).floor().long()
    u = torch.rand(strata, generator=gen, dtype=torch.float64)
    drawn = bounds[:-1] + (u * (bounds[1:] - bounds[:-1]).double()).floor().long()
    return torch.cat([torch.zeros(1, dtype=torch.long), drawn]) if time_type == "discrete_with_init" else drawn


def awm_policy_loss(l: torch.Tensor, l_old: torch.Tensor, adv: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row PPO-clipped loss on the surrogate log-prob -l: max(-A r, -A clip(r, 1 - c, 1 + c)) with
    r = exp(l_old - l), and the ratios."""
    ratio = torch.exp(l_old - l)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range)), ratio


@register_objective
class AWM(Objective):
    name = "awm"
    options = AWMOptions
    needs = SAMPLES

    def __init__(self, ctx):
        super().__init__(ctx)
        self.opts = ctx.cfg.objective.awm
        self.ema = EMA(ctx.params, self.opts.ema_decay_max) if self.opts.beta_ema > 0 else None

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.objective.awm
        check_choice("objective.awm.time_type", o.time_type, TIME_TYPES)
        check_choice("objective.awm.weighting", o.weighting, WEIGHTINGS)
        check_choice("objective.awm.advantage_scale", o.advantage_scale, ADVANTAGE_SCALES)
        check_choice("objective.awm.kl_terms", o.kl_terms, KL_TERMS)
        for key, spec in (("timesteps", ">= 0"), ("timestep_fraction", "(0, 1]"), ("ghuber_power", "> 0"), ("clip_range", "> 0"),
                          ("beta_ema", ">= 0"), ("ema_decay_max", "[0, 1)"), ("ema_decay_rate", ">= 0")):
            check_range(f"objective.awm.{key}", getattr(o, key), spec)
        if o.beta is not None:
            check_range("objective.awm.beta", o.beta, ">= 0")
        start, k = 0 if o.time_type == "discrete" else 1, trained_timesteps(o, cfg.sampling.num_steps)
        end = int(o.timestep_fraction * cfg.sampling.num_steps)
        if end - start < k - (o.time_type == "discrete_with_init"):
            raise ConfigError(f"objective.awm.timesteps ({k}) needs that many grid indices in [{start}, {end}] "
                              f"(objective.awm.timestep_fraction x sampling.num_steps {cfg.sampling.num_steps}); lower it or "
                              "raise the fraction")
        if o.guidance_scale is not None and not o.guidance_scale >= 1.0:
            raise ConfigError(f"objective.awm.guidance_scale must be >= 1 (1: the conditional velocity alone) or null "
                              f"(model.guidance_scale); got {o.guidance_scale}")
        if not cfg.lora.enabled and (o.beta if o.beta is not None else cfg.trainer.kl_beta) > 0:
            raise ConfigError("objective.awm.beta's KL compares with the network with the adapter disabled, so it needs "
                              "lora.enabled=true (or objective.awm.beta: 0)")

    # ---- pieces (each written out in tests/train/test_reference_objectives.py) -----------------
    def scaled_advantages(self, experience: Experience) -> torch.Tensor:
        """The reference's A clamped to +-advantage.clip, then x 1 / advantage.clip; Flow-Factory's
        clamped to +-1."""
        if self.opts.advantage_scale == "clip":
            return experience.advantages.clamp(-1.0, 1.0)
        c = self.ctx.cfg.advantage.clip
        return experience.advantages.clamp(-c, c) / c

    def kl_weights(self) -> tuple[float, float]:
        """(beta, beta_ema) as they apply: nested, the EMA term only when beta > 0."""
        o = self.opts
        beta = o.beta if o.beta is not None else self.ctx.cfg.trainer.kl_beta
        beta_ema = o.beta_ema if (o.kl_terms == "independent" or beta > 0) and self.ema is not None else 0.0
        return beta, beta_ema

    def step_loss(self, v, v_ref, v_ema, x0, eps, sigma: float, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """One (micro-batch, sigma) term: the mean over rows of the clipped policy loss on the weighted
        float64 matching error, plus the KL terms; and what it logs."""
        o = self.opts
        dims = tuple(range(1, v.ndim))
        m = ((v.double() - flow_matching_target(x0, eps).double()) ** 2).mean(dim=dims)
        l = awm_weighting(m, sigma, o.weighting, o.ghuber_power)
        pg, ratio = awm_policy_loss(l, l.detach(), adv.double(), o.clip_range)
        loss = pg.mean()
        beta, beta_ema = self.kl_weights()
        logged = {"policy_loss": loss.item(), "awm_error": m.mean().item(), "ratio_mean": ratio.mean().item()}
        if beta > 0:
            kl = ((v - v_ref) ** 2).mean()
            loss = loss + beta * kl
            logged["kl"] = kl.item()
        if beta_ema > 0:
            kl_ema = ((v - v_ema) ** 2).mean()
            loss = loss + beta_ema * kl_ema
            logged["kl_ema"] = kl_ema.item()
        return loss, logged

    def update(self, experience: Experience) -> dict:
        ctx, t, o = self.ctx, self.ctx.cfg.trainer, self.opts
        acc, policy, s = ctx.accelerator, ctx.policy, ctx.cfg.sampling
        gen = torch.Generator().manual_seed(sample_seed(t.seed, experience.iteration, ORDER_STREAM))
        grid = policy.sigmas(s.num_steps, s.schedule, s.shift).double()
        adv, k_steps = self.scaled_advantages(experience), trained_timesteps(o, s.num_steps)
        beta, beta_ema = self.kl_weights()
        batches, sums, terms, grad_norms = experience.samples, {}, 0, []
        policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * len(batches) * k_steps, desc=f"iter {experience.iteration} training", leave=False,
                   disable=not ctx.progress, unit="step")
        with policy.guidance(o.guidance_scale):
            for epoch in range(t.inner_epochs):
                order = torch.randperm(len(batches), generator=gen).tolist()
                for j, bi in enumerate(order):
                    batch = batches[bi]
                    x0 = batch.x0.to(acc.device, torch.float32)
                    cond, seeds, a = policy.encode(batch.prompts), batch.seeds.tolist(), advantages_at(adv, batch.index).to(acc.device)
                    indices = awm_indices(s.num_steps, k_steps, o.timestep_fraction, o.time_type, gen)
                    for k, index in enumerate(indices.tolist()):
                        sigma = float(grid[index])
                        eps = seeded_noise(seeds, FORWARD_NOISING - epoch * k_steps - k, x0.shape[1:], acc.device)
                        x_t = forward_noise(x0, eps, sigma)
                        v_ema = None
                        if beta_ema > 0:  # before the forward with grad: the swap writes the weights in place
                            with torch.no_grad(), self.ema.swapped_in(ctx.params):
                                v_ema = policy.velocity(x_t, sigma, cond)
                        last = j == len(order) - 1 and k == len(indices) - 1
                        with contextlib.nullcontext() if last else acc.no_sync(policy.net):
                            v = policy.velocity(x_t, sigma, cond)
                            v_ref = None
                            if beta > 0:
                                with torch.no_grad(), policy.reference():
                                    v_ref = policy.velocity(x_t, sigma, cond)
                            loss, logged = self.step_loss(v, v_ref, v_ema, x0, eps, sigma, a)
                            # the mean over the micro-batch's K x B rows, and over the micro-batches (one step)
                            acc.backward(loss / (len(indices) * len(order)))
                        for key, value in {"loss": loss.item(), "awm_sigma": sigma, **logged}.items():
                            sums[key] = sums.get(key, 0.0) + value
                        terms += 1
                        bar.update(1)
                grad_norms.append(ctx.optimizer_step())
        bar.close()
        policy.transformer.eval()
        if self.ema is not None:  # once per iteration, the reference's once per epoch of one step
            self.ema.update(ctx.params, decay=self.ema_decay_after(experience.iteration, len(grad_norms)))
        stats = {k: v / max(terms, 1) for k, v in sums.items()}
        stats.update(grad_norm=sum(grad_norms) / max(len(grad_norms), 1), optimizer_steps=len(grad_norms),
                     trained_transitions=terms, lr=ctx.optimizer.param_groups[0]["lr"])
        return stats

    def ema_decay_after(self, iteration: int, steps: int) -> float:
        """The KL EMA's decay after `iteration`, which took `steps` optimizer steps: min(ema_decay_max,
        ema_decay_rate x n) with n = (i + 1) x steps, i the iteration on the budget's nominal clock: the
        reference's global_step, which counts an epoch's step before the EMA reads it."""
        o = self.opts
        return min(o.ema_decay_max, o.ema_decay_rate * (self.ctx.plan.progress(iteration) + 1) * steps)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"awm_ema": self.ema.shadow} if self.ema is not None else {}

    def load_state_dict(self, state, checkpoint: str) -> None:
        if self.ema is None:
            return
        if state.get("awm_ema") is None:
            raise UserError(f"--resume: checkpoint '{checkpoint}' has no awm_ema.safetensors, which objective.awm.beta_ema needs")
        self.ema.shadow = {n: t.clone() for n, t in state["awm_ema"].items()}
