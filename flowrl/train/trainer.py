"""Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL"):
G SDE samples per prompt, rewards, group-normalised advantages, a PPO-clipped loss over the
trained denoising transitions plus the exact Gaussian KL to the reference (LoRA disabled).

One iteration: rollout -> decode -> reward -> gather -> advantages -> inner epochs of
updates. Every random draw is keyed by (seed, iteration, sample, step), so a resumed run
repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm.auto import tqdm

from flowrl.config import Config
from flowrl.core import clipped_policy_loss, gaussian_kl, nft_loss, optimality_probability
from flowrl.core.advantages import estimate_advantages, unit_scale_per_group
from flowrl.core.allocation import make_allocator
from flowrl.core.losses import PolicyLoss
from flowrl.core.lr_schedule import lr_factor
from flowrl.core.tree import depthwise_advantages, fuse_rewards, level_counts, trained_depths, width_prune
from flowrl.errors import UserError
from flowrl.models import load_policy
from flowrl.sampling.precision import autocast_precision, check_training_precision
from flowrl.sampling.noise import seeded_noise
from flowrl.sampling.rollout import SamplerSpec, Trajectory, policy_precision, rollout, transition
from flowrl.sampling.steps import StepOutput
from flowrl.sampling.schedules import shifted_sigmas, stratified_sigma, window_mask
from flowrl.sampling.tree import TreeTrajectory, edge_children, parent_batches, tree_edges, tree_rollout, tree_spec
from flowrl.train.checkpoint import latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint
from flowrl.train.ema import EMA
from flowrl.train.evaluate import shapes_category_table
from flowrl.train.images import save_grid
from flowrl.train.prompts import load_prompts
from flowrl.train.run_dir import RunDir
from rewards import AsyncRewardRunner, MultiReward


class Stage(NamedTuple):
    """One allocation stage: this process's trajectory and the gathered, unpadded rewards."""

    traj: Trajectory  # this process's slice (may end with padding copies)
    rewards: torch.Tensor  # [n, K] every process's real samples, in stage order
    prompt_ids: torch.Tensor  # [n] pool indices of the real samples
    positions: torch.Tensor  # [n_local] stage positions of this process's samples (>= n: padding)
    reward_time: float  # seconds inside reward calls (overlapping the sampling of later batches)
    reward_wait: float  # seconds spent waiting for rewards after the last batch was sampled
    valid: torch.Tensor  # [n] bool: False where the reward output was invalid (reward.on_invalid: drop)


class MicroBatch(NamedTuple):
    """One forward of the policy over stored transitions: `evaluate()` recomputes them (with
    grad; under `policy.reference()` it gives the reference); `keep` masks the edges that carry
    gradient (None: all)."""

    evaluate: Callable[[], StepOutput]
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    keep: torch.Tensor | None = None


class TreeBatch(NamedTuple):
    """One iteration's trees on this process (BranchGRPO) and what training needs of them."""

    tree: TreeTrajectory  # this process's trees (may end with padding copies)
    rewards: torch.Tensor  # [n_trees x G, K] every process's real leaves, in tree order
    prompt_ids: torch.Tensor  # [n_trees x G] pool index of each real leaf
    advantages: list[torch.Tensor]  # per level [n_t]: depth-wise, clipped; 0 on padding trees
    real: torch.Tensor  # [n_local_trees] bool: False for padding copies
    num_trees: int  # real trees over all processes
    reward_time: float


NFT_NOISE_KEY = -1_000  # below every sampling key (steps >= 0, INITIAL = -1): NFT's forward-process noise is its own


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
        from accelerate import Accelerator, DistributedDataParallelKwargs, PartialState
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
        self.mixed_precision = autocast_precision(t.mixed_precision, cpu)
        self.accelerator = Accelerator(
            mixed_precision=self.mixed_precision,
            cpu=cpu,
            log_with=None if cfg.run.tracker == "none" else cfg.run.tracker,
            project_dir=str(self.run.path),
            # DDP would broadcast the transformer's buffers (constant position embeddings) in every
            # forward: a collective that hangs when only rank 0 samples (grids, evals)
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
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
        # DiffusionNFT's old policy when it is not the current weights: it samples, and gives v_old
        self.nft_old = EMA(self.params, t.nft_old_decay) if t.objective == "nft" and t.nft_old_policy == "sampling" else None
        self.reward_fn = MultiReward.from_config(cfg.reward, rewards=rewards)
        self.reward_runner = AsyncRewardRunner(self.reward_fn)
        self.iteration = 0
        self.history: list[dict] = []
        self.two_stage = None
        if cfg.rollout.kind == "two_stage":
            from flowrl.train.two_stage import TwoStage

            self.two_stage = TwoStage(self)  # owns the low-precision exploration copy

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
    def sample_stage(self, prompt_ids: list[int], seeds: list[int], spec: SamplerSpec, desc: str, policy=None) -> Stage:
        """Sample one allocation stage, split across processes, and gather its rewards (with
        `policy`, default the trained one; two-stage exploration passes its low-precision copy).
        The stage is padded with copies of its last sample to a multiple of the process count,
        so every process runs the same number of batches (DDP needs equal backward counts);
        the copies get zero advantage and count toward nothing."""
        cfg, acc = self.cfg, self.accelerator
        n = len(prompt_ids)
        pad = (-n) % acc.num_processes
        prompt_ids, seeds = prompt_ids + prompt_ids[-1:] * pad, seeds + seeds[-1:] * pad
        n_local = len(seeds) // acc.num_processes
        local = slice(acc.process_index * n_local, (acc.process_index + 1) * n_local)
        local_prompts = [self.prompts[i] for i in prompt_ids[local]]
        busy_before = self.reward_runner.reward_seconds

        def score(batch: slice, final: torch.Tensor) -> None:  # on a worker thread, while the next batch samples
            self.reward_runner.submit_with_mask(self.policy.decode(final), local_prompts[batch])

        traj = rollout(
            policy if policy is not None else self.policy,
            local_prompts,
            seeds[local],
            spec,
            cfg.sampling.batch_size,
            prompt_ids=prompt_ids[local],
            group_ids=prompt_ids[local],
            policy_version=self.iteration,
            progress=cfg.run.progress and acc.is_local_main_process,
            desc=desc,
            on_batch=score,
        )
        t_sampled = time.perf_counter()
        results = self.reward_runner.wait_all()
        wait = time.perf_counter() - t_sampled
        local_rewards = torch.cat([r[0] for r in results])
        local_valid = torch.cat([r[1] for r in results])
        # group statistics need everyone's samples
        rewards = acc.gather(local_rewards.to(acc.device)).cpu()[:n]
        valid = acc.gather(local_valid.to(acc.device)).cpu()[:n]
        positions = torch.arange(local.start, local.stop)
        return Stage(traj, rewards, torch.tensor(prompt_ids[:n]), positions,
                     self.reward_runner.reward_seconds - busy_before, wait, valid)

    def sample_allocated(self, it: int, spec: SamplerSpec) -> list[Stage]:
        """One iteration's rollouts in allocation stages: the allocator decides, we sample, it sees
        the outcomes, repeat."""
        stages: list[Stage] = []
        n_prompts = len(self.prompts)
        totals = torch.zeros(n_prompts, dtype=torch.long)
        extra = self.allocator.first_stage(it)
        while int(extra.sum()) > 0:
            ids = torch.repeat_interleave(torch.arange(n_prompts), extra).tolist()
            offset = int(totals.sum())
            seeds = [sample_seed(self.cfg.trainer.seed, it, offset + j) for j in range(len(ids))]
            stages.append(self.sample_stage(ids, seeds, spec, desc=f"iter {it} sampling" + (f" (stage {len(stages) + 1})" if stages else "")))
            totals += extra
            seen = torch.cat([st.prompt_ids for st in stages])
            ok = self.successes(torch.cat([st.rewards for st in stages]) @ self.reward_fn.channel_weights)
            successes = torch.bincount(seen, weights=ok.double(), minlength=n_prompts).long()
            extra = self.allocator.next_stage(totals, successes, totals - successes)
        return stages

    def train_iteration(self) -> dict:
        if self.cfg.rollout.kind == "tree":
            return self.tree_iteration()
        if self.cfg.rollout.kind == "two_stage":
            return self.two_stage.iteration()
        cfg, it = self.cfg, self.iteration
        t0 = time.perf_counter()
        spec = self.sampler_spec(it)
        weights = self.reward_fn.channel_weights
        self.policy.transformer.eval()

        with self.nft_old.swapped_in(self.params) if self.nft_old is not None else contextlib.nullcontext():
            stages = self.sample_allocated(it, spec)
        t_sample = time.perf_counter()
        t_reward = sum(st.reward_time for st in stages)

        rewards = torch.cat([st.rewards for st in stages])
        prompt_ids = torch.cat([st.prompt_ids for st in stages])
        valid = torch.cat([st.valid for st in stages])
        if not valid.any():
            raise UserError(f"every reward output of iteration {it} was invalid (NaN, inf or misshapen); see reward.on_invalid")
        a = cfg.advantage
        # samples with invalid rewards (reward.on_invalid: drop) take no part: zero advantage
        adv = estimate_advantages(a.kind, rewards[valid], prompt_ids[valid], weights, a.std, a.eps, a.clip)
        advantages = torch.zeros(len(valid))
        advantages[valid] = adv.advantages.float()
        if cfg.trainer.objective == "nft" and cfg.trainer.nft_r_scale == "group_max":
            advantages[valid] = unit_scale_per_group(advantages[valid], prompt_ids[valid])
        self.allocator.observe(prompt_ids[valid], self.successes(rewards[valid] @ weights))
        batches, offset = [], 0
        for st in stages:  # each process's slice of every stage, padding copies at zero advantage
            n = len(st.prompt_ids)
            local_adv = torch.zeros(len(st.positions))
            real = st.positions < n
            local_adv[real] = advantages[offset + st.positions[real]]
            batches.append((st.traj, local_adv))
            offset += n
        stats = self.update(batches, spec)
        t_train = time.perf_counter()

        total = rewards[valid] @ weights
        sizes = torch.bincount(prompt_ids, minlength=len(self.prompts))
        sizes = sizes[sizes > 0]
        row = {
            "iteration": it,
            "reward_mean": total.mean().item(),
            "reward_std": total.std(unbiased=False).item(),
            **self.reward_columns(rewards[valid], prompt_ids[valid]),
            "dropped_samples": int((~valid).sum()),
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
            # rewards run on a worker thread while later batches sample: time_reward overlaps
            # time_sampling, and only time_reward_wait (after the last batch) is not hidden
            "time_sampling": t_sample - t0,
            "time_reward": t_reward,
            "time_reward_wait": sum(st.reward_wait for st in stages),
            "time_training": t_train - t_sample,
        }
        self.iteration += 1
        row["time_iteration"] = time.perf_counter() - t0
        return row

    def reward_columns(self, rewards: torch.Tensor, prompt_ids: torch.Tensor) -> dict[str, float]:
        """Metrics of an iteration's rewards [N, K]: the mean of every channel, and with the
        shapes reward the strict mean per GenEval category (`strict/<category>`), so a run shows
        which categories RL moves (the overall mean hides a gain in one behind a loss in another)."""
        names = self.reward_fn.channel_names
        out = {f"reward/{c}": rewards[:, k].mean().item() for k, c in enumerate(names)}
        table = shapes_category_table([self.prompts[i] for i in prompt_ids.tolist()], list(names), rewards)
        out.update({f"strict/{c}": t["strict"] for c, t in (table or {}).items() if c != "overall"})
        return out

    def successes(self, total_rewards: torch.Tensor) -> torch.Tensor:
        """Pass/fail for the allocator: above allocator.success_threshold, or above the mean of
        the iteration's rewards so far when no threshold is set (continuous rewards)."""
        threshold = self.cfg.allocator.success_threshold
        return total_rewards > (total_rewards.mean() if threshold is None else threshold)

    def update(self, batches: list[tuple[Trajectory, torch.Tensor]], spec: SamplerSpec) -> dict:
        """Flat rollouts: one micro-batch per (sample batch, trained step); a sample batch is
        the unit of gradient accumulation. Micro-batches are exactly the sampling batches, so
        the first forward reproduces the behaviour log-probs bit for bit and the ratio starts at 1.
        Refuses any trajectory not sampled in the training precision (Sol-RL's guard: a log-prob
        ratio between precisions is not the policy's). NFT takes no log-probs; it trains on the
        clean samples of any sampler and precision."""
        if self.cfg.trainer.objective == "nft":
            return self.update_nft(batches)
        for traj, _ in batches:
            check_training_precision(traj.precision, policy_precision(self.policy))
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

    def update_nft(self, batches: list[tuple[Trajectory, torch.Tensor]]) -> dict:
        """DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): flow matching on the clean samples,
        pulled toward the better-than-group ones and pushed from the worse (flowrl.core.nft_loss).
        Each sample batch is noised afresh at `trainer.nft_timesteps` sigmas, stratified inside
        lora.sigma_range (where the adapter acts), and makes one optimizer step, for
        `trainer.inner_epochs` passes. The old policy v_old is, with `nft_old_policy: current`, the
        weights before each step (its detached prediction: the gradient is then (2r - 1) beta times
        the plain flow-matching gradient); with `sampling`, the weights that sampled the iteration,
        which stay fixed through its steps, so the loss's minimiser v_old + (2r - 1)(u - v_old) / beta
        bounds how far an iteration can move, and are soft-updated after it."""
        cfg, acc, t = self.cfg, self.accelerator, self.cfg.trainer
        bs, k_steps = cfg.sampling.batch_size, t.nft_timesteps
        low, high = self.policy.lora_sigma_range or (0.0, 1.0)
        gen = torch.Generator().manual_seed(sample_seed(t.seed, self.iteration, 999_979))
        work = [(traj, slice(start, start + bs), optimality_probability(adv))
                for traj, adv in batches for start in range(0, len(traj), bs)]
        losses, grad_norms, kls, sigmas = [], [], [], []
        needs_old = t.nft_negatives or t.nft_beta != 1.0  # the positive half alone at beta 1 trains v+ = v: no v_old
        self.policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * len(work) * k_steps, desc=f"iter {self.iteration} training", leave=False,
                   disable=not (cfg.run.progress and acc.is_local_main_process), unit="step")
        with self.policy.guidance(t.nft_guidance_scale):  # the velocity the loss trains
            for epoch in range(t.inner_epochs):
                for wi in torch.randperm(len(work), generator=gen).tolist():
                    traj, c, r = work[wi]
                    x0 = traj.final[c].to(acc.device, torch.float32)  # a low-precision explorer's samples too
                    cond = self.policy.encode(traj.prompts[c])
                    seeds = traj.seeds[c].tolist()
                    for k in range(k_steps):
                        sigma = stratified_sigma(k, k_steps, low, high, t.nft_sigma_shift, gen)
                        sigmas.append(sigma)
                        eps = seeded_noise(seeds, NFT_NOISE_KEY - epoch * k_steps - k, x0.shape[1:], acc.device)
                        x_t = (1 - sigma) * x0 + sigma * eps
                        v_old = None
                        if self.nft_old is not None and needs_old:  # before the forward with grad: the swap writes the weights in place
                            with torch.no_grad(), self.nft_old.swapped_in(self.params):
                                v_old = self.policy.velocity(x_t, sigma, cond)
                        with contextlib.nullcontext() if k == k_steps - 1 else acc.no_sync(self.policy.net):
                            v = self.policy.velocity(x_t, sigma, cond)
                            loss = nft_loss(v, v.detach() if v_old is None else v_old, eps - x0, r[c].to(acc.device), t.nft_beta,
                                            sigma=sigma if t.nft_adaptive_weight else None, negatives=t.nft_negatives).mean()
                            if t.kl_beta > 0:  # anchor to the reference: the velocity's squared distance to the base network's
                                with torch.no_grad(), self.policy.reference():
                                    v_ref = self.policy.velocity(x_t, sigma, cond)
                                kl = ((v - v_ref) ** 2).mean()
                                kls.append(kl.item())
                                loss = loss + t.kl_beta * kl
                            acc.backward(loss / k_steps)
                        losses.append(loss.item())
                        bar.update(1)
                    grad_norms.append(self.optimizer_step())
        bar.close()
        self.policy.transformer.eval()
        if self.nft_old is not None:
            self.nft_old.update(self.params, decay=min(t.nft_old_decay, t.nft_old_decay_rate * self.iteration))
        return {"loss": sum(losses) / max(len(losses), 1), "kl": sum(kls) / max(len(kls), 1), "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                "optimizer_steps": len(grad_norms), "trained_transitions": len(losses), "lr": self.optimizer.param_groups[0]["lr"],
                "nft_sigma_mean": sum(sigmas) / max(len(sigmas), 1)}

    def optimizer_step(self) -> float:
        """Clip, step, zero, update the EMA; returns the gradient norm before clipping."""
        norm = float(self.accelerator.clip_grad_norm_(list(self.params.values()), self.cfg.trainer.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.params)
        return norm

    def micro_batch_loss(self, mb: MicroBatch, reduction: str) -> tuple[torch.Tensor, PolicyLoss | None, torch.Tensor]:
        """(loss, policy-loss terms, KL) of one micro-batch over its kept transitions: the PPO-clipped
        surrogate, plus beta x the exact Gaussian KL to the reference (the adapter disabled).
        With nothing kept: (a zero loss that still reaches every weight, None, 0)."""
        acc, t = self.accelerator, self.cfg.trainer
        clip_hi = t.clip_range_high if t.clip_range_high is not None else t.clip_range
        out = mb.evaluate()
        if mb.keep is not None and not bool(mb.keep.any()):
            # nothing kept: a zero loss, after the same forwards as any micro-batch (under DDP every
            # forward may broadcast buffers, so all processes must run the same number)
            if t.kl_beta > 0:
                with torch.no_grad(), self.policy.reference():
                    mb.evaluate()
            return out.log_prob.sum() * 0.0, None, torch.zeros((), device=acc.device)
        keep = mb.keep.to(acc.device) if mb.keep is not None else slice(None)
        old, adv = mb.old_log_prob.to(acc.device)[keep], mb.advantages.to(acc.device)[keep]
        pl = clipped_policy_loss(out.log_prob[keep], old, adv, t.clip_range, clip_hi)
        loss = pl.loss
        kl = torch.zeros((), device=acc.device)
        if t.kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                ref = mb.evaluate()
            kl = gaussian_kl(out.mean[keep], ref.mean[keep], out.std, reduction).mean()
            loss = loss + t.kl_beta * kl
        return loss, pl, kl

    def optimize(self, groups: list[list[MicroBatch]], reduction: str, per_transition: bool = False) -> dict:
        """Inner epochs of PPO-clipped updates (+ beta x exact Gaussian KL to the reference).
        Groups are shuffled each epoch; `trainer.gradient_accumulation_steps` groups make one
        optimizer step; under DDP, gradients are synchronised only on the step's last backward.
        Each micro-batch's loss is a mean over its kept transitions; within an optimizer step
        every micro-batch weighs the same (flat: equal sizes), or with `per_transition` every
        kept transition does (trees: micro-batches differ in size). A micro-batch with nothing
        kept gets a zero backward (so every process runs the same backwards) and no statistics."""
        cfg, acc, t = self.cfg, self.accelerator, self.cfg.trainer
        accum = t.gradient_accumulation_steps
        gen = torch.Generator().manual_seed(sample_seed(t.seed, self.iteration, 999_983))
        sums = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "ratio_mean": 0.0, "clipfrac": 0.0}
        count, grad_norms, first_ratio_dev = 0, [], None
        kept = [[len(mb.advantages) if mb.keep is None else int(mb.keep.sum()) for mb in g] for g in groups]
        self.policy.transformer.train()
        bar = tqdm(total=t.inner_epochs * sum(len(g) for g in groups), desc=f"iter {self.iteration} training", leave=False,
                   disable=not (cfg.run.progress and acc.is_local_main_process), unit="step")
        for epoch in range(t.inner_epochs):
            order = torch.randperm(len(groups), generator=gen).tolist()
            for gi, group_index in enumerate(order):
                group = groups[group_index]
                closes_step = (gi + 1) % accum == 0 or gi == len(order) - 1
                first = (gi // accum) * accum
                step_len = min(accum, len(order) - first)  # the last step's share may be short
                step_kept = sum(sum(kept[j]) for j in order[first : first + step_len])
                for k, mb in enumerate(group):
                    sync = closes_step and k == len(group) - 1
                    with contextlib.nullcontext() if sync else acc.no_sync(self.policy.net):
                        loss, pl, kl = self.micro_batch_loss(mb, reduction)
                        if pl is None:  # nothing kept: zero gradient, no statistics
                            acc.backward(loss)
                            bar.update(1)
                            continue
                        if per_transition:
                            acc.backward(loss * (kept[group_index][k] / step_kept))
                        else:
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
                    grad_norms.append(self.optimizer_step())
        bar.close()
        self.policy.transformer.eval()
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out.update(grad_norm=sum(grad_norms) / max(len(grad_norms), 1), first_ratio_deviation=first_ratio_dev or 0.0,
                   optimizer_steps=len(grad_norms), trained_transitions=count, lr=self.optimizer.param_groups[0]["lr"])
        return out

    # ---- trees (BranchGRPO) -------------------------------------------------------------
    def tree_sampler_spec(self, iteration: int) -> SamplerSpec:
        """between=sde: every step stochastic; window (BranchGRPO-Mix): the flat SDE window of
        this iteration; ode: none. Split steps are stochastic in every case."""
        spec = self.sampler_spec(iteration)  # sampling.window is 'all' unless between=window (validated)
        if self.cfg.rollout.tree.between == "ode":
            spec.sde_steps = torch.zeros_like(spec.sde_steps)
        return tree_spec(spec, self.cfg.rollout.splits())

    def sample_trees(self, iteration: int, spec: SamplerSpec) -> TreeBatch:
        """One tree per prompt the allocator picks (uniform), trees split across processes and
        padded with copies of the last one (zero advantage, never trained) so every process runs
        the same forwards. Rewards of the leaves are fused up the tree and turned into depth-wise
        advantages; both only involve one tree, so each process does its own."""
        cfg, acc = self.cfg, self.accelerator
        g, bs, tr = cfg.data.group_size, cfg.sampling.batch_size, cfg.rollout.tree
        counts = self.allocator.first_stage(iteration)
        ids = torch.repeat_interleave(torch.arange(len(self.prompts)), counts // g).tolist()
        n = len(ids)
        # the root noise of tree k is that of the flat group's first sample (seed index k x G)
        seeds = [sample_seed(cfg.trainer.seed, iteration, k * g) for k in range(n)]
        pad = (-n) % acc.num_processes
        ids, seeds = ids + ids[-1:] * pad, seeds + seeds[-1:] * pad
        n_local = len(ids) // acc.num_processes
        local = slice(acc.process_index * n_local, (acc.process_index + 1) * n_local)
        tree = tree_rollout(self.policy, [self.prompts[i] for i in ids[local]], seeds[local], spec, cfg.rollout.splits(), bs,
                            prompt_ids=ids[local], progress=cfg.run.progress and acc.is_local_main_process,
                            desc=f"iter {iteration} tree sampling")
        t_sampled = time.perf_counter()
        images = torch.cat([self.policy.decode(tree.leaves[i : i + bs]) for i in range(0, len(tree.leaves), bs)])
        local_rewards = self.reward_fn(images, [tree.prompts[i] for i in tree.tree_ids[-1].tolist()])
        rewards = acc.gather(local_rewards.to(acc.device)).cpu()[: n * g]  # process-major = tree order; padding last
        reward_time = time.perf_counter() - t_sampled

        real = torch.arange(local.start, local.stop) < n
        values = fuse_rewards(tree.parents, local_rewards.float().cpu() @ self.reward_fn.channel_weights, tr.fusion, tree.log_probs)
        clip = cfg.advantage.clip
        advantages = [torch.where(real[t_ids], a.clamp(-clip, clip), torch.zeros_like(a))
                      for a, t_ids in zip(depthwise_advantages(values, tree.tree_ids, cfg.advantage.eps), tree.tree_ids)]
        prompt_ids = torch.tensor(ids[:n]).repeat_interleave(g)
        return TreeBatch(tree, rewards, prompt_ids, advantages, real, n, reward_time)

    def tree_keep(self, batch: TreeBatch, iteration: int) -> list[torch.Tensor | None]:
        """Per step t, the mask over level t + 1 of the edges that carry gradient, or None where
        the step is not trained at all: ODE steps, depth 0, pruned depths and depths outside the
        sliding depth window. Width pruning keeps, per tree, the last depth's edges with the
        largest |A| (the split edges of the last split and every edge after it)."""
        tr, tree = self.cfg.rollout.tree, batch.tree
        depth_of_step = tree.depth_of_step
        depths = len(tree.splits)
        trained = trained_depths(depths, tr.prune_depths, tr.depth_window, tr.depth_window_shift_every, iteration)
        width = width_prune(batch.advantages[-1], tree.tree_ids[-1], tr.width_keep) if tr.width_keep < 1 else None
        keep: list[torch.Tensor | None] = []
        for t in range(tree.num_steps):
            d = int(depth_of_step[t])
            if not bool(tree.stochastic[t]) or not bool(trained[d]):
                keep.append(None)
                continue
            k = batch.real[tree.tree_ids[t + 1]].clone()
            if width is not None and d == depths:
                k &= width  # after the last split, level t + 1 holds the leaves' ancestors one to one, in leaf order
            keep.append(k)
        return keep

    def tree_groups(self, batch: TreeBatch, spec: SamplerSpec, keep: list[torch.Tensor | None]) -> list[list[MicroBatch]]:
        """One micro-batch (and accumulation group) per (trained step, sampling batch of parents):
        the forward of the sampling batch again, so the first ratio is exactly 1. Alone, a
        micro-batch whose edges are all pruned is skipped (pruning saves its forward); with
        several processes it stays, with a zero backward, so all run the same backwards."""
        tree, bs = batch.tree, self.cfg.sampling.batch_size
        skip_empty = self.accelerator.num_processes == 1
        groups = []
        for t, k in enumerate(keep):
            if k is None:
                continue
            for parents in parent_batches(len(tree.levels[t]), bs):
                children = edge_children(tree, t, parents)
                if skip_empty and not bool(k[children].any()):
                    continue
                groups.append([MicroBatch(lambda t=t, parents=parents: tree_edges(self.policy, tree, spec, t, parents)[0],
                                          tree.log_probs[t][children], batch.advantages[t + 1][children], k[children])])
        return groups

    def tree_iteration(self) -> dict:
        """BranchGRPO (Li et al., arXiv:2509.06040): sample a tree per prompt, reward the leaves,
        fuse rewards up the tree, depth-wise advantages, PPO-clipped updates on the kept SDE edges."""
        cfg, acc, it = self.cfg, self.accelerator, self.iteration
        t0 = time.perf_counter()
        self.policy.transformer.eval()
        spec = self.tree_sampler_spec(it)
        batch = self.sample_trees(it, spec)
        t_sample = time.perf_counter()
        total = batch.rewards @ self.reward_fn.channel_weights
        self.allocator.observe(batch.prompt_ids, self.successes(total))
        keep = self.tree_keep(batch, it)
        groups = self.tree_groups(batch, spec, keep)
        stats = self.optimize(groups, spec.reduction, per_transition=True)
        t_train = time.perf_counter()

        tree, g, n = batch.tree, cfg.data.group_size, batch.num_trees
        local_kept = sum(int(k.sum()) for k in keep if k is not None)
        kept = int(acc.gather(torch.tensor([local_kept], device=acc.device)).sum())
        per_depth = {}
        counts = level_counts(tree.num_steps, tree.splits)
        for d, s in enumerate(sorted(tree.splits), start=1):
            a = acc.gather(batch.advantages[s + 1].to(acc.device)).cpu()[: n * counts[s + 1]]  # real trees only
            per_depth[f"adv_abs_mean/depth{d}"] = a.abs().mean().item()
            per_depth[f"adv_std/depth{d}"] = a.std(unbiased=False).item()
        leaf_adv = acc.gather(batch.advantages[-1].to(acc.device)).cpu()[: n * g]
        by_tree = total.view(n, g)
        row = {
            "iteration": it,
            "reward_mean": total.mean().item(),
            "reward_std": total.std(unbiased=False).item(),
            **self.reward_columns(batch.rewards, batch.prompt_ids),
            "adv_abs_mean": leaf_adv.abs().mean().item(),
            "degenerate_groups": (by_tree.amax(1) == by_tree.amin(1)).float().mean().item(),
            "samples": n * g,
            "prompts": int(batch.prompt_ids.unique().numel()),
            "trees": n,
            "nfe_per_leaf": tree.nfe / len(tree.leaves),
            "trained_steps": sum(k is not None for k in keep),
            **stats,
            "trained_transitions": kept,  # kept edges per inner epoch, all processes
            "training_forwards": len(groups),  # micro-batches per inner epoch, this process
            **per_depth,
            "time_sampling": t_sample - t0 - batch.reward_time,
            "time_reward": batch.reward_time,
            "time_training": t_train - t_sample,
        }
        self.iteration += 1
        row["time_iteration"] = time.perf_counter() - t0
        return row

    # ---- the loop -----------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg, acc = self.cfg, self.accelerator
        r = cfg.run
        bar = tqdm(total=cfg.trainer.iterations, initial=self.iteration, desc="flowrl train", unit="iter",
                   disable=not (r.progress and acc.is_local_main_process))
        if self.iteration == 0 and r.sample_every:
            self.save_samples("iter_000000_before")
        started = time.perf_counter()
        budget_s = cfg.trainer.max_minutes * 60
        out_of_time = False
        while self.iteration < cfg.trainer.iterations and not out_of_time:
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.trainer.lr * lr_factor(cfg.trainer.lr_schedule, self.iteration, cfg.trainer.iterations)
            row = self.train_iteration()
            self.history.append(row)
            acc.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "iteration"}, step=row["iteration"])
            if acc.is_main_process:
                self.run.append_metrics(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.4g}", kl=f"{row['kl']:.2e}")
            if budget_s:  # every process calls the broadcast, so all agree with rank 0's clock
                from accelerate.utils import broadcast_object_list

                out_of_time = bool(broadcast_object_list([time.perf_counter() - started >= budget_s])[0])
            done = self.iteration >= cfg.trainer.iterations or out_of_time
            if r.sample_every and (self.iteration % r.sample_every == 0 or done):
                self.save_samples(f"iter_{self.iteration:06d}")
            if done or (r.checkpoint_every and self.iteration % r.checkpoint_every == 0):
                self.save()
        bar.close()
        self.reward_runner.close()
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
                allocator=self.allocator.state_dict(),
                nft_old=self.nft_old.shadow if self.nft_old is not None else None,
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
        if self.nft_old is not None:
            if data["nft_old"] is None:
                raise UserError(f"--resume: checkpoint '{ckpt}' has no nft_old.safetensors, which trainer.nft_old_policy sampling needs")
            self.nft_old.shadow = {n: t.clone() for n, t in data["nft_old"].items()}
        restore_rng(data["rng"], data["state"]["python_random"])
        self.iteration = int(data["state"]["iteration"])
        if self.accelerator.is_main_process:
            self.history = self.run.truncate_metrics(self.iteration)
        else:
            self.history = [r for r in self.run.read_metrics() if r["iteration"] < self.iteration]
