"""objective.kind dpo: online Diffusion-DPO (Wallace et al., arXiv 2311.12908, in its flow-matching
velocity form; docs/algorithms.md section 17). The defaults are Flow-GRPO's DPO code
(yifan123/flow_grpo, scripts/train_sd3_dpo.py with config/dpo.py); Flow-Factory's readings
(src/flow_factory/trainers/dpo.py) are named options.

Each prompt group of the iteration gives one pair: its highest-reward sample wins, its lowest
loses. Per pair and repetition one sigma is drawn (logit-normal over the model's 1000 training
sigmas) and one noise eps, shared by the winner and the loser; each is noised to
x = (1 - sigma) x0 + sigma eps and scored by its flow-matching error e (float32 mean over
elements) under the policy and the reference. With z = -(beta / 2) ((e_w - e_ref_w) - (e_l - e_ref_l)),
the loss is -log sigmoid(z), averaged over the pairs: matching the winner more closely than the
reference does, and the loser less, lowers it. All repetitions of all pair batches accumulate
into one optimizer step per iteration (per inner epoch), as the reference's gradient accumulation;
a step's loss is the mean over its real pairs and repetitions on every process, so several processes
take the step one process would: the weight-0 rounds a process repeats to keep DDP in step count in
no divisor (`pair_loss_scales`).

Who samples: with `sampler: reference` (Flow-GRPO's) the rollouts are drawn with the reference
weights, which `reference_refresh` replaces by the policy's every so many optimizer steps (the
reference ships 1e7, never: DPO on freshly drawn base-model samples; its config suggests about
40 for online DPO); with `sampler: policy` (Flow-Factory's) the current policy samples and the
reference stays the frozen base.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from flowrl.core.seeds import Stream, sample_seed
from flowrl.errors import ConfigError, UserError, check_choice, check_range
from flowrl.models.base import resolve_schedule
from flowrl.runtime.ema import EMA
from flowrl.sampling.noise import FORWARD_NOISING, seeded_noise
from flowrl.sampling.schedules import time_shift
from flowrl.sampling.steps import flow_matching_target, forward_noise
from flowrl.train.experience import SAMPLES, Experience
from flowrl.train.objectives.implicit import padded_rounds, whole_group_samples
from flowrl.train.objectives.stepping import check_stepping, step_plan, step_shares
from flowrl.train.parts import Objective, register_objective

SAMPLERS = ("reference", "policy")
TIES = ("reference", "skip")
TIMESTEP_DRAWS = ("logit_normal", "uniform")
TRAINING_TIMESTEPS = 1000  # the scheduler's training grid the reference indexes (num_train_timesteps)
LOGGED = ("loss", "dpo_accuracy", "dpo_z", "dpo_sigma", "dpo_error_winner", "dpo_error_loser")  # means over the pairs
ORDER_STREAM = Stream.NFT_ORDER  # the clean-sample objectives' stream of batch orders and sigmas (one runs at a time)


@dataclass
class DPOOptions:
    """objective.kind dpo: online Diffusion-DPO on each group's best and worst sample (any sampler,
    ode too). The defaults are Flow-GRPO's DPO code; each other value is a named variant."""

    beta: float = 100.0  # the implicit reward's scale (both references' shipped 100)
    # repetitions per pair batch, each with a fresh sigma and noise per pair; 0: the reference's
    # int(0.99 x sampling.num_steps) (its 39 of 40)
    timesteps: int = 0
    # logit_normal (the reference's): u = sigmoid(N(0, 1)), the training sigma at index floor(1000 u) of the
    # model's 1000 shifted training sigmas, one per pair | uniform: u ~ U(0, 1) likewise
    timestep_draw: str = "logit_normal"
    # reference (Flow-GRPO's): rollouts sample with the reference weights (the base until refreshed) |
    # policy (Flow-Factory's): with the current policy
    sampler: str = "reference"
    # every this many optimizer steps the reference becomes a copy of the policy; 0: never (the reference ships
    # 1e7; its config suggests about 40 for online DPO). Flow-Factory never refreshes
    reference_refresh: int = 0
    # a group whose rewards all tie: reference (Flow-GRPO's) pairs its members 1 (winner) and 0 | skip: no
    # pair (Flow-Factory pairs a sample with itself, whose gradient is 0)
    ties: str = "reference"
    # the trained velocity's guidance: 1, the conditional velocity alone (both references); null: model.guidance_scale
    guidance_scale: Optional[float] = 1.0
    # iteration: one optimizer step per epoch over every pair batch and repetition (the reference's accumulation) |
    # micro_batch (Flow-Factory's): a step per pair batch
    stepping: str = "iteration"


class PairBatch(NamedTuple):
    """Pairs of one forward: rows [winners; losers], the winners' seeds keying the shared noise."""

    x0: torch.Tensor  # [2P, *shape] fp32: P winners, then their P losers
    prompts: list[str]  # [2P]
    seeds: torch.Tensor  # [P] long: the winner's seed, which keys the pair's noise
    weight: float  # 1, or 0 for a round this process only repeats to keep DDP in step


def dpo_loss(err_w: torch.Tensor, err_ref_w: torch.Tensor, err_l: torch.Tensor, err_ref_l: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: Diffusion-DPO's -log sigmoid(z), z = -(beta / 2) ((e_w - e_ref_w) - (e_l - e_ref_l)),
    and z (z > 0: the policy prefers the winner more than the reference does)."""
    z = -(beta / 2) * ((err_w - err_ref_w) - (err_l - err_ref_l))
    return -F.logsigmoid(z), z


def group_pairs(rewards: torch.Tensor, groups: torch.Tensor, ties: str) -> list[tuple[int, int]]:
    """(winner, loser) positions, one pair per group of two or more samples (groups in sorted id
    order): the first highest reward and the first lowest; a group whose rewards all tie pairs its
    members 1 and 0 (ties reference) or gives no pair (skip)."""
    pairs = []
    for g in groups.unique().tolist():
        members = (groups == g).nonzero().flatten()
        if len(members) < 2:
            continue
        r = rewards[members]
        if bool((r == r[0]).all()):
            if ties == "reference":
                pairs.append((int(members[1]), int(members[0])))
            continue
        pairs.append((int(members[torch.argmax(r)]), int(members[torch.argmin(r)])))  # argmax/argmin: the first of equals
    return pairs


def pair_loss_scales(plan: list[list[tuple[int, int]]], real_pairs: list[int], accelerator) -> dict[tuple[int, int], float]:
    """Per (pair batch, repetition) of the epoch's optimizer steps: the factor on the sum of its pairs'
    losses that makes each step's gradient the mean over the real pairs and repetitions of that step on
    every process, as one process holding them all would take it. `real_pairs[b]`: batch b's pairs, 0 for
    a padding round (weight 0, repeated only so every process runs the same forwards), which counts in no
    divisor. The factor is processes / (the step's real pairs summed over processes): DDP averages the
    processes' gradients. Every process has the same plan (padded_rounds), so all reduce alike."""
    if not plan:
        return {}
    local = torch.tensor([float(sum(real_pairs[b] for b, _ in step)) for step in plan], dtype=torch.float64)
    total = accelerator.reduce(local.to(accelerator.device), "sum").cpu().tolist()
    n = accelerator.num_processes
    return {(b, k): n / total[s] if real_pairs[b] and total[s] > 0 else 0.0 for s, step in enumerate(plan) for b, k in step}


def training_grid(policy, schedule: str, shift: float) -> torch.Tensor:
    """[1000] the sigmas the model was trained on, the noisiest first: t = 1000/1000 ... 1/1000
    time-shifted by the pipeline scheduler's own shift (the reference's scheduler.sigmas; left
    unshifted where the scheduler shifts by resolution, as FLUX's), or by sampling.shift under
    sampling.schedule shifted_linear."""
    t = torch.arange(TRAINING_TIMESTEPS, 0, -1, dtype=torch.float64) / TRAINING_TIMESTEPS
    if resolve_schedule(schedule, policy.cfg.path) != "pipeline":
        return time_shift(t, shift)
    config = policy.pipe.scheduler.config
    return t if config.get("use_dynamic_shifting") else time_shift(t, config.get("shift", 1.0))


def training_sigmas(grid: torch.Tensor, n: int, draw: str, gen: torch.Generator) -> torch.Tensor:
    """[n] sigmas from `grid`, the model's 1000 training sigmas from 1 down (index i: the reference's
    scheduler.sigmas[i]): at index floor(1000 u), u = sigmoid(N(0, 1)) for logit_normal (the
    reference's compute_density_for_timestep_sampling with mean 0, std 1), U(0, 1) for uniform."""
    u = torch.sigmoid(torch.randn(n, generator=gen, dtype=torch.float64)) if draw == "logit_normal" else \
        torch.rand(n, generator=gen, dtype=torch.float64)
    index = (u * TRAINING_TIMESTEPS).long().clamp(max=TRAINING_TIMESTEPS - 1)
    return grid[index]


@register_objective
class DPO(Objective):
    name = "dpo"
    options = DPOOptions
    defaults = {"trainer.kl_beta": 0.0}  # DPO's beta is its tie to the reference; neither reference adds a KL
    needs = SAMPLES

    def __init__(self, ctx):
        super().__init__(ctx)
        self.opts = ctx.cfg.objective.dpo
        # the reference weights as a copy of the adapter: needed to sample with them, or once they are refreshed
        # (the adapter at initialisation is the base exactly: LoRA's B starts at 0)
        self.snapshot = EMA(ctx.params, 0.0) if self.opts.sampler == "reference" or self.opts.reference_refresh else None
        self.steps = 0  # optimizer steps, which reference_refresh counts

    @classmethod
    def validate(cls, cfg) -> None:
        o = cfg.objective.dpo
        check_choice("objective.dpo.sampler", o.sampler, SAMPLERS)
        check_choice("objective.dpo.ties", o.ties, TIES)
        check_choice("objective.dpo.timestep_draw", o.timestep_draw, TIMESTEP_DRAWS)
        check_stepping("objective.dpo", o.stepping, 0, 0, cfg.trainer.gradient_accumulation_steps)
        for key, spec in (("beta", "> 0"), ("timesteps", ">= 0"), ("reference_refresh", ">= 0")):
            check_range(f"objective.dpo.{key}", getattr(o, key), spec)
        if o.guidance_scale is not None and not o.guidance_scale >= 1.0:
            raise ConfigError(f"objective.dpo.guidance_scale must be >= 1 (1: the conditional velocity alone) or null "
                              f"(model.guidance_scale); got {o.guidance_scale}")
        if cfg.trainer.kl_beta != 0:  # beta is DPO's tie to the reference; neither reference adds a KL term
            raise ConfigError(f"objective.kind dpo adds no KL term (objective.dpo.beta ties it to the reference); set "
                              f"trainer.kl_beta: 0; got {cfg.trainer.kl_beta}")
        if not cfg.lora.enabled:
            raise ConfigError("objective.kind dpo needs lora.enabled=true: its implicit reward compares the policy with the "
                              "network with the adapter disabled")
        if list(cfg.lora.sigma_range) != [0.0, 1.0]:
            raise ConfigError(f"objective.kind dpo draws its training sigmas over all of (0, 1], so it needs lora.sigma_range "
                              f"[0.0, 1.0]; got {list(cfg.lora.sigma_range)}")

    def behaviour_weights(self):
        return self.snapshot.swapped_in(self.ctx.params) if self.opts.sampler == "reference" else contextlib.nullcontext()

    def reference_weights(self):
        """The reference's weights: the adapter disabled until the first refresh, then the copy."""
        return self.snapshot.swapped_in(self.ctx.params) if self.opts.reference_refresh and self.steps >= self.opts.reference_refresh \
            else self.ctx.policy.reference()

    def timesteps(self) -> int:
        return self.opts.timesteps or max(1, int(0.99 * self.ctx.cfg.sampling.num_steps))

    def pair_batches(self, experience: Experience) -> list[PairBatch]:
        """This process's pairs in batches of sampling.batch_size / 2 pairs, padded to the busiest
        process's count. The winner is chosen on the channel-weighted reward (the reference's raw
        "avg"), else on the advantage (the same order within a group)."""
        local = whole_group_samples(experience, self.ctx.accelerator)
        groups = experience.prompt_ids[local.index]
        scores = experience.reward_totals if experience.reward_totals is not None else experience.advantages
        pairs = group_pairs(scores[local.index], groups, self.opts.ties)
        per = max(1, self.ctx.cfg.sampling.batch_size // 2)
        batches = []
        for start in range(0, len(pairs), per):
            w, l = (torch.tensor(side) for side in zip(*pairs[start:start + per]))
            rows = torch.cat([w, l])
            batches.append(PairBatch(local.x0[rows], [local.prompts[i] for i in rows.tolist()], local.seeds[w], 1.0))
        b = experience.samples[0]  # a weight-0 pair for a process without pairs (its groups tied, or all on other processes)
        filler = PairBatch(b.x0[:1].float().repeat(2, *[1] * (b.x0.ndim - 1)), b.prompts[:1] * 2, b.seeds[:1], 0.0)
        return padded_rounds(batches, self.ctx.accelerator, filler)

    def pair_errors(self, batch: PairBatch, sigma: torch.Tensor, eps: torch.Tensor, cond) -> tuple[torch.Tensor, torch.Tensor]:
        """The flow-matching errors [2P] of the batch's rows under the policy (with grad) and the
        reference (detached), each pair's winner and loser noised with the same eps and sigma."""
        policy, x0 = self.ctx.policy, batch.x0.to(eps.device)
        eps2, sigma2 = torch.cat([eps, eps]), torch.cat([sigma, sigma])
        x_t = forward_noise(x0, eps2, sigma2.to(eps.device, torch.float32).reshape(-1, *[1] * (x0.ndim - 1)))
        target, dims = flow_matching_target(x0, eps2), tuple(range(1, x0.ndim))
        with torch.no_grad(), self.reference_weights():
            err_ref = ((policy.velocity(x_t, sigma2, cond).float() - target) ** 2).mean(dims)
        err = ((policy.velocity(x_t, sigma2, cond).float() - target) ** 2).mean(dims)
        return err, err_ref

    def update(self, experience: Experience) -> dict:
        ctx, t, o = self.ctx, self.ctx.cfg.trainer, self.opts
        acc, policy, s = ctx.accelerator, ctx.policy, ctx.cfg.sampling
        gen = torch.Generator().manual_seed(sample_seed(t.seed, experience.iteration, ORDER_STREAM))
        grid = training_grid(policy, s.schedule, s.shift)
        batches, k_steps = self.pair_batches(experience), self.timesteps()
        plan = step_plan(len(batches), k_steps, o.stepping, 0, t.gradient_accumulation_steps)
        shares = step_shares(plan)
        # each step's loss: the mean over its real pairs and repetitions on all processes (padding counts in no divisor)
        scales = pair_loss_scales(plan, [len(b.seeds) if b.weight else 0 for b in batches], acc)
        sums, terms, pair_terms, grad_norms, pairs = dict.fromkeys(LOGGED, 0.0), 0, 0, [], 0
        policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * len(batches) * k_steps, desc=f"iter {experience.iteration} training", leave=False,
                   disable=not ctx.progress, unit="step")
        with policy.guidance(o.guidance_scale):
            for epoch in range(t.inner_epochs):
                for b, batch in enumerate(batches):
                    cond, p = policy.encode(batch.prompts), len(batch.seeds)
                    pairs += p if batch.weight and epoch == 0 else 0
                    for k in range(k_steps):
                        sigma = training_sigmas(grid, p, o.timestep_draw, gen)
                        eps = seeded_noise(batch.seeds.tolist(), FORWARD_NOISING - epoch * k_steps - k, batch.x0.shape[1:], acc.device)
                        steps_now = shares[(b, k)][1]
                        with contextlib.nullcontext() if steps_now else acc.no_sync(policy.net):
                            err, err_ref = self.pair_errors(batch, sigma, eps, cond)
                            per_pair, z = dpo_loss(err[:p], err_ref[:p], err[p:], err_ref[p:], o.beta)
                            acc.backward(per_pair.sum() * scales[(b, k)])
                        if batch.weight:  # the logged means are over the real pairs too
                            per_pair_values = (per_pair, (z > 0).float(), z, sigma, err[:p], err[p:])
                            for key, value in zip(LOGGED, per_pair_values):
                                sums[key] += value.detach().double().sum().item()
                            terms, pair_terms = terms + 1, pair_terms + p
                        bar.update(1)
                        if steps_now:
                            grad_norms.append(ctx.optimizer_step())
                            self.after_optimizer_step()
        bar.close()
        policy.transformer.eval()
        # over every process's real pairs: the logged loss is the global batch's on any number of processes
        totals = acc.reduce(torch.tensor([*sums.values(), pair_terms, terms, pairs], dtype=torch.float64, device=acc.device),
                            "sum").tolist()
        pair_terms, terms, pairs = (int(v) for v in totals[-3:])
        stats = {key: value / max(pair_terms, 1) for key, value in zip(LOGGED, totals)}
        stats.update(kl=0.0, grad_norm=sum(grad_norms) / max(len(grad_norms), 1), optimizer_steps=len(grad_norms),
                     trained_transitions=terms, trained_pairs=pairs, lr=ctx.optimizer.param_groups[0]["lr"])
        return stats

    def after_optimizer_step(self) -> None:
        """Counts the step; every reference_refresh steps the reference becomes the policy
        (the reference's copy_learner_to_ref)."""
        self.steps += 1
        if self.opts.reference_refresh and self.steps % self.opts.reference_refresh == 0:
            self.snapshot.update(self.ctx.params, decay=0.0)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.snapshot is None:
            return {}
        return {"dpo_reference": {**self.snapshot.shadow, "__steps__": torch.tensor(self.steps)}}

    def load_state_dict(self, state, checkpoint: str) -> None:
        if self.snapshot is None:
            return
        if state.get("dpo_reference") is None:
            raise UserError(f"--resume: checkpoint '{checkpoint}' has no dpo_reference.safetensors, which objective.dpo.sampler "
                            "reference and objective.dpo.reference_refresh need")
        saved = dict(state["dpo_reference"])
        self.steps = int(saved.pop("__steps__"))
        self.snapshot.shadow = {n: v.clone() for n, v in saved.items()}
