"""RLVR for a causal language model (docs/text.md): each iteration the shared allocator picks
prompts and group sizes, the policy samples completions with its KV cache, the text rewards
score them against the dataset's columns, a shared advantage estimator turns them into one
advantage per completion, and the token-level clipped surrogate (flowrl/core/token_losses.py)
updates the policy (the objective chosen by loss.kind, flowrl/text/objective.py). Runs, metrics,
checkpoints and exact resume are the runtime's (flowrl/runtime), as for the image trainer.
With run.async_rollouts a producer process collects ahead of the trainer
(flowrl/runtime/producers.py) and the loss is an off-policy one (loss.off_policy).

Every draw is keyed by (seed, iteration, sample), so a resumed run repeats an uninterrupted one,
and several processes (accelerate's launcher or run.cpu_processes) train as one: each process
samples and scores its slice of every stage, the rewards are gathered so every process computes
the same allocator decisions and advantages, each trains on its own completions, and the
gradients are summed across processes before the one optimizer step.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from flowrl.core.allocation import spending_by_bucket
from flowrl.errors import UserError
from flowrl.runtime.checkpoint import restore_weights, save_checkpoint
from flowrl.runtime.optimizers import build_optimizer
from flowrl.runtime.processes import plain_accelerator, start_processes
from flowrl.runtime.run_dir import RunDir, default_run_dir
from flowrl.runtime.run_manager import RunManager
from flowrl.text.collect import TextExperience, build_text_collector, producer_collector
from flowrl.text.config import TextConfig
from flowrl.text.data import PromptSet
from flowrl.text.objective import TEXT_OBJECTIVES, StepProximal, TextContext
from flowrl.text.policy import CausalLMPolicy
from rewards.text import TextReward


class TextTrainer(RunManager):
    progress_label = "flowrl train (text)"

    def __init__(self, cfg: TextConfig, run_dir: str | Path | None = None, resume: bool = False):
        self.start_clock(cfg.trainer)  # a wall-clock budget counts from here
        self.cfg, t = cfg, cfg.trainer
        cpu, run_dir = start_processes(cfg.model.device, run_dir or default_run_dir(cfg, "text-"))
        self.run = RunDir(run_dir)
        self.accelerator = acc = plain_accelerator(cpu, "the text trainer replicates the model on every process", mixed_precision="no")
        self.collector = c = build_text_collector(cfg, acc)
        self.data, self.policy, self.reward, self.allocator = c.data, c.policy, c.reward, c.allocator
        self.params = self.policy.trainable_parameters()
        self.optimizer = build_optimizer(self.params.values(), t)
        # the training forwards go through DDP when there are several processes (it sums the
        # gradients at the last micro-batch); generation and the reference use the bare model
        self.train_model = acc.prepare_model(self.policy.model) if acc.num_processes > 1 else self.policy.model
        self.objective = TEXT_OBJECTIVES.get(cfg.loss.kind)(TextContext(cfg, acc, self.policy, self.train_model, self.optimizer,
                                                                        self.optimizer_step))
        if cfg.run.async_rollouts and acc.num_processes > 1:
            raise UserError("run.async_rollouts runs one text trainer process beside its producers; set run.cpu_processes: 1 "
                            "and launch without accelerate's multi-process launcher")
        self.start_run(resume)

    def producer_start(self):
        """run.async_rollouts: the producer collects with a copy of the policy and the allocator as they are now."""
        return functools.partial(producer_collector, self.cfg, self.allocator.state_dict()), self.params

    def next_batch(self) -> tuple[TextExperience, StepProximal | None, dict]:
        """This iteration's experience, the proximal log-probs of its completions when it came from
        the producer (None when synchronous), and what the producer's timing adds to the row."""
        if self.producer is None:
            return self.collector.collect(self.iteration), None, {}
        exp, staleness, timing = self.take_batch()
        # AReaL's proximal policy: the weights at the start of this update; fresh samples' own log-probs are it
        return exp, StepProximal(exp.gen, known=staleness == 0), timing

    def train_iteration(self) -> dict:
        t0 = time.perf_counter()
        exp, proximal, timing = self.next_batch()
        t1 = time.perf_counter()
        stats = self.objective.update(exp, proximal)
        if self.producer is not None:  # the producer's next batches sample with these weights
            self.producer.publish(self.params, self.iteration + 1)
        row = {"iteration": self.iteration, **self.metrics(exp), **stats, **timing, "time_sampling": t1 - t0,
               "time_training": time.perf_counter() - t1}
        self.iteration += 1
        row["time_iteration"] = time.perf_counter() - t0
        return row

    def metrics(self, exp: TextExperience) -> dict:
        total = self.reward.total(exp.rewards[exp.valid])
        lengths = exp.lengths.float()
        row = {"reward_mean": float(total.mean()), "samples": len(exp.prompt_ids),
               "completion_length": float(lengths.mean()), "completion_length_max": float(lengths.max()),
               "truncated_fraction": float(exp.truncated.float().mean()),
               "zero_variance_fraction": int(exp.degenerate.sum()) / max(len(exp.groups), 1), "invalid": int((~exp.valid).sum())}
        row.update({f"reward/{name}": float(exp.rewards[exp.valid, k].mean()) for k, name in enumerate(self.reward.names)})
        row.update(exp.rollout_metrics)
        row.update(allocation_diagnostics(exp, self.data.columns.get(self.cfg.data.bucket_column)))
        row.update(self.allocator.coverage())  # after this batch's outcomes (a producer's state, when async)
        return row

    # ---- what the run manager asks of the text trainer (flowrl/runtime/run_manager.py) -------
    def clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.trainer.max_grad_norm))

    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint (the processes hold the same weights); the others wait."""
        policy, acc, path = self.policy, self.accelerator, None
        if acc.is_main_process:
            path = save_checkpoint(self.run.checkpoints, self.iteration, self.params, self.optimizer.state_dict(), None,
                                   {"policy_version": self.iteration, "task": "text", "num_processes": acc.num_processes,
                                    **self.budget_state()},
                                   export=lambda tmp: policy.save(tmp / ("adapter" if policy.has_lora else "model")),
                                   allocator=self.allocator.state_dict())
        acc.wait_for_everyone()
        return path

    def restore(self, ckpt: Path, data: dict) -> None:
        restore_weights(self.params, data["params"], ckpt)
        self.optimizer.load_state_dict(data["optimizer"])


def allocation_diagnostics(exp: TextExperience, buckets: list | None) -> dict:
    """Where the iteration's rollouts went: the samples and distinct prompts the loss trains on,
    those with a nonzero advantage, and, with the data's difficulty buckets, rollouts and
    zero-variance groups per bucket."""
    trained = exp.trained
    row = {"samples_trained": int(trained.sum()), "prompts_trained": int(torch.unique(exp.prompt_ids[trained]).numel()),
           "nonzero_advantage_samples": int((trained & (exp.advantages != 0)).sum())}
    if buckets is not None:
        row.update(spending_by_bucket(exp.prompt_ids, exp.groups, exp.degenerate, buckets))
    return row


@torch.no_grad()
def evaluate_text(policy: CausalLMPolicy, data: PromptSet, cfg: TextConfig, reward: TextReward) -> dict:
    """Greedy completions of every prompt, each reward channel's mean overall and per bucket
    (data.bucket_column, when the data has it): exact match per operand length for builtin:add."""
    gen = policy.generate(data.prompts, [0] * len(data), cfg.generation, greedy=True)
    scores, valid = reward(data.prompts, gen.texts, data.columns)
    out = {"all": {name: float(scores[valid, k].mean()) for k, name in enumerate(reward.names)}, "count": {"all": len(data)}}
    buckets = data.columns.get(cfg.data.bucket_column)
    if buckets is not None:
        for b in sorted(set(buckets)):
            rows = torch.tensor([x == b for x in buckets]) & valid
            out[str(b)] = {name: float(scores[rows, k].mean()) for k, name in enumerate(reward.names)}
            out["count"][str(b)] = int(rows.sum())
    return out

