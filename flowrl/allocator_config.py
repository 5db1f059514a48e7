"""The config's allocator section (image and text alike): which allocator (flowrl/core/allocation.py)
and every allocator's options, their ranges, their checks, and the allocator they build. Each
field's comment is its description in `flowrl config show`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flowrl.core.allocation import SUBSET_KINDS, make_allocator
from flowrl.errors import ConfigError, check_choice, check_range

# each allocator setting's range, and optionally why (flowrl.errors.check_range)
ALLOCATOR_RANGES = {"min_group": (">= 2", "a group of one has no baseline"), "prior_a": "> 0", "prior_b": "> 0", "fast_decay": "(0, 1]", "slow_decay": "(0, 1]",
                    "first_fraction": "(0, 1]", "hard_accuracy": "(0, 1]", "target_positives": ">= 1", "round_size": ">= 1",
                    "cap": ">= 0", "ada_round_size": ">= 1", "ada_max_rounds": ">= 1", "gdro_bins": ">= 1",
                    "gdro_window": ">= 1", "gdro_step": ">= 0", "gdro_ema": "[0, 1)", "gdro_uniform_mix": "(0, 1]"}


@dataclass
class AllocatorConfig:
    """Which prompts get how many of the data.prompts_per_iteration x data.group_size rollouts."""

    # uniform | vade | xrpo | dars | dars_budget | successive_elimination | reinforce_ada | sqrt | prompt_gdro
    kind: str = "uniform"
    # a rollout "succeeds" when its weighted reward exceeds this; unset: when it exceeds the mean
    # reward of the iteration so far (continuous rewards have no natural pass/fail)
    success_threshold: Optional[float] = None
    min_group: int = 2
    prior_a: float = 1.0  # Beta prior of every prompt's success probability
    prior_b: float = 1.0
    fast_decay: float = 0.5  # VADE's two forgetting scales, applied each time a prompt is sampled
    slow_decay: float = 0.95
    dars_schedule: str = "equal"  # dars: the authors' equal-treatment schedule | hardness (hardness weighted)
    first_fraction: float = 0.5  # dars_budget: share of the budget spent in the first, uniform stage
    hard_accuracy: float = 0.5  # dars_budget: prompts below this success rate get top-ups
    target_positives: int = 2  # dars_budget: ...until they have this many successes
    round_size: int = 4  # successive_elimination (and dars_budget top-up size)
    cap: int = 0  # successive_elimination: most rollouts per prompt (0: 2 x group_size)
    ada_round_size: int = 8  # reinforce_ada: rollouts per prompt and round
    ada_max_rounds: int = 4  # reinforce_ada: most rounds; a prompt trains on group_size of its samples
    ada_exit: str = "balanced"  # reinforce_ada: a prompt stops at group_size/2 successes and failures | positive: one success
    gdro_bins: int = 4  # prompt_gdro: pass@k difficulty bins (the unseen prompts form one more)
    gdro_window: int = 4  # prompt_gdro: a prompt's pass@k averages its last this many visits
    gdro_step: float = 1.0  # prompt_gdro: the adversary's multiplicative-weights step
    gdro_ema: float = 0.9  # prompt_gdro: decay of each bin's error average (the debiasing)
    gdro_uniform_mix: float = 0.1  # prompt_gdro: share of the uniform distribution mixed into the bin weights

    def validate(self, group_size: int, kinds: tuple[str, ...]) -> None:
        """One sentence for the first setting that is not allowed; `kinds`: the allocators the
        task's rollouts can drive (the image and the text config both call this)."""
        if self.kind in SUBSET_KINDS and self.kind not in kinds:
            raise ConfigError(f"allocator.kind {self.kind} trains on a subset of each prompt's samples, which the image "
                              f"rollouts do not do yet; choose one of {', '.join(kinds)} (or use it with task: text)")
        check_choice("allocator.dars_schedule", self.dars_schedule, ("equal", "hardness"))
        check_choice("allocator.kind", self.kind, kinds)
        check_choice("allocator.ada_exit", self.ada_exit, ("balanced", "positive"))
        for name, spec in ALLOCATOR_RANGES.items():
            spec, why = (spec, "") if isinstance(spec, str) else spec
            check_range(f"allocator.{name}", getattr(self, name), spec, why)
        if group_size < self.min_group:
            raise ConfigError(f"data.group_size ({group_size}) must be >= allocator.min_group ({self.min_group})")
        if self.kind == "reinforce_ada" and self.ada_round_size * self.ada_max_rounds < group_size:
            raise ConfigError(f"allocator.ada_max_rounds ({self.ada_max_rounds}) rounds of allocator.ada_round_size "
                              f"({self.ada_round_size}) cannot fill a group of data.group_size ({group_size})")

    def build(self, num_prompts: int, prompts_per_iteration: int, group_size: int, seed: int):
        """The allocator these settings describe (flowrl/core/allocation.py) over a pool of
        `num_prompts`, spending prompts_per_iteration x group_size rollouts an iteration."""
        return make_allocator(
            self.kind, num_prompts=num_prompts, budget=prompts_per_iteration * group_size,
            prompts_per_iteration=prompts_per_iteration, seed=seed, min_group=self.min_group, prior_a=self.prior_a,
            prior_b=self.prior_b, fast_decay=self.fast_decay, slow_decay=self.slow_decay, first_fraction=self.first_fraction,
            hard_accuracy=self.hard_accuracy, target_positives=self.target_positives, round_size=self.round_size,
            cap=self.cap or 2 * group_size, ada_round_size=self.ada_round_size, ada_max_rounds=self.ada_max_rounds,
            ada_exit=self.ada_exit, dars_schedule=self.dars_schedule, gdro_bins=self.gdro_bins, gdro_window=self.gdro_window, gdro_step=self.gdro_step,
            gdro_ema=self.gdro_ema, gdro_uniform_mix=self.gdro_uniform_mix)
