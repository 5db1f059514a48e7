"""The one training loop: `experience = rollout.collect(iteration)`, `stats = objective.update(experience)`,
log, checkpoint (docs/architecture.md).

The loop owns what every run shares: the accelerator, the policy and its optimizer, the EMA,
the learning-rate schedule, the run directory, sample grids, checkpoints and resume, and the
iteration counter. `rollout.kind` and `objective.kind` pick the registered parts
(flowrl/train/rollouts, flowrl/train/objectives); the loop never looks at their names. Every
random draw is keyed by (seed, iteration, sample, step), so a resumed run repeats an
uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl.core.seeds import sample_seed
from flowrl.errors import UserError
from flowrl.models import load_policy
from flowrl.models.compile import CompileWatch
from flowrl.runtime.budget import cross_marks, pending_marks
from flowrl.runtime.ema import EMA
from flowrl.runtime.optimizers import build_optimizer, optimizer_class
from flowrl.runtime.run_dir import default_run_dir
from flowrl.runtime.run_manager import RunManager
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import Config
from flowrl.train.experience import Experience
from flowrl.train.image_producer import image_producer
from flowrl.train.images import log_grid, save_grid, with_sources
from flowrl.train.metrics import iteration_row
from flowrl.train.monitor.watch import Monitor, held_out_prompts, monitor_evaluate, monitor_saved, monitor_start
from flowrl.train.parts import TrainContext
from flowrl.train.prompts import eval_prompts, load_prompts, prompt_set
from flowrl.train.registry import add_adapter, check_async_processes, objective_class, rollout_class
from flowrl.train.sharding import launch_image_run, reference_copy
from flowrl.train.trainer_state import restore_trainer, save_trainer
from rewards import AsyncRewardRunner, MultiReward


def flat_config(cfg: Config) -> dict:
    """Scalars only, for trackers (tensorboard's hparams cannot hold lists)."""
    from omegaconf import OmegaConf

    out = {}

    def walk(prefix, node):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg)))
    return out


class Trainer(RunManager):
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, resume: bool = False, rewards: dict | None = None):
        self.start_clock(cfg.trainer)  # a wall-clock budget counts from here
        self.cfg, self.rewards = cfg, rewards
        self.grid_every = cfg.run.sample_every
        self.accelerator, self.run, self.mixed_precision, self.layout = launch_image_run(cfg, run_dir or default_run_dir(cfg))
        try:
            self._build(cfg, resume, rewards)
        except BaseException:  # a refused resume or a bad model: the process group made for it goes too
            self.layout.close()
            raise

    def _build(self, cfg: Config, resume: bool, rewards: dict | None) -> None:
        t, acc = cfg.trainer, self.accelerator
        rollout_cls, objective_cls = rollout_class(cfg.rollout.kind), objective_class(cfg.objective.kind)
        check_async_processes(cfg, acc.num_processes)  # a multi-GPU launch: its count is known only now
        self.prompts = load_prompts(cfg.data) if rollout_cls.needs_prompts else list(cfg.data.prompts)
        self.eval_prompts = eval_prompts(cfg.data, self.prompts)
        d = cfg.data
        self.allocator = cfg.allocator.build(len(self.prompts), d.prompts_per_iteration, d.group_size, t.seed)

        optimizer_class(t.optimizer)  # a missing bitsandbytes is named before the model loads, not after
        # model.text_encoders cached: the prompts and eval prompts encoded once, the encoders then off the GPU
        self.policy = load_policy(cfg.model, device=acc.device, prompts=prompt_set(cfg.data, self.prompts, held_out_prompts(cfg)))
        if cfg.lora.enabled:
            add_adapter(self.policy, cfg)
        else:
            if t.kl_beta > 0:  # no adapter to disable: the KL's reference is a frozen copy of the network as loaded
                self.policy.set_reference_network(reference_copy(self.policy.transformer))
            self.policy.enable_full_finetune()
        self.layout.shard(self.policy)  # fsdp2: the weights become shards, so the optimizer is built after
        self.params = self.policy.named_trainable_parameters()
        self.optimizer = self.layout.prepare(self.policy, build_optimizer(self.params.values(), t))
        # model.compile: in place, after the adapter and accelerate's wrapper; forwards then run on sampling.batch_size rows
        self.policy.compile(cfg.model.compile, cfg.sampling.batch_size)
        self.compile_watch = CompileWatch() if cfg.model.compile != "none" else None
        self.ema = EMA(self.params, t.ema_decay) if t.ema else None
        if cfg.reward.placement == "ray" and acc.num_processes > 1:
            raise UserError("reward.placement ray runs beside one trainer process; launch one, or set reward.placement: inline")
        self.join_cluster()  # run.cluster ray: before reward.placement ray puts the reward models on it
        self.reward_fn = MultiReward.from_config(cfg.reward, rewards=rewards) if rollout_cls.needs_rewards else None
        self.reward_runner = AsyncRewardRunner(self.reward_fn, max_workers=self.reward_fn.concurrency if self.reward_fn else 1)
        ctx = TrainContext(cfg=cfg, accelerator=acc, policy=self.policy, params=self.params, prompts=self.prompts,
                           reward_fn=self.reward_fn, reward_runner=self.reward_runner, allocator=self.allocator,
                           optimizer_step=self.optimizer_step, optimizer=self.optimizer, objective_needs=objective_cls.needs,
                           plan=self.plan)
        self.objective = objective_cls(ctx)
        self.rollout = rollout_cls(ctx)
        # monitor.enabled: gold rewards and image statistics on fixed prompts, with rules that act (docs/monitor.md)
        self.monitor = Monitor(cfg, rewards, encoders=self.reward_fn.fns.values() if self.reward_fn else ()) if cfg.monitor.enabled else None
        self.start_run(resume)
        if cfg.run.tracker != "none":
            acc.init_trackers("tracker", config=flat_config(cfg))

    # ---- one iteration ------------------------------------------------------------------
    def train_iteration(self) -> dict:
        t0 = time.perf_counter()
        self.policy.transformer.eval()
        experience, timing = self.next_experience()
        t_collected = time.perf_counter()
        self.skipped_steps = 0
        stats = self.objective.update(experience)
        if self.producer is not None:  # the producer's next batches sample with what this update left
            with self.objective.behaviour_weights():
                self.producer.publish(self.params, self.iteration + 1)
        t_updated = time.perf_counter()
        row = iteration_row(experience, stats, self.reward_fn, self.prompts)
        row["skipped_steps"] = self.skipped_steps
        row.update(time_sampling=t_collected - t0, time_training=t_updated - t_collected, **timing)
        self.iteration += 1
        row["time_iteration"] = time.perf_counter() - t0
        if self.monitor is not None and self.monitor.due(self.iteration):  # after time_iteration: its cost is its own column
            row.update(monitor_evaluate(self, row))
        if self.compile_watch is not None:  # graphs compiled in this iteration: 0 after the first, or one warning line
            say = tqdm.write if self.accelerator.is_main_process else None
            row["compiled_graphs"] = self.compile_watch.after_iteration(self.iteration - 1, say)
        return row

    def next_experience(self) -> tuple[Experience, dict]:
        """This iteration's experience, sampled here or taken from the producer (run.async_rollouts,
        with the metrics columns of its timing)."""
        if not self.cfg.run.async_rollouts:
            with self.objective.behaviour_weights(), self.layout.gathered():  # behaviour weights first: they swap shards
                return self.rollout.collect(self.iteration), {}
        batch, staleness, timing = self.take_batch()
        acc = self.accelerator
        if acc.num_processes > 1:  # drawn whole by the producer: this process trains its share
            batch = self.rollout.split(batch, acc.num_processes, acc.process_index)
        experience = self.rollout.experience(batch)
        experience.staleness = staleness
        return experience, timing

    def producer_start(self):
        """run.async_rollouts: the producer builds the policy as this trainer did and samples with
        the objective's behaviour weights (NFT's and DGPO's old copies where they sample)."""
        with self.objective.behaviour_weights():
            weights = {k: v.detach().clone() for k, v in self.params.items()}
        return functools.partial(image_producer, self.cfg, self.allocator.state_dict(), self.rewards), weights

    # ---- what the run manager asks of the image trainer (flowrl/runtime/run_manager.py) ------
    def clip_grad_norm(self) -> float:
        return self.layout.clip_grad_norm(list(self.params.values()), self.cfg.trainer.max_grad_norm)

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update(self.params)

    def before_loop(self) -> None:
        if self.monitor is not None:
            monitor_start(self)
        if self.iteration == 0 and self.cfg.run.sample_every:
            t0 = self.now()
            self.save_samples("iter_000000_before")
            self.measured.add_grid(self.now() - t0)
        self.marks = pending_marks(self.cfg.run.checkpoint_at_minutes, self.history)

    def mark(self, row: dict) -> bool:
        crossed = cross_marks(row, self.marks, self.started)
        return crossed or (self.monitor is not None and self.monitor.best_pending)  # a new best gets its checkpoint now

    def log(self, row: dict) -> None:
        self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "iteration"}, step=row["iteration"])

    def before_checkpoint(self, done: bool) -> None:
        every = self.cfg.run.sample_every
        if every and (self.iteration % every == 0 or done):
            t0 = self.now()
            self.save_samples(f"iter_{self.iteration:06d}")
            self.measured.add_grid(self.now() - t0)

    def finish(self) -> None:
        self.rollout.close()
        self.reward_runner.close()
        self.accelerator.end_training()
        self.layout.close()

    def release(self) -> None:
        if self.reward_fn is not None:
            self.reward_fn.close()  # reward.placement ray: the reward workers stop with the run

    # ---- outputs ------------------------------------------------------------------------
    def eval_spec(self) -> SamplerSpec:
        s = self.cfg.sampling
        return SamplerSpec.ode(self.policy.sigmas(s.eval_num_steps, s.schedule, s.shift))

    @torch.no_grad()
    def save_samples(self, name: str, seeds_per_prompt: int = 2) -> Path | None:
        """A grid of ODE samples on the eval prompts (EMA weights when enabled), drawn by rank 0;
        under fsdp2 every process takes part in gathering the weights."""
        main = self.accelerator.is_main_process
        if not (main or self.layout.sharded) or not self.eval_prompts:
            return None
        prompts = [p for p in self.eval_prompts for _ in range(seeds_per_prompt)]
        seeds = [sample_seed(self.cfg.trainer.seed, -1, j % seeds_per_prompt) for j in range(len(prompts))]
        with self.ema.swapped_in(self.params) if self.ema is not None else contextlib.nullcontext(), self.layout.gathered():
            if not main:
                return None
            traj = rollout(self.policy, prompts, seeds, self.eval_spec(), self.cfg.sampling.batch_size)
            images = self.policy.decode(traj.final)
        captions, columns = list(prompts), seeds_per_prompt * 2
        if self.policy.edits:  # each edit's source opens its samples
            images, captions = with_sources(images, prompts, [p.instruction for p in prompts], seeds_per_prompt)
            columns = (seeds_per_prompt + 1) * 2
        path = save_grid(images, self.run.samples / f"{name}.png", columns=columns, captions=captions)
        log_grid(self.accelerator, self.cfg.run.tracker, path, self.iteration)  # the tracker's pictures beside its curves
        return path

    def save(self) -> Path | None:
        """A checkpoint of everything a resume needs, with the user-facing exports
        (flowrl/train/trainer_state.py)."""
        path = save_trainer(self)
        if self.monitor is not None:
            monitor_saved(self, path)
        return path

    def restore(self, ckpt: Path, data: dict) -> None:
        """Weights, optimizer, EMA and objective state (flowrl/train/trainer_state.py)."""
        restore_trainer(self, ckpt, data)
        if self.monitor is not None and data["state"].get("monitor"):
            self.monitor.load_state_dict(data["state"]["monitor"])

    def closing_notes(self) -> list[str]:
        return self.monitor.summary() if self.monitor is not None else []
