"""Singular stochastic rollouts at several granularities (G2RPO: arXiv 2510.01982; docs/algorithms.md section 12).

Per prompt: one ODE anchor x_0 .. x_T from a noise the group shares. At each branch step k, G
samples take ONE SDE step from the anchor's x_k, all from the anchor's own velocity there (the
G samples share the transition's mean, so the branch costs no network call), and every other
step of a sample is deterministic: its reward belongs to that one injected noise. From each
branched latent x'_{k+1} an ODE tail finishes the sample at every granularity g (`tail_indices`:
by default the reference's grid, k + 1, k + 2, k + 2 + g, ..., and always the last, sigma = 0).

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


TAIL_GRIDS = ("reference", "from_branch")
TAIL_ENDS = ("zero", "x0_prediction")


def tail_indices(k: int, g: int, num_steps: int, grid: str = "reference", end: str = "zero") -> list[int]:
    """The sigma indices an ODE tail from x'_{k+1} visits at granularity g (docs/algorithms.md
    section 12), from k + 1 to num_steps (sigma = 0).

    grid reference (G2RPO's code): one step of the schedule first, k + 1 -> k + 2, then every g-th
    sigma counted from k + 2. from_branch (flowrl's earlier grid): every g-th sigma counted from k + 1.
    end zero: a tail whose stride misses the last index takes one more, shorter step to it.
    x0_prediction (the reference's scoring): the last index the stride reaches is replaced by
    num_steps, so the image is the one-step x0-prediction x - sigma v from the index before it
    (an Euler step to sigma = 0 is that prediction); at T = 16 and g = 2 that is sigma 0.41 for odd k."""
    if grid not in TAIL_GRIDS:
        raise ValueError(f"rollout.granular.tail_grid must be one of {TAIL_GRIDS}, got {grid!r}")
    if end not in TAIL_ENDS:
        raise ValueError(f"rollout.granular.tail_end must be one of {TAIL_ENDS}, got {end!r}")
    first = k + 1
    if first >= num_steps:  # a branch at the last step is finished already
        return [num_steps]
    idx = [first, *range(first + 1, num_steps + 1, g)] if grid == "reference" else list(range(first, num_steps + 1, g))
    if idx[-1] != num_steps:
        if end == "x0_prediction" and len(idx) > 1:
            idx[-1] = num_steps
        else:
            idx.append(num_steps)
    return idx


def granular_nfe(num_steps: int, branch_steps: Sequence[int], granularities: Sequence[int], group_size: int,
                 grid: str = "reference", end: str = "zero") -> int:
    """Network evaluations per prompt: the anchor's T plus every tail step of every sample."""
    tails = sum(len(tail_indices(k, g, num_steps, grid, end)) - 1 for k in branch_steps for g in granularities)
    return num_steps + group_size * tails


def sequential_calls(num_steps: int, branch_steps: Sequence[int], granularities: Sequence[int], grid: str = "reference",
                     end: str = "zero") -> int:
    """Network calls one after another per prompt (at unlimited batch size): the anchor's T, then one
    per sigma index at which some tail stands."""
    stops = {j for k in branch_steps for g in granularities for j in tail_indices(k, g, num_steps, grid, end)[:-1]}
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
                     progress: bool = False, desc: str = "granular sampling", tail_grid: str = "reference",
                     tail_end: str = "zero") -> GranularBatch:
    """Anchors, branches and tails for `prompts` (one group each, seeded `seeds`). `spec` gives the
    sigmas and the SDE of the branch steps; the anchor and the tails are ODE, the tails on
    `tail_indices(k, g, T, tail_grid, tail_end)`."""
    prompts, seeds = list(prompts), [int(s) for s in seeds]
    P, T, G = len(prompts), spec.num_steps, group_size
    shape = tuple(policy.latent_shape())
    sig = spec.sigmas
    for p in dict.fromkeys(prompts):  # each prompt encoded alone (see FlowPolicy.encode)
        policy.encode([p])
    tails = [[tail_indices(k, g, T, tail_grid, tail_end) for g in granularities] for k in branch_steps]  # [M][L]
    bar = tqdm(total=granular_nfe(T, branch_steps, granularities, G, tail_grid, tail_end) * P, desc=desc, disable=not progress,
               leave=False, unit="nfe")
    anchors, branch_v, nfe, calls = _anchor(policy, prompts, seeds, spec, branch_steps, batch_size, shape, bar)
    branch_next, log_probs = _branches(policy, anchors, branch_v, seeds, spec, branch_steps, G, shape)
    state, tail_nfe, tail_calls = _tails(policy, branch_next, tails, len(granularities), prompts, sig, T, batch_size, shape, bar)
    nfe, calls = nfe + tail_nfe, calls + tail_calls
    bar.close()
    return GranularBatch(anchors, branch_next, log_probs, state, list(branch_steps), list(granularities), prompts,
                         torch.as_tensor(list(prompt_ids) if prompt_ids is not None else range(P), dtype=torch.long),
                         torch.as_tensor(seeds, dtype=torch.long), nfe, calls)


def _anchor(policy, prompts: list[str], seeds: list[int], spec: SamplerSpec, branch_steps: Sequence[int], batch_size: int,
            shape: tuple, bar) -> tuple[torch.Tensor, dict, int, int]:
    """The anchors' ODE chains: (every latent [P, T + 1, *latent], the velocity at each branch step, rows, calls)."""
    P, T, sig = len(prompts), spec.num_steps, spec.sigmas
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
    return anchors, branch_v, nfe, calls


def _branches(policy, anchors: torch.Tensor, branch_v: dict, seeds: list[int], spec: SamplerSpec, branch_steps: Sequence[int],
              G: int, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The branches' SDE steps from the anchors: (x'_{k+1} [P, M, G, *latent], their log-probs [P, M, G])."""
    P, M = anchors.shape[0], len(branch_steps)
    # the branches: G noises around one mean per (prompt, step)
    branch_next = torch.empty((P, M, G, *shape))
    log_probs = torch.zeros((P, M, G))
    for m, k in enumerate(branch_steps):
        xk = anchors[:, k].to(policy.device).repeat_interleave(G, 0)
        noise = seeded_noise([path_seed(s, i) for s in seeds for i in range(G)], k, shape, policy.device)
        out = spec.step(k, xk, branch_v[k].repeat_interleave(G, 0), noise=noise)
        branch_next[:, m] = out.next_x.view(P, G, *shape).cpu()
        log_probs[:, m] = out.log_prob.view(P, G).cpu()
    return branch_next, log_probs


def _tails(policy, branch_next: torch.Tensor, tails: list[list[list[int]]], L: int, prompts: list[str], sig: torch.Tensor,
           T: int, batch_size: int, shape: tuple, bar) -> tuple[torch.Tensor, int, int]:
    """The ODE tails from every branch, batched by sigma: (the finished tails [P, M, L, G, *latent], rows, calls)."""
    P, M, G = branch_next.shape[0], len(tails), branch_next.shape[2]
    nfe = calls = 0
    # the tails: tail (p, m, l, i) stands at sigma index where[m, l], the pos[m, l]-th of its indices
    # (a branch at the last step is finished already); every index advances, in one batched call,
    # the tails standing there to their next index
    state = branch_next[:, :, None].expand(P, M, L, G, *shape).clone()
    where = torch.tensor([[t[0] for t in row] for row in tails])  # [M, L]
    pos = torch.zeros(M, L, dtype=torch.long)
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
        nxt = torch.tensor([tails[m][l_][int(pos[m, l_]) + 1] for m, l_ in ml.tolist()])  # [n_ml]
        dt = (sig[nxt] - sig[j]).view(1, -1, 1, *([1] * len(shape)))
        state[:, ml[:, 0], ml[:, 1]] = (rows.to(policy.device) + dt.to(policy.device) * v.view(rows.shape)).cpu()
        where[ml[:, 0], ml[:, 1]] = nxt
        pos[ml[:, 0], ml[:, 1]] += 1
    return state, nfe, calls


def branch_edges(policy, batch: GranularBatch, spec: SamplerSpec, m: int, prompt_slice: slice) -> StepOutput:
    """Re-evaluate, with grad, the branch transitions of step batch.branch_steps[m] for the prompts
    in `prompt_slice` (one of the anchor's sampling batches, so the forward repeats it bit for
    bit): one forward for the anchors, then the G samples' log-probs from the shared mean."""
    k, G = batch.branch_steps[m], batch.group_size
    xk = batch.anchors[prompt_slice, k].to(policy.device)
    v = policy.velocity(xk, float(spec.sigmas[k]), policy.encode(batch.prompts[prompt_slice]))
    x_next = batch.branch_next[prompt_slice, m].reshape(-1, *xk.shape[1:]).to(policy.device)
    return spec.step(k, xk.repeat_interleave(G, 0), v.repeat_interleave(G, 0), x_next=x_next)
