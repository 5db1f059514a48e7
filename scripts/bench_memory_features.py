"""Peak memory of the memory features of issue 68, each against scripts/plan_memory.py's plan: one Flow-GRPO
iteration of a 1-GPU preset at its real transformer size with random weights, under each configuration.

    python scripts/bench_memory_features.py                  # SD3.5-Medium, on a CUDA machine (scripts/gpu_checks.sh)
    python scripts/bench_memory_features.py --model flux1    # FLUX.1-dev (12B)
    python scripts/bench_memory_features.py --cpu-smoke      # the same code path with a tiny transformer, no reading

CONFIGS names each configuration by what it changes: AdamW against 8-bit AdamW, the bf16 base against NF4, the
text encoders on the device against cached, and all three together. The pipeline is scripts/random_pipeline.py's
(the transformer's real config, small text encoders and VAE of the real widths, so the encoders' saving is that of
the small ones here; the planner counts the real ones), loaded by the trainer through from_pretrained. One prompt's
group per iteration, scored by the built-in brightness reward (no reward model on the GPU, none in the plan). The
reading is torch.cuda.max_memory_allocated over one iteration above what was allocated before the trainer was
built, printed beside the plan of the same launch (Launch.from_config with the built pipeline's own encoders) and
appended to --out as one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import append_result, use_cuda  # noqa: E402
from random_pipeline import build_pipeline  # noqa: E402

PRESETS = {"sd35": ("sd35_medium_pickscore_1gpu", 4), "flux1": ("flux1_dev_hps_1gpu", 2)}  # model: (preset, batch per forward)
CONFIGS = {  # name: overrides over the preset (TEXT_CACHE is replaced by the run's cache directory)
    "adamw_bf16": [],
    "adamw8bit": ["trainer.optimizer=adamw8bit"],
    "nf4": ["model.quantize=nf4"],
    "cached": ["model.text_encoders=cached", "model.text_cache_dir=TEXT_CACHE"],
    "all": ["trainer.optimizer=adamw8bit", "model.quantize=nf4", "model.text_encoders=cached", "model.text_cache_dir=TEXT_CACHE"],
}
PROMPT = "a photo of a red fox in the snow"


def overrides_for(model: str, config: str, model_dir: Path, cuda: bool, tmp: Path) -> list[str]:
    batch = PRESETS[model][1]
    out = [f"model.path={model_dir}", f"model.device={'cuda' if cuda else 'cpu'}", "model.gradient_checkpointing=true",
           "data.prompt_file=null", f"data.prompts=[{PROMPT}]", f"data.eval_prompts=[{PROMPT}]", "data.prompts_per_iteration=1",
           f"data.group_size={batch}", f"sampling.batch_size={batch}", "trainer.gradient_accumulation_steps=1",
           "reward.weights={brightness: 1.0}", "reward.options={}", "run.tracker=none", "run.progress=false",
           "run.sample_every=0", "run.checkpoint_every=0", "trainer.budget_minutes=0", "monitor.enabled=false"]
    out += [o.replace("TEXT_CACHE", str(tmp / "text_cache")) for o in CONFIGS[config]]
    if not cuda:  # the code path only: 64 pixels, two samples, two steps
        out += ["model.height=64", "model.width=64", "sampling.num_steps=2", "sampling.eval_num_steps=2", "sampling.batch_size=2",
                "data.group_size=2", "model.max_sequence_length=16"]
    return out


def bench(model: str, config: str, model_dir: Path, cuda: bool, tmp: Path) -> dict:
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer
    from flowrl.train.memory_plan import GIB, Launch, load_model, plan, plan_peak

    cfg = load_config(PRESETS[model][0], overrides_for(model, config, model_dir, cuda, tmp))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir=tmp / f"run-{model}-{config}")
    row = trainer.train_iteration()
    seconds = time.perf_counter() - t0
    print(f"  {model} {config}: built and one iteration in {seconds:.1f} s, loss {row['loss']:.4g}, "
          f"gradient norm {row['grad_norm']:.6g}", flush=True)
    planned = plan_peak(plan(load_model(str(model_dir)), Launch.from_config(cfg)))
    out = {"check": "memory_features", "model": model, "config": config, "overrides": CONFIGS[config], "plan_gib": planned,
           "seconds": seconds, "loss": row["loss"], "reward_mean": row["reward_mean"], "grad_norm": row["grad_norm"],
           "cpu_smoke": not cuda}
    if cuda:
        out["peak_gib"] = (torch.cuda.max_memory_allocated() - before) / GIB
        out["measured_over_plan"] = out["peak_gib"] / planned
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(PRESETS), default="sd35")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny transformer on the CPU: the code path, no reading")
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per configuration")
    a = ap.parse_args(argv)
    cuda = use_cuda("bench_memory_features", a.cpu_smoke)
    if cuda is None:
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_memory_features-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        model_dir = build_pipeline(tmp / a.model, tiny=not cuda, tiny_layers=3, model=a.model)
        print(f"bench_memory_features: {a.model} pipeline built in {time.perf_counter() - t0:.1f} s", flush=True)
        for config in a.configs:
            result = bench(a.model, config, model_dir, cuda, tmp)
            print(json.dumps(result), flush=True)
            append_result(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
