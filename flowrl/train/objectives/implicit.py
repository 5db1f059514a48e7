"""The implicit reward of a flow, shared by the group objectives (DGPO, GDRO; docs/algorithms.md
section 10), and the whole-group micro-batches they train on.

Diffusion-DPO's implicit reward: noise a clean sample at sigma, x = (1 - sigma) x0 + sigma eps,
and compare the trained policy's and the reference's (adapter disabled) flow-matching errors,
each a mean over dimensions: delta = ||u - v_theta||^2 - ||u - v_ref||^2, s = -beta delta. The
(sigma, eps) pair is shared by every sample of a group, so s_i - s_j depends on the samples only
(eps keyed by the group's seed, sigma shared by the whole micro-batch). A group loss needs its
whole group in one forward, so the clean samples of this process are regrouped into micro-batches
of whole groups; every process then runs the same number of rounds (the ones with fewer groups
repeat their last micro-batch at weight 0), as DDP's gradient all-reduce needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import contextlib
from collections import defaultdict
from typing import ClassVar

from tqdm.auto import tqdm

from flowrl.core.seeds import Stream, sample_seed
from flowrl.errors import ConfigError, check_positive
from flowrl.runtime.shards import whole_group_owners
from flowrl.sampling.noise import GROUP_NOISING, seeded_noise
from flowrl.sampling.schedules import stratified_sigma
from flowrl.sampling.steps import flow_matching_target, forward_noise
from flowrl.train.experience import Experience
from flowrl.train.objectives.stepping import step_plan, step_shares
from flowrl.train.parts import Objective


class GroupBatch(NamedTuple):
    """Whole groups of one process: clean samples, their prompts, group ids and experience index."""

    x0: torch.Tensor  # [b, *shape] fp32
    prompts: list[str]
    groups: torch.Tensor  # [b] long: the group (prompt id) of each sample
    index: torch.Tensor  # [b] long: position in the experience's per-sample arrays
    weight: float  # 1, or 0 for a round this process only repeats to keep DDP in step


class FlowErrors(NamedTuple):
    err: torch.Tensor  # [b] ||u - v_theta||^2 (mean over dims), with grad
    err_ref: torch.Tensor  # [b] ||u - v_ref||^2, detached
    v: torch.Tensor  # [b, ...] the trained velocity (with grad)
    v_ref: torch.Tensor  # [b, ...] the reference's, detached


def group_batches(experience: Experience, accelerator, batch_size: int) -> list[GroupBatch]:
    """This process's real, valid samples regrouped into micro-batches of whole groups (greedy
    packing up to `batch_size` samples; a larger group is a batch of its own), padded to the
    number of rounds of the busiest process. Every member's implicit reward must be in one loss,
    so groups the sampling split across processes are brought together first (`whole_group_samples`).
    Invalid samples (reward.on_invalid: drop) leave their group, and groups whose advantages are
    all 0 (all rewards tied: no preference) are left out."""
    local = whole_group_samples(experience, accelerator)
    x0, prompts, index = local.x0, local.prompts, local.index
    groups = experience.prompt_ids[index]
    preferring = groups[experience.advantages[index] != 0].unique()
    live = torch.isin(groups, preferring)
    x0, prompts, groups, index = x0[live], [p for p, k in zip(prompts, live.tolist()) if k], groups[live], index[live]
    packs: list[GroupBatch] = []
    current: list[int] = []
    for g in groups.unique().tolist():
        members = (groups == g).nonzero().flatten().tolist()
        if current and len(current) + len(members) > batch_size:
            packs.append(_pack(x0, prompts, groups, index, current))
            current = []
        current += members
    if current:
        packs.append(_pack(x0, prompts, groups, index, current))
    b = experience.samples[0]
    filler = GroupBatch(b.x0[:1].float(), b.prompts[:1], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0.0)
    return padded_rounds(packs, accelerator, filler)


class LocalSamples(NamedTuple):
    """This process's real samples with a valid reward, in experience order."""

    x0: torch.Tensor  # [n, *shape] fp32
    prompts: list[str]
    seeds: torch.Tensor  # [n] long
    index: torch.Tensor  # [n] long: position in the experience's per-sample arrays


def local_samples(experience: Experience) -> LocalSamples:
    """The clean samples of this process that are neither padding copies nor invalid
    (reward.on_invalid: drop)."""
    n = len(experience.advantages)
    x0s, prompts, seeds, index = [], [], [], []
    for b in experience.samples:
        keep = (b.index < n) & experience.valid[b.index.clamp(max=n - 1)]  # not a padding copy, a valid reward
        x0s.append(b.x0[keep].float())
        prompts += [p for p, k in zip(b.prompts, keep.tolist()) if k]
        seeds.append(b.seeds[keep])
        index.append(b.index[keep])
    return LocalSamples(torch.cat(x0s), prompts, torch.cat(seeds), torch.cat(index))


def whole_group_samples(experience: Experience, accelerator) -> LocalSamples:
    """This process's valid samples in whole groups. The even split of the sampling keeps uniform
    groups whole (data.prompts_per_iteration a multiple of the processes); an allocator that sizes
    groups over several stages spreads a group over processes, and then every process's samples
    are exchanged and each group goes whole to one process (`whole_group_owners`)."""
    local = local_samples(experience)
    total = torch.bincount(experience.prompt_ids[experience.valid], minlength=int(experience.prompt_ids.max()) + 1)
    here = torch.bincount(experience.prompt_ids[local.index], minlength=len(total))
    split_here = int(((here > 0) & (here != total)).sum())  # groups this process holds only part of
    if accelerator.num_processes == 1 or not int(accelerator.gather(torch.tensor([split_here], device=accelerator.device)).max()):
        return local
    from accelerate.utils import gather_object

    everyone = gather_object([local._replace(x0=local.x0.cpu())])
    return take_whole_groups(everyone, experience.prompt_ids, accelerator.num_processes, accelerator.process_index)


def take_whole_groups(everyone: list[LocalSamples], prompt_ids: torch.Tensor, num_processes: int, process_index: int) -> LocalSamples:
    """From every process's samples (`everyone`, in process order), the groups this process owns
    (`whole_group_owners` over the group sizes), in experience order."""
    x0 = torch.cat([s.x0 for s in everyone])
    prompts = [p for s in everyone for p in s.prompts]
    seeds, index = torch.cat([s.seeds for s in everyone]), torch.cat([s.index for s in everyone])
    groups = prompt_ids[index]
    ids, counts = groups.unique(return_counts=True)
    owner = whole_group_owners(dict(zip(ids.tolist(), counts.tolist())), num_processes)
    rows = [r for r in index.argsort().tolist() if owner[int(groups[r])] == process_index]
    r = torch.tensor(rows, dtype=torch.long)
    return LocalSamples(x0[r], [prompts[i] for i in rows], seeds[r], index[r])


def padded_rounds(packs: list, accelerator, filler) -> list:
    """`packs` padded to the busiest process's count, every process running the same number of
    forwards and backwards as DDP's all-reduce needs: with the last pack repeated at weight 0, or
    with `filler` (a weight-0 pack) where this process has none. [] when no process has any."""
    rounds = int(accelerator.gather(torch.tensor([len(packs)], device=accelerator.device)).max())
    if not rounds:
        return []
    if not packs:
        packs = [filler]
    return packs + [packs[-1]._replace(weight=0.0)] * (rounds - len(packs))


def _pack(x0, prompts, groups, index, rows: list[int]) -> GroupBatch:
    r = torch.tensor(rows)
    return GroupBatch(x0[r], [prompts[i] for i in rows], groups[r], index[r], 1.0)


def group_noise(groups: torch.Tensor, seed: int, iteration: int, key: int, shape, device) -> torch.Tensor:
    """eps [b, *shape] shared within each group: keyed by (run seed, iteration, group) and the
    training draw `key` (epoch and sigma), never by the sample."""
    seeds = [sample_seed(seed, iteration, int(g)) for g in groups.tolist()]
    return seeded_noise(seeds, GROUP_NOISING - key, shape, device)


def flow_errors(policy, x0: torch.Tensor, eps: torch.Tensor, sigma: float, cond) -> FlowErrors:
    """The trained and the reference flow-matching errors of x0 noised at sigma with eps."""
    x_t, target = forward_noise(x0, eps, sigma), flow_matching_target(x0, eps)
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad(), policy.reference():
        v_ref = policy.velocity(x_t, sigma, cond)
    v = policy.velocity(x_t, sigma, cond)
    return FlowErrors(((v - target) ** 2).mean(dims), ((v_ref - target) ** 2).mean(dims), v, v_ref)


def draw_sigmas(seed: int, iteration: int, count: int, sigma_range, shift: float) -> list[float]:
    """`count` training sigmas, stratified inside sigma_range (one per stratum, crowding toward the
    noisy end when shift > 1), keyed by (run seed, iteration)."""
    gen = torch.Generator().manual_seed(sample_seed(seed, iteration, Stream.GROUP_SIGMAS))
    return [stratified_sigma(k, count, sigma_range[0], sigma_range[1], shift, gen) for k in range(count)]


class ImplicitRewardObjective(Objective):
    """The training loop DGPO and GDRO share: whole-group micro-batches, per epoch `timesteps`
    sigmas, per sigma the group-shared noise, the trained and reference errors (`flow_errors`),
    the objective's own `loss`, the optional KL (trainer.kl_beta x the mean squared velocity gap
    to the reference), and optimizer steps by `stepping` (flowrl.train.objectives.stepping; by
    default one step per micro-batch over all its sigmas). A subclass names its config section and
    writes `loss` (and, if it needs them, `prepare` for per-iteration state, `training_sigmas`)."""

    section: ClassVar[str]  # objective.<section>: beta, timesteps, sigma_range, sigma_shift, guidance_scale

    @classmethod
    def validate(cls, cfg) -> None:
        o, field = getattr(cfg.objective, cls.section), f"objective.{cls.section}"
        check_positive(f"{field}.beta", o.beta)
        check_positive(f"{field}.timesteps", o.timesteps)
        check_positive(f"{field}.sigma_shift", o.sigma_shift)
        if cls.draws_stratified(o):
            r = o.sigma_range
            if len(r) != 2 or not 0.0 <= r[0] < r[1] <= 1.0:
                raise ConfigError(f"{field}.sigma_range must be [low, high] with 0 <= low < high <= 1; got {list(r)}")
            low, high = cfg.lora.sigma_range
            if r[0] < low or r[1] > high:
                raise ConfigError(f"{field}.sigma_range {list(r)} must lie inside lora.sigma_range {list(cfg.lora.sigma_range)} "
                                  "(where the adapter acts)")
        if not cfg.lora.enabled:
            raise ConfigError(f"objective.kind {cls.section} needs lora.enabled=true: its implicit reward compares the policy with "
                              "the network with the adapter disabled")
        if o.guidance_scale is not None and not o.guidance_scale >= 1.0:
            raise ConfigError(f"{field}.guidance_scale must be >= 1 (1: the conditional velocity alone) or null "
                              f"(model.guidance_scale); got {o.guidance_scale}")

    @staticmethod
    def draws_stratified(opts) -> bool:
        """Whether the training sigmas are drawn stratified inside opts.sigma_range (the default)."""
        return True

    @property
    def opts(self):
        return getattr(self.ctx.cfg.objective, self.section)

    @property
    def stepping(self) -> str:
        """iteration (one optimizer step per epoch) or micro_batch (the default here: see stepping.py)."""
        return "micro_batch"

    @property
    def sigmas_per_step(self) -> int:
        """Under micro_batch stepping, how many sigmas of a micro-batch one step accumulates (default: all)."""
        return self.opts.timesteps

    def training_sigmas(self, iteration: int, epoch: int) -> list[float]:
        """The epoch's training sigmas, shared by all its micro-batches (default: stratified in sigma_range)."""
        o = self.opts
        return draw_sigmas(self.ctx.cfg.trainer.seed, iteration * self.ctx.cfg.trainer.inner_epochs + epoch, o.timesteps,
                           o.sigma_range, o.sigma_shift)

    def anchor(self, experience: Experience, batch: GroupBatch, x0: torch.Tensor) -> torch.Tensor | None:
        """A regulariser added once per optimizer step, with the step's last pair (default: none)."""
        return None

    def after_optimizer_step(self) -> None:
        """Anything to do after each optimizer step (default: nothing)."""

    def prepare(self, experience: Experience) -> None:
        """Per-iteration state before any micro-batch (default: none)."""

    def before_forward(self, batch: GroupBatch, x0: torch.Tensor, eps: torch.Tensor, sigma: float, cond):
        """Anything computed before the forward with grad (default: nothing), passed to `loss`.
        Forwards under swapped-in weights belong here: the swap writes the weights in place."""
        return None

    def loss(self, experience: Experience, batch: GroupBatch, errors: FlowErrors, before) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective's loss on one micro-batch at one sigma, and its statistics."""
        raise NotImplementedError

    def update(self, experience: Experience) -> dict:
        ctx, t, o = self.ctx, self.ctx.cfg.trainer, self.opts
        acc, policy = ctx.accelerator, ctx.policy
        self.prepare(experience)
        batches = group_batches(experience, acc, ctx.cfg.sampling.batch_size)
        stats, grad_norms, trained_groups = defaultdict(list), [], 0
        policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * len(batches) * o.timesteps, desc=f"iter {experience.iteration} training", leave=False,
                   disable=not ctx.progress, unit="step")
        with policy.guidance(o.guidance_scale):
            for epoch in range(t.inner_epochs):
                sigmas = self.training_sigmas(experience.iteration, epoch)
                # the pairs of one optimizer step share its weight: its gradient is their mean
                shares = step_shares(step_plan(len(batches), len(sigmas), self.stepping, self.sigmas_per_step,
                                               t.gradient_accumulation_steps))
                for b, batch in enumerate(batches):
                    x0 = batch.x0.to(acc.device)
                    cond = policy.encode(batch.prompts)
                    trained_groups += int(batch.groups.unique().numel()) if batch.weight else 0
                    for k, sigma in enumerate(sigmas):
                        eps = group_noise(batch.groups, t.seed, experience.iteration, epoch * o.timesteps + k, x0.shape[1:], acc.device)
                        before = self.before_forward(batch, x0, eps, sigma, cond)
                        share, steps_now = shares[(b, k)]
                        with contextlib.nullcontext() if steps_now else acc.no_sync(policy.net):
                            errors = flow_errors(policy, x0, eps, sigma, cond)
                            loss, own = self.loss(experience, batch, errors, before)
                            if t.kl_beta > 0:
                                kl = ((errors.v - errors.v_ref) ** 2).mean()
                                own["kl"] = kl.item()
                                loss = loss + t.kl_beta * kl
                            # once per optimizer step, at its full weight after the step's mean over its pairs
                            anchor = self.anchor(experience, batch, x0) if steps_now else None
                            if anchor is not None:
                                stats["anchor"].append(anchor.item())
                            acc.backward(batch.weight * (loss if anchor is None else loss + share * anchor) / share)
                        for key, value in {"loss": loss.item(), **own}.items():
                            stats[key].append(value)
                        bar.update(1)
                        if steps_now:
                            grad_norms.append(ctx.optimizer_step())
                            self.after_optimizer_step()
        bar.close()
        policy.transformer.eval()
        mean = lambda xs: sum(xs) / max(len(xs), 1)
        trained_groups = int(acc.reduce(torch.tensor([trained_groups], device=acc.device), "sum"))  # every process's groups
        return {"loss": 0.0, "kl": 0.0, **{k: mean(v) for k, v in stats.items()}, "grad_norm": mean(grad_norms),
                "optimizer_steps": len(grad_norms), "trained_transitions": len(stats["loss"]),
                "lr": ctx.optimizer.param_groups[0]["lr"], "trained_groups": trained_groups}
