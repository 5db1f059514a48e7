"""The metrics row of a training iteration, built in one place: the reward columns every run
shares, then the rollout's own columns, the objective's statistics and the loop's timings."""

from __future__ import annotations

import torch

from flowrl.train.experience import Experience


def reward_columns(reward_fn, prompts: list[str], rewards: torch.Tensor, prompt_ids: torch.Tensor) -> dict[str, float]:
    """The mean of every reward channel, and the headline (first) column of the reward's breakdown
    by kind of prompt (the shapes reward: `strict/<category>` per GenEval category), so a run shows
    which kinds RL moves (the overall mean hides a gain in one behind a loss in another)."""
    out = {f"reward/{c}": rewards[:, k].mean().item() for k, c in enumerate(reward_fn.channel_names)}
    table = reward_fn.breakdown([prompts[i] for i in prompt_ids.tolist()], rewards) or {}
    headline = [(kind, next((c, v) for c, v in row.items() if c != "n")) for kind, row in table.items() if kind != "overall"]
    out.update({f"{column}/{kind}": value for kind, (column, value) in headline})
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
                    **reward_columns(reward_fn, prompts, rewards, ids)})
    row.update({"dropped_samples": int((~valid).sum()), "samples": len(valid),
                "prompts": int(experience.prompt_ids.unique().numel())})
    return {**row, **stats, **experience.metrics}
