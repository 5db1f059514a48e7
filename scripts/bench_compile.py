#!/usr/bin/env python3
"""Benchmark model.compile on the default preset: eager against torch.compile per block and whole.

The default preset (configs/default.yaml: the embedded shapes model, its objective and processes)
trains --iterations iterations three times, each in its own process tree with the same seed:
model.compile none (eager), blocks (each transformer block compiled) and full (the whole
transformer compiled). The wall-clock budget, sample grids and checkpoints are off, so every run
trains exactly --iterations iterations and the metrics rows time iterations alone. The first
--warmup iterations of every run (where torch.compile builds its graphs) are left out; the rest
give the seconds per iteration, split into sampling and training, and the ratio to eager
(eager seconds / mode seconds: above 1 is faster). The last column counts the graphs compiled
after warm-up (0: nothing recompiled). Measure on a quiet machine: runs follow each other, so
other load skews the ratios.

Usage:
  .venv/bin/python scripts/bench_compile.py                     # 20 iterations, 2 warm-up
  .venv/bin/python scripts/bench_compile.py --iterations 3 --warmup 1 --modes none blocks
Trailing key=value arguments override the preset for every run (e.g. run.cpu_processes=1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("none", "blocks", "full")
FIXED = ["trainer.budget_minutes=0", "trainer.max_minutes=0", "run.sample_every=0", "run.checkpoint_every=0",
         "run.tracker=none", "run.progress=false"]
TRAIN = "import sys; from flowrl.cli import main; sys.exit(main(sys.argv[1:]))"


def train(config: str, mode: str, iterations: int, seed: int, overrides: list[str], run_dir: Path) -> list[dict]:
    """One run of `config` under model.compile `mode` in its own process (and its own workers);
    its metrics rows."""
    argv = ["train", config, *FIXED, f"trainer.iterations={iterations}", f"trainer.seed={seed}", f"model.compile={mode}",
            *overrides, "--run-dir", str(run_dir)]
    done = subprocess.run([sys.executable, "-c", TRAIN, *argv], cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"bench_compile: the {mode} run failed (exit status {done.returncode}); its output is above")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="default", help="preset name or YAML (default: the default preset)")
    p.add_argument("--iterations", type=int, default=20, help="iterations per run, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first iterations of every run left out of the timing")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="model.compile values to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per mode (scripts/gpu_checks.sh)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    if args.iterations <= args.warmup:
        p.error(f"--iterations ({args.iterations}) must exceed --warmup ({args.warmup}): no iteration would be timed")
    if "none" not in args.modes:
        args.modes = ["none", *args.modes]  # the ratios are to eager

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_compile-") as tmp:
        for mode in args.modes:
            print(f"bench_compile: model.compile={mode}, {args.iterations} iterations ...", flush=True)
            rows = train(args.config, mode, args.iterations, args.seed, args.overrides, Path(tmp) / mode)
            timed = rows[args.warmup:]
            results[mode] = {
                "warmup_s": sum(r["time_iteration"] for r in rows[: args.warmup]),
                "iteration_s": mean([r["time_iteration"] for r in timed]),
                "sampling_s": mean([r["time_sampling"] for r in timed]),
                "training_s": mean([r["time_training"] for r in timed]),
                "late_graphs": sum(r.get("compiled_graphs", 0) for r in timed),
                "reward": mean([r["reward_mean"] for r in rows]),
            }

    eager = results["none"]
    print(f"\n{args.config}: {args.iterations} iterations per run, the first {args.warmup} left out "
          f"(seconds per iteration; ratio = eager / mode, above 1 is faster)")
    print(f"{'model.compile':<14} {'warm-up s':>10} {'s/iter':>8} {'ratio':>6} {'sampling':>9} {'ratio':>6} "
          f"{'training':>9} {'ratio':>6} {'graphs after warm-up':>21} {'mean reward':>12}")
    for mode, r in results.items():
        print(f"{mode:<14} {r['warmup_s']:10.1f} {r['iteration_s']:8.2f} {eager['iteration_s'] / r['iteration_s']:5.2f}x "
              f"{r['sampling_s']:9.2f} {eager['sampling_s'] / r['sampling_s']:5.2f}x {r['training_s']:9.2f} "
              f"{eager['training_s'] / r['training_s']:5.2f}x {'-' if mode == 'none' else r['late_graphs']:>21} "
              f"{r['reward']:12.4f}")
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps({"check": "compile", "config": args.config, "mode": mode, **r,
                                    "vs_eager": eager["iteration_s"] / r["iteration_s"]}) + "\n")


if __name__ == "__main__":
    main()
