"""Sol-RL, "FP4 explore, BF16 train" (rollout.kind: two_stage; ALGORITHMS.md section 5).

One iteration:
  1. resync the exploration copy with the trained adapter (merged into the quantised base);
  2. stage 1: M candidates per prompt from recorded seeds, sampled by the copy (the training
     sampler, or a P-step ODE preview) and scored;
  3. select K per prompt with `selection.kind` on the stage-1 rewards;
  4. stage 2: regenerate exactly those seeds with the training policy (the initial and the
     per-step noise come from (seed, step)-keyed generators, so a chain is replayed, not
     resampled), score them, and train on them alone, with advantages from their own rewards.
Every `fidelity_every` iterations the whole pool is regenerated instead, and the rank
correlations of low- and full-precision rewards of the same seeds are logged; the selected
samples are then taken from that regeneration. Nothing sampled by the copy reaches a log-prob
ratio: the config refuses it, and the trainer's GRPO update refuses any trajectory not in the
training precision. DiffusionNFT (trainer.objective nft) may skip stage 2
(`regenerate: false`): it flow-matches the clean samples of any sampler, so a cheap copy's
candidates are training data as they are. With `nft_old_policy: sampling` the copy is merged
from the old weights, which sample in the flat path too.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from flowrl.core.advantages import estimate_advantages
from flowrl.core.correlation import grouped, kendall_tau, spearman
from flowrl.core.selection import select_per_group
from flowrl.errors import UserError
from flowrl.sampling.precision import ExplorationCopy
from flowrl.sampling.rollout import SamplerSpec, policy_precision
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.train.trainer import Stage, sample_seed  # trainer.py imports this module lazily


def subset_stage(stage, selected: torch.Tensor, num_processes: int, process_index: int):
    """The samples of `stage` at the (sorted, global) stage positions `selected`, as a Stage of
    their own: each process keeps the selected samples it holds, padded with zero-advantage
    copies to the largest count over processes (every process can count them all, as every
    process knows the selection), so all run the same number of micro-batches."""
    n, pool_n = len(selected), len(stage.prompt_ids)
    n_local = len(stage.positions)
    rank_of = {int(p): i for i, p in enumerate(selected.tolist())}
    rows = [r for r, p in enumerate(stage.positions.tolist()) if p < pool_n and p in rank_of]
    per_process = [sum(1 for p in selected.tolist() if q * n_local <= p < (q + 1) * n_local) for q in range(num_processes)]
    pad = max(per_process) - len(rows)
    positions = [rank_of[int(stage.positions[r])] for r in rows] + [n] * pad
    rows = rows + [rows[-1] if rows else 0] * pad
    return Stage(stage.traj.subset(rows), stage.rewards[selected], stage.prompt_ids[selected], torch.tensor(positions, dtype=torch.long),
                 stage.reward_time, stage.reward_wait, stage.valid[selected])


def spread(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[float, float]:
    """(mean within-group std, mean within-group max - min) of `values`."""
    stds, ranges = [], []
    for g in torch.unique(group_ids).tolist():
        v = values[group_ids == g].double()
        stds.append(float(v.std(unbiased=False)) if v.numel() > 1 else 0.0)
        ranges.append(float(v.max() - v.min()))
    return sum(stds) / len(stds), sum(ranges) / len(ranges)


class TwoStage:
    """The two-stage iteration of a GRPOTrainer (its sampling, reward, advantage and update
    machinery), with the exploration copy it owns."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg.rollout.two_stage
        self.explorer = ExplorationCopy(trainer.policy, self.cfg.explore_precision, self.cfg.backend, self.cfg.high_precision_layers)

    def explore_spec(self, spec: SamplerSpec) -> SamplerSpec:
        p = self.cfg.preview_steps
        if not p:
            return spec
        return SamplerSpec(shifted_sigmas(p, self.trainer.cfg.sampling.shift), torch.zeros(p, dtype=torch.bool), "ode")

    def iteration(self) -> dict:
        tr, ts = self.trainer, self.cfg
        cfg, acc, it = tr.cfg, tr.accelerator, tr.iteration
        t0 = time.perf_counter()
        tr.policy.transformer.eval()
        spec, weights = tr.sampler_spec(it), tr.reward_fn.channel_weights
        k_group = cfg.data.group_size
        counts = tr.allocator.first_stage(it)  # uniform (validated): K per chosen prompt
        pool_ids = torch.repeat_interleave(torch.arange(len(tr.prompts)), counts // k_group * ts.candidates).tolist()
        seeds = [sample_seed(cfg.trainer.seed, it, j) for j in range(len(pool_ids))]
        explore_spec = self.explore_spec(spec)

        # nft_old_policy sampling: the soft-updated old weights sample (the copy is merged from them too)
        with tr.nft_old.swapped_in(tr.params) if tr.nft_old is not None else contextlib.nullcontext():
            resync_s = self.explorer.resync()
            # stage 1: explore
            t1 = time.perf_counter()
            pool = tr.sample_stage(pool_ids, seeds, explore_spec, desc=f"iter {it} exploring ({self.explorer.label or 'policy'})",
                                   policy=self.explorer.policy)
            explore_s = time.perf_counter() - t1 - pool.reward_wait
            explore_total = pool.rewards.float() @ weights
            gen = torch.Generator().manual_seed(sample_seed(cfg.trainer.seed, it, 777_767))
            selected = select_per_group(tr.cfg.selection.kind, explore_total, pool.prompt_ids,
                                        {int(p): int(counts[p]) for p in pool.prompt_ids.unique()}, pool.valid, gen)

            # stage 2: regenerate the selected seeds in the training precision (or the whole pool, to measure fidelity)
            t2 = time.perf_counter()
            fidelity = {}
            if not ts.regenerate:  # training-precision samples of the training sampler, or nft's clean samples (validated)
                train_stage, regenerated = subset_stage(pool, selected, acc.num_processes, acc.process_index), 0
            elif ts.fidelity_every and it % ts.fidelity_every == 0:
                full = tr.sample_stage(pool_ids, seeds, spec, desc=f"iter {it} regenerating the pool")
                fidelity = self.fidelity(explore_total, full.rewards.float() @ weights, pool.valid & full.valid, pool.prompt_ids)
                train_stage, regenerated = subset_stage(full, selected, acc.num_processes, acc.process_index), len(pool_ids)
            else:
                train_stage = tr.sample_stage([pool_ids[i] for i in selected.tolist()], [seeds[i] for i in selected.tolist()], spec,
                                              desc=f"iter {it} regenerating")
                regenerated = len(selected)
            regen_s = time.perf_counter() - t2 - (train_stage.reward_wait if regenerated else 0.0)
        t_sample = time.perf_counter()

        # train on the regenerated samples, with advantages from their own rewards
        rewards, prompt_ids, valid = train_stage.rewards, train_stage.prompt_ids, train_stage.valid
        if not valid.any():
            raise UserError(f"every reward output of iteration {it} was invalid (NaN, inf or misshapen); see reward.on_invalid")
        a = cfg.advantage
        adv = estimate_advantages(a.kind, rewards[valid], prompt_ids[valid], weights, a.std, a.eps, a.clip)
        advantages = torch.zeros(len(valid))
        advantages[valid] = adv.advantages.float()
        tr.allocator.observe(prompt_ids[valid], tr.successes(rewards[valid] @ weights))
        local_adv = torch.zeros(len(train_stage.positions))
        real = train_stage.positions < len(valid)
        local_adv[real] = advantages[train_stage.positions[real]]
        stats = tr.update([(train_stage.traj, local_adv)], spec)
        t_train = time.perf_counter()

        total = rewards[valid] @ weights
        ok = pool.valid
        pool_std, pool_range = spread(explore_total[ok], pool.prompt_ids[ok])
        chosen = selected[ok[selected]]
        sel_std, sel_range = spread(explore_total[chosen], pool.prompt_ids[chosen])
        row = {
            "iteration": it,
            "reward_mean": total.mean().item(),
            "reward_std": total.std(unbiased=False).item(),
            **tr.reward_columns(rewards[valid], prompt_ids[valid]),
            "dropped_samples": int((~valid).sum()),
            "adv_abs_mean": adv.advantages.abs().mean().item(),
            "degenerate_groups": adv.degenerate.float().mean().item(),
            "nonzero_advantage_samples": int((adv.mask & (adv.advantages != 0)).sum()),
            "samples": len(prompt_ids),
            "prompts": int(prompt_ids.unique().numel()),
            "trained_steps": len(spec.trained_steps()),
            **stats,
            "explore_precision": self.explorer.label or policy_precision(tr.policy),
            "candidates": len(pool_ids),
            "explore_reward_mean": explore_total[ok].mean().item() if ok.any() else math.nan,
            "explore_images_per_s": len(pool_ids) / max(explore_s, 1e-9),
            "nfe_explore": len(pool_ids) * explore_spec.num_steps,  # transformer calls per sample x samples
            "nfe_regenerate": regenerated * spec.num_steps,
            "selection/pool_std": pool_std,
            "selection/selected_std": sel_std,
            "selection/pool_range": pool_range,
            "selection/selected_range": sel_range,
            **fidelity,
            "time_resync": resync_s,
            "time_explore": explore_s,
            "time_regenerate": regen_s,
            "time_sampling": t_sample - t1,
            "time_reward": pool.reward_time + (train_stage.reward_time if regenerated else 0.0),
            "time_reward_wait": pool.reward_wait + (train_stage.reward_wait if regenerated else 0.0),
            "time_training": t_train - t_sample,
        }
        tr.iteration += 1
        row["time_iteration"] = time.perf_counter() - t0
        return row

    @staticmethod
    def fidelity(explore: torch.Tensor, train: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor) -> dict:
        """Rank agreement of explore- and training-precision rewards of the same seeds: over the
        whole pool, and within each prompt's group (what the selection sees). Undefined values
        (a constant reward vector) are left out."""
        e, t, g = explore[valid], train[valid], group_ids[valid]
        out = {
            "fidelity/spearman": spearman(e, t),
            "fidelity/kendall": kendall_tau(e, t),
            "fidelity/spearman_within_prompt": grouped(spearman, e, t, g),
            "fidelity/kendall_within_prompt": grouped(kendall_tau, e, t, g),
            "fidelity/reward_gap": (e - t).mean().item() if e.numel() else math.nan,
        }
        return {k: v for k, v in out.items() if not math.isnan(v)}

