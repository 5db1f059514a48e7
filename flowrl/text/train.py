"""RLVR for a causal language model (docs/text.md): each iteration the shared allocator picks
prompts and group sizes, the policy samples completions with its KV cache, the text rewards
score them against the dataset's columns, a shared advantage estimator turns them into one
advantage per completion, and the token-level clipped surrogate (flowrl/core/token_losses.py)
updates the policy. Runs, metrics, checkpoints and exact resume use the image loop's pieces.
With run.async_rollouts a producer process collects ahead of the trainer
(flowrl/runtime/producers.py) and the loss is an off-policy one (loss.off_policy).

Every draw is keyed by (seed, iteration, sample), so a resumed run repeats an uninterrupted one,
and several processes (accelerate's launcher or run.cpu_processes) train as one: each process
samples and scores its slice of every stage, the rewards are gathered so every process computes
the same allocator decisions and advantages, each trains on its own completions, and the
gradients are summed across processes before the one optimizer step.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from pathlib import Path

import torch

from flowrl.core.allocation import spending_by_bucket
from flowrl.core.off_policy import behaviour_weight_stats, decoupled_policy_loss, m2po_mask, m2po_policy_loss
from flowrl.core.seeds import Stream, sample_seed
from flowrl.core.token_losses import aggregate, k3_kl, overlong_mask, token_policy_loss
from flowrl.errors import UserError
from flowrl.runtime.checkpoint import restore_weights, save_checkpoint
from flowrl.runtime.processes import plain_accelerator, start_processes
from flowrl.runtime.run_dir import RunDir, default_run_dir
from flowrl.runtime.run_manager import RunManager
from flowrl.text.collect import TextExperience, build_text_collector, producer_collector
from flowrl.text.config import TextConfig
from flowrl.text.data import PromptSet
from flowrl.text.generate import Generation
from flowrl.text.policy import CausalLMPolicy
from rewards.text import TextReward


class StepProximal:
    """AReaL's proximal log-probs of a batch: those of the weights at the start of this optimizer
    step. The trainer takes one step per inner epoch and its first epoch forwards every completion
    once with exactly those weights, so each completion's proximal log-probs are its first training
    forward's, detached: the same policy AReaL recomputes (`prox_logp_method: recompute`), without
    the separate forward over the batch (about a quarter of an asynchronous text iteration here).
    Rows given as `known` (fresh samples: the behaviour log-probs are the proximal ones) are kept."""

    def __init__(self, gen: Generation, known: bool = False):
        self.log_probs = gen.log_probs.float().clone() if known else torch.zeros_like(gen.log_probs, dtype=torch.float32)
        self.taken = torch.full((len(gen.texts),), known)
        self.mask = gen.completion_mask

    def of(self, rows: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """The proximal log-probs of `rows`, taking those not yet known from `lp` (their training
        forward's log-probs under the step's starting weights)."""
        new = ~self.taken[rows]
        if bool(new.any()):
            first = rows[new]
            self.log_probs[first] = lp.detach().float().cpu()[new] * self.mask[first]
            self.taken[first] = True
        return self.log_probs[rows]


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
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           weight_decay=t.weight_decay)
        # the training forwards go through DDP when there are several processes (it sums the
        # gradients at the last micro-batch); generation and the reference use the bare model
        self.train_model = acc.prepare_model(self.policy.model) if acc.num_processes > 1 else self.policy.model
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

    def update(self, exp: TextExperience, proximal: StepProximal | None = None) -> dict:
        """One optimizer step per inner epoch over every completion; micro-batches weighted so the
        step's loss is the aggregation over the whole batch (over every process's completions).
        `proximal`: the log-probs of samples that came from the producer (the off-policy loss)."""
        l, t, acc = self.cfg.loss, self.cfg.trainer, self.accelerator
        gen = exp.gen
        mask = gen.completion_mask & exp.local_valid.unsqueeze(1)
        if l.overlong_mask:
            mask = overlong_mask(mask, gen.truncated)
        advantages, n = exp.local_advantages, len(exp.rows)
        total_tokens = int(acc.reduce(mask.sum().to(acc.device), "sum"))
        total_seqs = int(exp.trained.sum())
        # DDP averages the processes' gradients; each process's loss is its share of the global sum
        scale = acc.num_processes
        order_gen = torch.Generator().manual_seed(sample_seed(t.seed, exp.iteration, Stream.UPDATE_ORDER))
        sums = {k: 0.0 for k in ("loss", "kl", "entropy", "clip_low", "clip_high")}
        grad_norms, first_ratio_dev = [], None
        self.policy.model.train()
        for _ in range(t.inner_epochs):
            order = torch.randperm(n, generator=order_gen)
            starts = range(0, n, t.micro_batch)  # the same count on every process: their slices are equal
            for start in starts:
                rows = order[start : start + t.micro_batch]
                m = mask[rows]
                # this micro-batch's share of the whole batch's aggregate
                share = (int(m.sum()) / max(total_tokens, 1)) if l.aggregation == "token_mean" else len(rows) / total_seqs
                # gradients are summed across processes once, at the last micro-batch
                with contextlib.nullcontext() if start == starts[-1] else acc.no_sync(self.train_model):
                    loss, logged, dev = self._micro_batch(gen, rows, m, advantages[rows], proximal)
                    (loss * share * scale).backward()
                first_ratio_dev = dev if first_ratio_dev is None else first_ratio_dev
                for key, value in logged.items():
                    sums[key] += value * share
            grad_norms.append(self.optimizer_step())  # a non-finite gradient never reaches the weights
        self.policy.model.eval()
        epochs = t.inner_epochs
        # every process's share of the whole batch's aggregate, summed
        totals = acc.reduce(torch.tensor(list(sums.values()), dtype=torch.float64, device=acc.device), "sum").tolist()
        stats = {k: v / epochs for k, v in zip(sums, totals)}
        first_ratio_dev = float(acc.reduce(torch.tensor(first_ratio_dev or 0.0, device=acc.device), "max"))
        stats.update(grad_norm=sum(grad_norms) / len(grad_norms), first_ratio_deviation=first_ratio_dev,
                     lr=self.optimizer.param_groups[0]["lr"],
                     skipped_steps=sum(not math.isfinite(g) for g in grad_norms))
        if proximal is not None:
            stats.update(behaviour_weight_stats(proximal.log_probs, gen.log_probs, mask, l.behaviour_cap))
        return stats

    def _micro_batch(self, gen: Generation, rows: torch.Tensor, m: torch.Tensor, advantages: torch.Tensor,
                     step_proximal: StepProximal | None):
        """The loss of some of this process's completions (aggregated over them), what it logs, and
        the largest deviation of a ratio from 1."""
        cfg, l = self.cfg, self.cfg.loss
        temp, horizon = cfg.generation.temperature, cfg.generation.max_new_tokens
        lp, ent = self.policy.log_probs(gen, rows, temp, model=self.train_model)
        md = m.to(lp.device)
        behaviour, advantages = gen.log_probs[rows].to(lp.device), advantages.to(lp.device)
        proximal = None if step_proximal is None else step_proximal.of(rows, lp).to(lp.device)
        if proximal is None:  # synchronous: the samples are these weights' own
            pl = token_policy_loss(lp, behaviour, advantages, md, l.clip_low, l.clip_high, l.aggregation, l.ratio_level, horizon)
        elif l.off_policy == "m2po":  # M2PO: the second-moment mask is the trust region, no clip
            pl = m2po_policy_loss(lp, behaviour, advantages, md, m2po_mask(proximal, behaviour, md, l.m2po_tau))
        else:  # AReaL's decoupled PPO: the clip against the proximal weights, the behaviour weight for staleness
            pl = decoupled_policy_loss(lp, proximal, behaviour, advantages, md, l.clip_low, l.clip_high, l.aggregation,
                                       horizon, l.behaviour_weight, l.behaviour_cap, l.behaviour_level)
        loss, kl = pl.loss, torch.zeros(())
        if cfg.trainer.kl_beta > 0:
            with torch.no_grad(), self.policy.reference() as ref:
                ref_lp, _ = self.policy.log_probs(gen, rows, temp, model=ref)
            kl = aggregate(k3_kl(lp, ref_lp), md, l.aggregation, horizon)
            loss = loss + cfg.trainer.kl_beta * kl
        tokens = max(int(m.sum()), 1)
        logged = {"loss": loss.item(), "kl": kl.item(), "entropy": float((ent * md).sum()) / tokens,
                  "clip_low": float(pl.clipped_low.sum()) / tokens, "clip_high": float(pl.clipped_high.sum()) / tokens}
        return loss, logged, ((pl.ratio - 1).abs() * md).max().item()

    def train_iteration(self) -> dict:
        t0 = time.perf_counter()
        exp, proximal, timing = self.next_batch()
        t1 = time.perf_counter()
        stats = self.update(exp, proximal)
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

    def finish(self) -> None:
        if self.accelerator.is_main_process:  # the run's curves, and where its rollouts went
            self.run.plot_reward_curve(self.run.read_metrics())

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

