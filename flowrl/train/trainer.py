"""Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL"):
G SDE samples per prompt, rewards, group-normalised advantages, a PPO-clipped loss over the
trained denoising transitions plus the exact Gaussian KL to the reference (LoRA disabled).

One iteration: rollout -> decode -> reward -> gather -> advantages -> inner epochs of
updates. Every random draw is keyed by (seed, iteration, sample, step), so a resumed run
repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm.auto import tqdm

from flowrl.config import Config
from flowrl.core import clipped_policy_loss, gaussian_kl
from flowrl.core.advantages import estimate_advantages
from flowrl.core.allocation import make_allocator
from flowrl.errors import ConfigError, UserError
from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, Trajectory, rollout, transition
from flowrl.sampling.steps import StepOutput
from flowrl.sampling.schedules import shifted_sigmas, window_mask
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint
from flowrl.train.ema import EMA
from flowrl.train.images import save_grid
from flowrl.train.prompts import load_prompts
from flowrl.train.run_dir import RunDir
from rewards import MultiReward


class Stage(NamedTuple):
    """One allocation stage: this process's trajectory and the gathered, unpadded rewards."""

    traj: Trajectory  # this process's slice (may end with padding copies)
    rewards: torch.Tensor  # [n, K] every process's real samples, in stage order
    prompt_ids: torch.Tensor  # [n] pool indices of the real samples
    positions: torch.Tensor  # [n_local] stage positions of this process's samples (>= n: padding)
    reward_time: float


class MicroBatch(NamedTuple):
    """One forward of the policy over stored transitions: `evaluate()` recomputes them (with
    grad; under `policy.reference()` it gives the reference); `keep` masks the edges that carry
    gradient (None: all)."""

    evaluate: Callable[[], StepOutput]
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    keep: torch.Tensor | None = None


def sample_seed(base: int, iteration: int, index: int) -> int:
    return (base * 1_000_003 + iteration) * 100_003 + index


def flat_config(cfg: Config) -> dict:
    """Scalars only, for trackers (tensorboard's hparams cannot hold lists)."""
    from omegaconf import OmegaConf

    out = {}

    def walk(prefix, node):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(key + ".", v)
            else:
                out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg)))
    return out


class GRPOTrainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, resume: bool = False, rewards: dict | None = None):
        from accelerate import Accelerator, PartialState
        from accelerate.utils import broadcast_object_list

        self.cfg = cfg
        t = cfg.trainer
        cpu = cfg.model.device == "cpu" or not torch.cuda.is_available()
        PartialState(cpu=cpu)  # start the process group so every process can agree on one run directory
        if run_dir is None:
            name = cfg.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
            run_dir = Path(cfg.run.output_dir) / name
        run_dir = broadcast_object_list([str(run_dir)])[0]
        self.run = RunDir(run_dir)
        self.accelerator = Accelerator(
            mixed_precision=t.mixed_precision,
            cpu=cpu,
            log_with=None if cfg.run.tracker == "none" else cfg.run.tracker,
            project_dir=str(self.run.path),
        )
        acc = self.accelerator

        self.prompts = load_prompts(cfg.data)
        self.eval_prompts = list(cfg.data.eval_prompts) or self.prompts[:4]
        al = cfg.allocator
        self.allocator = make_allocator(
            al.kind, num_prompts=len(self.prompts), budget=cfg.data.prompts_per_iteration * cfg.data.group_size,
            prompts_per_iteration=cfg.data.prompts_per_iteration, seed=t.seed, min_group=al.min_group,
            prior_a=al.prior_a, prior_b=al.prior_b, fast_decay=al.fast_decay, slow_decay=al.slow_decay,
            first_fraction=al.first_fraction, hard_accuracy=al.hard_accuracy, target_positives=al.target_positives,
            round_size=al.round_size, cap=al.cap or 2 * cfg.data.group_size,
        )

        self.policy = load_policy(cfg.model, device=acc.device)
        if cfg.lora.enabled:
            self.policy.add_lora(cfg.lora, seed=t.seed)
        else:
            self.policy.enable_full_finetune()
        self.params = self.policy.named_trainable_parameters()
        optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay
        )
        self.policy.net, self.optimizer = acc.prepare(self.policy.transformer, optimizer)
        self.ema = EMA(self.params, t.ema_decay) if t.ema else None
        self.reward_fn = MultiReward(cfg.reward.weights, cfg.reward.batch_size, rewards=rewards)
        self.iteration = 0
        self.history: list[dict] = []

        if resume:
            self._resume()
        elif (self.run.path / "metrics.jsonl").exists():
            raise UserError(
                f"run directory '{self.run.path}' already holds a run; resume it with --resume {self.run.path} "
                "or choose another run.name"
            )
        if acc.is_main_process:
            self.run.create(cfg)  # on resume too: the run directory shows the config in force
        acc.wait_for_everyone()
        if cfg.run.tracker != "none":
            acc.init_trackers("tracker", config=flat_config(cfg))

    # ---- schedule -------------------------------------------------------------------
    def sampler_spec(self, iteration: int) -> SamplerSpec:
        s = self.cfg.sampling
        w = s.window
        mask = window_mask(w.strategy, s.num_steps, w.size, w.start, iteration, self.cfg.trainer.seed, w.shift_every)
        return SamplerSpec(shifted_sigmas(s.num_steps, s.shift), mask, s.sampler, s.noise_level, s.logprob_reduction)

    def eval_spec(self) -> SamplerSpec:
        s = self.cfg.sampling
        return SamplerSpec(shifted_sigmas(s.eval_num_steps, s.shift), torch.zeros(s.eval_num_steps, dtype=torch.bool), "ode")

    # ---- one iteration ------------------------------------------------------------------
    def sample_stage(self, prompt_ids: list[int], seeds: list[int], spec: SamplerSpec, desc: str) -> Stage:
        """Sample one allocation stage, split across processes, and gather its rewards.
        The stage is padded with copies of its last sample to a multiple of the process count,
        so every process runs the same number of batches (DDP needs equal backward counts);
        the copies get zero advantage and count toward nothing."""
        cfg, acc = self.cfg, self.accelerator
        n = len(prompt_ids)
        pad = (-n) % acc.num_processes
        prompt_ids, seeds = prompt_ids + prompt_ids[-1:] * pad, seeds + seeds[-1:] * pad
        n_local = len(seeds) // acc.num_processes
        local = slice(acc.process_index * n_local, (acc.process_index + 1) * n_local)
        traj = rollout(
            self.policy,
            [self.prompts[i] for i in prompt_ids[local]],
            seeds[local],
            spec,
            cfg.sampling.batch_size,
            prompt_ids=prompt_ids[local],
            group_ids=prompt_ids[local],
            policy_version=self.iteration,
            progress=cfg.run.progress and acc.is_local_main_process,
            desc=desc,
        )
        t_sampled = time.perf_counter()
        bs = cfg.sampling.batch_size
        images = torch.cat([self.policy.decode(traj.final[i : i + bs]) for i in range(0, len(traj), bs)])
        local_rewards = self.reward_fn(images, traj.prompts)
        rewards = acc.gather(local_rewards.to(acc.device)).cpu()[:n]  # group statistics need everyone's samples
        positions = torch.arange(local.start, local.stop)
        return Stage(traj, rewards, torch.tensor(prompt_ids[:n]), positions, time.perf_counter() - t_sampled)

    def train_iteration(self) -> dict:
        cfg, acc, it = self.cfg, self.accelerator, self.iteration
        t0 = time.perf_counter()
        spec = self.sampler_spec(it)
        weights = self.reward_fn.channel_weights
        self.policy.transformer.eval()

        # allocation stages: the allocator decides, we sample, it sees the outcomes, repeat
        stages: list[Stage] = []
        n_prompts = len(self.prompts)
        totals = torch.zeros(n_prompts, dtype=torch.long)
        extra = self.allocator.first_stage(it)
        while int(extra.sum()) > 0:
            ids = torch.repeat_interleave(torch.arange(n_prompts), extra).tolist()
            offset = int(totals.sum())
            seeds = [sample_seed(cfg.trainer.seed, it, offset + j) for j in range(len(ids))]
            stages.append(self.sample_stage(ids, seeds, spec, desc=f"iter {it} sampling" + (f" (stage {len(stages) + 1})" if stages else "")))
            totals += extra
            seen = torch.cat([st.prompt_ids for st in stages])
            ok = self.successes(torch.cat([st.rewards for st in stages]) @ weights)
            successes = torch.bincount(seen, weights=ok.double(), minlength=n_prompts).long()
            extra = self.allocator.next_stage(totals, successes, totals - successes)
        t_sample = time.perf_counter()
        t_reward = sum(st.reward_time for st in stages)

        rewards = torch.cat([st.rewards for st in stages])
        prompt_ids = torch.cat([st.prompt_ids for st in stages])
        a = cfg.advantage
        adv = estimate_advantages(a.kind, rewards, prompt_ids, weights, a.std, a.eps, a.clip)
        self.allocator.observe(prompt_ids, self.successes(rewards @ weights))
        batches, offset = [], 0
        for st in stages:  # each process's slice of every stage, padding copies at zero advantage
            n = len(st.prompt_ids)
            local_adv = torch.zeros(len(st.positions))
            real = st.positions < n
            local_adv[real] = adv.advantages[offset + st.positions[real]]
            batches.append((st.traj, local_adv))
            offset += n
        stats = self.update(batches, spec)
        t_train = time.perf_counter()

        total = rewards @ weights
        sizes = torch.bincount(prompt_ids, minlength=n_prompts)
        sizes = sizes[sizes > 0]
        row = {
            "iteration": it,
            "reward_mean": total.mean().item(),
            "reward_std": total.std(unbiased=False).item(),
            **{f"reward/{c}": rewards[:, k].mean().item() for k, c in enumerate(self.reward_fn.channel_names)},
            "adv_abs_mean": adv.advantages.abs().mean().item(),
            "degenerate_groups": adv.degenerate.float().mean().item(),
            "nonzero_advantage_samples": int((adv.mask & (adv.advantages != 0)).sum()),
            "samples": len(prompt_ids),
            "prompts": int(sizes.numel()),
            "allocation_stages": len(stages),
            "group_size_min": int(sizes.min()),
            "group_size_max": int(sizes.max()),
            "group_size_histogram": {str(int(k)): int(v) for k, v in zip(*torch.unique(sizes, return_counts=True))},
            "trained_steps": len(spec.trained_steps()),
            **stats,
            "time_sampling": t_sample - t0 - t_reward,
            "time_reward": t_reward,
            "time_training": t_train - t_sample,
        }
        self.iteration += 1
        row["time_iteration"] = time.perf_counter() - t0
        return row

    def successes(self, total_rewards: torch.Tensor) -> torch.Tensor:
        """Pass/fail for the allocator: above allocator.success_threshold, or above the mean of
        the iteration's rewards so far when no threshold is set (continuous rewards)."""
        threshold = self.cfg.allocator.success_threshold
        return total_rewards > (total_rewards.mean() if threshold is None else threshold)

    def update(self, batches: list[tuple[Trajectory, torch.Tensor]], spec: SamplerSpec) -> dict:
        """Flat rollouts: one micro-batch per (sample batch, trained step); a sample batch is
        the unit of gradient accumulation. Micro-batches are exactly the sampling batches, so
        the first forward reproduces the behaviour log-probs bit for bit and the ratio starts at 1."""
        bs = self.cfg.sampling.batch_size
        groups = []
        for traj, adv in batches:
            for start in range(0, len(traj), bs):
                c = slice(start, start + bs)
                groups.append([
                    MicroBatch(lambda traj=traj, c=c, step=step: transition(self.policy, traj, spec, c, step, self.policy.encode(traj.prompts[c])),
                               traj.log_probs[c, step], adv[c])
                    for step in spec.trained_steps()
                ])
        return self.optimize(groups, spec.reduction)

    def optimize(self, groups: list[list[MicroBatch]], reduction: str) -> dict:
        """Inner epochs of PPO-clipped updates (+ beta x exact Gaussian KL to the reference).
        Groups are shuffled each epoch; `trainer.gradient_accumulation_steps` groups make one
        optimizer step; under DDP, gradients are synchronised only on the step's last backward."""
        cfg, acc, t = self.cfg, self.accelerator, self.cfg.trainer
        accum = t.gradient_accumulation_steps
        clip_hi = t.clip_range_high if t.clip_range_high is not None else t.clip_range
        gen = torch.Generator().manual_seed(sample_seed(t.seed, self.iteration, 999_983))
        sums = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "ratio_mean": 0.0, "clipfrac": 0.0}
        count, grad_norms, first_ratio_dev = 0, [], None
        self.policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * sum(len(g) for g in groups), desc=f"iter {self.iteration} training", leave=False,
                   disable=not (cfg.run.progress and acc.is_local_main_process), unit="step")
        for epoch in range(t.inner_epochs):
            order = torch.randperm(len(groups), generator=gen).tolist()
            for gi, group_index in enumerate(order):
                group = groups[group_index]
                closes_step = (gi + 1) % accum == 0 or gi == len(order) - 1
                step_len = min(accum, len(order) - (gi // accum) * accum)  # the last step's share may be short
                for k, mb in enumerate(group):
                    sync = closes_step and k == len(group) - 1
                    with contextlib.nullcontext() if sync else acc.no_sync(self.policy.net):
                        out = mb.evaluate()
                        keep = mb.keep if mb.keep is not None else slice(None)
                        old, adv = mb.old_log_prob.to(acc.device)[keep], mb.advantages.to(acc.device)[keep]
                        pl = clipped_policy_loss(out.log_prob[keep], old, adv, t.clip_range, clip_hi)
                        loss = pl.loss
                        kl = torch.zeros((), device=acc.device)
                        if t.kl_beta > 0:
                            with torch.no_grad(), self.policy.reference():
                                ref = mb.evaluate()
                            kl = gaussian_kl(out.mean[keep], ref.mean[keep], out.std, reduction).mean()
                            loss = loss + t.kl_beta * kl
                        acc.backward(loss / (step_len * len(group)))
                    if first_ratio_dev is None:
                        first_ratio_dev = (pl.ratio - 1).abs().max().item()
                    sums["loss"] += loss.item()
                    sums["policy_loss"] += pl.loss.item()
                    sums["kl"] += kl.item()
                    sums["ratio_mean"] += pl.ratio.mean().item()
                    sums["clipfrac"] += pl.clipped.float().mean().item()
                    count += 1
                    bar.update(1)
                if closes_step:
                    grad_norms.append(float(acc.clip_grad_norm_(list(self.params.values()), t.max_grad_norm)))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.ema is not None:
                        self.ema.update(self.params)
        bar.close()
        self.policy.transformer.eval()
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out.update(grad_norm=sum(grad_norms) / max(len(grad_norms), 1), first_ratio_deviation=first_ratio_dev or 0.0,
                   optimizer_steps=len(grad_norms), trained_transitions=count, lr=self.optimizer.param_groups[0]["lr"])
        return out

    # ---- the loop -----------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg, acc = self.cfg, self.accelerator
        r = cfg.run
        bar = tqdm(total=cfg.trainer.iterations, initial=self.iteration, desc="flowrl train", unit="iter",
                   disable=not (r.progress and acc.is_local_main_process))
        if self.iteration == 0 and r.sample_every:
            self.save_samples("iter_000000_before")
        while self.iteration < cfg.trainer.iterations:
            row = self.train_iteration()
            self.history.append(row)
            acc.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "iteration"}, step=row["iteration"])
            if acc.is_main_process:
                self.run.append_metrics(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.4g}", kl=f"{row['kl']:.2e}")
            done = self.iteration >= cfg.trainer.iterations
            if r.sample_every and (self.iteration % r.sample_every == 0 or done):
                self.save_samples(f"iter_{self.iteration:06d}")
            if done or (r.checkpoint_every and self.iteration % r.checkpoint_every == 0):
                self.save()
        bar.close()
        acc.end_training()
        return self.history

    # ---- outputs ------------------------------------------------------------------------
    @torch.no_grad()
    def save_samples(self, name: str, seeds_per_prompt: int = 2) -> Path | None:
        """A grid of ODE samples on the eval prompts (EMA weights when enabled)."""
        if not self.accelerator.is_main_process:
            return None
        prompts = [p for p in self.eval_prompts for _ in range(seeds_per_prompt)]
        seeds = [sample_seed(self.cfg.trainer.seed, -1, j % seeds_per_prompt) for j in range(len(prompts))]
        ctx = self.ema.swapped_in(self.params) if self.ema is not None else contextlib.nullcontext()
        with ctx:
            traj = rollout(self.policy, prompts, seeds, self.eval_spec(), self.cfg.sampling.batch_size)
            images = self.policy.decode(traj.final)
        return save_grid(images, self.run.samples / f"{name}.png", columns=seeds_per_prompt * 2)

    def save(self) -> Path | None:
        acc = self.accelerator
        acc.wait_for_everyone()
        path = None
        if acc.is_main_process:
            def export(tmp: Path):
                if self.cfg.lora.enabled:
                    self.policy.save_lora(tmp / "lora")
                    if self.ema is not None:
                        with self.ema.swapped_in(self.params):
                            self.policy.save_lora(tmp / "ema_lora")

            path = save_checkpoint(
                self.run.checkpoints,
                self.iteration,
                self.params,
                self.optimizer.state_dict(),
                self.ema.shadow if self.ema is not None else None,
                {"policy_version": self.iteration, "num_processes": acc.num_processes},
                export=export,
                allocator_state=self.allocator.state_dict(),
            )
            self.run.plot_reward_curve(self.run.read_metrics())
        acc.wait_for_everyone()
        return path

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.run.checkpoints)
        if ckpt is None:
            raise UserError(f"--resume: '{self.run.path}' has no checkpoint to resume from (expected {self.run.checkpoints}/latest)")
        data = load_checkpoint(ckpt)
        missing = set(self.params) ^ set(data["params"])
        if missing:
            raise UserError(f"--resume: checkpoint '{ckpt}' does not match the configured model ({len(missing)} mismatched weights)")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(data["params"][n])
        self.optimizer.load_state_dict(data["optimizer"])
        if data["allocator"] is not None:
            self.allocator.load_state_dict(data["allocator"])
        if self.ema is not None and data["ema"] is not None:
            self.ema.shadow = {n: t.clone() for n, t in data["ema"].items()}
        restore_rng(data["rng"], data["state"]["python_random"])
        self.iteration = int(data["state"]["iteration"])
        if self.accelerator.is_main_process:
            self.history = self.run.truncate_metrics(self.iteration)
        else:
            self.history = [r for r in self.run.read_metrics() if r["iteration"] < self.iteration]
