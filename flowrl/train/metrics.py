"""The metrics row of a training iteration, built in one place: the reward columns every run
shares, then the rollout's own columns, the objective's statistics and the loop's timings."""

from __future__ import annotations

import torch

from flowrl.train.evaluate import shapes_category_table
from flowrl.train.experience import Experience


def reward_columns(channel_names, prompts: list[str], rewards: torch.Tensor, prompt_ids: torch.Tensor) -> dict[str, float]:
    """The mean of every reward channel, and with the shapes reward the strict mean per GenEval
    category (`strict/<category>`), so a run shows which categories RL moves (the overall mean
    hides a gain in one behind a loss in another)."""
    names = list(channel_names)
    out = {f"reward/{c}": rewards[:, k].mean().item() for k, c in enumerate(names)}
    table = shapes_category_table([prompts[i] for i in prompt_ids.tolist()], names, rewards)
    out.update({f"strict/{c}": t["strict"] for c, t in (table or {}).items() if c != "overall"})
    return out


def iteration_row(experience: Experience, stats: dict, reward_fn, prompts: list[str]) -> dict:
    """One row of metrics.jsonl. Where the rollout and the objective name the same column, the
    rollout's wins: it counts over every process (the objective counts its own process)."""
    row: dict = {"iteration": experience.iteration}
    valid = experience.valid
    if reward_fn is not None and len(valid):
        rewards, ids = experience.rewards[valid], experience.prompt_ids[valid]
        total = rewards @ reward_fn.channel_weights
        row.update({"reward_mean": total.mean().item(), "reward_std": total.std(unbiased=False).item(),
                    **reward_columns(reward_fn.channel_names, prompts, rewards, ids)})
    row.update({"dropped_samples": int((~valid).sum()), "samples": len(valid),
                "prompts": int(experience.prompt_ids.unique().numel())})
    return {**row, **stats, **experience.metrics}
