"""Rollouts and objectives: the two kinds of registered parts the training loop composes.

A rollout turns the current policy into an `Experience` (`collect(iteration)`); an objective
turns an `Experience` into optimizer steps (`update(experience)`). Each registers under the name
that `rollout.kind` / `objective.kind` selects, declares what it provides or needs, so the
config is checked from the declarations (`check_compatible`) and the loop never branches on a
name, and owns its options: a dataclass (`options`) that becomes the config's rollout.<name> or
objective.<name> section, checked by the part's `validate`. Adding one is a new module with a
registered class, in flowrl/train/rollouts or objectives (found there by name) or in a user's own
package (the config's `plugins`); docs/architecture.md has an example. flowrl/train/registry.py
looks parts up by name and checks a config against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from flowrl.registry import Registry
from flowrl.runtime import parts as runtime_parts
from flowrl.runtime.budget import SchedulePlan
from flowrl.schema import Config
from flowrl.train.experience import Experience

ROLLOUTS = Registry("rollout.kind", "Rollouts")
OBJECTIVES = Registry("objective.kind", "Objectives")


@dataclass
class TrainContext:
    """What the loop lends its parts: the config, the accelerator, the policy and its trainable
    weights, the prompt pool, the reward and its runner, the allocator, and one optimizer step
    (clip, step, zero, EMA). Parts keep no reference to the loop itself."""

    cfg: "Config"
    accelerator: Any
    policy: Any
    params: dict[str, torch.Tensor]
    prompts: list[str]
    reward_fn: Any  # None when the rollout needs no online reward
    reward_runner: Any
    allocator: Any
    optimizer_step: Callable[[], float]
    optimizer: Any
    objective_needs: str  # the training data the objective consumes (experience.TRANSITIONS or SAMPLES)
    # maps a real iteration onto the nominal clock of trainer.iterations for iteration-based
    # schedules (identity without a budget; flowrl/runtime/budget.py)
    plan: SchedulePlan

    @property
    def progress(self) -> bool:
        return bool(self.cfg.run.progress and self.accelerator.is_local_main_process)


class Rollout:
    """Produces one iteration's `Experience`. `provides(cfg)` names the training data it fills
    (experience.TRANSITIONS, experience.SAMPLES) under that config."""

    name: ClassVar[str]
    options: ClassVar[type | None] = None  # a dataclass: the config's rollout.<name> section, with its defaults
    needs_prompts: ClassVar[bool] = True  # an online prompt source (data.prompts or data.prompt_file)
    needs_rewards: ClassVar[bool] = True  # an online reward (reward.weights)
    # runs under run.distributed fsdp2: its no-grad forwards stay inside collect() (the loop gathers the
    # weights around it) and every process gets the same number of training batches (tested with it)
    shards: ClassVar[bool] = False
    # runs under run.async_rollouts: `sample(iteration)` draws a batch with no reference to the trainer (it
    # travels from a producer process) and `experience(batch)` builds the Experience from it on the trainer's
    # policy; `collect` is then `experience(sample(iteration))`
    runs_ahead: ClassVar[bool] = False
    # runs_ahead with several trainer processes: `split(batch, n, i)` gives process i of n its share of a
    # batch the producer drew whole, as `sample` on that process would have drawn it
    splits_batches: ClassVar[bool] = False

    def __init__(self, ctx: TrainContext):
        self.ctx = ctx

    @classmethod
    def provides(cls, cfg: "Config") -> set[str]:
        raise NotImplementedError

    @classmethod
    def missing_reason(cls, cfg: "Config", data: str) -> str:
        """Why `data` is not provided under `cfg` (completes an error sentence), or ''."""
        return ""

    @classmethod
    def validate(cls, cfg: "Config") -> None:
        """Raise ConfigError for settings this rollout cannot run with."""

    def collect(self, iteration: int) -> Experience:
        """The iteration's Experience; a rollout that runs ahead builds it from its `sample`."""
        if not self.runs_ahead:
            raise NotImplementedError
        return self.experience(self.sample(iteration))

    def sample(self, iteration: int) -> Any:
        """(runs_ahead rollouts) The iteration's draws and scores, picklable."""
        raise NotImplementedError

    def experience(self, batch: Any) -> Experience:
        """(runs_ahead rollouts) The Experience of a `sample` batch, on this process's policy."""
        raise NotImplementedError

    def split(self, batch: Any, num_processes: int, process_index: int) -> Any:
        """(splits_batches rollouts) This process's share of a batch drawn whole by one producer."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Objective(runtime_parts.Objective):
    """Turns an `Experience` into optimizer steps and returns its statistics (the runtime's
    objective protocol, flowrl/runtime/parts.py, with the image trainer's TrainContext as `ctx`).
    `needs` is the training data it consumes (one of experience.DATA_KINDS)."""

    needs: ClassVar[str]
    # runs under run.distributed fsdp2: every process runs the same number of forwards and backwards
    # (tested with it)
    shards: ClassVar[bool] = False
    ctx: TrainContext

    @classmethod
    def trained_sigma_range(cls, cfg: "Config", grid: list[float]) -> tuple[float, float] | None:
        """(low, high): the sigmas this objective trains under `cfg` on the sampling grid `grid` (its steps, from
        the noisiest), where lora.acts_at trained lets the adapter act (low < sigma <= high); None: every sigma."""
        return None

    @classmethod
    def requires(cls, cfg: "Config") -> dict[str, str]:
        """Data beyond `needs` that its options call for under `cfg`: {data kind: the option that
        needs it} (experience.DATA_KINDS), checked against what the rollout provides."""
        return {}


register_rollout = ROLLOUTS.register
register_objective = OBJECTIVES.register
