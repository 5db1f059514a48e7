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

--gpu-iteration: on a CUDA machine, time one GRPO-like iteration of a randomly initialised
SD3.5-Medium-sized transformer (diffusers SD3Transformer2DModel with the SD3.5-Medium config,
bf16, LoRA r32 on Flow-GRPO's attention projections) at 512x512 (latents 16x64x64): T sampling
steps of a group of G (CFG doubles the batch) and one forward/backward per trained step, plus
the optimizer step; prints seconds per iteration and torch.cuda.max_memory_allocated. Without
CUDA it says so and exits 0.

--smoke: both code paths in seconds on the CPU, measuring nothing: the default benchmark on a
one-layer transformer of width 32 (2 samples x 2 steps, one repeat), then the --gpu-iteration
code on a one-layer SD3 transformer in fp32 on the CPU.

Usage:  .venv/bin/python scripts/bench_rollout.py [--repeats 5] [--gpu-iteration]
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

# diffusers SD3Transformer2DModel config of stabilityai/stable-diffusion-3.5-medium (transformer/config.json)
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# --smoke's stand-in for SD3.5-Medium in the --gpu-iteration code: one narrow block, 8x8 latents
TINY_SD3 = dict(sample_size=8, patch_size=2, in_channels=16, num_layers=1, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=16, pos_embed_max_size=16,
                qk_norm="rms_norm")
# Flow-GRPO's scripts/train_sd3.py LoRA targets (as configs/sd35_medium_pickscore_*.yaml)
FLOW_GRPO_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
]


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


def gpu_iteration(config: dict, device: str = "cuda", dtype=torch.bfloat16, group: int = 8, steps: int = 10,
                  latent_hw: int = 64, text_tokens: int = 205, guidance: float = 4.5, lora_rank: int = 32,
                  gradient_checkpointing: bool = False, iterations: int = 2, warmup: int = 1) -> dict:
    """One GRPO-like iteration on a random transformer: sampling (no grad) then one
    forward/backward per trained step, then the optimizer step. Returns timings in seconds."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from flowrl.core import clipped_policy_loss
    from flowrl.sampling.schedules import shifted_sigmas
    from flowrl.sampling.steps import flow_grpo_step

    import diffusers

    diffusers.utils.logging.set_verbosity_error()  # the "cast with to()" notice for a random model
    dev = torch.device(device)
    torch.manual_seed(0)
    with dev:
        net = SD3Transformer2DModel(**config)
    net.to(dtype).requires_grad_(False)
    net.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, init_lora_weights="gaussian", target_modules=FLOW_GRPO_TARGETS))
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # as FlowPolicy.add_lora: trainable weights stay fp32
    if gradient_checkpointing:
        net.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)
    use_cfg = guidance != 1.0
    nb = 2 * group if use_cfg else group
    c = config["in_channels"]
    emb = torch.randn(nb, text_tokens, config["joint_attention_dim"], device=dev, dtype=dtype)
    pooled = torch.randn(nb, config["pooled_projection_dim"], device=dev, dtype=dtype)
    sigmas = [float(s) for s in shifted_sigmas(steps, 3.0)]
    sigma_max = sigmas[1]

    def velocity(x, sigma):
        x_in = x.to(dtype)
        if use_cfg:
            x_in = torch.cat([x_in, x_in])
        t = torch.full((nb,), sigma * 1000.0, device=dev)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            v = net(hidden_states=x_in, timestep=t, encoder_hidden_states=emb, pooled_projections=pooled, return_dict=False)[0].float()
        if use_cfg:
            vu, vc = v.chunk(2)
            v = vu + guidance * (vc - vu)
        return v

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def one_iteration():
        t0 = time.perf_counter()
        net.eval()
        x = torch.randn(group, c, latent_hw, latent_hw, device=dev)
        traj, old_lp = [x], []
        with torch.no_grad():
            for t in range(steps):
                out = flow_grpo_step(x, velocity(x, sigmas[t]), sigmas[t], sigmas[t + 1], noise=torch.randn_like(x),
                                     noise_level=0.7, sigma_max=sigma_max)
                x = out.next_x
                traj.append(x)
                old_lp.append(out.log_prob)
        sync()
        t1 = time.perf_counter()
        net.train()
        adv = torch.randn(group, device=dev).clamp(-5, 5)
        for t in range(steps):
            out = flow_grpo_step(traj[t], velocity(traj[t], sigmas[t]), sigmas[t], sigmas[t + 1], x_next=traj[t + 1],
                                 noise_level=0.7, sigma_max=sigma_max)
            (clipped_policy_loss(out.log_prob, old_lp[t], adv, 1e-4).loss / steps).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    for _ in range(warmup):
        one_iteration()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    runs = [one_iteration() for _ in range(iterations)]
    res = {
        "sampling_s": statistics.median(r[0] for r in runs),
        "training_s": statistics.median(r[1] for r in runs),
        "params": sum(p.numel() for p in net.parameters()),
        "trainable": sum(p.numel() for p in params),
        "max_memory_allocated": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0,
    }
    res["iteration_s"] = res["sampling_s"] + res["training_s"]
    return res


def run_gpu_iteration(args) -> int:
    if args.smoke:  # the code path on the CPU: a one-block transformer in fp32, one timed iteration after one warm-up
        config, device, dtype, name, text_tokens, rank = TINY_SD3, "cpu", torch.float32, "one-block (--smoke)", 8, 2
    elif not torch.cuda.is_available():
        print("--gpu-iteration needs a CUDA GPU and torch.cuda.is_available() is False here; skipping the SD3.5-Medium iteration benchmark.")
        return 0
    else:
        config, device, dtype, name, text_tokens, rank = SD35_MEDIUM, "cuda", torch.bfloat16, "SD3.5-Medium-config", 205, 32
    hw = args.gpu_resolution // 8
    guidance = args.gpu_guidance
    r = gpu_iteration(config, device, dtype, group=args.gpu_group, steps=args.steps, latent_hw=hw, text_tokens=text_tokens,
                      guidance=guidance, lora_rank=rank, gradient_checkpointing=args.gpu_gradient_checkpointing,
                      iterations=args.gpu_iterations)
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gpu-iteration: {where}, torch {torch.__version__}; {name} SD3Transformer2DModel "
          f"(random init, {r['params'] / 1e9:.2f}B params, {str(dtype).removeprefix('torch.')}), LoRA r{rank} on {len(FLOW_GRPO_TARGETS)} "
          f"projections ({r['trainable'] / 1e6:.1f}M trainable, fp32), gradient checkpointing {'on' if args.gpu_gradient_checkpointing else 'off'}")
    print(f"workload: {args.gpu_resolution}x{args.gpu_resolution} (latents 16x{hw}x{hw}), group {args.gpu_group}, {args.steps} flow_grpo steps, "
          f"guidance {guidance} ({'CFG: batch ' + str(2 * args.gpu_group) if guidance != 1.0 else 'no CFG'}), {text_tokens} text tokens; "
          f"{args.steps} sampling forwards + {args.steps} forward/backward + 1 AdamW step; median of {args.gpu_iterations} after 1 warm-up")
    print(f"sampling {r['sampling_s']:.3f} s + training {r['training_s']:.3f} s = {r['iteration_s']:.3f} s per iteration")
    print(f"torch.cuda.max_memory_allocated {r['max_memory_allocated'] / 2**30:.2f} GiB")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--gpu-iteration", action="store_true", help="time one SD3.5-Medium GRPO iteration on CUDA instead")
    p.add_argument("--gpu-group", type=int, default=8)
    p.add_argument("--gpu-resolution", type=int, default=512)
    p.add_argument("--gpu-guidance", type=float, default=4.5, help="CFG scale; 1.0 disables CFG")
    p.add_argument("--gpu-iterations", type=int, default=2)
    p.add_argument("--gpu-gradient-checkpointing", action="store_true")
    p.add_argument("--smoke", action="store_true", help="both code paths on tiny transformers on the CPU, in seconds (no reading)")
    args = p.parse_args(argv)
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
