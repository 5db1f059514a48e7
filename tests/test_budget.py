"""A wall-clock budget (trainer.budget_minutes): the planned iteration count follows the measured
speed, the schedules end at the last planned iteration, and a resume keeps the recorded count."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import flowrl.train.loop as loop
from flowrl.config import ConfigError, load_config
from flowrl.core.lr_schedule import lr_factor
from flowrl.train.budget import SchedulePlan, plan_iterations, probe_speed
from flowrl.train.loop import Trainer
from flowrl.train.rollouts.flat import training_spec
from run_checks import run_metrics, trainable

BUDGET = [
    "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
    "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8",
    "run.sample_every=0", "trainer.kl_beta=0.01", "trainer.lr=1e-3", "trainer.lr_schedule=linear",
    "trainer.iterations=20", "trainer.budget_minutes=0.5", "trainer.budget_probe=2",
    # a progressive SDE window written for the 20 nominal iterations: one step later every 6
    "sampling.window.strategy=progressive", "sampling.window.size=1", "sampling.window.start=0", "sampling.window.shift_every=6",
]


class FakeClock:
    """The loop's clock: time moves only when an iteration's rollout says so, so the plan is exact."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=c.perf_counter))
    return c


def slowed(trainer: Trainer, clock: FakeClock, seconds: float, fail_at: int | None = None) -> Trainer:
    """Each iteration's rollout takes `seconds` on the fake clock; `fail_at` crashes that iteration."""
    collect = trainer.rollout.collect

    def slow(iteration):
        if iteration == fail_at:
            raise RuntimeError("killed")
        clock.now += seconds
        return collect(iteration)

    trainer.rollout.collect = slow
    return trainer


def budget_cfg(tiny_sd3_dir, *extra):
    return load_config("tiny_jpeg", [*BUDGET, f"model.path={tiny_sd3_dir}", *extra])


def test_plan_iterations_divides_what_is_left_of_the_budget():
    # 100 s budget, 3 % margin: 97 s; 10 s gone on 2 iterations; 87 s / 3 s = 29 more
    assert plan_iterations(100, 10, 2, 3.0) == 31
    assert plan_iterations(100, 10, 2, 3.0, overhead_per_iteration=1.0) == 2 + 87 // 4
    assert plan_iterations(100, 10, 2, 3.0, reserve_s=6) == 2 + 81 // 3
    assert plan_iterations(100, 200, 7, 3.0) == 7  # over budget already: no more than done
    assert probe_speed([9.0, 2.0, 4.0]) == 3.0  # the warm-up iteration is left out
    assert probe_speed([5.0]) == 5.0
    with pytest.raises(ValueError):
        plan_iterations(100, 10, 2, float("nan"))


def test_schedule_plan_maps_the_ends_onto_the_nominal_ends():
    identity = SchedulePlan(nominal=270, planned=270)
    assert all(identity.step(i) == i and identity.progress(i) == i for i in range(270))
    for planned in (100, 213, 270, 400):
        plan = SchedulePlan(nominal=270, planned=planned)
        steps = [plan.step(i) for i in range(planned)]
        assert steps[0] == 0 and steps[-1] == 269 and steps == sorted(steps)
        assert plan.progress(planned - 1) == pytest.approx(269)


@pytest.mark.parametrize("bad", ["trainer.budget_minutes=-1", "trainer.budget_minutes=nan", "trainer.budget_minutes=inf",
                                 "trainer.budget_probe=0"])
def test_budget_fields_are_checked(tiny_sd3_dir, bad):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
        budget_cfg(tiny_sd3_dir, bad)


def test_planned_count_follows_the_measured_speed_and_the_schedules_end_with_it(tmp_path, tiny_sd3_dir, clock):
    planned = {}
    for seconds in (2.5, 5.0):
        cfg = budget_cfg(tiny_sd3_dir, "run.checkpoint_every=0")
        trainer = slowed(Trainer(cfg, tmp_path / f"s{seconds}"), clock, seconds)
        history = trainer.train()
        # 2 probe iterations at `seconds` each; the rest of 0.97 x 30 s at `seconds` per iteration
        expected = math.floor(0.97 * 30 / seconds)
        planned[seconds] = len(history)
        assert len(history) == trainer.plan.planned == expected
        record = json.loads((tmp_path / f"s{seconds}" / "plan.json").read_text())
        assert record["planned"] == expected and record["nominal"] == 20 and record["seconds_per_iteration"] == seconds
        # the linear decay is written for 20 iterations and ends where it would have: lr (1 - 19 / 20) at the last one
        assert history[-1]["lr"] == pytest.approx(1e-3 * lr_factor("linear", 19, 20))
        assert [r["lr"] for r in history] == sorted((r["lr"] for r in history), reverse=True)
        # the progressive window reaches the last step exactly at the last planned iteration
        starts = [training_spec(cfg, i, trainer.policy, trainer.plan).trained_steps()[0] for i in range(len(history))]
        assert starts[0] == 0 and starts[-1] == 3 and starts == sorted(starts)
    assert planned[2.5] == 11 and planned[5.0] == 5  # half the speed, about half the iterations


def test_resume_keeps_the_recorded_count_and_repeats_the_uninterrupted_run(tmp_path, tiny_sd3_dir, clock):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    slowed(Trainer(budget_cfg(tiny_sd3_dir, "run.checkpoint_every=3"), straight), clock, 2.5).train()
    with pytest.raises(RuntimeError, match="killed"):
        slowed(Trainer(budget_cfg(tiny_sd3_dir, "run.checkpoint_every=3"), stopped), clock, 2.5, fail_at=7).train()
    assert len(run_metrics(stopped)) == 7  # iterations 0-6 logged, the checkpoint at 6
    # the machine is now four times slower: a new plan would fit 2 iterations; the recorded one holds
    resumed = slowed(Trainer(budget_cfg(tiny_sd3_dir, "run.checkpoint_every=3"), stopped, resume=True), clock, 10.0)
    assert resumed.iteration == 6 and resumed.plan.planned == 11
    resumed.train()
    assert run_metrics(stopped) == run_metrics(straight)
    a, b = trainable(straight, 11), trainable(stopped, 11)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_fast_machine_trains_trainer_iterations_and_no_more(tmp_path, tiny_sd3_dir, clock):
    # 0.5 s per iteration would fit 58 in the budget: the count stays at trainer.iterations, the schedule as written
    cfg = budget_cfg(tiny_sd3_dir, "run.checkpoint_every=0", "trainer.iterations=6")
    trainer = slowed(Trainer(cfg, tmp_path / "run"), clock, 0.5)
    assert len(trainer.train()) == 6 and trainer.plan.planned == 6
    assert [r["lr"] for r in run_metrics(tmp_path / "run")] == pytest.approx([1e-3 * (1 - i / 6) for i in range(6)])


def test_without_a_budget_the_run_is_what_it_was(tmp_path, tiny_sd3_dir, clock):
    cfg = budget_cfg(tiny_sd3_dir, "trainer.budget_minutes=0", "run.checkpoint_every=0", "trainer.iterations=3")
    trainer = slowed(Trainer(cfg, tmp_path / "run"), clock, 100.0)
    assert len(trainer.train()) == 3 and not (tmp_path / "run" / "plan.json").exists()
    assert [r["lr"] for r in run_metrics(tmp_path / "run")] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])
