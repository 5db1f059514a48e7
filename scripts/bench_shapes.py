#!/usr/bin/env python3
"""Base vs RL-trained held-out accuracy of the embedded shapes model, GenEval-style.

    python scripts/bench_shapes.py                      # the default preset, its own budget
    python scripts/bench_shapes.py trainer.max_minutes=10 --per-category 150
    python scripts/bench_shapes.py --per-category 100 --seed 10000 20000   # two eval sets
    python scripts/bench_shapes.py --smoke              # the code path in seconds: a tiny random model, one iteration
    python scripts/bench_shapes.py --config edit_shapes --seed 10000 20000   # the editing world (per edit type)
    python scripts/bench_shapes.py --config edit_shapes trainer.seed=1 --seed 10000 20000 --base-from runs/X/bench_shapes.json
        # another training seed: the base model's tables from the first run (checked to be the same evaluation)

Evaluates the base model on the held-out prompts (one ODE sample per prompt and seed,
`--per-category` images per category), trains the default preset (`flowrl train` with no
config, plus any overrides), evaluates the trained run's EMA weights on the same prompts and
seeds, and prints the per-category table, the number of iterations, the wall time, and on its
last line the absolute gain in held-out strict accuracy. A config that trains on edits (data.edits) is scored
on the editing world's held-out set (builtin:shapes-edit-heldout, or --edits) by the shapes_edit reward, per
edit type instead of per category. With several `--seed` values (eval
sets: image j of a set with seed S is sampled from seed S + j) both models are scored on each
set, and the last line gives the mean gain, each set's in parentheses; one run's gain moves by
several hundredths from one eval set to another (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="dot-list overrides of the default preset")
    ap.add_argument("--config", default=None, help="a preset or YAML (default: the default preset)")
    ap.add_argument("--per-category", type=int, default=150)
    ap.add_argument("--edits", default="builtin:shapes-edit-heldout",
                    help="the held-out edits of a config that trains on edits (data.edits); --per-category is then unused")
    ap.add_argument("--base-from", metavar="JSON", default=None,
                    help="reuse the base model's tables from an earlier run's bench_shapes.json with the same base model, "
                         "eval sets and evaluation settings (several training seeds score the base once)")
    ap.add_argument("--run-dir", default=None, help="where the training run goes (default runs/bench-shapes-<time>)")
    ap.add_argument("--seed", type=int, nargs="+", default=[10_000],
                    help="first eval seed of each eval set (training never uses these); several: one table and gain per set")
    ap.add_argument("--smoke", action="store_true", help="the code path on a tiny random shapes model (scripts/smoke.py): one "
                    "iteration, one held-out prompt per category, the run in a temporary directory unless --run-dir")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.smoke:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from smoke import shapes_overrides, tiny_shapes_model

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_shapes-smoke-")))
            args.overrides = shapes_overrides(tiny_shapes_model(tmp / "model")) + args.overrides
            args.per_category, args.run_dir = 1, args.run_dir or str(tmp / "run")
        return run(args)


def run(args) -> int:
    from flowrl.runs import load_run_policy
    from flowrl.cli import main as cli_main
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.runtime.budget import PLAN_FILE, machine_name
    from flowrl.train.evaluate import evaluate, format_category_table
    from flowrl.train.edit_data import read_edits
    from flowrl.train.prompts import builtin_prompts
    from flowrl.runtime.run_dir import RunDir
    from rewards import MultiReward

    cfg = load_config(args.config, args.overrides + ["run.progress=false"])
    world = "shapes_edit" if cfg.data.edits else "shapes"
    if cfg.data.edits:
        prompts, what = read_edits(args.edits, field="--edits"), f"edits of {args.edits}"
    else:
        prompts = builtin_prompts("builtin:shapes-heldout", "--prompts", per_category=args.per_category)
        what = f"prompts ({args.per_category} per category)"
    reward = MultiReward.from_config(cfg.reward)
    if world not in reward.channels:
        raise SystemExit(f"bench_shapes needs a config whose reward includes {world}")
    print(f"bench_shapes: {cfg.model.path}, {len(prompts)} held-out {what}, "
          f"{cfg.sampling.eval_num_steps}-step ODE, guidance {cfg.model.guidance_scale}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads on {machine_name()}", flush=True)

    t0 = time.perf_counter()
    # what the base model's scores depend on: a --base-from file must match it
    evaluation = {"model": dataclasses.asdict(cfg.model), "eval_num_steps": cfg.sampling.eval_num_steps, "schedule": cfg.sampling.schedule,
                  "shift": cfg.sampling.shift, "batch_size": cfg.sampling.batch_size, "reward": repr(cfg.reward),
                  "prompts": [str(p) for p in prompts]}
    if args.base_from:
        earlier = json.loads(Path(args.base_from).read_text())
        if earlier.get("evaluation") != evaluation or not all(str(s) in earlier["eval_sets"] for s in args.seed):
            raise SystemExit(f"bench_shapes: --base-from {args.base_from} scored another base model, evaluation or eval sets")
        base = {seed: earlier["eval_sets"][str(seed)]["base"] for seed in args.seed}
        print(f"base tables from {args.base_from}", flush=True)
    else:
        base_policy = load_policy(cfg.model)
        base = {seed: evaluate(cfg, base_policy, reward, prompts, seed=seed).category_table() for seed in args.seed}
        del base_policy
        print(f"base evaluated in {time.perf_counter() - t0:.0f} s", flush=True)

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
    _, policy, ckpt = load_run_policy(run_dir)
    gains, per_seed = {}, {}
    for seed in args.seed:
        trained = evaluate(cfg, policy, reward, prompts, seed=seed).category_table()
        if len(args.seed) > 1:
            print(f"eval seeds from {seed}:")
        print(format_category_table({"base": base[seed], f"trained ({ckpt.name})": trained}))
        gains[seed] = trained["overall"]["strict"] - base[seed]["overall"]["strict"]
        per_seed[seed] = {"base": base[seed], "trained": trained, "gain": gains[seed]}
    gain = sum(gains.values()) / len(gains)
    first = per_seed[args.seed[0]]
    plan = json.loads((run_dir / PLAN_FILE).read_text()) if (run_dir / PLAN_FILE).is_file() else None
    summary = {"evaluation": evaluation, "iterations": len(history), "rollouts": rollouts, "explored": explored, "train_minutes": t_train / 60, "run_dir": str(run_dir),
               "machine": machine_name(), "plan": plan,
               "base": first["base"], "trained": first["trained"], "gain": gain, "eval_sets": {str(s): v for s, v in per_seed.items()}}
    (run_dir / "bench_shapes.json").write_text(json.dumps(summary, indent=1))
    pool = f" ({explored} candidates explored)" if explored != rollouts else ""
    print(f"{len(history)} iterations, {rollouts} rollouts trained on{pool}, {t_train / 60:.1f} min of training (run {run_dir})")
    if plan is not None:
        print(f"budget plan: {plan['planned']} iterations for {plan['budget_minutes']:g} minutes at "
              f"{plan['seconds_per_iteration']:.2f} s per iteration (schedules written for {plan['nominal']})")
    sets = f" (mean of {len(gains)} eval sets: " + ", ".join(f"{s} {g:+.3f}" for s, g in gains.items()) + ")" if len(gains) > 1 else ""
    print(f"held-out strict gain {gain:+.3f}{sets}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
