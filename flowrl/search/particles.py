"""Best-of-N and SMC / Feynman-Kac steering: particles that move together through the proposal.

Particle i of a prompt seeded s draws its noise from path_seed(s, i), so best-of-N's sample i is
the flat rollout of that seed, and SMC's particles keep their slot's seed after resampling
(copies of one ancestor then diverge). Prompts are searched side by side, their rows batched.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from flowrl.core.search import Ledger, effective_sample_size, log_potential, resample_indices, update_history
from flowrl.sampling.tree import path_seed
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.steps import predicted_x0
from flowrl.search.problem import advance, charge, proposal
from flowrl.search.result import SearchResult


def samples_within(budget: int, num_steps: int) -> int:
    n = budget // num_steps
    if n < 1:
        raise ValueError(f"a budget of {budget} network evaluations per prompt is less than one sample ({num_steps} steps)")
    return n


def best_of_n(problem, seeds: Sequence[int], budgets: Sequence[int], sampler: str = "flow_grpo", noise_level: float = 0.7,
              progress=None) -> SearchResult:
    """N = budget // T independent samples per prompt, keep the highest reward. One pass serves every
    budget mark: the samples of a smaller budget are the first ones of a larger."""
    spec, T = proposal(problem.sigmas, sampler, noise_level), problem.sigmas.numel() - 1
    P, shape = problem.num_prompts, problem.latent_shape()
    budgets = sorted(budgets)
    ledgers = [Ledger(budgets[-1]) for _ in range(P)]
    result, start, done = SearchResult("bon"), time.perf_counter(), 0
    best_x, best_r = torch.zeros((P, *shape)), torch.full((P,), -float("inf"))
    for budget in budgets:
        n = samples_within(budget, T)
        rows = [p for p in range(P) for _ in range(done, n)]
        seeds_ = [path_seed(seeds[p], i) for p in range(P) for i in range(done, n)]
        if rows:
            x = seeded_noise(seeds_, INITIAL, shape)
            for t in range(T):
                v = problem.velocity(x, t, rows)
                charge(ledgers, rows, nfe=1)
                x = advance(spec, x, v, t, seeds_)
                if progress is not None:
                    progress.update(len(rows))
            r = problem.score(x, rows)
            charge(ledgers, rows, decodes=1, reward_calls=1)
            # rows are prompt-major; the first best on ties, so a larger budget never loses an earlier pick
            stage_r, stage_x = r.view(P, n - done), x.view(P, n - done, *shape)
            j = torch.argmax(stage_r, dim=1)
            better = stage_r[torch.arange(P), j] > best_r
            best_r = torch.where(better, stage_r[torch.arange(P), j], best_r)
            best_x[better] = stage_x[torch.arange(P), j][better]
        done = n
        result.add(budget, best_x.clone(), best_r.clone(), [lg.as_dict() for lg in ledgers], time.perf_counter() - start)
    return result


def smc(problem, seeds: Sequence[int], budget: int, sampler: str = "flow_grpo", noise_level: float = 0.7, lam: float = 10.0,
        potential: str = "max", resample: str = "adaptive", every: int = 2, resampling: str = "systematic",
        final: str = "best", progress=None) -> SearchResult:
    """SMC with Feynman-Kac potentials (FK steering): k = budget // T particles per prompt. Every
    `every` steps the particles' predicted x0 are scored and weighted by the potential; they are
    resampled there (resample='every') or only when the effective sample size falls under k/2
    ('adaptive'). At the end each particle's weight is exp(lam r(x0)) over the product of the
    potentials its lineage received, which makes the target p_theta(x0) exp(lam r(x0));
    final='best' returns the highest-reward particle, 'sample' one drawn by those weights."""
    spec, T = proposal(problem.sigmas, sampler, noise_level), problem.sigmas.numel() - 1
    P, shape = problem.num_prompts, problem.latent_shape()
    k = samples_within(budget, T)
    ledgers = [Ledger(budget) for _ in range(P)]
    rows = [p for p in range(P) for _ in range(k)]
    row_seeds = [path_seed(seeds[p], i) for p in range(P) for i in range(k)]
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]  # per prompt: its draws do not depend on the others
    start = time.perf_counter()
    x = seeded_noise(row_seeds, INITIAL, shape)
    log_w = torch.zeros(P, k, dtype=torch.float64)  # weights since the last resampling
    log_prod = torch.zeros(P, k, dtype=torch.float64)  # each lineage's product of potentials
    history = None
    resamples = [0] * P
    for t in range(T):
        v = problem.velocity(x, t, rows)
        charge(ledgers, rows, nfe=1)
        if t > 0 and t % every == 0:
            r = problem.score(predicted_x0(x, v, float(problem.sigmas[t])), rows).view(P, k).double()
            charge(ledgers, rows, decodes=1, reward_calls=1)
            g = log_potential(potential, lam, r, history)
            history = update_history(potential, r, history)
            log_w, log_prod = log_w + g, log_prod + g
            for p in range(P):
                if resample == "every" or float(effective_sample_size(log_w[p])) < k / 2:
                    idx = resample_indices(log_w[p], resampling, gens[p])
                    sl = slice(p * k, (p + 1) * k)
                    x[sl], v[sl] = x[sl][idx], v[sl][idx]
                    log_prod[p], history[p] = log_prod[p][idx], history[p][idx]
                    log_w[p] = 0.0
                    resamples[p] += 1
        x = advance(spec, x, v, t, row_seeds)
        if progress is not None:
            progress.update(len(rows))
    r = problem.score(x, rows)
    charge(ledgers, rows, decodes=1, reward_calls=1)
    r = r.view(P, k)
    final_log_w = log_w + lam * r.double() - log_prod
    if final == "best":
        pick = torch.argmax(r, dim=1)
    elif final == "sample":
        pick = torch.stack([torch.multinomial(torch.softmax(final_log_w[p], 0), 1, generator=gens[p])[0] for p in range(P)])
    else:
        raise ValueError(f"final must be 'best' or 'sample', got {final!r}")
    chosen = torch.arange(P) * k + pick
    out = SearchResult("smc")
    out.add(budget, x[chosen].clone(), r[torch.arange(P), pick].clone(),
            [dict(lg.as_dict(), particles=k, resamples=resamples[p]) for p, lg in enumerate(ledgers)], time.perf_counter() - start)
    return out
