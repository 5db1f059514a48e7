#!/usr/bin/env python3
"""Benchmark the overhead of flowrl's rollout loop over the bare transformer forwards.

Default (CPU or GPU): build a tiny random SD3 pipeline whose SD3Transformer2DModel has about
5M parameters (width 192, 4 layers), then time, in one process and interleaved:

  rollout     flowrl.sampling.rollout.rollout(policy, prompts, seeds, spec, batch_size) for
              G samples x T steps, flow_grpo SDE on every step (seeded noise, log-probs,
              latents copied to the CPU trajectory every step);
  velocity    the same T policy.velocity(x, sigma, cond) calls on the same [G, C, H, W]
              batch, under torch.no_grad (the forwards the rollout cannot avoid);
  transformer the same T raw policy.transformer(...) calls with identical tensors.

guidance_scale is 1.0, so every step is exactly one forward of batch G in all three. They are
warmed up, then repeated back to back (medians reported); the overhead line is the median of
the per-repeat ratios rollout / velocity, which cancels load drift on a shared machine:
`rollout overhead 1.03x bare forwards`. The rollout's other work (noise, step math, copies) is
also timed piece by piece, with the rollout's call counts and shapes; when the ratio is above
--profile-threshold (or with --profile) the pieces are printed one by one.

--gpu-iteration: on a CUDA machine, train one iteration of the Flow-GRPO SD3.5-Medium preset
(configs/sd35_medium_pickscore_1gpu.yaml) through flowrl's Trainer, the code `flowrl train` runs:
the registered flat rollout and grpo objective, the policy, LoRA (r32 on Flow-GRPO's attention
projections), optimizer and EMA the trainer builds, on a pipeline whose transformer has the
SD3.5-Medium config with random weights (scripts/random_pipeline.py; --gpu-model DIR reuses one),
bf16, at 512x512, one prompt x --gpu-group samples in one batch (CFG doubles it), a reward without a
model (brightness). Prints the trainer's seconds per iteration, split into sampling (the rollout's
collect: sampling, decoding, rewards) and training (the objective's update), and
torch.cuda.max_memory_allocated. Trailing key=value arguments override the preset (e.g.
trainer.kl_beta=0). Without CUDA it says so and exits 0.

--smoke: both code paths in seconds on the CPU, measuring nothing: the default benchmark on a
one-layer transformer of width 32 (2 samples x 2 steps, one repeat), then the --gpu-iteration
code on a two-block random pipeline (the last block has no context output to adapt) in fp32 on the CPU.

Usage:  .venv/bin/python scripts/bench_rollout.py [--repeats 5] [--gpu-iteration [key=value ...]]
        .venv/bin/python scripts/bench_rollout.py --smoke
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl.runtime.budget import machine_name

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(1, str(Path(__file__).resolve().parent))  # random_pipeline, the SD3.5-Medium-sized random pipeline


def _median_time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _fmt(times: list[float]) -> str:
    return f"median {statistics.median(times) * 1e3:8.2f} ms  (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}, n={len(times)})"


# ---- CPU / default benchmark ---------------------------------------------------------------


def build_policy(directory: Path, width: int, num_layers: int, resolution: int, device: str):
    from flowrl.schema import ModelConfig
    from flowrl.models import load_policy
    from flowrl.models.tiny import build_tiny_sd3

    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    path = build_tiny_sd3(directory / "sd3", width=width, num_layers=num_layers)
    cfg = ModelConfig(kind="sd3", path=str(path), dtype="fp32", height=resolution, width=resolution, guidance_scale=1.0, device=device)
    return load_policy(cfg)


def bench_rollout(args) -> float:
    from flowrl.sampling.noise import INITIAL, seeded_noise
    from flowrl.sampling.rollout import SamplerSpec, rollout
    from flowrl.sampling.schedules import shifted_sigmas

    G, T = args.group, args.steps
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(Path(tmp), args.width, args.layers, args.resolution, args.device)
    n_params = sum(p.numel() for p in policy.transformer.parameters())
    spec = SamplerSpec(shifted_sigmas(T, 3.0), torch.ones(T, dtype=torch.bool), "flow_grpo", 0.7, "mean")
    prompts = ["a red circle above a blue square"] * G
    seeds = list(range(1000, 1000 + G))
    shape = policy.latent_shape()
    sigmas = [float(s) for s in spec.sigmas]

    cond = policy.encode(prompts)  # also fills the prompt cache the rollout reads
    x0 = seeded_noise(seeds, INITIAL, shape, policy.device)
    t_in = torch.full((G,), 1000.0 * sigmas[0], device=policy.device)

    def sync():
        if policy.device.type == "cuda":
            torch.cuda.synchronize()

    def run_rollout():
        rollout(policy, prompts, seeds, spec, batch_size=G)
        sync()

    @torch.no_grad()
    def run_velocity():
        for t in range(T):
            policy.velocity(x0, sigmas[t], cond)
        sync()

    @torch.no_grad()
    def run_transformer():
        for t in range(T):
            t_in.fill_(1000.0 * sigmas[t])
            policy.transformer(hidden_states=x0, timestep=t_in, encoder_hidden_states=cond["embeds"],
                               pooled_projections=cond["pooled"], return_dict=False)
        sync()

    for _ in range(args.warmup):
        run_rollout(), run_velocity(), run_transformer()
    results = {"rollout": [], "velocity": [], "transformer": []}
    for _ in range(args.repeats):  # interleaved, so drift hits all three alike
        results["rollout"] += _median_time(run_rollout, 1)
        results["velocity"] += _median_time(run_velocity, 1)
        results["transformer"] += _median_time(run_transformer, 1)

    med = {k: statistics.median(v) for k, v in results.items()}
    # each repeat times the three back to back: the per-repeat ratio cancels machine-load drift
    paired = [r / v for r, v in zip(results["rollout"], results["velocity"])]
    ratio = statistics.median(paired)
    print(f"bench_rollout: SD3Transformer2DModel {n_params / 1e6:.2f}M params (width {args.width}, {args.layers} layers), "
          f"latents {'x'.join(map(str, shape))} ({args.resolution}x{args.resolution} px), fp32, device {policy.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"workload: G={G} samples x T={T} steps, flow_grpo SDE (noise 0.7) on every step, batch {G}, "
          f"guidance 1.0 (no CFG): {T} forwards of batch {G} in each measurement; {args.warmup} warm-up, {args.repeats} repeats")
    print(f"rollout()                          {_fmt(results['rollout'])}")
    print(f"bare forwards, policy.velocity x{T:<3}  {_fmt(results['velocity'])}")
    print(f"bare forwards, transformer x{T:<3}     {_fmt(results['transformer'])}")
    print(f"velocity wrapper vs raw transformer: {med['velocity'] / med['transformer']:.3f}x")
    pieces = measure_pieces(policy, spec, prompts, seeds, cond, x0, args)
    extra = sum(pieces.values())
    print(f"rollout work besides the forwards, timed piece by piece: {extra * 1e3:.2f} ms per rollout "
          f"= {extra / med['velocity'] * 100:.3f}% of the forwards")
    print(f"per-repeat rollout/velocity ratios: {', '.join(f'{r:.3f}' for r in paired)}; ratio of the medians {med['rollout'] / med['velocity']:.3f}x")
    print(f"rollout overhead {ratio:.2f}x bare forwards (median of the per-repeat ratios)")
    if args.profile or ratio > args.profile_threshold:
        print_pieces(pieces, med, args)
    return ratio


def measure_pieces(policy, spec, prompts, seeds, cond, x0, args) -> dict[str, float]:
    """Median time of each thing the rollout does besides the forwards, with the rollout's
    call counts and shapes (robust to a noisy machine, unlike the difference of two totals)."""
    from flowrl.sampling.noise import INITIAL, seeded_noise

    G, T = args.group, args.steps
    shape = policy.latent_shape()
    dev = policy.device
    v = torch.randn_like(x0)
    latents = torch.empty((G, T + 1, *shape))
    log_probs = torch.zeros((G, T))
    noises = [seeded_noise(seeds, t, shape, dev) for t in range(T)]
    out = spec.step(0, x0, v, noise=noises[0])

    def noise():
        seeded_noise(seeds, INITIAL, shape, dev)
        for t in range(T):
            seeded_noise(seeds, t, shape, dev)

    def step_math():
        for t in range(T):
            spec.is_stochastic(t)
            spec.step(t, x0, v, noise=noises[t])

    def copies():
        latents[:, 0] = x0.cpu()
        for t in range(T):
            latents[:, t + 1] = out.next_x.cpu()
            log_probs[:, t] = out.log_prob.cpu()

    def encode():
        policy.encode(list(prompts))

    def bookkeeping():
        torch.tensor([spec.is_stochastic(t) for t in range(T)])
        torch.empty((G, T + 1, *shape)), torch.zeros((G, T))

    pieces = {
        "seeded_noise (1 + T calls, G generators each)": noise,
        "step math (spec.step + is_stochastic, T)": step_math,
        ".cpu() copies into the trajectory (2T + 1)": copies,
        "policy.encode (cached prompts)": encode,
        "trajectory allocation + trained mask": bookkeeping,
    }
    for fn in pieces.values():
        fn()
    return {name: statistics.median(_median_time(fn, max(args.repeats * 3, 9))) for name, fn in pieces.items()}


def print_pieces(pieces: dict[str, float], med: dict[str, float], args) -> None:
    gap = med["rollout"] - med["velocity"]
    print(f"profile: median rollout - median velocity forwards = {gap * 1e3:+.2f} ms per rollout; pieces:")
    for name, m in pieces.items():
        print(f"  {name:<48} {m * 1e3:8.3f} ms  ({m / med['velocity'] * 100:6.2f}% of the forwards)")
    total = sum(pieces.values())
    print(f"  {'sum of pieces':<48} {total * 1e3:8.3f} ms  (gap minus pieces {(gap - total) * 1e3:+.2f} ms: timing noise and Python glue)")


# ---- --gpu-iteration -------------------------------------------------------------------------

# The Flow-GRPO recipe on SD3.5-Medium for one GPU: --gpu-iteration trains one iteration of it, as `flowrl train` does
GPU_PRESET = "sd35_medium_pickscore_1gpu"


def gpu_overrides(model_dir: str | Path, args, device: str, smoke: bool) -> list[str]:
    """The preset's overrides for one timed iteration: one prompt x --gpu-group samples in one batch (one optimizer
    step), a reward without a model (nothing can be downloaded), no monitor, grids or checkpoints; then the
    trailing key=value overrides."""
    side = args.gpu_resolution
    return [
        f"model.path={model_dir}", f"model.device={device}", f"model.height={side}", f"model.width={side}",
        f"model.guidance_scale={args.gpu_guidance}", f"model.gradient_checkpointing={str(args.gpu_gradient_checkpointing).lower()}",
        f"sampling.num_steps={args.steps}", f"sampling.batch_size={args.gpu_group}", f"data.group_size={args.gpu_group}",
        "data.prompts_per_iteration=1", "data.prompt_file=null", "data.prompts=[a red fox in the snow]",
        "reward.weights={brightness: 1.0}", "trainer.gradient_accumulation_steps=1", "monitor.enabled=false",
        "run.sample_every=0", "run.checkpoint_every=0", "run.tracker=none", "run.progress=false",
        *(["model.dtype=fp32", "trainer.mixed_precision=no"] if smoke else []),  # the CPU computes bf16 slowly
        *args.overrides,
    ]


def gpu_iteration(model_dir: str | Path, overrides: list[str], iterations: int = 2, warmup: int = 1) -> dict:
    """Train GPU_PRESET's iterations with `overrides` through flowrl's Trainer (its registered rollout and
    objective, the policy and LoRA it builds, its optimizer and EMA); the median of `iterations` after `warmup`,
    split as the trainer's metrics row splits it. Returns seconds, sizes and the peak CUDA memory."""
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer

    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    cfg = load_config(GPU_PRESET, overrides)
    with tempfile.TemporaryDirectory(prefix="bench_rollout-") as run_dir:
        trainer = Trainer(cfg, run_dir=run_dir)
        dev = trainer.policy.device
        for _ in range(warmup):
            trainer.train_iteration()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        rows = [trainer.train_iteration() for _ in range(iterations)]
        trainer.finish()
    res = {
        "sampling_s": statistics.median(r["time_sampling"] for r in rows),  # rollout.collect: sampling, decoding, rewards
        "training_s": statistics.median(r["time_training"] for r in rows),  # objective.update
        "params": sum(p.numel() for p in trainer.policy.transformer.parameters()),
        "trainable": sum(p.numel() for p in trainer.params.values()),
        "trained_steps": rows[-1]["trained_steps"],
        "optimizer_steps": rows[-1]["optimizer_steps"],
        "max_memory_allocated": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0,
        "text_tokens": trainer.policy.encode(cfg.data.prompts[:1])["embeds"].shape[1],  # CLIP's 77 + T5's
        "cfg": cfg,
    }
    res["iteration_s"] = res["sampling_s"] + res["training_s"]
    return res


def run_gpu_iteration(args) -> int:
    from random_pipeline import build_pipeline

    if args.smoke:  # the code path on the CPU: a two-block transformer in fp32, one timed iteration after one warm-up
        device, name = "cpu", "two-block (--smoke)"
    elif not torch.cuda.is_available():
        print("--gpu-iteration needs a CUDA GPU and torch.cuda.is_available() is False here; skipping the SD3.5-Medium iteration benchmark.")
        return 0
    else:
        device, name = "cuda", "SD3.5-Medium-config"
    with tempfile.TemporaryDirectory(prefix="bench_rollout-model-") as tmp:
        model_dir = args.gpu_model or build_pipeline(Path(tmp) / "sd35", tiny=args.smoke, tiny_layers=2)
        r = gpu_iteration(model_dir, gpu_overrides(model_dir, args, device, args.smoke), iterations=args.gpu_iterations)
    cfg = r["cfg"]
    m, t, g = cfg.model, cfg.trainer, args.gpu_group
    hw = m.height // 8
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gpu-iteration: {where}, torch {torch.__version__}; {GPU_PRESET} through flowrl's Trainer on a {name} "
          f"SD3Transformer2DModel (random init, {r['params'] / 1e9:.2f}B params, {m.dtype}), LoRA r{cfg.lora.rank} on "
          f"{len(cfg.lora.target_modules)} projections ({r['trainable'] / 1e6:.1f}M trainable, fp32), "
          f"gradient checkpointing {'on' if m.gradient_checkpointing else 'off'}")
    cfg_batch = f"CFG: batch {2 * g}" if m.guidance_scale != 1.0 else "no CFG"
    print(f"workload: {m.height}x{m.width} (latents 16x{hw}x{hw}), group {g}, {cfg.sampling.num_steps} {cfg.sampling.sampler} steps, "
          f"guidance {m.guidance_scale} ({cfg_batch}), {r['text_tokens']} text tokens; rollout.{cfg.rollout.kind} + "
          f"objective.{cfg.objective.kind}: {r['trained_steps']} of {cfg.sampling.num_steps} steps trained, kl_beta {t.kl_beta:g}, "
          f"EMA {'on' if t.ema else 'off'}, {r['optimizer_steps']} optimizer step(s); median of {args.gpu_iterations} after 1 warm-up")
    print(f"sampling {r['sampling_s']:.3f} s + training {r['training_s']:.3f} s = {r['iteration_s']:.3f} s per iteration")
    print(f"torch.cuda.max_memory_allocated {r['max_memory_allocated'] / 2**30:.2f} GiB")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value overrides of the --gpu-iteration preset")
    p.add_argument("--group", type=int, default=8, help="samples G (one batch)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps T")
    p.add_argument("--width", type=int, default=192, help="tiny transformer width (192 x 4 layers: ~5.07M params)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--resolution", type=int, default=64, help="image side in pixels (latents side / 8)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="always break the rollout overhead down")
    p.add_argument("--profile-threshold", type=float, default=1.05)
    p.add_argument("--gpu-iteration", action="store_true", help="time one iteration of the SD3.5-Medium Flow-GRPO preset on CUDA instead")
    p.add_argument("--gpu-model", default=None, metavar="DIR", help="--gpu-iteration's pipeline directory (default: a random "
                   "SD3.5-Medium-sized one built in a temporary directory)")
    p.add_argument("--gpu-group", type=int, default=8)
    p.add_argument("--gpu-resolution", type=int, default=512)
    p.add_argument("--gpu-guidance", type=float, default=4.5, help="CFG scale; 1.0 disables CFG")
    p.add_argument("--gpu-iterations", type=int, default=2)
    p.add_argument("--gpu-gradient-checkpointing", action="store_true")
    p.add_argument("--smoke", action="store_true", help="both code paths on tiny transformers on the CPU, in seconds (no reading)")
    args = p.parse_args(argv)
    if args.overrides and not (args.gpu_iteration or args.smoke):
        p.error("key=value overrides apply to --gpu-iteration's preset only")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.group, args.steps, args.width, args.layers, args.warmup, args.repeats = 2, 2, 32, 1, 0, 1
        args.gpu_group, args.gpu_resolution, args.gpu_iterations = 2, 64, 1
    if args.gpu_iteration and not args.smoke:
        return run_gpu_iteration(args)
    print(f"machine: {machine_name()}, python {platform.python_version()}")
    bench_rollout(args)
    if args.smoke:
        run_gpu_iteration(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
