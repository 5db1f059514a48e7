"""What the image and the text trainer share (flowrl/train/loop.py, flowrl/text/train.py), written
once: the run directory's start (a fresh run refuses a directory that already holds one), resume
(the latest checkpoint restored, or the run trained again in place when it has none), the outer
loop (progress bar, metrics rows, trainer.max_minutes on rank 0's clock, a checkpoint every
run.checkpoint_every iterations and at the end), the learning rate set from the iteration alone,
and the non-finite step policy (a step whose gradient norm is NaN or inf is skipped;
trainer.max_skipped_steps of them in a row stop the run). With run.async_rollouts, the producer
process beside the loop: started from the trainer's `producer_start`, its batches taken with
their staleness, closed however the loop ends.

And the wall-clock budget (flowrl/runtime/budget.py): with trainer.budget_minutes the loop times
its first trainer.budget_probe iterations, plans the iteration count that fits (at most
trainer.iterations, or with trainer.budget_fill as many as fill the budget), plans again at every
checkpoint, and maps the iterations onto the schedules' nominal clock; the plans, the budget's
clock and what it measured go into every checkpoint. The loop, its progress bar and its last
checkpoint end at the plan's count, never at trainer.iterations itself.

A trainer calls `start_clock` first (the budget counts from there), sets `cfg`, `accelerator`,
`run`, `params`, `optimizer` and `allocator`, then calls `start_run`; it writes `train_iteration`
(one row of metrics), `save` and `restore` (its own part of a checkpoint, with `budget_state` in
the checkpoint's state), and may fill the loop's hooks (the image trainer's marks and sample grids).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from flowrl.core.lr_schedule import lr_factor, warmup_factor
from flowrl.errors import UserError
from flowrl.runtime.budget import Measured, SchedulePlan, replan, write_plan
from flowrl.runtime.checkpoint import latest_checkpoint, load_checkpoint, restore_rng
from flowrl.runtime.processes import rank0
from flowrl.runtime.producers import RolloutProducer, replay


class RunManager:
    progress_label = "flowrl train"
    progress_columns = ("reward_mean", "kl")  # the metrics the progress bar shows, where a row has them
    grid_every = 0  # iterations between sample grids, which the budget plans for (the image trainer's run.sample_every)
    stop_reason: str | None = None  # set by a trainer's check (the monitor's stop): the loop ends with a checkpoint
    # a checkpoint redraws reward_curve.png at most this often, and always at the run's end: a draw costs about 0.1 s
    # (matplotlib's layout and PNG), which short runs with a checkpoint every iteration paid at each one
    curve_every_s = 60.0
    curve_drawn_at = -math.inf

    def start_clock(self, trainer_cfg) -> None:
        """The budget's clock starts here (a resume: from the checkpoint's count). The plan is fixed
        at the start without a budget; with one, after the probe iterations (or from the
        checkpoint), then planned again at every checkpoint from what `measured` holds."""
        t = trainer_cfg
        if t.threads:
            torch.set_num_threads(t.threads)
        self.started = self.now()
        self.plan = SchedulePlan(nominal=t.iterations, planned=t.iterations, fixed=not t.budget_minutes,
                                 budget_minutes=t.budget_minutes)
        self.measured = Measured()

    def start_run(self, resume: bool) -> None:
        """Iteration 0, or the latest checkpoint's state under `resume`; then the run directory
        shows the config in force (on resume too)."""
        self.iteration = 0
        self.history: list[dict] = []
        self.skipped_steps, self.skipped_in_a_row = 0, 0  # optimizer steps skipped for a non-finite gradient norm
        self.stop_reason = None
        if resume:
            self.resume()
        elif self.run.metrics_file.exists():
            raise UserError(f"run directory '{self.run.path}' already holds a run; resume it with --resume {self.run.path} "
                            "or choose another run.name")
        if self.accelerator.is_main_process:
            self.run.create(self.cfg)
        self.accelerator.wait_for_everyone()

    # ---- the loop ---------------------------------------------------------------------
    def now(self) -> float:
        """The loop's clock, in seconds (what trainer.max_minutes and a wall-clock budget count)."""
        return time.perf_counter()

    def planned_iterations(self) -> int:
        return self.plan.planned

    def train(self) -> list[dict]:
        """The loop; with run.async_rollouts, beside a producer process that samples ahead."""
        try:
            if self.cfg.run.async_rollouts:
                self.join_cluster()
                self.start_producer()
            return self.loop()
        finally:
            if self.producer is not None:
                self.producer.close()
                self.producer = None
            self.release()
            if self.ray_started:
                from flowrl.runtime.ray_cluster import leave_cluster

                leave_cluster()
                self.ray_started = False

    def loop(self) -> list[dict]:
        acc, r, t = self.accelerator, self.cfg.run, self.cfg.trainer
        self.bar = bar = tqdm(total=self.planned_iterations(), initial=self.iteration, desc=self.progress_label, unit="iter",
                              disable=not (r.progress and acc.is_local_main_process))
        self.before_loop()
        started, out_of_time = self.now(), False
        while self.iteration < self.planned_iterations() and not out_of_time and self.stop_reason is None:
            t0 = self.now()
            self.set_lr()
            row = self.train_iteration()
            marked = self.mark(row)
            self.history.append(row)
            self.log(row)
            if acc.is_main_process:
                self.run.append_metrics(row)
            bar.update(1)
            bar.set_postfix({k: f"{row[k]:.4g}" for k in self.progress_columns if k in row})
            if t.max_minutes:  # every process calls the broadcast, so all agree with rank 0's clock
                out_of_time = bool(rank0(self.now() - started >= t.max_minutes * 60))
            self.after_iteration(self.now() - t0, out_of_time)
            done = self.iteration >= self.planned_iterations() or out_of_time or self.stop_reason is not None
            self.before_checkpoint(done)
            if done or marked or (r.checkpoint_every and self.iteration % r.checkpoint_every == 0):
                self.checkpoint(done)
        bar.close()
        self.finish()
        return self.history

    # ---- run.async_rollouts (flowrl/runtime/producers.py) ------------------------------
    producer = None  # a RolloutProducer, or with run.cluster ray a RayProducer (flowrl/runtime/ray_rollouts.py)
    ray_started = False  # run.cluster ray: this process started the cluster, and shuts it down when the run ends

    def join_cluster(self) -> None:
        """run.cluster ray: join the cluster (or start one on this machine) before anything is placed
        on it: the rollout workers, and the image trainer's reward workers. The first trainer
        process is the driver; the others hold no Ray connection."""
        if self.cfg.run.cluster == "ray" and self.accelerator.is_main_process and not self.ray_started:
            from flowrl.runtime.ray_cluster import connect

            self.ray_started = connect(self.cfg.run.ray)

    def producer_start(self) -> tuple[Callable[[], object], dict]:
        """What a producer process builds its collector with (called there), and the weights it
        samples with now, by name."""
        raise NotImplementedError

    def start_producer(self) -> None:
        """A producer from this iteration, the weights as they are now, the allocator as it is now: a
        process on this machine, where on a CPU each side takes trainer.threads threads (half the
        cores when that is 0), or Ray actors (run.cluster ray). With several trainer processes the
        first one holds the producers and hands every batch to the others."""
        if not self.accelerator.is_main_process:
            return
        r = self.cfg.run
        build, weights = self.producer_start()
        if r.cluster == "ray":
            from flowrl.runtime.ray_rollouts import RayProducer

            self.producer = RayProducer(build, weights, r.max_staleness, self.iteration, r.ray, self.cfg.trainer.threads)
            return
        cpu = self.accelerator.device.type == "cpu"
        threads = self.cfg.trainer.threads
        if not threads and cpu:
            threads = max(1, (os.cpu_count() or 2) // 2)
            torch.set_num_threads(threads)
        # no fork once CUDA or a process group has started here (their threads' locks would be copied held)
        fork = cpu and self.accelerator.num_processes == 1
        self.producer = RolloutProducer(build, weights, r.max_staleness, self.iteration, threads, r.producers, r.producer_devices,
                                        fork=fork)

    def take_batch(self) -> tuple[object, int, dict]:
        """This iteration's batch from the producer, its staleness (updates since the weights that
        drew it) and the metrics columns of its timing; the allocator takes the producer's state."""
        batch = self.producer.take(self.iteration) if self.accelerator.num_processes == 1 else self.shared_batch()
        replay(self.allocator, batch.state)  # the checkpoints hold the allocator as the producer(s) left it
        staleness = self.iteration - batch.version
        row = {"staleness": staleness, "time_producer_idle": batch.producer_idle_s, "time_producer_busy": batch.producer_busy_s,
               "time_trainer_wait": batch.trainer_wait_s}
        if self.cfg.run.cluster == "ray":  # weights by version: what the last update put in the object store, what this batch fetched
            row.update({"weights_published_bytes": getattr(self.producer, "publish_bytes", 0),
                        "time_weights_publish": getattr(self.producer, "publish_s", 0.0),
                        "weights_fetched_bytes": batch.weights_bytes, "time_weights_fetch": batch.weights_fetch_s})
        return batch.experience, staleness, row

    def shared_batch(self):
        """Several trainer processes: the first takes the batch from the producers, and every process
        gets it (or the producers' failure, which each then raises)."""
        batch, failure = None, None
        if self.producer is not None:
            try:
                batch = self.producer.take(self.iteration)
            except UserError as exc:
                failure = str(exc)
        batch, failure = rank0((batch, failure))
        if failure is not None:
            raise UserError(failure)
        return batch

    def release(self) -> None:
        """What the trainer placed outside its process (the image trainer's reward workers), stopped
        however the run ends."""

    # the loop's hooks: the image trainer's budget, marks, trackers and sample grids
    def before_loop(self) -> None:
        pass

    def mark(self, row: dict) -> bool:
        """Whether this iteration must end with a checkpoint (its row may say why)."""
        return False

    def log(self, row: dict) -> None:
        pass

    def after_iteration(self, seconds: float, out_of_time: bool) -> None:
        """Time the iteration; with a budget, plan after the probe and again at every checkpoint (in a
        run without periodic checkpoints, at every tenth of the plan: a one-shot plan from a few probe
        iterations missed a 5-minute budget by up to 17 %)."""
        t, every = self.cfg.trainer, self.cfg.run.checkpoint_every or max(1, self.plan.planned // 10)
        self.measured.add_iteration(seconds)
        if t.budget_minutes and not out_of_time and self.iteration < self.plan.planned and (
                self.measured.iterations >= t.budget_probe if not self.plan.fixed else self.iteration % every == 0):
            self.replan()  # before the checkpoint, which records it
            self.bar.total = self.plan.planned
            self.bar.refresh()

    def replan(self) -> None:
        """Plan the iteration count that fits trainer.budget_minutes again (flowrl/runtime/budget.py, `replan`)."""
        self.plan.budget_minutes = self.cfg.trainer.budget_minutes  # a resume may change it
        replan(self.plan, self.measured, self.iteration, self.now() - self.started,
               self.run.path if self.accelerator.is_main_process else None, self.grid_every, self.cfg.run.checkpoint_every,
               fill=self.cfg.trainer.budget_fill)

    def before_checkpoint(self, done: bool) -> None:
        pass

    def checkpoint(self, done: bool) -> None:
        """The trainer's checkpoint (`save`), then the run's reward curve redrawn (rank 0, which holds the metrics)
        at the run's last checkpoint and at others `curve_every_s` or more after its last draw."""
        t0 = self.now()
        self.save()
        if self.accelerator.is_main_process and (done or t0 - self.curve_drawn_at >= self.curve_every_s):
            self.run.plot_reward_curve(self.run.read_metrics())
            self.curve_drawn_at = t0
        self.measured.add_checkpoint(self.now() - t0)

    def finish(self) -> None:
        pass

    def closing_notes(self) -> list[str]:
        """What the closing line says besides the rewards (the image trainer's monitor: what fired, and when)."""
        return []

    def closing_line(self) -> str:
        """What `flowrl train` ends with (rank 0, which holds the metrics file): the mean training
        reward of the run's first and last tenth of iterations, resumed parts included. Single
        iterations draw different prompts, so first-against-last single rows read as noise. It ends
        with the command that evaluates the run."""
        rows = [r for r in self.run.read_metrics() if "reward_mean" in r]
        evaluate = f"; evaluate it: flowrl eval --run {self.run.path}"
        notes = "".join(f"; {n}" for n in self.closing_notes())
        if not rows:
            return f"{self.iteration} iterations{notes}; run: {self.run.path}{evaluate}"
        tenth = max(1, len(rows) // 10)
        first, last = (sum(r["reward_mean"] for r in part) / tenth for part in (rows[:tenth], rows[-tenth:]))
        what = "iteration" if tenth == 1 else f"{tenth} iterations"
        return (f"mean training reward {first:.4g} over the first {what}, {last:.4g} over the last {what} "
                f"({len(rows)} iterations){notes}; run: {self.run.path}{evaluate}")

    # ---- learning rate and optimizer steps ---------------------------------------------
    def schedule_position(self) -> tuple[float, int]:
        """(iteration, total) on the learning-rate schedule's clock: a budget's plan maps the
        iterations onto the nominal count (the identity without a budget)."""
        return self.plan.progress(self.iteration), self.plan.nominal

    def set_lr(self) -> None:
        """From the iteration alone, so a resumed run sets the same (core/lr_schedule.py)."""
        t = self.cfg.trainer
        position, total = self.schedule_position()
        factor = lr_factor(t.lr_schedule, position, total) * warmup_factor(self.iteration, t.warmup_iterations)
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr * factor

    def clip_grad_norm(self) -> float:
        raise NotImplementedError

    def optimizer_step(self) -> float:
        """Clip, step, zero, `after_step`; returns the gradient norm before clipping.

        A NaN or inf anywhere in the loss or the gradients makes the norm non-finite (on every
        process alike: it is taken after the all-reduce). That step is skipped: the gradients are
        dropped, and the weights, the optimizer's moments (and the EMA) stay as they were.
        trainer.max_skipped_steps such steps in a row stop the run."""
        norm = self.clip_grad_norm()
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= self.cfg.trainer.max_skipped_steps:
                last = latest_checkpoint(self.run.checkpoints)
                raise UserError(f"iteration {self.iteration}: {self.skipped_in_a_row} optimizer steps in a row had a non-finite "
                                f"gradient norm ({norm}), so the run stopped; the last checkpoint, all finite, is "
                                f"{last if last is not None else 'none (no checkpoint yet)'}; try a lower trainer.lr")
            return norm
        self.skipped_in_a_row = 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.after_step()
        return norm

    def after_step(self) -> None:
        pass

    # ---- checkpoints and resume --------------------------------------------------------
    def save(self) -> Path | None:
        raise NotImplementedError

    def budget_state(self) -> dict:
        """The budget's part of a checkpoint's state: its plans once made, its clock and measurements."""
        out = {"plan": self.plan.to_state() if self.plan.fixed and self.plan.budget_minutes else None}
        if self.cfg.trainer.budget_minutes:
            out["budget"] = {"elapsed_s": self.now() - self.started, "measured": self.measured.to_state()}
        return out

    def restore_budget(self, state: dict) -> None:
        """The budget's plans, clock and measurements as a checkpoint recorded them."""
        if not self.cfg.trainer.budget_minutes:
            return
        if state.get("plan"):
            vars(self.plan).update(vars(SchedulePlan.from_state(state["plan"])))  # in place: the parts hold it
            if self.accelerator.is_main_process:  # plans made after the checkpoint are undone
                write_plan(self.run.path, self.plan)
        if state.get("budget"):
            self.started = self.now() - state["budget"]["elapsed_s"]
            self.measured = Measured.from_state(state["budget"]["measured"])

    def restore(self, ckpt: Path, data: dict) -> None:
        """The trainer's own part of checkpoint `ckpt` (`data`, as load_checkpoint reads it)."""
        raise NotImplementedError

    def resume(self) -> None:
        """Restore the run's latest checkpoint, or train it again in place when it has none."""
        ckpt = latest_checkpoint(self.run.checkpoints)
        if ckpt is None:  # stopped before its first checkpoint
            self.start_over()
            return
        data = load_checkpoint(ckpt)
        self.restore(ckpt, data)
        self.restore_budget(data["state"])
        if data["allocator"] is not None:
            self.allocator.load_state_dict(data["allocator"])
        restore_rng(data["rng"], data["state"]["python_random"])
        self.iteration = int(data["state"]["iteration"])
        if self.accelerator.is_main_process:
            self.history = self.run.truncate_metrics(self.iteration)
        else:
            self.history = [r for r in self.run.read_metrics() if r["iteration"] < self.iteration]

    def start_over(self) -> None:
        """`--resume` of a run that has no checkpoint yet: every draw is keyed by (seed, iteration),
        so training again from iteration 0 repeats what was lost. What the run wrote (metrics,
        sample grids) moves to RUN/restart-N first, so nothing is deleted."""
        acc, run = self.accelerator, self.run
        if acc.is_main_process:
            written = [p for p in (run.metrics_file, run.samples) if p.exists()]
            if written:
                n = 1 + sum(1 for _ in run.path.glob("restart-*"))
                backup = run.path / f"restart-{n}"
                backup.mkdir()
                for p in written:
                    p.rename(backup / p.name)
                print(f"flowrl: '{run.path}' has no checkpoint yet; training it again from iteration 0 (what it wrote "
                      f"is kept in {backup})", file=sys.stderr)
        acc.wait_for_everyone()
