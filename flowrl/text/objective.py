"""The text trainer's objectives (docs/text.md), registered by `loss.kind` and following the
runtime's objective protocol (flowrl/runtime/parts.py) as the image objectives do. The built-in
one, `token_pg`, is the token-level clipped surrogate (flowrl/core/token_losses.py) with its
variants: the aggregations of GRPO, DAPO and Dr. GRPO, GSPO's sequence-level ratio, DAPO's
clip-higher and overlong mask, a k3 KL to the reference, and under run.async_rollouts the
off-policy losses (AReaL's decoupled PPO with TIS or rejection, M2PO; flowrl/core/off_policy.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flowrl.core.off_policy import (OFF_POLICY_LOSSES, WEIGHT_LEVELS, WEIGHT_MODES, behaviour_weight_stats, decoupled_policy_loss,
                                    m2po_mask, m2po_policy_loss)
from flowrl.core.seeds import Stream, sample_seed
from flowrl.core.token_losses import AGGREGATIONS, RATIO_LEVELS, aggregate, k3_kl, overlong_mask, token_policy_loss
from flowrl.errors import ConfigError, check_choice
from flowrl.registry import Registry
from flowrl.runtime.parts import Objective
from flowrl.text.generate import Generation

TEXT_OBJECTIVES = Registry("loss.kind", "Text objectives")


@dataclass
class TextLossConfig:
    """The text trainer's objective (loss.kind) and the token policy loss's options."""

    kind: str = "token_pg"  # a registered text objective: token_pg (the token-level clipped surrogate and its variants)
    aggregation: str = "token_mean"  # seq_mean_token_mean (GRPO) | token_mean (DAPO) | seq_mean_token_sum_norm (Dr. GRPO) | seq_mean_token_sum
    ratio_level: str = "token"  # token | sequence (GSPO)
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO's clip-higher (0.28)
    overlong_mask: bool = False  # DAPO: completions cut at max_new_tokens carry no loss
    # with run.async_rollouts (docs/text.md, "Asynchronous rollouts"): decoupled (AReaL's PPO: the clip against the
    # weights at the update's start, times the behaviour weight) | m2po (M2PO's second-moment mask, no clip)
    off_policy: str = "decoupled"
    behaviour_weight: str = "none"  # decoupled's weight exp(proximal - behaviour): none (as it is) | truncate (TIS) | mask (rejection)
    behaviour_cap: float = 2.0  # truncate and mask: the cap on the behaviour weight (TIS: 2)
    behaviour_level: str = "token"  # token | sequence (the geometric mean of the sequence's token weights)
    m2po_tau: float = 0.04  # m2po: the bound on the mean squared log-ratio of the kept tokens


@dataclass
class TextContext:
    """What the text trainer lends its objective: the config, the accelerator, the policy (its
    bare model generates and gives the reference), the model the training forwards go through
    (DDP's wrapper with several processes), the optimizer and one optimizer step (clip, the
    non-finite policy, step, zero)."""

    cfg: Any
    accelerator: Any
    policy: Any
    train_model: Any
    optimizer: Any
    optimizer_step: Callable[[], float]


class StepProximal:
    """AReaL's proximal log-probs of a batch: those of the weights at the start of this optimizer
    step. The trainer takes one step per inner epoch and its first epoch forwards every completion
    once with exactly those weights, so each completion's proximal log-probs are its first training
    forward's, detached: the same policy AReaL recomputes (`prox_logp_method: recompute`), without
    the separate forward over the batch (about a quarter of an asynchronous text iteration here).
    Rows given as `known` (fresh samples: the behaviour log-probs are the proximal ones) are kept."""

    def __init__(self, gen: Generation, known: bool = False):
        self.log_probs = gen.log_probs.float().clone() if known else torch.zeros_like(gen.log_probs, dtype=torch.float32)
        self.taken = torch.full((len(gen.texts),), known)
        self.mask = gen.completion_mask

    def of(self, rows: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """The proximal log-probs of `rows`, taking those not yet known from `lp` (their training
        forward's log-probs under the step's starting weights)."""
        new = ~self.taken[rows]
        if bool(new.any()):
            first = rows[new]
            self.log_probs[first] = lp.detach().float().cpu()[new] * self.mask[first]
            self.taken[first] = True
        return self.log_probs[rows]


@TEXT_OBJECTIVES.register
class TokenPolicyGradient(Objective):
    name = "token_pg"
    options = TextLossConfig
    ctx: TextContext

    @classmethod
    def validate(cls, cfg) -> None:
        l = cfg.loss
        check_choice("loss.aggregation", l.aggregation, AGGREGATIONS)
        check_choice("loss.ratio_level", l.ratio_level, RATIO_LEVELS)
        for key, value in (("loss.clip_low", l.clip_low), ("loss.clip_high", l.clip_high), ("loss.behaviour_cap", l.behaviour_cap),
                           ("loss.m2po_tau", l.m2po_tau)):
            if not value > 0:
                raise ConfigError(f"{key} must be > 0; got {value}")
        check_choice("loss.off_policy", l.off_policy, OFF_POLICY_LOSSES)
        check_choice("loss.behaviour_weight", l.behaviour_weight, WEIGHT_MODES)
        check_choice("loss.behaviour_level", l.behaviour_level, WEIGHT_LEVELS)
        if l.off_policy == "m2po" and l.aggregation != "token_mean":  # its objective is the mean over the batch's tokens
            raise ConfigError(f"loss.off_policy: m2po is a token-mean objective; set loss.aggregation: token_mean (got {l.aggregation})")
        if cfg.run.async_rollouts and l.ratio_level != "token":
            raise ConfigError("run.async_rollouts trains with a token-level off-policy loss (loss.off_policy); set loss.ratio_level: token")

    def update(self, exp, proximal: StepProximal | None = None) -> dict:
        """One optimizer step per inner epoch over every completion of `exp` (a TextExperience,
        flowrl/text/collect.py); micro-batches weighted so the step's loss is the aggregation over
        the whole batch (over every process's completions). `proximal`: the log-probs of samples
        that came from the producer (the off-policy loss)."""
        ctx = self.ctx
        l, t, acc = ctx.cfg.loss, ctx.cfg.trainer, ctx.accelerator
        gen = exp.gen
        mask = gen.completion_mask & exp.local_valid.unsqueeze(1)
        if l.overlong_mask:
            mask = overlong_mask(mask, gen.truncated)
        advantages, n = exp.local_advantages, len(exp.rows)
        total_tokens = int(acc.reduce(mask.sum().to(acc.device), "sum"))
        total_seqs = int(exp.trained.sum())
        # DDP averages the processes' gradients; each process's loss is its share of the global sum
        scale = acc.num_processes
        order_gen = torch.Generator().manual_seed(sample_seed(t.seed, exp.iteration, Stream.UPDATE_ORDER))
        sums = {k: 0.0 for k in ("loss", "kl", "entropy", "clip_low", "clip_high")}
        grad_norms, first_ratio_dev = [], None
        ctx.policy.model.train()
        for _ in range(t.inner_epochs):
            order = torch.randperm(n, generator=order_gen)
            starts = range(0, n, t.micro_batch)  # the same count on every process: their slices are equal
            for start in starts:
                rows = order[start : start + t.micro_batch]
                m = mask[rows]
                # this micro-batch's share of the whole batch's aggregate
                share = (int(m.sum()) / max(total_tokens, 1)) if l.aggregation == "token_mean" else len(rows) / total_seqs
                # gradients are summed across processes once, at the last micro-batch
                with contextlib.nullcontext() if start == starts[-1] else acc.no_sync(ctx.train_model):
                    loss, logged, dev = self._micro_batch(gen, rows, m, advantages[rows], proximal)
                    (loss * share * scale).backward()
                first_ratio_dev = dev if first_ratio_dev is None else first_ratio_dev
                for key, value in logged.items():
                    sums[key] += value * share
            grad_norms.append(ctx.optimizer_step())  # a non-finite gradient never reaches the weights
        ctx.policy.model.eval()
        epochs = t.inner_epochs
        # every process's share of the whole batch's aggregate, summed
        totals = acc.reduce(torch.tensor(list(sums.values()), dtype=torch.float64, device=acc.device), "sum").tolist()
        stats = {k: v / epochs for k, v in zip(sums, totals)}
        first_ratio_dev = float(acc.reduce(torch.tensor(first_ratio_dev or 0.0, device=acc.device), "max"))
        stats.update(grad_norm=sum(grad_norms) / len(grad_norms), first_ratio_deviation=first_ratio_dev,
                     lr=ctx.optimizer.param_groups[0]["lr"],
                     skipped_steps=sum(not math.isfinite(g) for g in grad_norms))
        if proximal is not None:
            stats.update(behaviour_weight_stats(proximal.log_probs, gen.log_probs, mask, l.behaviour_cap))
        return stats

    def _micro_batch(self, gen: Generation, rows: torch.Tensor, m: torch.Tensor, advantages: torch.Tensor,
                     step_proximal: StepProximal | None):
        """The loss of some of this process's completions (aggregated over them), what it logs, and
        the largest deviation of a ratio from 1."""
        cfg, l, policy = self.ctx.cfg, self.ctx.cfg.loss, self.ctx.policy
        temp, horizon = cfg.generation.temperature, cfg.generation.max_new_tokens
        lp, ent = policy.log_probs(gen, rows, temp, model=self.ctx.train_model)
        md = m.to(lp.device)
        behaviour, advantages = gen.log_probs[rows].to(lp.device), advantages.to(lp.device)
        proximal = None if step_proximal is None else step_proximal.of(rows, lp).to(lp.device)
        if proximal is None:  # synchronous: the samples are these weights' own
            pl = token_policy_loss(lp, behaviour, advantages, md, l.clip_low, l.clip_high, l.aggregation, l.ratio_level, horizon)
        elif l.off_policy == "m2po":  # M2PO: the second-moment mask is the trust region, no clip
            pl = m2po_policy_loss(lp, behaviour, advantages, md, m2po_mask(proximal, behaviour, md, l.m2po_tau))
        else:  # AReaL's decoupled PPO: the clip against the proximal weights, the behaviour weight for staleness
            pl = decoupled_policy_loss(lp, proximal, behaviour, advantages, md, l.clip_low, l.clip_high, l.aggregation,
                                       horizon, l.behaviour_weight, l.behaviour_cap, l.behaviour_level)
        loss, kl = pl.loss, torch.zeros(())
        if cfg.trainer.kl_beta > 0:
            with torch.no_grad(), policy.reference() as ref:
                ref_lp, _ = policy.log_probs(gen, rows, temp, model=ref)
            kl = aggregate(k3_kl(lp, ref_lp), md, l.aggregation, horizon)
            loss = loss + cfg.trainer.kl_beta * kl
        tokens = max(int(m.sum()), 1)
        logged = {"loss": loss.item(), "kl": kl.item(), "entropy": float((ent * md).sum()) / tokens,
                  "clip_low": float(pl.clipped_low.sum()) / tokens, "clip_high": float(pl.clipped_high.sum()) / tokens}
        return loss, logged, ((pl.ratio - 1).abs() * md).max().item()
