"""A wall-clock budget for a run: the iteration count that fits it, fixed once from measured speed.

With `trainer.budget_minutes` > 0 the loop times its first `trainer.budget_probe` iterations,
fixes how many iterations fit the budget (`plan_iterations`, never more than `trainer.iterations`)
and records that count in the run directory (plan.json) and in every checkpoint, so a resumed run
trains exactly the same count. `trainer.iterations` stays the length that every iteration-based
schedule is written for (the nominal length): the `SchedulePlan` maps a real iteration onto that
nominal clock, so the
learning-rate decay, a progressive SDE window, a sliding depth window and DiffusionNFT's
old-policy decay all reach their end at the last planned iteration, on a fast machine or a slow
one. Without a budget the plan is the identity and the run is what it always was.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

PLAN_FILE = "plan.json"


@dataclass
class SchedulePlan:
    nominal: int  # trainer.iterations: the length the schedules are written for
    planned: int  # the iterations this run trains (= nominal without a budget, or until the budget fixes it)
    fixed: bool = False  # True once a budget plan has been made (or without a budget: nothing to plan)
    seconds_per_iteration: float = 0.0  # the measured speed the plan was made from
    budget_minutes: float = 0.0
    machine: str = ""  # the CPU (and GPU) that made the measurement

    def step(self, iteration: int) -> int:
        """The nominal iteration that `iteration` stands for, for schedules that move in whole steps
        (a progressive window shifts every k nominal iterations). The first and last planned
        iterations map onto the first and last nominal ones; exact integer arithmetic, so the
        identity plan returns `iteration` itself."""
        return iteration * (self.nominal - 1) // (self.planned - 1) if self.planned > 1 else 0

    def progress(self, iteration: int) -> float:
        """The nominal iteration as a real number, for continuous schedules (the learning rate)."""
        return iteration * (self.nominal - 1) / (self.planned - 1) if self.planned > 1 else 0.0

    def to_state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "SchedulePlan":
        return cls(**{k: state[k] for k in cls.__dataclass_fields__ if k in state})


def plan_iterations(budget_s: float, elapsed_s: float, done: int, seconds_per_iteration: float,
                    overhead_per_iteration: float = 0.0, reserve_s: float = 0.0, margin: float = 0.03) -> int:
    """How many iterations in all fit `budget_s`, given `done` iterations after `elapsed_s` seconds.

    The rest of the budget, less `margin` of the whole (timing noise) and `reserve_s` (the final
    grid and checkpoint), is divided by the cost of one more iteration: its measured time plus
    its share of the periodic sample grids and checkpoints. Never fewer than `done`."""
    if not (seconds_per_iteration > 0 and math.isfinite(seconds_per_iteration)):
        raise ValueError(f"seconds_per_iteration must be a positive finite number, got {seconds_per_iteration}")
    left = budget_s * (1.0 - margin) - elapsed_s - reserve_s
    return done + max(0, int(left // (seconds_per_iteration + overhead_per_iteration)))


def probe_speed(iteration_times: list[float]) -> float:
    """Seconds per iteration from the probe's iteration times: the first is left out when there
    are others (it pays for one-off warm-up: lazy initialisation, allocator growth)."""
    times = iteration_times[1:] if len(iteration_times) > 1 else iteration_times
    return sum(times) / len(times)


def machine_name() -> str:
    """The CPU model (from /proc/cpuinfo where there is one) with its core count, and the GPU if
    there is one: what BENCHMARKS.md names for every measurement."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    name = info.get("model name") or platform.processor() or platform.machine()
    if info.get("cpu family") and info.get("model"):
        name += f" (family {info['cpu family']}, model {info['model']})"
    name += f", {os.cpu_count()} CPUs"
    import torch

    if torch.cuda.is_available():
        name += f", {torch.cuda.get_device_name(0)}"
    return name


def write_plan(run_path: Path, plan: SchedulePlan) -> None:
    tmp = run_path / f".{PLAN_FILE}.tmp"
    tmp.write_text(json.dumps(plan.to_state(), indent=1) + "\n")
    os.replace(tmp, run_path / PLAN_FILE)
