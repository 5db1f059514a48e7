"""FSDP2 smoke run: full fine-tuning of an SD3.5-Medium-sized transformer on one GPU under
run.distributed=fsdp2, its peak memory against scripts/plan_memory.py's estimate (goal: within 15%).

    python scripts/bench_fsdp_memory.py            # on a CUDA machine (scripts/gpu_checks.sh)
    python scripts/bench_fsdp_memory.py --cpu-smoke  # the same code path with a tiny transformer, no memory reading

The pipeline is built from configs with random weights (nothing is downloaded): the transformer
with the SD3.5-Medium config in bf16, and small text encoders and VAE with the real ones' output
sizes, so the transformer's training state dominates the memory. The run is the flowrl trainer
itself (flowrl.train.loop.Trainer) for a few iterations without checkpoints; the reading is
torch.cuda.max_memory_allocated over them, and the plan is the planner's for the same launch
with the encoders' real parameter count replaced by the built ones'.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl.train.memory_plan import GIB, Launch, format_plan, load_model, plan, plan_peak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import append_result, use_cuda  # noqa: E402
from random_pipeline import build_pipeline  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny transformer on the CPU: the code path, no reading")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="sampling.batch_size (training rows: x2 for CFG)")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="append the reading as one JSON line (scripts/gpu_checks.sh)")
    a = ap.parse_args(argv)
    cuda = use_cuda("bench_fsdp_memory", a.cpu_smoke)
    if cuda is None:
        return 0
    resolution = 64 if a.cpu_smoke else a.resolution
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = build_pipeline(Path(tmp) / "pipe", tiny=a.cpu_smoke)
        print(f"pipeline built in {time.perf_counter() - t0:.1f} s")
        overrides = [
            f"model.path={model_dir}", "model.kind=sd3", "model.dtype=bf16", f"model.height={resolution}",
            f"model.width={resolution}", "model.max_sequence_length=128", "model.gradient_checkpointing=true",
            f"model.device={'cuda' if cuda else 'cpu'}", "lora.enabled=false", "run.distributed=fsdp2",
            "trainer.mixed_precision=bf16", "trainer.kl_beta=0.04", "trainer.ema=true", "trainer.lr=1e-5",
            "sampling.num_steps=4", "sampling.eval_num_steps=4", f"sampling.batch_size={a.batch}",
            "data.prompts_per_iteration=1", f"data.group_size={a.batch}", "model.guidance_scale=4.5",
            "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0",
            "reward.weights={brightness: 1.0}",
        ]
        cfg = load_config("tiny_jpeg", overrides)
        launch = Launch.from_config(cfg)  # fsdp2, full fine-tuning with a KL and EMA, as the overrides above
        model = load_model(str(model_dir))
        rows = plan(model, launch)
        print(format_plan(model, launch, rows))
        trainer = Trainer(cfg, run_dir=Path(tmp) / "run")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(a.iterations):  # no checkpoints: only the training iterations' memory
            t0 = time.perf_counter()
            row = trainer.train_iteration()
            print(f"iteration {row['iteration']}: {time.perf_counter() - t0:.2f} s, loss {row['loss']:.4g}, "
                  f"grad norm {row['grad_norm']:.4g}, skipped {row['skipped_steps']}")
        planned = plan_peak(rows)
        result = {"check": "fsdp_memory", "plan_gib": planned, "cpu_smoke": not cuda}
        if cuda:
            peak = torch.cuda.max_memory_allocated() / GIB
            result.update(peak_gib=peak, measured_over_plan=peak / planned)
            print(f"peak torch.cuda.max_memory_allocated {peak:.2f} GiB; plan {planned:.2f} GiB; "
                  f"measured / plan {peak / planned:.3f} (goal 0.85-1.15)")
        else:
            print(f"plan {planned:.4f} GiB; no memory reading on the CPU")
        append_result(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
