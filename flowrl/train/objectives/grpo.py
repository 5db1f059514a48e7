"""objective.kind grpo: the PPO-clipped surrogate over transitions with behaviour log-probs,
plus beta x the exact KL to the reference, the network with its adapter disabled (Flow-GRPO:
Liu et al., arXiv:2505.05470; docs/algorithms.md section 2). `trust_region: divergence_mask`
replaces the ratio clip with Flow-DPPO's divergence mask (docs/algorithms.md section 15).

Inner epochs over the experience's accumulation groups, shuffled each epoch (or in their order
when the experience asks: G2RPO's branch steps); `trainer.gradient_accumulation_steps` groups
make one optimizer step, and under DDP gradients are synchronised only on the step's last
backward. Each micro-batch's loss is a mean over its kept transitions; within an optimizer step
every micro-batch weighs the same, or, when the experience asks (trees and G2RPO: micro-batches
may differ in size), every kept transition does. A
micro-batch with nothing kept gets a zero backward (so every process runs the same backwards)
and no statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import contextlib

import torch
from tqdm.auto import tqdm

from flowrl.core import clipped_policy_loss, gaussian_kl
from flowrl.core.losses import PolicyLoss, divergence_masked_policy_loss, ratio_norm_log_ratio
from flowrl.core.off_policy import (OFF_POLICY_LOSSES, WEIGHT_MODES, behaviour_weight_stats, decoupled_policy_loss, m2po_mask,
                                    m2po_policy_loss)
from flowrl.core.gardo import GATE_SIGNS
from flowrl.core.seeds import Stream, sample_seed
from flowrl.errors import ConfigError, check_choice, check_positive
from flowrl.sampling.precision import check_training_precision
from flowrl.sampling.rollout import policy_precision
from flowrl.train.experience import STEP_MEANS, TRANSITIONS, Experience, TransitionBatch
from flowrl.train.objectives.gardo import GardoRegularizer
from flowrl.train.parts import Objective, register_objective

STAT_NAMES = ("loss", "policy_loss", "kl", "ratio_mean", "clipfrac")
TRUST_REGIONS = ("clip", "divergence_mask")
KL_FORMS = ("reference", "exact")
REGULARIZERS = ("kl", "gardo")


@dataclass
class GRPOOptions:
    """objective.kind grpo: the PPO-clipped surrogate over the SDE steps' log-probs (Flow-GRPO)."""

    clip_range: float = 1e-4  # PPO ratio clip (Flow-GRPO: 1e-4; GRPO-Guard's settings: 2e-6, 4e-6 for PickScore)
    clip_range_high: Optional[float] = None  # defaults to clip_range
    # GRPO-Guard (arXiv 2510.22319), off in Flow-GRPO: ratio_norm takes the log-ratio as s (logp - logp_old) +
    # mean(d^2) / (2 s), d = mu - mu_old, s the step's std (centred, one scale at every step); step_reweight
    # divides each step's loss by its dt. Flow-GRPO's SDE (sampling.sampler flow_grpo) on flat rollouts only
    ratio_norm: bool = False
    step_reweight: bool = False
    # with run.async_rollouts, batches up to run.max_staleness updates old (docs/usage.md, "Asynchronous rollouts"):
    # decoupled (AReaL's PPO: the clip against the weights at the update's start, times the behaviour weight) | m2po
    # (M2PO's second-moment mask over the transitions, no clip)
    off_policy: str = "decoupled"
    behaviour_weight: str = "none"  # decoupled's weight exp(proximal - behaviour): none (as it is) | truncate (TIS) | mask (rejection)
    behaviour_cap: float = 2.0  # truncate and mask: the cap on the behaviour weight (TIS: 2)
    m2po_tau: float = 0.04  # m2po: the bound on the mean squared log-ratio of the kept transitions
    # clip (Flow-GRPO: PPO's ratio clip at clip_range) | divergence_mask (Flow-DPPO, arXiv 2606.11025: no ratio clip; a
    # transition stops pulling once its divergence from the sampling step, mean (mu - mu_old)^2 / (2 s^2), has reached
    # divergence_threshold and the update pushes its ratio further in its advantage's direction)
    trust_region: str = "clip"
    # divergence_mask: the threshold (Flow-Factory's kl_mask_threshold, 1e-6; UniRL's FlowDPPO sets 1e-5)
    divergence_threshold: float = 1e-6
    # the trainer.kl_beta term: kl (Flow-GRPO's: the KL to the base network on every transition) | gardo (GARDO, arXiv
    # 2512.24138, docs/monitor.md: the KL only on the samples gated by the trained reward's disagreement with
    # gardo_auxiliary, to a copy of the adapter reset periodically, with the diversity-aware advantage)
    regularizer: str = "kl"
    # the KL's normalisation: reference (Flow-GRPO's and GARDO's code: mean (mu - mu_ref)^2 / (2 s^2) with the Flow-SDE's
    # noise scale s = a sqrt(sigma / (1 - sigma)) without sqrt(-dt), i.e. |dt| x the exact KL; CPS and DanceGRPO's SDE:
    # the exact KL) | exact (flowrl's earlier form: the Gaussian KL of the transition, ||mu - mu_ref||^2 / (2 s^2 |dt|),
    # about T times the reference's at T steps, so its trainer.kl_beta does not carry over)
    kl_form: str = "reference"
    gardo_auxiliary: list[str] = field(default_factory=list)  # channels scored with weight 0 that the gate ranks against
    # which disagreement the gate flags: paper (the samples the trained reward ranks better than the auxiliaries: the
    # paper's stated intent) | reference_code (those it ranks worse: tinnerhrhe/GARDO's code as written)
    gardo_gate_sign: str = "paper"
    gardo_kappa: float = 0.1  # the gated share of the disagreements u >= 0 at the start (adapts within [0.02, 0.2])
    gardo_kl_threshold: float = 3e-4  # an optimizer step's mean KL above this resets the reference at the next iteration
    gardo_reset_every: int = 15  # and it resets after this many iterations without one
    gardo_diversity: bool = True  # the diversity-aware advantage (false: advantage.kind's)


@register_objective
class GRPO(Objective):
    name = "grpo"
    options = GRPOOptions
    shards = True
    needs = TRANSITIONS
    gardo: GardoRegularizer | None = None  # objective.grpo.regularizer gardo

    def __init__(self, ctx):
        super().__init__(ctx)
        self.gardo = GardoRegularizer(ctx) if ctx.cfg.objective.grpo.regularizer == "gardo" else None

    @classmethod
    def validate(cls, cfg) -> None:
        g = cfg.objective.grpo
        check_choice("objective.grpo.regularizer", g.regularizer, REGULARIZERS)
        check_choice("objective.grpo.kl_form", g.kl_form, KL_FORMS)
        if g.regularizer == "gardo":
            validate_gardo(cfg)
        check_positive("objective.grpo.clip_range", g.clip_range)
        if g.clip_range_high is not None:
            check_positive("objective.grpo.clip_range_high", g.clip_range_high)
        check_choice("objective.grpo.off_policy", g.off_policy, OFF_POLICY_LOSSES)
        check_choice("objective.grpo.behaviour_weight", g.behaviour_weight, WEIGHT_MODES)
        check_positive("objective.grpo.behaviour_cap", g.behaviour_cap)
        check_positive("objective.grpo.m2po_tau", g.m2po_tau)
        check_choice("objective.grpo.trust_region", g.trust_region, TRUST_REGIONS)
        check_positive("objective.grpo.divergence_threshold", g.divergence_threshold)
        if g.trust_region == "divergence_mask" and (g.ratio_norm or cfg.run.async_rollouts):
            other = "objective.grpo.ratio_norm" if g.ratio_norm else "run.async_rollouts (whose stale batches take off_policy's loss)"
            raise ConfigError(f"objective.grpo.trust_region divergence_mask replaces the ratio clip and cannot combine with {other}; "
                              "turn one of them off")
        if cfg.run.async_rollouts and g.ratio_norm:
            raise ConfigError("objective.grpo.ratio_norm compares with the behaviour step's mean, which a stale batch does not "
                              "keep; turn it off or set run.async_rollouts: false")
        if g.ratio_norm or g.step_reweight:
            guard = "objective.grpo.ratio_norm" if g.ratio_norm else "objective.grpo.step_reweight"
            if cfg.sampling.sampler != "flow_grpo" or cfg.sampling.logprob_reduction != "mean":
                raise ConfigError(f"{guard} (GRPO-Guard) is defined for Flow-GRPO's SDE with dimension-averaged log-probs: "
                                  "sampling.sampler flow_grpo, sampling.logprob_reduction mean; got "
                                  f"{cfg.sampling.sampler}, {cfg.sampling.logprob_reduction}")

    @classmethod
    def requires(cls, cfg) -> dict[str, str]:
        g = cfg.objective.grpo  # GRPO-Guard and Flow-DPPO compare with the sampling step's mean
        if g.trust_region == "divergence_mask":
            return {STEP_MEANS: "objective.grpo.trust_region divergence_mask (Flow-DPPO)"}
        return {STEP_MEANS: "objective.grpo.ratio_norm (GRPO-Guard)"} if g.ratio_norm or g.step_reweight else {}

    def update(self, experience: Experience) -> dict:
        """Refuses an experience not sampled in the training precision (Sol-RL's guard: a
        log-prob ratio between precisions is not the policy's)."""
        ctx, t = self.ctx, self.ctx.cfg.trainer
        check_training_precision(experience.precision, policy_precision(ctx.policy))
        groups, gardo_stats = self.gardo.prepare(experience) if self.gardo is not None else (experience.transitions, {})
        accum = t.gradient_accumulation_steps
        gen = torch.Generator().manual_seed(sample_seed(t.seed, experience.iteration, Stream.UPDATE_ORDER))
        sums = dict.fromkeys(STAT_NAMES, 0.0)
        count, grad_norms, first_ratio_dev = 0, [], None
        kept = [[mb.kept() for mb in g] for g in groups]
        # a stale batch (run.async_rollouts): AReaL's proximal log-probs, these weights' before any step of this update
        proximal = self.proximal_log_probs(groups) if experience.staleness > 0 else None
        ctx.policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * sum(len(g) for g in groups), desc=f"iter {experience.iteration} training", leave=False,
                   disable=not ctx.progress, unit="step")
        for _ in range(t.inner_epochs):
            order = torch.randperm(len(groups), generator=gen).tolist() if experience.shuffle else list(range(len(groups)))
            for gi, group_index in enumerate(order):
                group = groups[group_index]
                closes_step, step_len, step_kept = _optimizer_step_share(gi, order, accum, kept)
                for k, mb in enumerate(group):
                    sync = closes_step and k == len(group) - 1
                    with contextlib.nullcontext() if sync else ctx.accelerator.no_sync(ctx.policy.net):
                        loss, pl, kl = self.micro_batch_loss(mb, None if proximal is None else proximal[group_index][k])
                        if pl is None:  # nothing kept: zero gradient, no statistics
                            ctx.accelerator.backward(loss)
                            bar.update(1)
                            continue
                        if experience.weigh_by_transition:
                            ctx.accelerator.backward(loss * (kept[group_index][k] / step_kept))
                        else:
                            ctx.accelerator.backward(loss / (step_len * len(group)))
                    if first_ratio_dev is None:
                        first_ratio_dev = (pl.ratio - 1).abs().max().item()
                    for name, value in zip(STAT_NAMES, (loss, pl.loss, kl, pl.ratio.mean(), pl.clipped.float().mean())):
                        sums[name] += value.item()
                    count += 1
                    bar.update(1)
                if closes_step:
                    grad_norms.append(ctx.optimizer_step())
                    if self.gardo is not None:
                        self.gardo.after_step()
        bar.close()
        ctx.policy.transformer.eval()
        return {**self._update_stats(sums, count, grad_norms, first_ratio_dev, groups, proximal), **gardo_stats}

    def state_dict(self) -> dict:
        """GARDO's reference copy and its controller's state, when it regularises."""
        return self.gardo.state_dict() if self.gardo is not None else {}

    def load_state_dict(self, state: dict, checkpoint: str) -> None:
        if self.gardo is not None:
            self.gardo.load_state_dict(state)

    def _update_stats(self, sums: dict, count: int, grad_norms: list, first_ratio_dev: float | None,
                      groups: list[list[TransitionBatch]], proximal: list[list[torch.Tensor]] | None) -> dict:
        """The update's statistics, reduced over every process, with the behaviour weights' on a stale batch."""
        ctx = self.ctx
        # over every process's micro-batches: the logged loss is the global batch's on any number of processes
        acc = ctx.accelerator
        totals = acc.reduce(torch.tensor([*sums.values(), count], dtype=torch.float64, device=acc.device), "sum").tolist()
        count = int(totals[-1])
        first_ratio_dev = float(acc.reduce(torch.tensor(first_ratio_dev or 0.0, device=acc.device), "max"))
        out = {k: v / max(count, 1) for k, v in zip(STAT_NAMES, totals)}
        out.update(grad_norm=sum(grad_norms) / max(len(grad_norms), 1), first_ratio_deviation=first_ratio_dev,
                   optimizer_steps=len(grad_norms), trained_transitions=count, lr=ctx.optimizer.param_groups[0]["lr"])
        if proximal is not None:
            prox = torch.cat([p for g in proximal for p in g])
            behaviour = torch.cat([mb.old_log_prob for g in groups for mb in g])
            kept_mask = torch.cat([torch.ones_like(mb.old_log_prob, dtype=torch.bool) if mb.keep is None else mb.keep.bool().cpu()
                                   for g in groups for mb in g])  # pruned tree edges and padding take no part
            cap = ctx.cfg.objective.grpo.behaviour_cap
            out.update(behaviour_weight_stats(prox, behaviour, kept_mask, cap))
        return out

    @torch.no_grad()
    def proximal_log_probs(self, groups: list[list[TransitionBatch]]) -> list[list[torch.Tensor]]:
        """Every transition's log-prob under the weights at the start of the update (AReaL's
        `recompute`): one forward per micro-batch before the first optimizer step."""
        return [[mb.evaluate().log_prob.detach().float().cpu() for mb in group] for group in groups]

    def kl_rows(self, mb: TransitionBatch, out, ref, keep) -> torch.Tensor:
        """Per kept transition, the KL to the reference in objective.grpo.kl_form: the exact Gaussian KL,
        times the step's reference scale (|dt| on the Flow-SDE) in the references' form."""
        rows = mb.kl(out, ref, keep)
        if self.ctx.cfg.objective.grpo.kl_form != "reference":
            return rows
        scale = mb.kl_scale
        return rows * (scale.to(rows.device)[keep] if isinstance(scale, torch.Tensor) else scale)

    def micro_batch_loss(self, mb: TransitionBatch, proximal: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, PolicyLoss | None, torch.Tensor]:
        """(loss, policy-loss terms, KL) of one micro-batch over its kept transitions. With
        nothing kept: (a zero loss that still reaches every weight, None, 0). `proximal`: the
        transitions' log-probs at the update's start when the batch is stale (the off-policy loss)."""
        ctx, t, g = self.ctx, self.ctx.cfg.trainer, self.ctx.cfg.objective.grpo
        device = ctx.accelerator.device
        clip_hi = g.clip_range_high if g.clip_range_high is not None else g.clip_range
        # GARDO's reference first: its weights are swapped in, which must not happen under the policy's graph
        gardo_ref = self.gardo.reference_pass(mb) if self.gardo is not None and t.kl_beta > 0 else None
        out = mb.evaluate()
        if mb.keep is not None and not bool(mb.keep.any()):
            # nothing kept: a zero loss, after the same forwards as any micro-batch (under DDP every
            # forward may broadcast buffers, so all processes must run the same number)
            if t.kl_beta > 0:
                with torch.no_grad(), ctx.policy.reference():
                    mb.evaluate()
            return out.log_prob.sum() * 0.0, None, torch.zeros((), device=device)
        keep = mb.keep.to(device) if mb.keep is not None else slice(None)
        old, adv = mb.old_log_prob.to(device)[keep], mb.advantages.to(device)[keep]
        log_prob = out.log_prob[keep]
        if g.ratio_norm:  # GRPO-Guard: the ratio exp(log_prob - old) becomes exp(RatioNorm's log-ratio)
            log_prob = ratio_norm_log_ratio(log_prob, old, out.mean[keep], mb.behaviour_mean()[keep], out.std)
            old = torch.zeros_like(old)
        if proximal is None and g.trust_region == "divergence_mask":  # Flow-DPPO: D only feeds the detached mask
            divergence = gaussian_kl(out.mean[keep].detach(), mb.behaviour_mean()[keep], out.std, "mean")
            pl = divergence_masked_policy_loss(log_prob, old, adv, divergence, g.divergence_threshold)
        elif proximal is None:
            pl = clipped_policy_loss(log_prob, old, adv, g.clip_range, clip_hi)
        else:
            pl = off_policy_loss(g, log_prob, proximal.to(device)[keep], old, adv, clip_hi)
        loss = pl.loss / mb.dt if g.step_reweight else pl.loss  # GRPO-Guard's reweighting: the step's loss over its dt
        kl = torch.zeros((), device=device)
        if gardo_ref is not None:  # GARDO: the KL on the gated transitions only
            kl = self.gardo.kl(mb, self.kl_rows(mb, out, gardo_ref, keep), keep)
            loss = loss + t.kl_beta * kl
        elif t.kl_beta > 0:
            with torch.no_grad(), ctx.policy.reference():
                ref = mb.evaluate()
            kl = self.kl_rows(mb, out, ref, keep).mean()
            loss = loss + t.kl_beta * kl
        return loss, pl, kl


def validate_gardo(cfg) -> None:
    """objective.grpo.regularizer gardo: what it runs with, one sentence for the first thing missing."""
    g = cfg.objective.grpo
    check_choice("objective.grpo.gardo_gate_sign", g.gardo_gate_sign, GATE_SIGNS)
    if not 0 < g.gardo_kappa <= 1:
        raise ConfigError(f"objective.grpo.gardo_kappa must be in (0, 1]; got {g.gardo_kappa}")
    check_positive("objective.grpo.gardo_kl_threshold", g.gardo_kl_threshold)
    if g.gardo_reset_every < 1:
        raise ConfigError(f"objective.grpo.gardo_reset_every must be at least 1; got {g.gardo_reset_every}")
    needs = {"lora.enabled": (cfg.lora.enabled, "true (the reference is a copy of the adapter)"),
             "rollout.kind": (cfg.rollout.kind == "flat", "flat (its transitions know their samples)"),
             "run.async_rollouts": (not cfg.run.async_rollouts, "false"), "run.distributed": (cfg.run.distributed == "ddp", "ddp"),
             "trainer.kl_beta": (cfg.trainer.kl_beta > 0, "> 0 (the gated KL's weight)")}
    for key, (ok, want) in needs.items():
        if not ok:
            raise ConfigError(f"objective.grpo.regularizer gardo needs {key} {want}")
    if not g.gardo_auxiliary:
        raise ConfigError("objective.grpo.regularizer gardo needs objective.grpo.gardo_auxiliary: the channels (scored, with "
                          "weight 0) that the gate ranks against the trained reward, e.g. [shapes_clean]")
    scored = set(cfg.reward.weights)
    for c in g.gardo_auxiliary:
        if c.split("/")[0] not in scored:
            raise ConfigError(f"objective.grpo.gardo_auxiliary '{c}' is not among the scored rewards ({', '.join(sorted(scored))}); "
                              f"add it to reward.weights with weight 0")


def _optimizer_step_share(gi: int, order: list[int], accum: int, kept: list[list[int]]) -> tuple[bool, int, int]:
    """(whether the gi-th group closes its optimizer step, the step's groups, the step's kept transitions)."""
    closes_step = (gi + 1) % accum == 0 or gi == len(order) - 1
    first = (gi // accum) * accum
    step_len = min(accum, len(order) - first)  # the last step's share may be short
    step_kept = sum(sum(kept[j]) for j in order[first : first + step_len])
    return closes_step, step_len, step_kept


def off_policy_loss(g, log_prob: torch.Tensor, proximal: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                    clip_high: float) -> PolicyLoss:
    """objective.grpo.off_policy on a stale batch, each transition a sequence of one step (the core's
    token losses with T = 1, whose token mean is the mean over transitions, as Flow-GRPO's): AReaL's
    decoupled PPO (the clip against the proximal weights, exp(proximal - behaviour) as the detached
    behaviour weight) or M2PO (the transitions with the largest squared behaviour-proximal log-ratio
    left out until the mean of the rest is below m2po_tau; no clip). With proximal = behaviour the
    decoupled loss is Flow-GRPO's clipped surrogate exactly."""
    lp, prox, behav = log_prob.unsqueeze(1), proximal.unsqueeze(1), behaviour.unsqueeze(1)
    mask = torch.ones_like(lp, dtype=torch.bool)
    if g.off_policy == "m2po":
        tl = m2po_policy_loss(lp, behav, advantages, mask, m2po_mask(prox, behav, mask, g.m2po_tau))
    else:
        tl = decoupled_policy_loss(lp, prox, behav, advantages, mask, g.clip_range, clip_high, "token_mean", None,
                                   g.behaviour_weight, g.behaviour_cap)
    return PolicyLoss(tl.loss, tl.ratio[:, 0], (tl.clipped_low | tl.clipped_high)[:, 0])
