"""rollout.kind two_stage: Sol-RL, "FP4 explore, BF16 train" (docs/algorithms.md section 5).

One iteration, composed of the flat rollout's stages:
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
ratio: without regeneration this rollout provides transitions only when the candidates already
are training-precision samples of the training sampler, and the GRPO objective refuses any
experience sampled in another precision. Objectives that need clean samples only (experience.
SAMPLES: nft, dgpo, gdro, awm, dpo, which flow-match or compare the clean samples and take no
log-prob of them) may skip stage 2 (`regenerate: false`): they train on the clean samples of any
sampler and precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math
import time

import torch

from flowrl.core.allocation import successes
from flowrl.core.correlation import grouped, kendall_tau, spearman
from flowrl.core.seeds import Stream, sample_seed
from flowrl.core.selection import select_per_group
from flowrl.errors import ConfigError, check_choice, check_positive
from flowrl.models.compile import compile_network
from flowrl.sampling.precision import BACKENDS, EXPLORE_PRECISIONS, FP8_SCALINGS, HIGH_PRECISION_LAYERS, ExplorationCopy
from flowrl.sampling.rollout import SamplerSpec, policy_precision
from flowrl.train.experience import SAMPLES, TRANSITIONS, Experience
from flowrl.train.parts import Rollout, register_rollout
from flowrl.train.rollouts.common import Stage, group_advantages, spread, training_spec
from flowrl.train.rollouts.flat import FlatBatch, FlatRollout, flat_experience, split_flat_batch


def subset_stage(stage: Stage, selected: torch.Tensor, num_processes: int, process_index: int) -> Stage:
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


def selection_spread(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor) -> dict:
    """How spread out the selected rewards are within their groups, against the whole pool's."""
    pool_std, pool_range = spread(rewards[valid], group_ids[valid])
    chosen = selected[valid[selected]]
    sel_std, sel_range = spread(rewards[chosen], group_ids[chosen])
    return {"selection/pool_std": pool_std, "selection/selected_std": sel_std, "selection/pool_range": pool_range,
            "selection/selected_range": sel_range}


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


@dataclass
class TwoStageOptions:
    """Sol-RL, "FP4 explore, BF16 train" (rollout.kind: two_stage; docs/algorithms.md section 5).
    Stage 1 samples `candidates` chains per prompt from recorded seeds with a copy of the
    current policy in `explore_precision` (LoRA merged in, re-synchronised every iteration) and
    scores them; `selection.kind` picks data.group_size of them per prompt; stage 2 regenerates
    exactly those seeds (initial and per-step noise) with the training policy, and only the
    regenerated samples are trained on."""

    candidates: int = 32  # M per prompt, >= data.group_size (the K that are selected and trained)
    explore_precision: str = "nvfp4"  # nvfp4 | fp8 | bf16 | fp16 | fp32
    # auto: torchao's kernels where the GPU has them (NVFP4: sm100+, FP8: sm89+), fake quantisation
    # elsewhere | emulated: always fake quantisation | torchao: the kernels or an error
    backend: str = "auto"
    # linear layers whose name contains one of these stay unquantised (default: embeddings and output
    # layers; add "norm" for the adaLN modulation linears inside the norm modules)
    high_precision_layers: list[str] = field(default_factory=lambda: list(HIGH_PRECISION_LAYERS))
    # fp8's scales: row (one per output channel of a weight and per token of an activation, torchao's
    # PerRow: the accurate FP8 GEMM of the diffusers-torchao recipes) | tensor (one per tensor, PerTensor)
    fp8_scaling: str = "row"
    # linears narrower than this (the smaller of in_features and out_features) stay in the compute dtype:
    # FP8 GEMMs lose to BF16 at small widths (torchao: 0.8x at 1024x2048x1024, 1.39x at 4096x8192x16384).
    # 0 quantises every eligible linear
    min_features: int = 0
    # > 0: diffusers' First Block Cache on the exploration copy, explore only: a step whose first-block residual
    # changed by less than this (relative mean absolute difference) reuses the previous step's other blocks
    # (2x on FLUX.1-dev at 0.08). Candidates explored with it reach no log-prob ratio (only a clean-sample objective
    # with regenerate false trains on them as they are). 0: off
    first_block_cache: float = 0.0
    preview_steps: int = 0  # 0: stage 1 runs the training sampler | P > 0: a P-step ODE preview
    # false: train on the selected candidates themselves; only allowed when they already are
    # training-precision samples of the training sampler (explore_precision = model.dtype, no preview, no cache),
    # or with an objective that needs clean samples only (nft, dgpo, gdro, awm, dpo: they take no log-prob of them)
    regenerate: bool = True
    fidelity_every: int = 10  # iterations between regenerating the whole pool to log reward rank correlations (0: never)


@register_rollout
class TwoStageRollout(Rollout):
    name = "two_stage"
    options = TwoStageOptions
    runs_ahead = True
    splits_batches = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.flat = FlatRollout(ctx)  # sampling, scoring and gathering of each stage
        self.ts = ctx.cfg.rollout.two_stage
        self._explorer: ExplorationCopy | None = None

    @property
    def explorer(self) -> ExplorationCopy:
        """The low-precision copy, built where the first batch is sampled (with run.async_rollouts,
        in the producer only: a trainer that never explores holds no second copy of the network)."""
        if self._explorer is None:
            ts = self.ts
            self._explorer = ExplorationCopy(self.ctx.policy, ts.explore_precision, ts.backend, ts.high_precision_layers,
                                             ts.fp8_scaling, ts.min_features, ts.first_block_cache)
            if self._explorer.net is not None:  # its own network: compiled as model.compile says (the policy's forwards were)
                compile_network(self._explorer.net, self.ctx.cfg.model.compile)
        return self._explorer

    @classmethod
    def provides(cls, cfg) -> set[str]:
        ts = cfg.rollout.two_stage
        candidates_trainable = ts.regenerate or (ts.explore_precision == cfg.model.dtype and not ts.preview_steps
                                                 and not ts.first_block_cache)
        # otherwise the candidates are clean samples only: what an objective that takes no log-prob of its samples
        # needs (objective `needs` SAMPLES: nft, dgpo, gdro, awm, dpo), whatever they were sampled in
        return FlatRollout.provides(cfg) if candidates_trainable else {SAMPLES}

    @classmethod
    def missing_reason(cls, cfg, data: str) -> str:
        ts = cfg.rollout.two_stage
        if TRANSITIONS in FlatRollout.provides(cfg):
            return (f"from candidates sampled with explore_precision '{ts.explore_precision}', preview_steps {ts.preview_steps} "
                    f"and first_block_cache {ts.first_block_cache:g} "
                    f"unless rollout.two_stage.regenerate is true (a log-prob ratio needs model.dtype '{cfg.model.dtype}' "
                    "samples of the training sampler)")
        return FlatRollout.missing_reason(cfg, data)

    @classmethod
    def validate(cls, cfg) -> None:
        ts, k = cfg.rollout.two_stage, cfg.data.group_size
        if cfg.rollout.tree != type(cfg.rollout.tree)():
            raise ConfigError("rollout.tree is set but rollout.kind is two_stage, which regenerates flat chains only; "
                              "leave rollout.tree at its defaults or use rollout.kind tree")
        if ts.candidates < k:
            raise ConfigError(f"rollout.two_stage.candidates must be >= data.group_size ({k}), the samples selected from them "
                              f"per prompt; got {ts.candidates}")
        check_choice("rollout.two_stage.explore_precision", ts.explore_precision, EXPLORE_PRECISIONS)
        check_choice("rollout.two_stage.backend", ts.backend, BACKENDS)
        check_positive("rollout.two_stage.preview_steps", ts.preview_steps, strict=False)
        check_choice("rollout.two_stage.fp8_scaling", ts.fp8_scaling, FP8_SCALINGS)
        check_positive("rollout.two_stage.min_features", ts.min_features, strict=False)
        check_positive("rollout.two_stage.first_block_cache", ts.first_block_cache, strict=False)
        check_positive("rollout.two_stage.fidelity_every", ts.fidelity_every, strict=False)
        if list(cfg.lora.sigma_range) != [0.0, 1.0]:  # the exploration copy merges the adapter in at every sigma
            raise ConfigError(f"lora.sigma_range must be [0, 1] when rollout.kind is two_stage; got {list(cfg.lora.sigma_range)}"
                              + (" (from lora.acts_at trained: set lora.acts_at all)" if cfg.lora.acts_at == "trained" else ""))
        if cfg.model.quantize != "none":  # the exploration copy merges the adapter into the base's weights, dequantised
            raise ConfigError(f"rollout.kind two_stage builds its exploration copy from the transformer's full-precision weights, "
                              f"which model.quantize {cfg.model.quantize} does not keep; set model.quantize: none or another "
                              "rollout.kind")
        if cfg.allocator.kind != "uniform":
            raise ConfigError(f"allocator.kind must be uniform when rollout.kind is two_stage (selection, not allocation, picks "
                              f"the trained samples); got '{cfg.allocator.kind}'")

    def explore_spec(self, spec: SamplerSpec) -> SamplerSpec:
        p = self.ts.preview_steps
        if not p:
            return spec
        s = self.ctx.cfg.sampling
        return SamplerSpec.ode(self.ctx.policy.sigmas(p, s.schedule, s.shift))

    def sample(self, iteration: int) -> FlatBatch:
        """Explore the pool in low precision, select, regenerate the selection in the training
        precision; the regenerated samples with their advantages (the allocator sees them)."""
        ctx, ts, it = self.ctx, self.ts, iteration
        cfg = ctx.cfg
        spec, weights = training_spec(cfg, it, ctx.policy, ctx.plan), ctx.reward_fn.channel_weights
        counts = ctx.allocator.first_stage(it)  # uniform (validated): K per chosen prompt
        pool_ids = torch.repeat_interleave(torch.arange(len(ctx.prompts)), counts // cfg.data.group_size * ts.candidates).tolist()
        seeds = [sample_seed(cfg.trainer.seed, it, j) for j in range(len(pool_ids))]
        explore_spec = self.explore_spec(spec)

        resync_s = self.explorer.resync()
        t1 = time.perf_counter()  # stage 1: explore
        pool = self.flat.sample_stage(pool_ids, seeds, explore_spec, f"iter {it} exploring ({self.explorer.label or 'policy'})", it,
                                      policy=self.explorer.policy)
        explore_s = time.perf_counter() - t1 - pool.reward_wait
        cache_calls, cache_reused = self.explorer.cache_reuse()
        explore_total = pool.rewards.float() @ weights
        gen = torch.Generator().manual_seed(sample_seed(cfg.trainer.seed, it, Stream.SELECTION))
        selected = select_per_group(cfg.selection.kind, explore_total, pool.prompt_ids,
                                    {int(p): int(counts[p]) for p in pool.prompt_ids.unique()}, pool.valid, gen)

        train_stage, regenerated, fid, regen_s = self._regenerate(pool, selected, pool_ids, seeds, spec, explore_total, weights, it)

        # train on the regenerated samples, with advantages from their own rewards
        rewards, prompt_ids, valid = train_stage.rewards, train_stage.prompt_ids, train_stage.valid
        advantages, _, adv_metrics = group_advantages(cfg, rewards, prompt_ids, valid, weights, it)
        ctx.allocator.observe(prompt_ids[valid], successes(rewards[valid] @ weights, cfg.allocator.success_threshold))
        ok = pool.valid
        metrics = {
            **adv_metrics,
            "trained_steps": len(spec.trained_steps()),
            "explore_precision": self.explorer.label or policy_precision(ctx.policy),
            "candidates": len(pool_ids),
            "explore_reward_mean": explore_total[ok].mean().item() if ok.any() else math.nan,
            "explore_images_per_s": len(pool_ids) / max(explore_s, 1e-9),
            **({"explore_cache_reused": cache_reused / cache_calls} if cache_calls else {}),
            "nfe_explore": len(pool_ids) * explore_spec.num_steps,  # transformer calls per sample x samples
            "nfe_regenerate": regenerated * spec.num_steps,
            **selection_spread(explore_total, pool.prompt_ids, ok, selected),
            **fid,
            "time_resync": resync_s,
            "time_explore": explore_s,
            "time_regenerate": regen_s,
            "time_reward": pool.reward_time + (train_stage.reward_time if regenerated else 0.0),
            "time_reward_wait": pool.reward_wait + (train_stage.reward_wait if regenerated else 0.0),
        }
        return FlatBatch(it, spec, [train_stage], rewards, prompt_ids, valid, advantages, metrics)

    def _regenerate(self, pool: Stage, selected: torch.Tensor, pool_ids: list[int], seeds: list[int], spec: SamplerSpec,
                    explore_total: torch.Tensor, weights: torch.Tensor, it: int) -> tuple[Stage, int, dict, float]:
        """Stage 2: (the stage to train on, the samples regenerated, the fidelity metrics, the regeneration's seconds)."""
        ts, acc = self.ts, self.ctx.accelerator
        # stage 2: regenerate the selected seeds in the training precision (or the whole pool, to measure fidelity)
        t2 = time.perf_counter()
        fid = {}
        if not ts.regenerate:  # training-precision samples of the training sampler, or clean samples only (validated)
            train_stage, regenerated = subset_stage(pool, selected, acc.num_processes, acc.process_index), 0
        elif ts.fidelity_every and it % ts.fidelity_every == 0:
            full = self.flat.sample_stage(pool_ids, seeds, spec, f"iter {it} regenerating the pool", it)
            fid = fidelity(explore_total, full.rewards.float() @ weights, pool.valid & full.valid, pool.prompt_ids)
            train_stage, regenerated = subset_stage(full, selected, acc.num_processes, acc.process_index), len(pool_ids)
        else:
            train_stage = self.flat.sample_stage([pool_ids[i] for i in selected.tolist()], [seeds[i] for i in selected.tolist()],
                                                 spec, f"iter {it} regenerating", it)
            regenerated = len(selected)
        regen_s = time.perf_counter() - t2 - (train_stage.reward_wait if regenerated else 0.0)
        return train_stage, regenerated, fid, regen_s

    def experience(self, batch: FlatBatch) -> Experience:
        return flat_experience(self.ctx, batch, with_transitions=TRANSITIONS in self.provides(self.ctx.cfg))

    def split(self, batch: FlatBatch, num_processes: int, process_index: int) -> FlatBatch:
        return split_flat_batch(batch, num_processes, process_index)
