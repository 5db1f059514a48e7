"""Sol-RL's stage-1 exploration on one card: the exploration copies against compiled BF16, same group.

    python scripts/bench_explore.py                 # CUDA: an SD3.5-Medium-sized transformer (scripts/gpu_checks.sh)
    python scripts/bench_explore.py --cpu-smoke     # the code path: a tiny transformer, fake-quantised FP8, eager

One prompt's group of --group chains (classifier-free guidance, batches of --batch) is sampled by
each copy, in this order (a time limit keeps what finished):
  bf16            the policy itself, --steps ODE steps: the reference
  fp8+preview+fbc FP8 (per-row scales), a --preview-step ODE preview, First Block Cache --fbc
  fp8             FP8 alone, --steps steps
  fp8+preview     FP8 and the preview
Every network is compiled per block (model.compile blocks; eager with --cpu-smoke) with
fixed batch shapes; the first group warms up and compiles, the second is timed. The reading is
images per second, its ratio to BF16 (goal: fp8+preview+fbc at least 1.6x), and each copy's
error against BF16 for the same seeds: the relative RMS of the final latents (random weights
have no reward to compare; a trained model's reward ranking is what bench_two_stage measures).
FP8 copies quantise only the linears at least --min-features wide (Sol-RL's rule for where FP8
GEMMs pay). Each result is printed and appended to --out as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import append_result, use_cuda  # noqa: E402
from random_pipeline import build_pipeline  # noqa: E402

VARIANTS = {  # name: (precision, preview, first-block-cache)
    "bf16": ("bf16", False, False),
    "fp8+preview+fbc": ("fp8", True, True),
    "fp8": ("fp8", False, False),
    "fp8+preview": ("fp8", True, False),
}


def relative_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt())


def measure(name: str, policy, specs: dict, prompts: list[str], seeds: list[int], a, mode: str, cuda: bool, device: str):
    """One copy's group, warmed up, then timed: its row (without the comparison to BF16) and final latents."""
    from flowrl.models.compile import compile_network
    from flowrl.sampling.precision import ExplorationCopy
    from flowrl.sampling.rollout import rollout

    precision, preview, cached = VARIANTS[name]
    t0 = time.perf_counter()
    copy = ExplorationCopy(policy, precision, fp8_scaling="row", min_features=a.min_features, first_block_cache=a.fbc if cached else 0.0)
    if copy.net is not None:
        compile_network(copy.net, mode)
    for group in ("warm-up", "timed"):
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        traj = rollout(copy.policy, prompts, seeds, specs[preview], a.batch)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t1
        print(f"  {name}: {group} group {seconds:.1f} s", flush=True)
    calls, reused = copy.cache_reuse()
    row = {"check": "explore", "variant": name, "device": device, "images_per_s": a.group / seconds, "label": copy.label or "bfloat16",
           "quantized_linears": len(copy.quantized), "build_and_warmup_s": time.perf_counter() - t0 - seconds, "cpu_smoke": a.cpu_smoke}
    if cached:
        row["cache_reused"] = reused / max(calls, 1)
    return row, traj.final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny transformer on the CPU: the code path, no reading")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8, help="chains of one prompt per timed group")
    ap.add_argument("--batch", type=int, default=4, help="chains per forward (x2 rows with guidance)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--preview", type=int, default=6, help="ODE steps of the preview")
    ap.add_argument("--fbc", type=float, default=0.08, help="First Block Cache threshold")
    ap.add_argument("--min-features", type=int, default=1536, help="FP8 only for linears at least this wide")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per variant")
    a = ap.parse_args(argv)
    cuda = use_cuda("bench_explore", a.cpu_smoke)
    if cuda is None:
        return 0
    if a.cpu_smoke:
        a.resolution, a.group, a.batch, a.steps, a.preview, a.min_features = 64, 2, 2, 3, 2, 0
    if "bf16" not in a.variants:
        a.variants.insert(0, "bf16")  # the reference every ratio and error needs
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.sampling.rollout import SamplerSpec

    mode = "none" if a.cpu_smoke else "blocks"
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = build_pipeline(Path(tmp) / "pipe", tiny=a.cpu_smoke, tiny_layers=3)
        cfg = load_config("tiny_jpeg", [
            f"model.path={model_dir}", "model.kind=sd3", "model.dtype=bf16", f"model.height={a.resolution}",
            f"model.width={a.resolution}", "model.max_sequence_length=128", "model.guidance_scale=4.5",
            f"model.device={'cuda' if cuda else 'cpu'}", "lora.enabled=false"])
        policy = load_policy(cfg.model)
        policy.compile(mode, a.batch)
        device = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"bench_explore: {device}; SD3.5-Medium-sized transformer ({sum(p.numel() for p in policy.transformer.parameters()) / 1e9:.2f}B "
              f"params, random weights, built in {time.perf_counter() - t0:.1f} s), {a.resolution}x{a.resolution}, a group of {a.group} "
              f"in batches of {a.batch} with guidance, {a.steps} steps (preview {a.preview}), model.compile {mode}", flush=True)
        s = cfg.sampling
        specs = {False: SamplerSpec.ode(policy.sigmas(a.steps, s.schedule, s.shift)),
                 True: SamplerSpec.ode(policy.sigmas(a.preview, s.schedule, s.shift))}
        prompts, seeds = ["a photo of a red fox in the snow"] * a.group, list(range(a.group))
        reference, results = None, []
        for name in a.variants:
            try:
                row, final = measure(name, policy, specs, prompts, seeds, a, mode, cuda, device)
            except Exception as exc:  # one copy failing (a kernel, a compile) leaves the others to measure
                if name == "bf16":
                    raise
                row, final = {"check": "explore", "variant": name, "device": device, "error": f"{type(exc).__name__}: {exc}"[:300]}, None
            if final is not None:
                if reference is None:
                    reference = (row["images_per_s"], final)
                else:
                    row["vs_bf16"] = row["images_per_s"] / reference[0]
                    row["relative_rms_vs_bf16"] = relative_rms(final, reference[1])
            results.append(row)
            print(json.dumps(row), flush=True)
            append_result(a.out, row)
            if cuda:
                torch.cuda.empty_cache()
    best = next((r for r in results if r["variant"] == "fp8+preview+fbc" and "vs_bf16" in r), None)
    if best:
        print(f"bench_explore: fp8+preview+fbc {best['vs_bf16']:.2f}x compiled bf16 (goal 1.6x), final latents' relative RMS "
              f"{best['relative_rms_vs_bf16']:.3f} against bf16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
