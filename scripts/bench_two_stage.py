#!/usr/bin/env python3
"""Benchmark Sol-RL two-stage exploration ("FP4 explore, BF16 train") on one model, side by side.

Three parts:

1. fidelity: the same seeds sampled by the full-precision policy and by its exploration
   copies (NVFP4 and FP8, fake-quantised unless --backend torchao, and a plain BF16 copy),
   with the training sampler (sampling.* of the config: SDE steps keyed by (seed, step)) or,
   with --preview-steps P, a P-step ODE preview. Printed per precision: Spearman and Kendall
   rank correlation of the weighted reward (for the shapes reward of the default preset:
   strict + 0.5 x partial) over all seeds, and within each prompt's seeds (what the
   selection sees), and the headline line `spearman X` for NVFP4 against full precision.

2. training (--iterations N > 0): flat GRPO and two-stage (M = --candidates-factor x K
   candidates per prompt, NVFP4 exploration, K selected by --selection and regenerated) train
   from the same model with the same seed, prompts per iteration and K, so both train on the
   same number of samples. Printed per method: rollout forwards at the training precision and
   at the exploration precision (transformer calls x samples), wall times, and the held-out
   ODE reward (EMA weights) after every --eval-every iterations. On a CPU the NVFP4 copy is
   emulated (fake quantisation costs more than fp32), so wall time there is not what FP4
   kernels would give; compare the forwards.

3. --gpu: explore throughput of the velocity two-stage's stage 1 calls, on the SD3.5-Medium
   preset's policy (built as the Trainer builds it, with its LoRA r32) over a randomly
   initialised SD3.5-medium-sized transformer (scripts/random_pipeline.py; 1024x1024 -> 128x128
   latents, batch --gpu-batch with the policy's classifier-free guidance): the policy itself
   in BF16, and its ExplorationCopy in FP8 (torchao kernels; sm89+) and NVFP4 (torchao kernels;
   sm100+ only), with the resync seconds of each copy. Printed: images/s and `fp8 vs bf16 explore
   throughput X.XXx`. Skipped with a message when there is no CUDA device; with --smoke, its
   code path on a narrow random pipeline on the CPU.

Usage:
  .venv/bin/python scripts/bench_two_stage.py --model builtin:tiny-sd3 --reward jpeg_compressibility --quick
  .venv/bin/python scripts/bench_two_stage.py                             # builtin:shapes, reward shapes
  .venv/bin/python scripts/bench_two_stage.py --iterations 6 --eval-every 3
  .venv/bin/python scripts/bench_two_stage.py --gpu --fidelity-prompts 0  # GPU throughput only
  .venv/bin/python scripts/bench_two_stage.py --smoke                     # parts 1 and 2 in seconds on builtin:tiny-sd3
  .venv/bin/python scripts/bench_two_stage.py --smoke --gpu               # and part 3's code on the CPU
Trailing key=value arguments override the config (e.g. sampling.num_steps=10).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(1, str(Path(__file__).resolve().parent))  # random_pipeline, for --gpu


def base_overrides(args) -> list[str]:
    out = [f"model.path={args.model}", "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0",
           f"trainer.seed={args.seed}"]
    if args.reward:
        out.append(f"reward.weights={{{args.reward}: 1.0}}")
    return out + list(args.overrides)


def load(args, extra: list[str] = ()):
    from flowrl.config import load_config

    return load_config(args.config, base_overrides(args) + list(extra))


def spread_prompts(prompts: list[str], n: int) -> list[str]:
    """n prompts evenly spaced through the list (the shapes sets are category-balanced)."""
    step = max(len(prompts) // n, 1)
    return [prompts[(i * step) % len(prompts)] for i in range(n)]


# ---- 1. fidelity ---------------------------------------------------------------------
@torch.no_grad()
def sample_rewards(policy, cfg, reward, prompts, seeds, spec) -> torch.Tensor:
    from flowrl.sampling.rollout import rollout

    bs = cfg.sampling.batch_size
    scores = []
    for i in range(0, len(prompts), bs):
        traj = rollout(policy, prompts[i : i + bs], seeds[i : i + bs], spec, bs)
        scores.append(reward(policy.decode(traj.final), prompts[i : i + bs]))
    return torch.cat(scores).float()


def fidelity(args) -> None:
    from flowrl.core.correlation import grouped, kendall_tau, spearman
    from flowrl.models import load_policy
    from flowrl.sampling.precision import ExplorationCopy
    from flowrl.sampling.rollout import SamplerSpec
    from flowrl.train.prompts import load_prompts
    from flowrl.train.rollouts.common import training_spec
    from rewards import MultiReward

    cfg = load(args)
    s = cfg.sampling
    policy = load_policy(cfg.model)
    reward = MultiReward.from_config(cfg.reward)
    weights = reward.channel_weights
    prompts = spread_prompts(load_prompts(cfg.data), args.fidelity_prompts)
    per = args.fidelity_seeds
    pool_prompts = [p for p in prompts for _ in range(per)]
    seeds = [10_000 + j for j in range(len(pool_prompts))]
    groups = torch.arange(len(prompts)).repeat_interleave(per)
    n_params = sum(p.numel() for p in policy.transformer.parameters())
    print(f"bench_two_stage: {args.model} ({type(policy.transformer).__name__}, {n_params / 1e6:.2f}M params), reward "
          f"{'+'.join(f'{w:g} x {c}' for c, w in zip(reward.channel_names, weights.tolist()))}, device {policy.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()} "
          f"with {os.cpu_count()} CPUs")
    # the samplers the two-stage rollout runs: the training sampler of iteration 0, and its preview (explore_spec)
    full_spec = training_spec(cfg, 0, policy)
    kind = "ODE" if s.sampler == "ode" else f"{s.sampler} SDE"
    specs = {f"{p}-step ODE preview" if p else f"{s.num_steps}-step {kind} (training sampler)":
             SamplerSpec.ode(policy.sigmas(p, s.schedule, s.shift)) if p else full_spec for p in args.preview_steps}
    t0 = time.perf_counter()
    # the reference: full precision, full quality (the training sampler)
    ref_channels = sample_rewards(policy, cfg, reward, pool_prompts, seeds, full_spec)
    ref = ref_channels @ weights
    ref_s = time.perf_counter() - t0
    print(f"fidelity: {len(prompts)} training prompts x {per} seeds = {len(seeds)} seeds; reference: {str(policy.dtype).removeprefix('torch.')} policy, "
          f"training sampler ({s.num_steps} steps), mean reward {ref.mean():.4f} ({len(seeds) / ref_s:.1f} images/s)")
    headline = None
    for precision in args.precisions:
        copy = ExplorationCopy(policy, precision, args.backend, cfg.rollout.two_stage.high_precision_layers)
        for name, spec in specs.items():
            t0 = time.perf_counter()
            low_channels = sample_rewards(copy.policy, cfg, reward, pool_prompts, seeds, spec)
            low = low_channels @ weights
            secs = time.perf_counter() - t0
            rho, tau = spearman(low, ref), kendall_tau(low, ref)
            rho_g, tau_g = grouped(spearman, low, ref, groups), grouped(kendall_tau, low, ref, groups)
            label = copy.label or str(policy.dtype).removeprefix("torch.")
            print(f"  {label:<15} {name:<38} spearman {rho:.3f}  kendall {tau:.3f}  within prompt: spearman {rho_g:.3f} "
                  f"kendall {tau_g:.3f}  mean reward {low.mean():.4f}  {len(seeds) / secs:.1f} images/s")
            if len(reward.channel_names) > 1:
                print("    per channel: " + "  ".join(
                    f"{c} spearman {spearman(low_channels[:, k], ref_channels[:, k]):.3f} (within prompt "
                    f"{grouped(spearman, low_channels[:, k], ref_channels[:, k], groups):.3f}), mean {low_channels[:, k].mean():.4f} "
                    f"vs {ref_channels[:, k].mean():.4f}" for k, c in enumerate(reward.channel_names)))
            if precision == "nvfp4" and headline is None:
                headline = (rho, label, name)
        del copy
    if headline is not None:
        print(f"spearman {headline[0]:.2f}  ({headline[1]} vs full precision, {headline[2]}, {len(seeds)} seeds, weighted reward)")


# ---- 2. training ----------------------------------------------------------------------
def eval_reward(trainer, prompts: list[str]) -> tuple[float, float]:
    """Mean weighted reward of one ODE sample per held-out prompt (EMA weights if on), and its standard error."""
    from flowrl.train.evaluate import evaluate

    ctx = trainer.ema.swapped_in(trainer.params) if trainer.ema is not None else contextlib.nullcontext()
    with ctx:
        res = evaluate(trainer.cfg, trainer.policy, trainer.reward_fn, prompts, seed=50_000)
    total = res.scores.float() @ res.channel_weights
    return total.mean().item(), (total.std() / len(total) ** 0.5).item()


def training(args) -> None:
    from flowrl.train.prompts import builtin_prompts
    from flowrl.train.loop import Trainer

    k = args.group_size
    common = [f"data.group_size={k}", f"data.prompts_per_iteration={args.prompts_per_iteration}", f"selection.kind={args.selection}"]
    methods = {
        "flat": ["rollout.kind=flat"],
        "two_stage": ["rollout.kind=two_stage", f"rollout.two_stage.candidates={args.candidates_factor * k}",
                      "rollout.two_stage.explore_precision=nvfp4", f"rollout.two_stage.backend={args.backend}",
                      f"rollout.two_stage.preview_steps={args.train_preview_steps}", "rollout.two_stage.fidelity_every=0"],
    }
    cfg0 = load(args, common)
    if args.model == "builtin:shapes":
        held_out = builtin_prompts("builtin:shapes-heldout", "bench", per_category=args.eval_prompts // 4)
    else:
        held_out = spread_prompts(list(cfg0.data.eval_prompts) or list(cfg0.data.prompts), args.eval_prompts)
    print(f"training: {args.iterations} iterations per method, {args.prompts_per_iteration} prompts x K={k} trained samples "
          f"per iteration; two_stage explores M={args.candidates_factor * k} per prompt in nvfp4 ({args.backend}), "
          f"selection {args.selection}, preview steps {args.train_preview_steps}; eval: {len(held_out)} held-out prompts, "
          f"one {cfg0.sampling.eval_num_steps}-step ODE sample each")
    print(f"{'method':<10} {'iter':>4} {'trained':>7} {'NFE train-prec':>14} {'NFE explore':>11} {'rollout s':>9} "
          f"{'total s':>8}  eval reward")
    with tempfile.TemporaryDirectory(prefix="bench_two_stage-") as tmp:
        for name, extra in methods.items():
            trainer = Trainer(load(args, common + extra), run_dir=Path(tmp) / name)
            base, se = eval_reward(trainer, held_out)
            trained = nfe_train = nfe_explore = 0
            rollout_s = total_s = 0.0
            print(f"{name:<10} {0:>4} {0:>7} {0:>14} {0:>11} {0.0:>9.1f} {0.0:>8.1f}  {base:.4f} +- {se:.4f}")
            for it in range(1, args.iterations + 1):
                row = trainer.train_iteration()
                trained += row["samples"]
                steps = trainer.cfg.sampling.num_steps
                nfe_train += row.get("nfe_regenerate", row["samples"] * steps)
                nfe_explore += row.get("nfe_explore", 0)
                rollout_s += row["time_sampling"]
                total_s += row["time_iteration"]
                if it % args.eval_every == 0 or it == args.iterations:
                    r, se = eval_reward(trainer, held_out)
                    print(f"{name:<10} {it:>4} {trained:>7} {nfe_train:>14} {nfe_explore:>11} {rollout_s:>9.1f} {total_s:>8.1f}  "
                          f"{r:.4f} +- {se:.4f}")
            del trainer


# ---- 3. GPU throughput -----------------------------------------------------------------
def gpu(args) -> None:
    """Explore throughput of the velocity two-stage's stage 1 calls: ExplorationCopy's policy over the SD3.5-Medium
    preset's policy with its LoRA, built as the Trainer builds it (load_policy, add_adapter) from a pipeline whose
    transformer has the SD3.5-Medium config and random weights (scripts/random_pipeline.py): the policy's own CFG on
    the prompt's embeddings; the copies compiled as the rollout compiles them (flowrl.models.compile). With --smoke:
    a narrow random pipeline on the CPU in fp32, 64x64 (the code path)."""
    if not args.smoke and not torch.cuda.is_available():
        print("gpu: skipped (no CUDA device on this machine)")
        return
    import diffusers
    from random_pipeline import build_pipeline

    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.models.compile import compile_network
    from flowrl.sampling.noise import INITIAL, seeded_noise
    from flowrl.sampling.precision import ExplorationCopy, real_kernels_available
    from flowrl.train.registry import add_adapter

    diffusers.utils.logging.set_verbosity_error()  # the "cast with to()" notice of a random pipeline
    cuda, side = not args.smoke, 64 if args.smoke else 1024
    with tempfile.TemporaryDirectory(prefix="bench_two_stage-gpu-") as tmp:
        model_dir = build_pipeline(Path(tmp) / "sd35", tiny=args.smoke)
        # the SD3.5-Medium preset's model (CFG 4.5) at 1024x1024 with 256 T5 tokens (SD3's pipeline default) after CLIP's 77
        cfg = load_config("sd35_medium_pickscore_1gpu", [
            f"model.path={model_dir}", f"model.device={'cuda' if cuda else 'cpu'}", f"model.height={side}", f"model.width={side}",
            "model.max_sequence_length=256", "data.prompt_file=null", "data.prompts=[a red fox in the snow]",
            *(["model.dtype=fp32", "trainer.mixed_precision=no"] if args.smoke else [])])
        policy = load_policy(cfg.model)  # as the Trainer builds it: its LoRA, which each copy merges (resync)
        add_adapter(policy, cfg)
    mode = "blocks" if args.compile else "none"
    policy.compile(mode, args.gpu_batch)  # as the Trainer compiles the policy (model.compile), lazily: on the first call
    n_params = sum(p.numel() for p in policy.transformer.parameters())
    dev = policy.device
    x = seeded_noise(list(range(args.gpu_batch)), INITIAL, policy.latent_shape(), dev)
    cond = policy.encode(["a red fox in the snow"] * args.gpu_batch)
    where = f"{torch.cuda.get_device_name(dev)} (sm{''.join(map(str, torch.cuda.get_device_capability(dev)))})" if cuda else "cpu (--smoke)"
    print(f"gpu: {where}, SD3.5-medium-sized transformer ({n_params / 1e9:.2f}B params, random init), {side}x{side}, "
          f"batch {args.gpu_batch} x 2 (CFG), {args.gpu_steps} steps per image, torch.compile {'regional (per block)' if args.compile else 'off'}")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    @torch.no_grad()
    def images_per_s(explorer) -> float:
        for call in range(3):  # warm-up (and compilation), each call timed so that a time limit still tells which one was slow
            t0 = time.perf_counter()
            explorer.velocity(x, 0.5, cond)
            sync()
            print(f"    warm-up{' and compilation' if args.compile else ''} call {call + 1}: {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        for _ in range(args.gpu_steps):
            explorer.velocity(x, 0.5, cond)
        sync()
        return args.gpu_batch / (time.perf_counter() - t0)

    # The low-precision copies go first: their compilation is the slow part, and BF16's compiled rate is known
    # from earlier runs should a time limit stop this one.
    rates = {}
    for precision in ("fp8", "nvfp4"):
        if not real_kernels_available(precision, dev):
            print(f"  {precision}: skipped (no {precision} kernels on this device; NVFP4 needs sm100+, FP8 sm89+)")
            continue
        t0 = time.perf_counter()
        copy = ExplorationCopy(policy, precision, backend="torchao")
        compile_network(copy.net, mode)  # as the two-stage rollout's explorer
        print(f"    {precision} copy built in {time.perf_counter() - t0:.1f} s", flush=True)
        resync = copy.resync()
        rates[precision] = images_per_s(copy.policy)
        print(f"  {precision:<5} (torchao kernels)     {rates[precision]:.3f} images/s, resync {resync:.2f} s")
        del copy
        if cuda:
            torch.cuda.empty_cache()
    rates["bf16"] = images_per_s(policy)
    print(f"  {str(policy.dtype).removeprefix('torch.')} (training precision, the policy and its LoRA)  {rates['bf16']:.3f} images/s")
    for precision in ("fp8", "nvfp4"):
        if precision in rates:
            print(f"{precision} vs bf16 explore throughput {rates[precision] / rates['bf16']:.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--model", default="builtin:shapes", help="model.path: builtin:NAME, a pipeline directory or a hub id")
    p.add_argument("--reward", default="shapes", help="reward name (weight 1.0; the preset's channel weights apply), e.g. "
                   "jpeg_compressibility with builtin:tiny-sd3; empty: the preset's rewards")
    p.add_argument("--config", default=None, help="base preset or YAML (default: tiny_jpeg for builtin:tiny-sd3, else the default preset)")
    p.add_argument("--precisions", nargs="+", default=["nvfp4", "fp8", "bf16"], help="exploration precisions to compare")
    p.add_argument("--backend", default="auto", choices=["auto", "emulated", "torchao"])
    p.add_argument("--preview-steps", type=int, nargs="+", default=[0], help="0: the training sampler; P: a P-step ODE preview")
    p.add_argument("--fidelity-prompts", type=int, default=32, help="0 skips the fidelity part")
    p.add_argument("--fidelity-seeds", type=int, default=8, help="seeds per prompt")
    p.add_argument("--iterations", type=int, default=0, help="training iterations per method (0 skips the training part)")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8, help="K, trained samples per prompt")
    p.add_argument("--candidates-factor", type=int, default=4, help="M = factor x K candidates per prompt")
    p.add_argument("--prompts-per-iteration", type=int, default=4)
    p.add_argument("--selection", default="best_worst")
    p.add_argument("--train-preview-steps", type=int, default=0)
    p.add_argument("--gpu", action="store_true", help="also measure FP8 / NVFP4 vs BF16 explore throughput on the GPU")
    p.add_argument("--gpu-batch", type=int, default=4)
    p.add_argument("--gpu-steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer blocks in the GPU part (regional compilation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="a short run: 4 prompts x 4 seeds, 2 training iterations")
    p.add_argument("--smoke", action="store_true", help="the code path of parts 1 and 2 in seconds, measuring nothing: "
                   "builtin:tiny-sd3 with the jpeg reward, 2 prompts x 2 seeds, one training iteration of one prompt x 2 per method; "
                   "with --gpu, part 3's code on a narrow random pipeline on the CPU (2 steps)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.reward, args.fidelity_prompts, args.fidelity_seeds = "builtin:tiny-sd3", "jpeg_compressibility", 2, 2
        args.iterations, args.eval_every, args.eval_prompts, args.group_size, args.candidates_factor = 1, 1, 2, 2, 2
        args.prompts_per_iteration, args.gpu_steps = 1, 2
    if args.quick:
        args.fidelity_prompts, args.fidelity_seeds, args.iterations, args.eval_every, args.eval_prompts = 4, 4, 2, 1, 4
        args.group_size, args.prompts_per_iteration = 4, 2
    if args.config is None and args.model == "builtin:tiny-sd3":
        args.config = "tiny_jpeg"
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flowrl.errors import UserError

    try:
        if args.fidelity_prompts:
            fidelity(args)
        if args.iterations:
            training(args)
        if args.gpu:
            gpu(args)
        elif torch.cuda.is_available():
            print("gpu: not measured (pass --gpu)")
    except UserError as exc:
        print(f"bench_two_stage: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
