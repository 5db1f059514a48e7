"""A wall-clock budget (trainer.budget_minutes): the planned iteration count follows the measured
speed and is planned again at every checkpoint, the schedules end at the last planned iteration
without a jump, and a resume repeats the recorded plans."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

import flowrl.runtime.run_manager as run_manager
from flowrl.config import ConfigError, load_config
from flowrl.core.lr_schedule import lr_factor
from flowrl.runtime.budget import Measured, SchedulePlan, plan_count, plan_iterations
from flowrl.train.loop import Trainer
from flowrl.train.rollouts.common import training_spec
from run_checks import run_metrics, trainable

BUDGET = [
    # 4 samples in one batch: the plans follow the fake clock, not the work, and exact resume needs no more
    "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=2",
    "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8",
    "run.sample_every=0", "trainer.kl_beta=0.01", "trainer.lr=1e-3", "trainer.lr_schedule=linear",
    "trainer.iterations=20", "trainer.budget_minutes=0.5", "trainer.budget_probe=2",
    # a progressive SDE window written for the 20 nominal iterations: one step later every 6, staying on the last step
    "sampling.window.strategy=progressive", "sampling.window.size=1", "sampling.window.start=0", "sampling.window.shift_every=6",
    "sampling.window.at_end=clamp",
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
    monkeypatch.setattr(run_manager, "time", SimpleNamespace(perf_counter=c.perf_counter))
    return c


def slowed(trainer: Trainer, clock: FakeClock, seconds, fail_at: int | None = None) -> Trainer:
    """Each iteration's rollout takes `seconds` (or `seconds(iteration)`) on the fake clock; `fail_at`
    crashes that iteration."""
    collect = trainer.rollout.collect

    def slow(iteration):
        if iteration == fail_at:
            raise RuntimeError("killed")
        clock.now += seconds(iteration) if callable(seconds) else seconds
        return collect(iteration)

    trainer.rollout.collect = slow
    return trainer


def timed_only(trainer: Trainer, clock: FakeClock, seconds, grid_s: float, checkpoint_s: float) -> list[float]:
    """The loop as it is, but each iteration only moves the fake clock by `seconds(iteration)` and
    reports its learning rate (hundreds of them in no time); a sample grid takes `grid_s`, a
    checkpoint (written for real) `checkpoint_s`. Returns the clock at the end of every iteration."""
    ends, save = [], trainer.save

    def iteration():
        clock.now += seconds(trainer.iteration)
        row = {"iteration": trainer.iteration, "lr": trainer.optimizer.param_groups[0]["lr"],
               "time_iteration": seconds(trainer.iteration)}
        trainer.iteration += 1
        ends.append(clock.now)
        return row

    def grid(name):
        clock.now += grid_s

    def checkpoint():
        clock.now += checkpoint_s
        return save()

    trainer.train_iteration, trainer.save_samples, trainer.save = iteration, grid, checkpoint
    return ends


def budget_cfg(tiny_sd3_dir, *extra):
    return load_config("tiny_jpeg", [*BUDGET, f"model.path={tiny_sd3_dir}", *extra])


def test_plan_iterations_divides_what_is_left_of_the_budget():
    # 100 s budget, 3 % margin: 97 s; 10 s gone on 2 iterations; 87 s / 3 s = 29 more
    assert plan_iterations(100, 10, 2, 3.0) == 31
    assert plan_iterations(100, 10, 2, 3.0, overhead_per_iteration=1.0) == 2 + 87 // 4
    assert plan_iterations(100, 10, 2, 3.0, reserve_s=6) == 2 + 81 // 3
    assert plan_iterations(100, 200, 7, 3.0) == 7  # over budget already: no more than done
    measured = Measured()
    measured.add_iteration(5.0)
    assert measured.seconds_per_iteration() == 5.0
    for seconds in (2.0, 4.0):
        measured.add_iteration(seconds)
    assert measured.seconds_per_iteration() == 3.0  # the warm-up iteration is left out
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


def test_plan_count_is_capped_at_the_nominal_count_unless_it_fills_the_budget():
    measured = Measured()
    for seconds in (4.0, 2.0, 2.0):  # the first is warm-up: 2 s per iteration
        measured.add_iteration(seconds)
    # 100 s less 3 %: 97 s; 8 s gone on 3 iterations, 89 s / 2 s = 44 more: 47 fit
    assert plan_count(100, 8, 3, 20, measured, sample_every=0, checkpoint_every=0, cap=False) == 47
    assert plan_count(100, 8, 3, 20, measured, sample_every=0, checkpoint_every=0) == 20  # capped: trainer.iterations
    assert plan_count(100, 8, 3, 60, measured, sample_every=0, checkpoint_every=0) == 47  # the cap only binds above the fit
    assert plan_count(100, 200, 3, 20, measured, sample_every=0, checkpoint_every=0, cap=False) == 3  # never below done


@pytest.mark.parametrize("planned", [21, 50, 137, 400])
def test_a_plan_past_the_nominal_count_stretches_the_clock_onto_it(planned):
    nominal = 20
    for probe in (0, 2, 5):  # a plan before any iteration ran, or after a probe on the nominal clock
        plan = SchedulePlan(nominal=nominal, planned=nominal)
        plan.replan(probe, planned, 1.0, 0.0)
        progress, steps = [plan.progress(i) for i in range(planned)], [plan.step(i) for i in range(planned)]
        assert progress[:probe] == list(range(probe))  # the probe ran on the nominal clock
        assert progress[0] == 0 and progress[-1] == nominal - 1 and steps[-1] == nominal - 1
        assert all(b > a for a, b in zip(progress, progress[1:]))  # monotone, slower than the iterations
        assert all(b - a <= 1 for a, b in zip(progress[probe:], progress[probe + 1:]))
        assert steps == [math.floor(p) for p in progress] and set(steps) == set(range(nominal))  # every step, none skipped
    # a re-plan past the nominal count keeps the clock of what ran, and a later shrink still ends on the last step
    plan = SchedulePlan(nominal=nominal, planned=nominal)
    plan.replan(2, planned, 1.0, 0.0)
    before = [plan.progress(i) for i in range(10)]
    plan.replan(10, planned + 30, 1.0, 0.0)
    assert [plan.progress(i) for i in range(10)] == before and plan.progress(planned + 29) == nominal - 1
    plan.replan(15, 16, 1.0, 0.0)  # slowed down: one more iteration, the clock jumps to its end without a step back
    assert plan.progress(15) == nominal - 1 and plan.progress(14) <= plan.progress(15)


@pytest.mark.parametrize("bad", ["trainer.budget_minutes=-1", "trainer.budget_minutes=nan", "trainer.budget_minutes=inf",
                                 "trainer.budget_probe=0"])
def test_budget_fields_are_checked(tiny_sd3_dir, bad):
    with pytest.raises(ConfigError, match=bad.split("=")[0]):
        budget_cfg(tiny_sd3_dir, bad)


def test_the_default_preset_fills_its_budget_and_a_fixed_count_needs_no_more_than_its_budget_off(tiny_sd3_dir):
    assert load_config("default").trainer.budget_fill
    assert not budget_cfg(tiny_sd3_dir, "trainer.budget_minutes=0").trainer.budget_fill  # off by default
    assert load_config("default", ["trainer.budget_minutes=0"]).trainer.budget_minutes == 0  # budget_fill then plans nothing


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


def test_a_new_plan_keeps_the_clock_of_the_iterations_that_ran():
    plan = SchedulePlan(nominal=270, planned=270)
    clocks = []
    # the probe's plan at 5, then the machine speeds up (190), then slows down (150), then a plan that keeps the count
    for made_at, planned in ((5, 152), (40, 190), (100, 150), (120, 150)):
        before = [plan.progress(i) for i in range(made_at)]
        plan.replan(made_at, planned, 10.0, 0.0)
        assert [plan.progress(i) for i in range(made_at)] == before  # what ran keeps its clock
        # no jump: the next iteration moves on at the new rate, which ends the nominal range at the last planned one
        rate = (269 - before[-1]) / (planned - made_at)
        assert plan.progress(made_at) - before[-1] == pytest.approx(rate)
        clocks.append([plan.progress(i) for i in range(planned)])
    progress, steps = clocks[-1], [plan.step(i) for i in range(150)]
    assert progress[:5] == [0, 1, 2, 3, 4] and progress[-1] == 269 and steps[-1] == 269  # the probe ran on the nominal clock
    assert all(b > a for a, b in zip(progress, progress[1:])) and steps == [math.floor(p) for p in progress]
    assert clocks[-1] == clocks[-2]  # the same count again: the same clock
    # a plan of the whole nominal count is the identity, exactly
    identity = SchedulePlan(nominal=270, planned=270)
    identity.replan(5, 270, 1.0, 0.0)
    assert all(identity.step(i) == i and identity.progress(i) == i for i in range(270))
    # a plan recorded before re-planning (no history) still maps from iteration 0, and later plans go on from it
    old = SchedulePlan.from_state({"nominal": 270, "planned": 152, "fixed": True, "seconds_per_iteration": 10.0, "budget_minutes": 28})
    assert [old.progress(i) for i in range(60)] == [i * 269 / 151 for i in range(60)]
    old.replan(60, 180, 8.6, 600.0)
    assert old.progress(59) == 59 * 269 / 151 and old.progress(179) == 269


@pytest.mark.parametrize("checkpoint_every", [10, 0], ids=["at-checkpoints", "no-checkpoints"])
@pytest.mark.parametrize("probe_s, after_s", [(0.5, 0.3125), (0.3125, 0.5)], ids=["faster", "slower"])
def test_re_planning_ends_the_run_within_5_percent_of_its_budget(tmp_path, tiny_sd3_dir, clock, probe_s, after_s,
                                                                 checkpoint_every):
    # a 30 s budget for at most 1000 iterations; the machine changes speed after the 5-iteration probe. Without
    # periodic checkpoints the loop plans again at every tenth of its plan
    cfg = budget_cfg(tiny_sd3_dir, "trainer.iterations=1000", "trainer.budget_probe=5",
                     f"run.checkpoint_every={checkpoint_every}", "run.sample_every=10")
    trainer = Trainer(cfg, tmp_path / "run")
    ends = timed_only(trainer, clock, lambda i: 1.0 if i == 0 else probe_s if i < 5 else after_s, grid_s=0.25,
                      checkpoint_s=0.125)
    rows = trainer.train()
    budget, used = 30.0, clock.now - trainer.started
    assert 0.95 * budget <= used <= budget
    assert len(rows) == trainer.plan.planned == json.loads((tmp_path / "run" / "plan.json").read_text())["planned"]
    # the one-shot plan from the probe would have ended far from the budget (the code before re-planning did)
    first = trainer.plan.history[0]
    assert first["iteration"] == 5 and first["seconds_per_iteration"] == probe_s
    one_shot_end = ends[min(first["planned"], len(ends)) - 1] + max(0, first["planned"] - len(ends)) * after_s
    assert not 0.95 * budget <= one_shot_end - trainer.started <= budget
    # the linear decay, written for 1000 iterations, fell at every iteration and ended where it would have
    lrs = [r["lr"] for r in rows]
    assert all(b < a for a, b in zip(lrs, lrs[1:])) and lrs[-1] == pytest.approx(1e-3 * lr_factor("linear", 999, 1000))


@pytest.mark.slow
def test_resume_repeats_the_recorded_plans_and_the_uninterrupted_run(tmp_path, tiny_sd3_dir, clock):
    straight, stopped, slow = tmp_path / "straight", tmp_path / "stopped", tmp_path / "slow"
    speed = lambda i: 2.5 if i < 4 else 1.25  # noqa: E731  the machine speeds up after the probe
    cfg = budget_cfg(tiny_sd3_dir, "run.checkpoint_every=3")
    slowed(Trainer(cfg, straight), clock, speed).train()
    plans = json.loads((straight / "plan.json").read_text())["history"]
    assert [p["planned"] for p in plans] == [11, 11, 14, 16, 17, 18] and len(run_metrics(straight)) == 18
    with pytest.raises(RuntimeError, match="killed"):
        slowed(Trainer(cfg, stopped), clock, speed, fail_at=7).train()
    assert len(run_metrics(stopped)) == 7  # iterations 0-6 logged, the checkpoint at 6
    shutil.copytree(stopped, slow)
    resumed = slowed(Trainer(cfg, stopped, resume=True), clock, speed)
    assert resumed.iteration == 6 and resumed.plan.history == plans[:3] and resumed.plan.planned == 14
    resumed.train()  # its plans at 9, 12 and 15 are its own, from the same measurements: the same plans
    assert json.loads((stopped / "plan.json").read_text())["history"] == plans
    assert run_metrics(stopped) == run_metrics(straight)
    a, b = trainable(straight, 18), trainable(stopped, 18)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # on a machine four times slower the plans up to the checkpoint hold; the next one, from its own speed, ends the run
    resumed = slowed(Trainer(cfg, slow, resume=True), clock, 5.0)
    assert resumed.plan.history == plans[:3] and resumed.plan.planned == 14
    assert len(resumed.train()) == 9 and resumed.plan.history[:3] == plans[:3]
    assert [(p["iteration"], p["planned"]) for p in resumed.plan.history[3:]] == [(9, 9)]


def test_a_fast_machine_trains_trainer_iterations_and_no_more(tmp_path, tiny_sd3_dir, clock):
    # 0.5 s per iteration would fit 58 in the budget: the count stays at trainer.iterations, the schedule as written
    cfg = budget_cfg(tiny_sd3_dir, "run.checkpoint_every=0", "trainer.iterations=6")
    trainer = slowed(Trainer(cfg, tmp_path / "run"), clock, 0.5)
    assert len(trainer.train()) == 6 and trainer.plan.planned == 6
    assert [r["lr"] for r in run_metrics(tmp_path / "run")] == pytest.approx([1e-3 * (1 - i / 6) for i in range(6)])


def test_budget_fill_trains_past_trainer_iterations_with_the_schedules_stretched(tmp_path, tiny_sd3_dir, clock):
    # the same fast machine as above, 2.5 s per iteration: 11 iterations fit the 30 s budget, past the 6 written; the
    # linear decay and the progressive window (one step later every 2 nominal iterations) are stretched onto all 11
    cfg = budget_cfg(tiny_sd3_dir, "run.checkpoint_every=0", "trainer.iterations=6", "trainer.budget_fill=true",
                     "sampling.window.shift_every=2")
    trainer = slowed(Trainer(cfg, tmp_path / "run"), clock, 2.5)
    history = trainer.train()
    assert len(history) == trainer.plan.planned == math.floor(0.97 * 30 / 2.5) == 11
    record = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (record["planned"], record["nominal"]) == (11, 6)
    assert trainer.iteration == 11 and (tmp_path / "run" / "checkpoints" / "iter_000011").is_dir()  # the last checkpoint
    lrs = [r["lr"] for r in run_metrics(tmp_path / "run")]
    # the probe on the nominal clock, then the rest falling slower, to the decay's last value at the last planned iteration
    assert lrs[:2] == pytest.approx([1e-3, 1e-3 * 5 / 6]) and lrs[-1] == pytest.approx(1e-3 * lr_factor("linear", 5, 6))
    assert all(b < a for a, b in zip(lrs, lrs[1:]))
    starts = [training_spec(cfg, i, trainer.policy, trainer.plan).trained_steps()[0] for i in range(11)]
    assert starts[0] == 0 and starts[-1] == 2 and starts == sorted(starts)  # step 5 // 2 at the last, as written


def test_budget_fill_keeps_the_max_minutes_backstop(tmp_path, tiny_sd3_dir, clock):
    # 0.5 s per iteration fills the 30 s budget with about 58 iterations; trainer.max_minutes (15 s) stops the run first
    cfg = budget_cfg(tiny_sd3_dir, "run.checkpoint_every=0", "trainer.iterations=6", "trainer.budget_fill=true",
                     "trainer.max_minutes=0.25")
    trainer = Trainer(cfg, tmp_path / "run")
    timed_only(trainer, clock, lambda i: 0.5, grid_s=0.0, checkpoint_s=0.0)
    rows = trainer.train()
    assert trainer.plan.planned > 50 and len(rows) == 30 < trainer.plan.planned


@pytest.mark.parametrize("fill", ["false", "true"])
def test_without_a_budget_the_run_is_what_it_was(tmp_path, tiny_sd3_dir, clock, fill):
    cfg = budget_cfg(tiny_sd3_dir, "trainer.budget_minutes=0", "run.checkpoint_every=0", "trainer.iterations=3",
                     f"trainer.budget_fill={fill}")
    trainer = slowed(Trainer(cfg, tmp_path / "run"), clock, 100.0)
    assert len(trainer.train()) == 3 and not (tmp_path / "run" / "plan.json").exists()


def test_a_filling_run_that_ends_within_its_probe_trains_its_iterations(tmp_path, tiny_sd3_dir, clock):
    # the plan is made after budget_probe (4) iterations: a run of 3 ends first, unplanned, whatever fits the budget
    cfg = budget_cfg(tiny_sd3_dir, "run.checkpoint_every=0", "trainer.iterations=3", "trainer.budget_fill=true",
                     "trainer.budget_probe=4")
    trainer = slowed(Trainer(cfg, tmp_path / "run"), clock, 0.5)
    assert len(trainer.train()) == 3 and trainer.plan.planned == 3
    assert [r["lr"] for r in run_metrics(tmp_path / "run")] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])
