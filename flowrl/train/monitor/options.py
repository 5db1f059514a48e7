"""The config's monitor section (docs/monitor.md): what the monitor inside the image trainer
(watch.py) evaluates, how often, and what each of its rules does; checked by validate.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class MonitorConfig:
    """Reward hacking caught while it happens (docs/monitor.md): every `every` iterations, ODE samples on
    fixed prompts and seeds (EMA weights where the run keeps them), scored by gold rewards the run does not
    train on and measured by image statistics against the base model's on the same prompts and seeds."""

    enabled: bool = False
    every: int = 20  # iterations between evaluations
    prompts: list[str] = field(default_factory=list)  # held-out prompts; empty: prompt_file, else data.eval_prompts
    prompt_file: Optional[str] = None  # one prompt per line, or builtin:shapes-heldout
    num_prompts: int = 8  # prompts taken at an even stride through the list
    seeds: int = 4  # fixed seeds per prompt: a group, for the diversity within it
    # gold channels, REWARD or REWARD/CHANNEL (shapes/strict), scored on the monitor's images and never trained on
    # there; options under reward.options.REWARD. The first is the one the `best` checkpoint follows
    gold: list[str] = field(default_factory=list)
    divergence_evals: int = 3  # gold_divergence: K evaluations in a row with the training reward up and a gold down
    divergence_min_drop: float = 0.0  # by more than this
    # stat_drift: statistic -> the largest |value - base| allowed (docs/monitor.md: the statistics' formulas)
    drift: dict[str, float] = field(default_factory=lambda: {
        "brightness": 0.15, "saturation": 0.2, "dark_fraction": 0.25, "bright_fraction": 0.25, "colour_entropy": 1.0,
        "edge_density": 0.1})
    diversity_floor: float = 0.5  # diversity_collapse: within-group diversity below this fraction of the base model's
    # each rule's action: warn (a line, and the closing line) | stop (a checkpoint, then the run ends) | rollback (the
    # `best` checkpoint's weights, optimizer, EMA and objective state restored; training goes on)
    on_gold_divergence: str = "stop"
    on_drift: str = "warn"
    on_diversity: str = "warn"
    max_rollbacks: int = 2  # a rule asking for one more rollback than this stops the run instead
