"""The record a search leaves next to its images: what was searched, what each image scored and
what it cost."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flowrl.search.result import SearchResult


def write_search_report(path: Path, cfg, result: SearchResult, prompts: list[str], seeds: list[int], source: str) -> dict:
    """Write (and return) the JSON record of the last budget mark of `result`."""
    rewards = result.rewards[-1].tolist()
    report = {
        "source": source,
        "search": dataclasses.asdict(cfg.search),
        "searched_reward": cfg.search.reward or dict(cfg.reward.weights),
        "budget_nfe_per_image": result.budgets[-1],
        "mean_reward": sum(rewards) / len(rewards),
        "seconds": result.seconds[-1],
        "total": result.totals(),
        "images": [{"prompt": p, "seed": s, "reward": r, "ledger": lg}
                   for p, s, r, lg in zip(prompts, seeds, rewards, result.ledgers[-1])],
    }
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    return report
