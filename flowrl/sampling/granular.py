"""Singular stochastic rollouts at several granularities (G2RPO: arXiv 2510.01982; docs/algorithms.md section 12).

Per prompt: one ODE anchor x_0 .. x_T from a noise the group shares. At each branch step k, G
samples take ONE SDE step from the anchor's x_k, all from the anchor's own velocity there (the
G samples share the transition's mean, so the branch costs no network call), and every other
step of a sample is deterministic: its reward belongs to that one injected noise. From each
branched latent x'_{k+1} an ODE tail finishes the sample at every granularity g, on the sigmas
k + 1, k + 1 + g, ... and always the last, sigma = 0.

All tails of all prompts, branch steps, granularities and samples advance together: tails that
stand at the same sigma share one batched network call, so a prompt needs T calls for its
anchor and at most T - 1 for its tails, whatever G, the branch steps and granularities are.
Noise is keyed by (path_seed(group seed, i), k) for sample i at branch step k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, StepOutput, batched_velocity
from flowrl.sampling.steps import ode_step
from flowrl.sampling.tree import path_seed


def default_branch_steps(num_steps: int) -> list[int]:
    """The reference's branch steps: the first half of the steps."""
    return list(range(num_steps // 2))


def tail_indices(k: int, g: int, num_steps: int) -> list[int]:
    """The sigma indices an ODE tail from x'_{k+1} visits at granularity g: k + 1, k + 1 + g, ...,
    then num_steps (sigma = 0) whatever the stride left over."""
    return list(range(k + 1, num_steps, g)) + [num_steps]


def granular_nfe(num_steps: int, branch_steps: Sequence[int], granularities: Sequence[int], group_size: int) -> int:
    """Network evaluations per prompt: the anchor's T plus every tail step of every sample."""
    tails = sum(len(tail_indices(k, g, num_steps)) - 1 for k in branch_steps for g in granularities)
    return num_steps + group_size * tails


def sequential_calls(num_steps: int, branch_steps: Sequence[int], granularities: Sequence[int]) -> int:
    """Network calls one after another per prompt (at unlimited batch size): the anchor's T, then one
    per sigma index at which some tail stands."""
    stops = {j for k in branch_steps for g in granularities for j in tail_indices(k, g, num_steps)[:-1]}
    return num_steps + len(stops)


@dataclass
class GranularBatch:
    """One iteration's anchors, branches and finished tails on this process."""

    anchors: torch.Tensor  # [P, T + 1, *latent] the ODE anchor latents
    branch_next: torch.Tensor  # [P, M, G, *latent] x'_{k+1} of sample i at branch step m
    log_probs: torch.Tensor  # [P, M, G] behaviour log-prob of each branch transition
    finals: torch.Tensor  # [P, M, L, G, *latent] the finished tail of every (branch step, granularity, sample)
    branch_steps: list[int]
    granularities: list[int]
    prompts: list[str]
    prompt_ids: torch.Tensor  # [P]
    seeds: torch.Tensor  # [P] group seeds
    nfe: int  # rows through the network while sampling
    calls: int  # batched network calls while sampling

    @property
    def group_size(self) -> int:
        return self.branch_next.shape[2]


@torch.no_grad()
def granular_rollout(policy, prompts: Sequence[str], seeds: Sequence[int], spec: SamplerSpec, branch_steps: Sequence[int],
                     granularities: Sequence[int], group_size: int, batch_size: int, prompt_ids: Sequence[int] | None = None,
                     progress: bool = False, desc: str = "granular sampling") -> GranularBatch:
    """Anchors, branches and tails for `prompts` (one group each, seeded `seeds`). `spec` gives the
    sigmas and the SDE of the branch steps; the anchor and the tails are ODE."""
    prompts, seeds = list(prompts), [int(s) for s in seeds]
    P, T, G = len(prompts), spec.num_steps, group_size
    M, L = len(branch_steps), len(granularities)
    shape = tuple(policy.latent_shape())
    sig = spec.sigmas
    for p in dict.fromkeys(prompts):  # each prompt encoded alone (see FlowPolicy.encode)
        policy.encode([p])
    bar = tqdm(total=granular_nfe(T, branch_steps, granularities, G) * P, desc=desc, disable=not progress, leave=False, unit="nfe")
    # the anchor: ODE from the group's noise, keeping every latent and the velocity at branch steps
    x = seeded_noise(seeds, INITIAL, shape, policy.device)
    anchors = torch.empty((P, T + 1, *shape))
    anchors[:, 0] = x.cpu()
    branch_v = {}
    nfe = calls = 0
    for t in range(T):
        v = batched_velocity(policy, x, float(sig[t]), prompts, batch_size)
        nfe, calls = nfe + P, calls + math.ceil(P / batch_size)
        bar.update(P)
        if t in branch_steps:
            branch_v[t] = v
        x = ode_step(x, v, float(sig[t]), float(sig[t + 1])).next_x
        anchors[:, t + 1] = x.cpu()
    # the branches: G noises around one mean per (prompt, step)
    branch_next = torch.empty((P, M, G, *shape))
    log_probs = torch.zeros((P, M, G))
    for m, k in enumerate(branch_steps):
        xk = anchors[:, k].to(policy.device).repeat_interleave(G, 0)
        noise = seeded_noise([path_seed(s, i) for s in seeds for i in range(G)], k, shape, policy.device)
        out = spec.step(k, xk, branch_v[k].repeat_interleave(G, 0), noise=noise)
        branch_next[:, m] = out.next_x.view(P, G, *shape).cpu()
        log_probs[:, m] = out.log_prob.view(P, G).cpu()
    # the tails: tail (p, m, l, i) stands at sigma index where[m, l] (a branch at the last step is
    # finished already); every index advances, in one batched call, the tails standing there
    state = branch_next[:, :, None].expand(P, M, L, G, *shape).clone()
    where = torch.tensor([[tail_indices(k, g, T)[0] for g in granularities] for k in branch_steps])  # [M, L]
    stride = torch.tensor(list(granularities))
    for j in range(1, T):
        ml = (where == j).nonzero()  # (m, l) pairs whose tails stand at j
        if len(ml) == 0:
            continue
        rows = state[:, ml[:, 0], ml[:, 1]]  # [P, n_ml, G, *latent]
        flat = rows.reshape(-1, *shape)
        row_prompts = [prompts[p] for p in range(P) for _ in range(len(ml) * G)]
        v = batched_velocity(policy, flat, float(sig[j]), row_prompts, batch_size)
        nfe, calls = nfe + len(flat), calls + math.ceil(len(flat) / batch_size)
        bar.update(len(flat))
        nxt = torch.clamp(j + stride[ml[:, 1]], max=T)  # [n_ml]
        dt = (sig[nxt] - sig[j]).view(1, -1, 1, *([1] * len(shape)))
        state[:, ml[:, 0], ml[:, 1]] = (rows.to(policy.device) + dt.to(policy.device) * v.view(rows.shape)).cpu()
        where[ml[:, 0], ml[:, 1]] = nxt
    bar.close()
    return GranularBatch(anchors, branch_next, log_probs, state, list(branch_steps), list(granularities), prompts,
                         torch.as_tensor(list(prompt_ids) if prompt_ids is not None else range(P), dtype=torch.long),
                         torch.as_tensor(seeds, dtype=torch.long), nfe, calls)


def branch_edges(policy, batch: GranularBatch, spec: SamplerSpec, m: int, prompt_slice: slice) -> StepOutput:
    """Re-evaluate, with grad, the branch transitions of step batch.branch_steps[m] for the prompts
    in `prompt_slice` (one of the anchor's sampling batches, so the forward repeats it bit for
    bit): one forward for the anchors, then the G samples' log-probs from the shared mean."""
    k, G = batch.branch_steps[m], batch.group_size
    xk = batch.anchors[prompt_slice, k].to(policy.device)
    v = policy.velocity(xk, float(spec.sigmas[k]), policy.encode(batch.prompts[prompt_slice]))
    x_next = batch.branch_next[prompt_slice, m].reshape(-1, *xk.shape[1:]).to(policy.device)
    return spec.step(k, xk.repeat_interleave(G, 0), v.repeat_interleave(G, 0), x_next=x_next)
