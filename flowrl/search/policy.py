"""Search with a flowrl policy and its config: the searched reward, the step grid, the budget."""

from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from flowrl.search.run import run_search
from flowrl.search.problem import PolicyProblem
from flowrl.search.result import SearchResult


def searched_reward(cfg):
    """search.reward alone (weight 1), or the config's reward weights when it is empty."""
    from rewards import MultiReward

    name = cfg.search.reward
    return MultiReward.single(name, cfg.reward) if name else MultiReward.from_config(cfg.reward)


def search_steps(cfg) -> int:
    return cfg.search.num_steps or cfg.sampling.num_steps


def search_budget(cfg) -> int:
    """search.budget, or four samples' worth when it is 0."""
    return cfg.search.budget or 4 * search_steps(cfg)


def search_policy(cfg, policy, prompts: Sequence[str], seeds: Sequence[int], budgets: Sequence[int] | None = None,
                  progress: bool = False) -> tuple[SearchResult, PolicyProblem]:
    """Run cfg.search.method for every prompt (its seed) at each of `budgets` (default: the config's)."""
    s = cfg.sampling
    sigmas = policy.sigmas(search_steps(cfg), s.schedule, s.shift)
    problem = PolicyProblem(policy, prompts, searched_reward(cfg), sigmas, s.batch_size)
    budgets = sorted(budgets or [search_budget(cfg)])
    total = len(prompts) * (sum(budgets) if cfg.search.method == "smc" else budgets[-1])
    with tqdm(total=total, desc=f"search ({cfg.search.method})", disable=not progress, leave=False, unit="nfe") as bar:
        result = run_search(cfg.search.method, problem, seeds, budgets, cfg.search, progress=bar)
    return result, problem
