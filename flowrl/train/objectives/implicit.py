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

from flowrl.errors import UserError
from flowrl.sampling.noise import GROUP_NOISING, sample_seed, seeded_noise
from flowrl.sampling.steps import flow_matching_target, forward_noise
from flowrl.train.experience import Experience


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
    number of rounds of the busiest process. A group split across processes cannot be trained:
    every member's implicit reward must be in one loss. Invalid samples (reward.on_invalid: drop)
    leave their group."""
    n = len(experience.advantages)
    x0s, prompts, index = [], [], []
    for b in experience.samples:
        keep = (b.index < n) & experience.valid[b.index.clamp(max=n - 1)]  # not a padding copy, a valid reward
        x0s.append(b.x0[keep].float())
        prompts += [p for p, k in zip(b.prompts, keep.tolist()) if k]
        index.append(b.index[keep])
    x0, index = torch.cat(x0s), torch.cat(index)
    groups = experience.prompt_ids[index]
    total = torch.bincount(experience.prompt_ids[experience.valid], minlength=int(experience.prompt_ids.max()) + 1)
    here = torch.bincount(groups, minlength=len(total))
    split = ((here > 0) & (here != total)).nonzero().flatten()
    if len(split):
        raise UserError(f"the group objective needs each group's samples on one process, but group {int(split[0])} is split "
                        f"across {accelerator.num_processes} processes; make data.prompts_per_iteration a multiple of the "
                        "number of processes and use allocator.kind uniform")
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
    rounds = int(accelerator.gather(torch.tensor([len(packs)], device=accelerator.device)).max())
    if not packs and rounds:  # every local sample was dropped: train nothing, but keep DDP in step
        b = experience.samples[0]
        packs = [GroupBatch(b.x0[:1].float(), b.prompts[:1], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0.0)]
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
