"""One training iteration of each algorithm's 1-GPU preset at its real model size, with random
weights: seconds per iteration and peak memory against scripts/plan_memory.py's plan.

    python scripts/bench_presets.py                      # on a CUDA machine (scripts/gpu_checks.sh presets)
    python scripts/bench_presets.py --presets dgpo nft   # some of them
    python scripts/bench_presets.py --cpu-smoke          # the same code path with tiny transformers, no reading

PRESETS names each algorithm's preset and what it changes there. The transformer is the preset
model's real config with random weights (scripts/random_pipeline.py: SD3.5-Medium or FLUX.1-dev,
small text encoders and VAE of the real widths), saved to a directory and loaded by the trainer
through from_pretrained. Every preset keeps its LoRA, sampler, group size, batch size,
resolution and objective; it trains one prompt's group per iteration (data.prompts_per_iteration
1), scored by the built-in brightness reward (no reward model to download). GDRO first builds its
offline store of that group with `flowrl offline build` (4 sampling steps). The reading is the
second iteration's seconds (the first warms up) and torch.cuda.max_memory_allocated over both,
each printed and appended to --out as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import append_result, use_cuda  # noqa: E402
from random_pipeline import build_pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {  # name: (preset, the model it trains, overrides that make the algorithm)
    "grpo": ("sd35_medium_pickscore_1gpu", "sd35", []),
    "dgpo": ("sd35_medium_dgpo_1gpu", "sd35", []),
    "nft": ("sd35_medium_pickscore_1gpu", "sd35", ["objective.kind=nft", "sampling.sampler=ode"]),
    "tree": ("sd35_medium_pickscore_1gpu", "sd35", ["rollout.kind=tree", "rollout.tree.split_steps=[0,3,6]",
                                                    "rollout.tree.branching=[2]", "data.group_size=8", "advantage.std=group"]),
    "g2rpo": ("flux1_dev_g2rpo_1gpu", "flux1", []),
    "gdro": ("flux1_dev_gdro_1gpu", "flux1", []),
}
PROMPT = "a photo of a red fox in the snow"


def overrides_for(name: str, model_dir: Path, cuda: bool, store: Path | None) -> list[str]:
    _, _, algorithm = PRESETS[name]
    out = [f"model.path={model_dir}", f"model.device={'cuda' if cuda else 'cpu'}", "data.prompt_file=null", f"data.prompts=[{PROMPT}]",
           f"data.eval_prompts=[{PROMPT}]", "data.prompts_per_iteration=1", "reward.weights={brightness: 1.0}", "reward.channel_weights={}",
           "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0", "trainer.budget_minutes=0",
           "trainer.gradient_accumulation_steps=1", *algorithm]
    if store is not None:
        out.append(f"data.offline={store}")
    if not cuda:  # the code path only: 64 pixels, two samples, two steps
        out += ["model.height=64", "model.width=64", "sampling.num_steps=2", "sampling.eval_num_steps=2", "sampling.batch_size=2",
                "data.group_size=2", "model.max_sequence_length=16"]
        if name == "dgpo":
            out += ["sampling.num_steps=5"]  # its grid of 5 sigmas needs 5 steps
        if name == "tree":
            out += ["rollout.tree.split_steps=[0]", "rollout.tree.branching=[2]"]
        if name == "g2rpo":
            out += ["rollout.granular.branch_steps=[0]", "rollout.granular.granularities=[1]"]
    return out


def build_store(name: str, model_dir: Path, cuda: bool, out: Path) -> Path:
    """The GDRO preset's offline store of the one prompt's group, sampled with 4 steps."""
    preset = PRESETS[name][0]
    args = [sys.executable, "-m", "flowrl.cli", "offline", "build", preset, *overrides_for(name, model_dir, cuda, None),
            "sampling.num_steps=4" if cuda else "sampling.num_steps=2", "-o", str(out)]
    subprocess.run(args, check=True, cwd=ROOT)
    return out


def bench(name: str, model_dir: Path, cuda: bool, tmp: Path) -> dict:
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer
    from flowrl.train.memory_plan import GIB, Launch, load_model, plan, plan_peak

    preset, model, _ = PRESETS[name]
    store = build_store(name, model_dir, cuda, tmp / f"store-{name}") if name == "gdro" else None
    cfg = load_config(preset, overrides_for(name, model_dir, cuda, store))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, run_dir=tmp / f"run-{name}")
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        row = trainer.train_iteration()
        seconds.append(time.perf_counter() - t0)
        print(f"  {name} iteration {row['iteration']}: {seconds[-1]:.2f} s, loss {row['loss']:.4g}", flush=True)
    launch = Launch.from_config(cfg)
    rows = plan(load_model(str(model_dir)), launch)
    out = {"check": "presets", "preset": preset, "algorithm": name, "model": model, "seconds_per_iteration": seconds[-1],
           "first_iteration_s": seconds[0], "samples_per_iteration": cfg.data.group_size, "plan_gib": plan_peak(rows),
           "cpu_smoke": not cuda}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["measured_over_plan"] = out["peak_gib"] / out["plan_gib"]
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny transformers on the CPU: the code path, no reading")
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per preset")
    a = ap.parse_args(argv)
    cuda = use_cuda("bench_presets", a.cpu_smoke)
    if cuda is None:
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_presets-") as tmp:
        tmp = Path(tmp)
        pipelines: dict[str, Path] = {}
        for name in a.presets:
            model = PRESETS[name][1]
            if model not in pipelines:
                t0 = time.perf_counter()
                pipelines[model] = build_pipeline(tmp / model, tiny=not cuda, tiny_layers=3, model=model)
                print(f"bench_presets: {model} pipeline built in {time.perf_counter() - t0:.1f} s", flush=True)
            result = bench(name, pipelines[model], cuda, tmp)
            print(json.dumps(result), flush=True)
            append_result(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
