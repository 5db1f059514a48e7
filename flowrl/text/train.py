"""RLVR for a causal language model (docs/text.md): each iteration the shared allocator picks
prompts and group sizes, the policy samples completions with its KV cache, the text rewards
score them against the dataset's columns, a shared advantage estimator turns them into one
advantage per completion, and the token-level clipped surrogate (flowrl/core/token_losses.py)
updates the policy. Runs, metrics, checkpoints and exact resume use the image loop's pieces.

Every draw is keyed by (seed, iteration, sample), so a resumed run repeats an uninterrupted one,
and several processes (accelerate's launcher or run.cpu_processes) train as one: each process
samples and scores its slice of every stage, the rewards are gathered so every process computes
the same allocator decisions and advantages, each trains on its own completions, and the
gradients are summed across processes before the one optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flowrl.core.advantages import estimate_advantages
from flowrl.core.allocation import allocate_in_stages, spending_by_bucket
from flowrl.core.token_losses import aggregate, k3_kl, overlong_mask, token_policy_loss
from flowrl.errors import UserError
from flowrl.sampling.noise import Stream, sample_seed
from flowrl.text.config import TextConfig
from flowrl.text.data import PromptSet, load_prompt_set
from flowrl.text.generate import Generation, concat
from flowrl.text.policy import CausalLMPolicy
from flowrl.train.checkpoint import restore_weights, save_checkpoint
from flowrl.train.experience import ProcessShard, gather_real
from flowrl.train.processes import plain_accelerator, start_processes
from flowrl.train.rollouts.common import successes
from flowrl.train.run_dir import RunDir
from flowrl.train.run_manager import RunManager
from rewards.text import TextReward


@dataclass
class TextExperience:
    """One iteration's completions: the whole batch's prompts, rewards and advantages (the same on
    every process), and this process's share of the completions themselves."""

    iteration: int
    prompt_ids: torch.Tensor  # [N] index into the prompt set, every sample drawn
    rewards: torch.Tensor  # [N, K]
    valid: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    lengths: torch.Tensor  # [N] completion tokens
    truncated: torch.Tensor  # [N] bool
    trained: torch.Tensor  # [N] bool: the samples the loss sees (the allocator's `keep`; all, but for reinforce_ada)
    degenerate: torch.Tensor  # [G] bool per prompt drawn (sorted ids `groups`): every valid reward equal
    groups: torch.Tensor  # [G]
    gen: Generation  # [n] this process's completions that train
    rows: torch.Tensor  # [n] each one's index among the N, -1 for a padding copy (the processes' shares are padded)

    @property
    def local_advantages(self) -> torch.Tensor:
        return torch.where(self.rows >= 0, self.advantages[self.rows.clamp(min=0)], torch.zeros(()))

    @property
    def local_valid(self) -> torch.Tensor:
        return (self.rows >= 0) & self.valid[self.rows.clamp(min=0)]


def default_text_run_dir(cfg: TextConfig) -> Path:
    return Path(cfg.run.output_dir) / (cfg.run.name or time.strftime("text-%Y%m%d-%H%M%S"))


def load_text_policy(cfg: TextConfig, trainable: bool = True, device: torch.device | None = None) -> CausalLMPolicy:
    policy = CausalLMPolicy.from_config(cfg.model, device=device)
    if trainable:
        if cfg.lora.enabled:
            policy.add_lora(cfg.lora, seed=cfg.trainer.seed)
        else:
            policy.enable_full_finetune(keep_reference=cfg.trainer.kl_beta > 0)
    return policy


class TextTrainer(RunManager):
    progress_label = "flowrl train (text)"

    def __init__(self, cfg: TextConfig, run_dir: str | Path | None = None, resume: bool = False):
        self.start_clock(cfg.trainer)  # a wall-clock budget counts from here
        self.cfg, t = cfg, cfg.trainer
        if t.threads:
            torch.set_num_threads(t.threads)
        cpu, run_dir = start_processes(cfg.model.device, run_dir or default_text_run_dir(cfg))
        self.run = RunDir(run_dir)
        self.accelerator = acc = plain_accelerator(cpu, "the text trainer replicates the model on every process", mixed_precision="no")
        self.data = load_prompt_set(cfg, cfg.data.split)
        self.policy = load_text_policy(cfg, device=acc.device)
        self.params = self.policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=t.lr, weight_decay=t.weight_decay)
        # the training forwards go through DDP when there are several processes (it sums the
        # gradients at the last micro-batch); generation and the reference use the bare model
        self.train_model = acc.prepare_model(self.policy.model) if acc.num_processes > 1 else self.policy.model
        self.reward = TextReward(dict(cfg.reward.weights), dict(cfg.reward.options), cfg.reward.on_invalid)
        d = cfg.data
        self.allocator = cfg.allocator.build(len(self.data), d.prompts_per_iteration, d.group_size, t.seed)
        self.start_run(resume)

    # ---- one iteration ------------------------------------------------------------------
    def collect(self, iteration: int) -> TextExperience:
        """The allocator's stages: sample, score, let it see the outcomes, repeat. Each process
        samples and scores its slice of a stage; the scores are gathered, so every process sees
        every outcome."""
        cfg, acc = self.cfg, self.accelerator
        ids_all, gens, local_rows, rewards, valid, lengths, truncated = [], [], [], [], [], [], []

        def sample_stage(ids: torch.Tensor, offset: int) -> torch.Tensor:
            m = len(ids)
            seeds = [sample_seed(cfg.trainer.seed, iteration, offset + j) for j in range(m)]
            shard = ProcessShard(m, acc.num_processes, acc.process_index)
            prompts, columns = self.data.take(shard.take(ids.tolist()))
            gen = self.policy.generate(prompts, shard.take(seeds), cfg.generation)
            r, ok = self.reward(prompts, gen.texts, columns)
            ids_all.append(ids), gens.append(gen)
            local_rows.append(torch.where(shard.positions < m, offset + shard.positions, -1))
            # every process's scores, validity, lengths and truncation, in one gather
            outcome = gather_real(acc, torch.cat([r, torch.stack([ok, gen.lengths, gen.truncated], 1).to(r.dtype)], 1), m)
            k = r.shape[1]
            rewards.append(outcome[:, :k]), valid.append(outcome[:, k].bool())
            lengths.append(outcome[:, k + 1].long()), truncated.append(outcome[:, k + 2].bool())
            return successes(cfg, self.reward.total(torch.cat(rewards)))

        allocate_in_stages(self.allocator, iteration, sample_stage)
        prompt_ids, rewards, valid = torch.cat(ids_all), torch.cat(rewards), torch.cat(valid)
        gen = concat(gens, self.policy.tokenizer.pad_token_id)
        if not bool(valid.any()):
            raise UserError(f"every reward of iteration {iteration} was invalid (NaN or inf); see reward.on_invalid")
        # the advantages' group statistics use every sample drawn, also those the loss leaves out
        out = estimate_advantages(cfg.advantage.kind, rewards[valid], prompt_ids[valid], self.reward.weights,
                                  std=cfg.advantage.std)
        advantages = torch.zeros(len(prompt_ids))
        advantages[valid] = out.advantages * out.mask
        won = successes(cfg, self.reward.total(rewards[valid]))
        trained = torch.zeros(len(prompt_ids), dtype=torch.bool)
        trained[valid] = self.allocator.keep(prompt_ids[valid], won)
        self.allocator.observe(prompt_ids[valid], won)
        gen, rows = trained_share(gen, torch.cat(local_rows), trained, acc)
        return TextExperience(iteration, prompt_ids, rewards, valid, advantages, torch.cat(lengths), torch.cat(truncated),
                              trained, out.degenerate, out.group_ids, gen, rows)

    def update(self, exp: TextExperience) -> dict:
        """One optimizer step per inner epoch over every completion; micro-batches weighted so the
        step's loss is the aggregation over the whole batch (over every process's completions)."""
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
                    loss, logged, dev = self._micro_batch(gen, rows, m, advantages[rows])
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
        return stats

    def _micro_batch(self, gen: Generation, rows: torch.Tensor, m: torch.Tensor, advantages: torch.Tensor):
        """The loss of some of this process's completions (aggregated over them), what it logs, and
        the largest deviation of a ratio from 1."""
        cfg, l = self.cfg, self.cfg.loss
        temp, horizon = cfg.generation.temperature, cfg.generation.max_new_tokens
        lp, ent = self.policy.log_probs(gen, rows, temp, model=self.train_model)
        md = m.to(lp.device)
        pl = token_policy_loss(lp, gen.log_probs[rows].to(lp.device), advantages.to(lp.device), md, l.clip_low, l.clip_high,
                               l.aggregation, l.ratio_level, horizon)
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
        exp = self.collect(self.iteration)
        t1 = time.perf_counter()
        stats = self.update(exp)
        row = {"iteration": self.iteration, **self.metrics(exp), **stats, "time_sampling": t1 - t0,
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
        row.update(allocation_diagnostics(exp, self.data.columns.get(self.cfg.data.bucket_column)))
        return row

    # ---- what the run manager asks of the text trainer (flowrl/train/run_manager.py) -------
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


def trained_share(gen: Generation, rows: torch.Tensor, trained: torch.Tensor, acc) -> tuple[Generation, torch.Tensor]:
    """This process's completions that the loss trains on, and their rows among the N; padded
    with copies marked -1 to the largest share of any process (the processes' micro-batches must
    pair up for DDP)."""
    if bool(trained.all()):  # the same on every process: all skip the collective below, or none does
        return gen, rows
    mine = ((rows >= 0) & trained[rows.clamp(min=0)]).nonzero().squeeze(1)
    most = int(acc.reduce(torch.tensor(len(mine), device=acc.device), "max"))
    pad = max(most, 1) - len(mine)
    index = torch.cat([mine, torch.zeros(pad, dtype=torch.long)])
    return gen.select(index), torch.cat([rows[mine], torch.full((pad,), -1, dtype=torch.long)])


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

