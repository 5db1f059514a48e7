"""RLVR for a causal language model (docs/text.md): each iteration the shared allocator picks
prompts and group sizes, the policy samples completions with its KV cache, the text rewards
score them against the dataset's columns, a shared advantage estimator turns them into one
advantage per completion, and the token-level clipped surrogate (flowrl/core/token_losses.py)
updates the policy. Runs, metrics, checkpoints and exact resume use the image loop's pieces.

Every draw is keyed by (seed, iteration, sample), so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl.core.advantages import estimate_advantages
from flowrl.core.allocation import make_allocator
from flowrl.core.token_losses import aggregate, k3_kl, overlong_mask, token_policy_loss
from flowrl.errors import UserError
from flowrl.sampling.noise import Stream, sample_seed
from flowrl.text.config import TextConfig
from flowrl.text.data import PromptSet, load_prompt_set
from flowrl.text.generate import Generation, concat
from flowrl.text.policy import CausalLMPolicy
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint, restore_rng, restore_weights, save_checkpoint
from flowrl.train.rollouts.flat import successes
from flowrl.train.run_dir import RunDir
from rewards.text import TextReward


@dataclass
class TextExperience:
    iteration: int
    prompt_ids: torch.Tensor  # [N] index into the prompt set
    gen: Generation
    rewards: torch.Tensor  # [N, K]
    valid: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    degenerate_groups: int
    groups: int


def default_text_run_dir(cfg: TextConfig) -> Path:
    return Path(cfg.run.output_dir) / (cfg.run.name or time.strftime("text-%Y%m%d-%H%M%S"))


def load_text_policy(cfg: TextConfig, trainable: bool = True) -> CausalLMPolicy:
    policy = CausalLMPolicy.from_config(cfg.model)
    if trainable:
        if cfg.lora.enabled:
            policy.add_lora(cfg.lora, seed=cfg.trainer.seed)
        else:
            policy.enable_full_finetune(keep_reference=cfg.loss.kl_beta > 0)
    return policy


class TextTrainer:
    def __init__(self, cfg: TextConfig, run_dir: str | Path | None = None, resume: bool = False):
        self.cfg, t = cfg, cfg.trainer
        if t.threads:
            torch.set_num_threads(t.threads)
        self.run = RunDir(run_dir or default_text_run_dir(cfg))
        self.data = load_prompt_set(cfg, cfg.data.split)
        self.policy = load_text_policy(cfg)
        self.params = self.policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=t.lr, weight_decay=t.weight_decay)
        self.reward = TextReward(dict(cfg.reward.weights), dict(cfg.reward.options), cfg.reward.on_invalid)
        al, d = cfg.allocator, cfg.data
        self.allocator = make_allocator(
            al.kind, num_prompts=len(self.data), budget=d.prompts_per_iteration * d.group_size,
            prompts_per_iteration=d.prompts_per_iteration, seed=t.seed, min_group=al.min_group, prior_a=al.prior_a,
            prior_b=al.prior_b, fast_decay=al.fast_decay, slow_decay=al.slow_decay, first_fraction=al.first_fraction,
            hard_accuracy=al.hard_accuracy, target_positives=al.target_positives, round_size=al.round_size,
            cap=al.cap or 2 * d.group_size)
        self.iteration = 0
        self.history: list[dict] = []
        if resume:
            self._resume()
        elif self.run.metrics_file.exists():
            raise UserError(f"run directory '{self.run.path}' already holds a run; resume it with --resume {self.run.path}")
        self.run.create(cfg)

    # ---- one iteration ------------------------------------------------------------------
    def collect(self, iteration: int) -> TextExperience:
        """The allocator's stages: sample, score, let it see the outcomes, repeat."""
        cfg, n = self.cfg, len(self.data)
        totals = torch.zeros(n, dtype=torch.long)
        ids_all, gens, rewards, valid = [], [], [], []
        extra = self.allocator.first_stage(iteration)
        while int(extra.sum()) > 0:
            ids = torch.repeat_interleave(torch.arange(n), extra)
            offset = int(totals.sum())
            seeds = [sample_seed(cfg.trainer.seed, iteration, offset + j) for j in range(len(ids))]
            prompts, columns = self.data.take(ids.tolist())
            gen = self.policy.generate(prompts, seeds, cfg.generation)
            r, ok = self.reward(prompts, gen.texts, columns)
            ids_all.append(ids), gens.append(gen), rewards.append(r), valid.append(ok)
            totals += extra
            seen, scored = torch.cat(ids_all), torch.cat(rewards)
            won = successes(cfg, self.reward.total(scored))
            per_prompt = torch.bincount(seen, weights=won.double(), minlength=n).long()
            extra = self.allocator.next_stage(totals, per_prompt, totals - per_prompt)
        prompt_ids, rewards, valid = torch.cat(ids_all), torch.cat(rewards), torch.cat(valid)
        gen = concat(gens, self.policy.tokenizer.pad_token_id)
        if not bool(valid.any()):
            raise UserError(f"every reward of iteration {iteration} was invalid (NaN or inf); see reward.on_invalid")
        out = estimate_advantages(cfg.loss.advantage, rewards[valid], prompt_ids[valid], self.reward.weights,
                                  std=cfg.loss.scale_rewards)
        advantages = torch.zeros(len(prompt_ids))
        advantages[valid] = out.advantages * out.mask
        self.allocator.observe(prompt_ids[valid], successes(cfg, self.reward.total(rewards[valid])))
        return TextExperience(iteration, prompt_ids, gen, rewards, valid, advantages, int(out.degenerate.sum()), len(out.group_ids))

    def update(self, exp: TextExperience) -> dict:
        """One optimizer step per inner epoch over every completion; micro-batches weighted so the
        step's loss is the aggregation over the whole batch."""
        cfg, l, t = self.cfg, self.cfg.loss, self.cfg.trainer
        gen, temp = exp.gen, cfg.generation.temperature
        mask = gen.completion_mask & exp.valid.unsqueeze(1)
        if l.overlong_mask:
            mask = overlong_mask(mask, gen.truncated)
        n = len(exp.prompt_ids)
        total_tokens, total_seqs = int(mask.sum()), n
        order_gen = torch.Generator().manual_seed(sample_seed(t.seed, exp.iteration, Stream.UPDATE_ORDER))
        sums = {k: 0.0 for k in ("loss", "kl", "entropy", "clip_low", "clip_high")}
        grad_norms, first_ratio_dev = [], None
        self.policy.model.train()
        for _ in range(t.inner_epochs):
            order = torch.randperm(n, generator=order_gen)
            for start in range(0, n, t.micro_batch):
                rows = order[start : start + t.micro_batch]
                m = mask[rows]
                lp, ent = self.policy.log_probs(gen, rows, temp)
                old = gen.log_probs[rows].to(lp.device)
                pl = token_policy_loss(lp, old, exp.advantages[rows].to(lp.device), m.to(lp.device), l.clip_low, l.clip_high,
                                       l.aggregation, l.ratio_level, cfg.generation.max_new_tokens)
                loss = pl.loss
                kl = torch.zeros(())
                if l.kl_beta > 0:
                    with torch.no_grad(), self.policy.reference() as ref:
                        ref_lp, _ = self.policy.log_probs(gen, rows, temp, model=ref)
                    kl = aggregate(k3_kl(lp, ref_lp), m.to(lp.device), l.aggregation, cfg.generation.max_new_tokens)
                    loss = loss + l.kl_beta * kl
                # this micro-batch's share of the whole batch's aggregate
                share = (int(m.sum()) / max(total_tokens, 1)) if l.aggregation == "token_mean" else len(rows) / total_seqs
                (loss * share).backward()
                tokens = max(int(m.sum()), 1)
                md = m.to(lp.device)
                dev = ((pl.ratio - 1).abs() * md).max().item()
                first_ratio_dev = dev if first_ratio_dev is None else first_ratio_dev
                for key, value in (("loss", loss.item()), ("kl", kl.item()), ("entropy", float((ent * md).sum()) / tokens),
                                   ("clip_low", float(pl.clipped_low.sum()) / tokens), ("clip_high", float(pl.clipped_high.sum()) / tokens)):
                    sums[key] += value * share
            norm = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), t.max_grad_norm))
            if math.isfinite(norm):  # a non-finite gradient never reaches the weights
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            grad_norms.append(norm)
        self.policy.model.eval()
        epochs = t.inner_epochs
        stats = {k: v / epochs for k, v in sums.items()}
        stats.update(grad_norm=sum(grad_norms) / len(grad_norms), first_ratio_deviation=first_ratio_dev or 0.0,
                     lr=self.optimizer.param_groups[0]["lr"],
                     skipped_steps=sum(not math.isfinite(g) for g in grad_norms))
        return stats

    def train_iteration(self) -> dict:
        t0 = time.perf_counter()
        t = self.cfg.trainer
        for group in self.optimizer.param_groups:  # set from the iteration alone, so a resume sets the same
            group["lr"] = t.lr * min(1.0, (self.iteration + 1) / t.warmup_iterations) if t.warmup_iterations else t.lr
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
        lengths = exp.gen.lengths.float()
        row = {"reward_mean": float(total.mean()), "samples": len(exp.prompt_ids),
               "completion_length": float(lengths.mean()), "completion_length_max": float(lengths.max()),
               "truncated_fraction": float(exp.gen.truncated.float().mean()),
               "zero_variance_fraction": exp.degenerate_groups / max(exp.groups, 1), "invalid": int((~exp.valid).sum())}
        row.update({f"reward/{name}": float(exp.rewards[exp.valid, k].mean()) for k, name in enumerate(self.reward.names)})
        return row

    # ---- the loop -----------------------------------------------------------------------
    def train(self) -> list[dict]:
        t, r = self.cfg.trainer, self.cfg.run
        bar = tqdm(total=t.iterations, initial=self.iteration, desc="flowrl train (text)", unit="iter", disable=not r.progress)
        started = time.perf_counter()
        while self.iteration < t.iterations:
            row = self.train_iteration()
            self.history.append(row)
            self.run.append_metrics(row)
            bar.update(1)
            bar.set_postfix({"reward": f"{row['reward_mean']:.3f}"})
            out_of_time = bool(t.max_minutes) and time.perf_counter() - started >= t.max_minutes * 60
            done = self.iteration >= t.iterations or out_of_time
            if done or (r.checkpoint_every and self.iteration % r.checkpoint_every == 0):
                self.save()
            if out_of_time:
                break
        bar.close()
        return self.history

    def save(self) -> Path:
        policy = self.policy
        return save_checkpoint(self.run.checkpoints, self.iteration, self.params, self.optimizer.state_dict(), None,
                               {"policy_version": self.iteration, "task": "text"},
                               export=lambda tmp: policy.save(tmp / ("adapter" if policy.has_lora else "model")),
                               allocator=self.allocator.state_dict())

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.run.checkpoints)
        if ckpt is None:
            raise UserError(f"--resume: '{self.run.path}' has no checkpoint yet; train it again with another run directory")
        data = load_checkpoint(ckpt)
        restore_weights(self.params, data["params"], ckpt)
        self.optimizer.load_state_dict(data["optimizer"])
        if data["allocator"] is not None:
            self.allocator.load_state_dict(data["allocator"])
        restore_rng(data["rng"], data["state"]["python_random"])
        self.iteration = int(data["state"]["iteration"])
        self.history = self.run.truncate_metrics(self.iteration)


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

