"""The search methods by name (search.method) and `run_search`, which runs one over a search problem
for a set of budgets."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from flowrl.search.options import SEARCH_METHOD_NAMES
from flowrl.search.dts import dts
from flowrl.search.particles import best_of_n, smc
from flowrl.search.problem import PolicyProblem, SearchProblem
from flowrl.search.result import SearchResult


def _bon(problem, seeds, budgets, cfg, progress=None):
    return best_of_n(problem, seeds, budgets, cfg.sampler, cfg.noise_level, progress=progress)


def _smc(problem, seeds, budgets, cfg, progress=None):
    out = SearchResult("smc")
    for budget in sorted(budgets):  # the particle count follows the budget, so each budget is its own run
        one = smc(problem, seeds, budget, cfg.sampler, cfg.noise_level, cfg.lam, cfg.potential, cfg.resample,
                  cfg.resample_every, cfg.resampling, cfg.final, progress=progress)
        out.add(budget, one.latents[0], one.rewards[0], one.ledgers[0], one.seconds[0])
    return out


def _dts(star: bool):
    def run(problem, seeds, budgets, cfg, progress=None):
        return dts(problem, seeds, budgets, cfg.sampler, cfg.noise_level, cfg.lam, star, cfg.branch_every, cfg.width_c,
                   cfg.width_alpha, cfg.uct_c, cfg.backup, cfg.in_flight, progress=progress)

    return run


# method name -> run(problem, seeds, budgets, search config, progress) -> SearchResult
SEARCH_METHODS: dict[str, Callable] = dict(zip(SEARCH_METHOD_NAMES, (_bon, _smc, _dts(False), _dts(True))))


def run_search(method: str, problem, seeds: Sequence[int], budgets: Sequence[int], cfg, progress=None) -> SearchResult:
    if method not in SEARCH_METHODS:
        raise ValueError(f"search.method must be one of {tuple(SEARCH_METHODS)}, got {method!r}")
    # no autograd: a trained run's adapter weights require grad, and a graph kept through every
    # step of every sample would grow until the machine runs out of memory
    with torch.no_grad():
        return SEARCH_METHODS[method](problem, list(seeds), list(budgets), cfg, progress)


__all__ = ["SEARCH_METHODS", "PolicyProblem", "SearchProblem", "SearchResult", "best_of_n", "dts", "run_search", "smc"]
