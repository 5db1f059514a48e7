"""The config's allocator section (image and text alike): which allocator (flowrl/core/allocation.py),
the options every allocator shares, and a sub-section per allocator with options of its own
(allocator.reinforce_ada, allocator.prompt_gdro, ...), typed by the allocator's options dataclass
(`ALLOCATORS.section`). Each field's comment is its description in `flowrl config show`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

from flowrl.core.allocation import ALLOCATORS
from flowrl.errors import ConfigError

# allocator options that moved into their allocator's sub-section: a run directory's config.yaml written before
# holds them at their defaults (left out when it is read: RETIRED_DEFAULTS); a value a user set is refused by name
MOVED = {"allocator.dars_schedule": ("allocator.dars.schedule", "equal"),
         "allocator.first_fraction": ("allocator.dars_budget.first_fraction", 0.5),
         "allocator.hard_accuracy": ("allocator.dars_budget.hard_accuracy", 0.5),
         "allocator.target_positives": ("allocator.dars_budget.target_positives", 2),
         "allocator.round_size": ("allocator.successive_elimination.round_size or allocator.dars_budget.round_size", 4),
         "allocator.cap": ("allocator.successive_elimination.cap", 0),
         "allocator.ada_round_size": ("allocator.reinforce_ada.round_size", 8),
         "allocator.ada_max_rounds": ("allocator.reinforce_ada.max_rounds", 4),
         "allocator.ada_exit": ("allocator.reinforce_ada.exit", "balanced"),
         **{f"allocator.gdro_{k}": (f"allocator.prompt_gdro.{k}", v)
            for k, v in (("bins", 4), ("window", 4), ("step", 1.0), ("ema", 0.9), ("uniform_mix", 0.1))}}
MOVED_KEYS = {old: new for old, (new, _) in MOVED.items()}
MOVED_DEFAULTS = {old: default for old, (_, default) in MOVED.items()}


@dataclass
class AllocatorSection:
    """Which prompts get how many of the data.prompts_per_iteration x data.group_size rollouts."""

    kind: str = "uniform"  # a registered allocator (`flowrl config show` lists them)
    # a rollout "succeeds" when its weighted reward exceeds this; unset: when it exceeds the mean
    # reward of the iteration so far (continuous rewards have no natural pass/fail)
    success_threshold: Optional[float] = None
    min_group: int = 2
    prior_a: float = 1.0  # Beta prior of every prompt's success probability
    prior_b: float = 1.0
    fast_decay: float = 0.5  # the two forgetting scales of every prompt's statistics (VADE's), applied each time it is sampled
    slow_decay: float = 0.95

    RANGES: ClassVar[dict] = {"min_group": (">= 2", "a group of one has no baseline"), "prior_a": "> 0", "prior_b": "> 0",
                              "fast_decay": "(0, 1]", "slow_decay": "(0, 1]"}
    CHOICES: ClassVar[dict] = {"kind": ALLOCATORS}

    def validate(self, cfg, subsets: bool) -> None:
        """What the ranges and choices (checked with the config's) leave: the allocator's own `validate`, and
        `subsets`: whether the task's rollouts can train on a subset of a prompt's samples (the image ones cannot)."""
        allocator = ALLOCATORS.get(self.kind)
        if not allocator.keeps_all and not subsets:
            raise ConfigError(f"allocator.kind {self.kind} trains on a subset of each prompt's samples, which the image rollouts "
                              f"do not do yet; choose one of {', '.join(ALLOCATORS.where(lambda a: a.keeps_all))} (or use it "
                              "with task: text)")
        if cfg.data.group_size < self.min_group:
            raise ConfigError(f"data.group_size ({cfg.data.group_size}) must be >= allocator.min_group ({self.min_group})")
        allocator.validate(cfg)

    def build(self, num_prompts: int, prompts_per_iteration: int, group_size: int, seed: int):
        """The allocator these settings describe over a pool of `num_prompts`, spending
        prompts_per_iteration x group_size rollouts an iteration."""
        allocator = ALLOCATORS.get(self.kind)
        own = dataclasses.asdict(getattr(self, self.kind)) if allocator.options else {}
        return allocator(num_prompts=num_prompts, budget=prompts_per_iteration * group_size,
                         prompts_per_iteration=prompts_per_iteration, seed=seed, min_group=self.min_group, prior_a=self.prior_a,
                         prior_b=self.prior_b, fast_decay=self.fast_decay, slow_decay=self.slow_decay, **own)


def allocator_section() -> type:
    """The section with a sub-section per registered allocator that has options (plug-ins' included)."""
    return ALLOCATORS.section("AllocatorConfig", AllocatorSection)


AllocatorConfig = allocator_section()
