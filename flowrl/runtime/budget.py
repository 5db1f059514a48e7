"""A wall-clock budget for a run: the iteration count that fits it, planned from the measured speed
and planned again at every checkpoint.

With `trainer.budget_minutes` > 0 the loop times its first `trainer.budget_probe` iterations and
plans how many iterations in all fit the budget (`plan_count`). At every checkpoint
(`run.checkpoint_every`) while iterations remain, it plans again from everything measured so far
(`Measured`): the mean time of an iteration (every timed iteration but the run's very first,
which pays for warm-up: lazy initialisation, allocator growth), plus the periodic sample grids
and checkpoints at their measured mean cost, against what is left of the budget less 3 % for
timing noise. A plan is never below the iterations already done, and never above
`trainer.iterations` unless `trainer.budget_fill` is set: without it a fast machine trains the
count as written and ends early; with it the plan fills the budget, past `trainer.iterations`,
and the schedules are stretched onto it by the clock below. A machine that speeds up after the
probe trains more iterations, one that slows down trains fewer, and the run ends within a few
percent of its budget (the margin, plus what the speed does after the last re-plan). A run with
`run.checkpoint_every` 0 plans again at every tenth of its plan instead.

The schedule clock. `trainer.iterations` stays the length every iteration-based schedule is
written for (the nominal length): the learning-rate decay, a progressive SDE window, a sliding
depth window, DiffusionNFT's old-policy decay. `SchedulePlan.progress(i)` maps a real iteration
onto that nominal clock and `step(i)` is its floor, for schedules that move in whole steps. A
changing plan must not make them jump, so the map is piecewise linear, one piece per plan:

- before the first plan the clock is the nominal one, progress(i) = i (the probe iterations);
- a plan made with `a` iterations done and `N` planned keeps the clock of the iterations that
  already ran: its piece starts at the last of them, (a - 1, progress(a - 1)), and maps the rest,
  a .. N - 1, linearly onto the rest of the nominal range, so that the last planned iteration
  lands on the last nominal one, nominal - 1 (a plan made before any iteration ran maps
  0 .. N - 1 onto 0 .. nominal - 1). N may be above nominal (`trainer.budget_fill`): the clock
  then runs slower than the iterations, and `step` repeats nominal steps instead of skipping them.

Every piece starts where the last one left off, so a re-plan changes only the clock's rate:
slower when the plan grows, faster when it shrinks. The clock never runs backwards: a re-plan
is made while iterations remain, where progress(a - 1) is at most nominal - 1, so every piece
rises to nominal - 1. Every schedule that moves forward in nominal time (a decaying learning
rate, a window shifting later) thus stays monotone, and all of them still end at the last planned
iteration. A re-plan that keeps the count adds a piece on the same line: the clock is unchanged.
The anchors are exact fractions, so `step` is exact integer arithmetic and a plan of the whole
`trainer.iterations` is the identity, `iteration` itself.

Records: every plan ({"iteration": a, "planned": N, "seconds_per_iteration", "elapsed_s"}) is in
`SchedulePlan.history`, written to plan.json in the run directory and into every checkpoint, with
`Measured` and the budget's elapsed seconds. A resumed run restores all three: the plans made
up to its checkpoint come from the record (so its clock is the same map), its budget clock goes
on from the checkpoint's elapsed seconds (what was lost after the checkpoint is not counted), and
its measurements add to the recorded sums, so its re-plans at later checkpoints use the same
numbers an uninterrupted run had, plus its own timings: on a machine as fast as before it makes
the same plans. Every decision is rank 0's (flowrl/runtime/processes.py `rank0`), so all processes
train the same count. Without a budget the plan is the identity and the run is what it always was.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from tqdm.auto import tqdm

from flowrl.runtime.processes import rank0

PLAN_FILE = "plan.json"


@dataclass
class SchedulePlan:
    nominal: int  # trainer.iterations: the length the schedules are written for
    planned: int  # the iterations this run trains (= nominal without a budget, or until the first plan)
    fixed: bool = False  # True once a budget plan has been made (or without a budget: nothing to plan)
    seconds_per_iteration: float = 0.0  # the measured speed the latest plan was made from
    budget_minutes: float = 0.0
    machine: str = ""  # the CPU (and GPU) that made the measurement
    # every plan, oldest first: {"iteration": iterations done when it was made, "planned", "seconds_per_iteration",
    # "elapsed_s": the budget's seconds gone}; empty: one plan made at iteration 0 (the identity without a budget)
    history: list[dict] = field(default_factory=list)

    def replan(self, iteration: int, planned: int, seconds_per_iteration: float, elapsed_s: float) -> None:
        """Record a plan made with `iteration` iterations done: `planned` in all from now on."""
        self.history.append({"iteration": iteration, "planned": planned, "seconds_per_iteration": seconds_per_iteration,
                             "elapsed_s": elapsed_s})
        self.planned, self.seconds_per_iteration, self.fixed = planned, seconds_per_iteration, True

    def _pieces(self) -> list[tuple[int, int, Fraction, int]]:
        """(first iteration, anchor iteration, anchor progress, planned) per plan, oldest first."""
        plans = [(p["iteration"], p["planned"]) for p in self.history] or [(0, self.planned)]
        if plans[0][0] > 0:
            plans.insert(0, (0, self.nominal))  # before the first plan: the nominal clock
        pieces: list[tuple[int, int, Fraction, int]] = []
        for first, planned in plans:
            anchor = max(first - 1, 0)
            value = min(self._on(pieces, anchor), Fraction(self.nominal - 1)) if first > 0 else Fraction(0)
            pieces.append((first, anchor, value, planned))
        return pieces

    def _on(self, pieces: list[tuple[int, int, Fraction, int]], iteration: int) -> Fraction:
        first, anchor, value, planned = next((p for p in reversed(pieces) if p[0] <= iteration), pieces[0])
        if planned - 1 <= anchor:  # nothing left to map (a plan made at its end)
            return value
        return value + (iteration - anchor) * (self.nominal - 1 - value) / (planned - 1 - anchor)

    def step(self, iteration: int) -> int:
        """The nominal iteration that `iteration` stands for, for schedules that move in whole steps
        (a progressive window shifts every k nominal iterations). The last planned iteration maps
        onto the last nominal one; exact integer arithmetic, so the identity plan returns `iteration`."""
        return math.floor(self._on(self._pieces(), iteration))

    def progress(self, iteration: int) -> float:
        """The nominal iteration as a real number, for continuous schedules (the learning rate)."""
        return float(self._on(self._pieces(), iteration))

    def to_state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "SchedulePlan":
        plan = cls(**{k: state[k] for k in cls.__dataclass_fields__ if k in state})
        if plan.fixed and "history" not in state:  # recorded before re-planning: one plan, mapped from iteration 0
            plan.history = [{"iteration": 0, "planned": plan.planned, "seconds_per_iteration": plan.seconds_per_iteration,
                             "elapsed_s": 0.0}]
        return plan


@dataclass
class Measured:
    """What the budget has timed so far on rank 0's clock, in seconds, carried through checkpoints
    so that a resumed run re-plans from the same numbers as an uninterrupted one."""

    iterations: int = 0  # timed iterations (an iteration's loop step: training, logging; no grids, no checkpoints)
    first_s: float = 0.0  # the run's first: warm-up, left out once there are others
    rest_s: float = 0.0  # the sum of the others
    grids: int = 0
    grid_s: float = 0.0
    checkpoints: int = 0
    checkpoint_s: float = 0.0

    def add_iteration(self, seconds: float) -> None:
        if self.iterations == 0:
            self.first_s = seconds
        else:
            self.rest_s += seconds
        self.iterations += 1

    def add_grid(self, seconds: float) -> None:
        self.grids, self.grid_s = self.grids + 1, self.grid_s + seconds

    def add_checkpoint(self, seconds: float) -> None:
        self.checkpoints, self.checkpoint_s = self.checkpoints + 1, self.checkpoint_s + seconds

    def seconds_per_iteration(self) -> float:
        return self.rest_s / (self.iterations - 1) if self.iterations > 1 else self.first_s

    def seconds_per_grid(self) -> float:
        return self.grid_s / self.grids if self.grids else 0.0

    def seconds_per_checkpoint(self) -> float:
        """The mean checkpoint, or before the first one a sample grid's time."""
        return self.checkpoint_s / self.checkpoints if self.checkpoints else self.seconds_per_grid()

    def to_state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "Measured":
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


def plan_count(budget_s: float, elapsed_s: float, done: int, nominal: int, measured: Measured, sample_every: int,
               checkpoint_every: int, cap: bool = True) -> int:
    """The iterations in all that fit `budget_s` at the measured costs, at least `done` and, with
    `cap`, at most `nominal`: every iteration at its mean time, a sample grid every `sample_every`
    and a checkpoint every `checkpoint_every` iterations (0: never, but one of each at the end) at
    theirs. Without `cap` (trainer.budget_fill) the count fills the budget, past `nominal` on a fast
    machine; the schedule clock stretches the nominal schedules onto it."""
    grid, checkpoint = measured.seconds_per_grid() if sample_every else 0.0, measured.seconds_per_checkpoint()
    overhead = (grid / sample_every if sample_every else 0.0) + (checkpoint / checkpoint_every if checkpoint_every else 0.0)
    fits = plan_iterations(budget_s, elapsed_s, done, measured.seconds_per_iteration(), overhead_per_iteration=overhead,
                           reserve_s=grid + checkpoint)
    # capped, never more than trainer.iterations: a budget squeezes the schedule onto a slow machine, and a fast one
    # ends early
    return min(nominal, fits) if cap else fits


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


def replan(plan: SchedulePlan, measured: Measured, iteration: int, elapsed: float, run_path: Path | None,
           sample_every: int, checkpoint_every: int, fill: bool = False) -> None:
    """Plan the iteration count that fits the plan's budget (trainer.budget_minutes) from the speed
    measured so far (rank 0's clock decides for every process), with a sample grid every
    `sample_every` and a checkpoint every `checkpoint_every` iterations, past the nominal count
    with `fill` (trainer.budget_fill); record the plan in the run directory (`run_path`: rank 0's,
    None elsewhere), and say so when the count is new. The first plan follows the probe; later
    ones, the checkpoints."""
    minutes = plan.budget_minutes
    planned = plan_count(minutes * 60, elapsed, iteration, plan.nominal, measured, sample_every, checkpoint_every,
                         cap=not fill)
    planned, speed, elapsed = rank0((planned, measured.seconds_per_iteration(), elapsed))
    first, before = not plan.fixed, plan.planned
    plan.replan(iteration, planned, speed, elapsed)
    plan.machine = machine_name()
    if run_path is None:
        return
    write_plan(run_path, plan)
    if first:
        of = "for" if planned > plan.nominal else "of"  # budget_fill: the schedules of trainer.iterations stretched
        tqdm.write(f"budget: {speed:.2f} s per iteration over the first {measured.iterations}; {planned} iterations "
                   f"{of} trainer.iterations {plan.nominal} fit trainer.budget_minutes {minutes:g}")
    elif planned != before:
        tqdm.write(f"budget: at iteration {iteration}, {speed:.2f} s per iteration so far; {before} -> {planned} "
                   f"iterations fit trainer.budget_minutes {minutes:g}")


def pending_marks(marks: list[float], history: list[dict]) -> list[float]:
    """The marks of run.checkpoint_at_minutes not yet passed, ascending: minutes on the budget's
    clock (from the trainer's start). A resumed run skips the marks its metrics show as passed."""
    passed = max((row["checkpoint_at_minutes"] for row in history if "checkpoint_at_minutes" in row), default=-math.inf)
    return sorted(m for m in marks if m > passed)


def cross_marks(row: dict, marks: list[float], started: float) -> bool:
    """Whether the iteration just trained ended past the next mark (rank 0's clock, counted from
    `started`, decides for every process). Its metrics row then names the mark
    (`checkpoint_at_minutes`, the last one if it passed several) with the minutes elapsed, and its
    checkpoint holds the weights there. Pops the passed marks."""
    if not marks:
        return False
    elapsed = rank0(time.perf_counter() - started) / 60
    if elapsed < marks[0]:
        return False
    while marks and elapsed >= marks[0]:
        row["checkpoint_at_minutes"] = marks.pop(0)
    row["elapsed_minutes"] = elapsed
    return True
