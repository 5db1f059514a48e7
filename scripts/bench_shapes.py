"""Base vs RL-trained held-out accuracy of the embedded shapes model, GenEval-style.

    python scripts/bench_shapes.py                      # the default preset, its own budget
    python scripts/bench_shapes.py trainer.max_minutes=10 --per-category 150

Evaluates the base model on the held-out prompts (one ODE sample per prompt and seed,
`--per-category` images per category), trains the default preset (`flowrl train` with no
config, plus any overrides), evaluates the trained run's EMA weights on the same prompts and
seeds, and prints the per-category table, the number of iterations, the wall time, and on its
last line the absolute gain in held-out strict accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="dot-list overrides of the default preset")
    ap.add_argument("--config", default=None, help="a preset or YAML (default: the default preset)")
    ap.add_argument("--per-category", type=int, default=150)
    ap.add_argument("--run-dir", default=None, help="where the training run goes (default runs/bench-shapes-<time>)")
    ap.add_argument("--seed", type=int, default=10_000, help="first eval seed (training never uses these)")
    args = ap.parse_args(argv)

    from flowrl.cli import _load_run_policy
    from flowrl.cli import main as cli_main
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.train.evaluate import evaluate, format_category_table
    from flowrl.train.prompts import builtin_prompts
    from flowrl.train.run_dir import RunDir
    from rewards import MultiReward

    cfg = load_config(args.config, args.overrides + ["run.progress=false"])
    prompts = builtin_prompts("builtin:shapes-heldout", "--prompts", per_category=args.per_category)
    reward = MultiReward.from_config(cfg.reward)
    if "shapes" not in reward.channels:
        raise SystemExit("bench_shapes needs a config whose reward includes shapes")
    print(f"bench_shapes: {cfg.model.path}, {len(prompts)} held-out images ({args.per_category} per category), "
          f"{cfg.sampling.eval_num_steps}-step ODE, guidance {cfg.model.guidance_scale}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)

    t0 = time.perf_counter()
    base = evaluate(cfg, load_policy(cfg.model), reward, prompts, seed=args.seed)
    t_eval = time.perf_counter() - t0
    print(f"base evaluated in {t_eval:.0f} s", flush=True)

    run_dir = Path(args.run_dir or f"runs/bench-shapes-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.perf_counter()
    # through the CLI, exactly as a user runs it (with run.cpu_processes > 1 it launches the processes)
    code = cli_main(["train", *([args.config] if args.config else []), *args.overrides, "run.progress=false",
                     "--run-dir", str(run_dir)])
    if code != 0:
        raise SystemExit(f"bench_shapes: training failed (exit {code})")
    t_train = time.perf_counter() - t0
    history = RunDir(run_dir).read_metrics()
    rollouts = sum(row["samples"] for row in history)  # trained on
    explored = sum(row.get("candidates", row["samples"]) for row in history)  # two-stage: the candidate pool
    _, policy, ckpt = _load_run_policy(run_dir)
    trained = evaluate(cfg, policy, reward, prompts, seed=args.seed)

    tables = {"base": base.category_table(), f"trained ({ckpt.name})": trained.category_table()}
    print(format_category_table(tables))
    gain = tables[list(tables)[1]]["overall"]["strict"] - tables["base"]["overall"]["strict"]
    summary = {"iterations": len(history), "rollouts": rollouts, "explored": explored, "train_minutes": t_train / 60, "run_dir": str(run_dir),
               "base": tables["base"], "trained": tables[list(tables)[1]]}
    (run_dir / "bench_shapes.json").write_text(json.dumps(summary, indent=1))
    pool = f" ({explored} candidates explored)" if explored != rollouts else ""
    print(f"{len(history)} iterations, {rollouts} rollouts trained on{pool}, {t_train / 60:.1f} min of training (run {run_dir})")
    print(f"held-out strict gain {gain:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
