#!/usr/bin/env python3
"""G2RPO (rollout.kind granular) against flat Flow-GRPO on the shapes model, at matched NFE per iteration and equal wall time.

    python scripts/bench_granular.py                       # 12 minutes per method, training seed 0
    python scripts/bench_granular.py --minutes 20 --train-seed 0 1 2
    python scripts/bench_granular.py --smoke                # the code path in seconds: a tiny random model, one iteration each

First prints the network calls a prompt waits for one after another (at unlimited batch) under
the FLUX.1-dev preset's settings (T = 16, G = 12, branch steps 0-7, granularities [1, 2] and
[1, 2, 3]) against the reference implementation's 1,792 serial calls at batch 1 (its procedure:
16 anchor steps, then for each of 12 samples at each of 8 branch steps a recomputed branch
forward and its tails), and the goal, at most 2T + 2.

Then trains, from the embedded shapes model with GRPO (PPO clip, LoRA, no KL) and for the same
wall time, flat Flow-GRPO (8 prompts x 8 samples, every step an SDE step: 640 network evaluations
per iteration) and G2RPO (3 prompts x 4 samples per branch step, branch steps 0-4, granularities
[1, 2]: 3 x 234 = 702 on the reference's tail grid; the run recorded in docs/experiments/granular.md
had flowrl's earlier grid, 3 x 226 = 678), scores held-out strict accuracy (400 prompts, 20-step ODE, eval seeds
from 10000, as bench_shapes) of each against the base, and writes `granular.png` (training reward
against cumulative network evaluations) and `granular.json` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

COMMON = ["objective.kind=grpo", "sampling.sampler=flow_grpo", "sampling.noise_level=0.7", "trainer.kl_beta=0",
          "trainer.budget_minutes=0", "trainer.lr_schedule=constant", "trainer.iterations=100000", "run.sample_every=0",
          "run.checkpoint_every=50", "run.progress=false"]
METHODS = {
    "flat": ["data.prompts_per_iteration=8", "data.group_size=8"],
    "granular": ["rollout.kind=granular", "rollout.granular.branch_steps=[0,1,2,3,4]", "rollout.granular.granularities=[1,2]",
                 "data.prompts_per_iteration=3", "data.group_size=4", "sampling.batch_size=12"],
}


def nfe_per_iteration(row: dict, steps: int) -> int:
    """Network evaluations the sampler spent on one iteration's rows."""
    if "nfe_per_prompt" in row:
        return int(row["nfe_per_prompt"] * row["prompts"])
    return int(row["sampled"] * steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="dot-list overrides for both methods")
    ap.add_argument("--minutes", type=float, default=12.0, help="training wall time per method")
    ap.add_argument("--train-seed", type=int, nargs="+", default=[0])
    ap.add_argument("--per-category", type=int, default=100)
    ap.add_argument("--eval-seed", type=int, default=10_000)
    ap.add_argument("--out", default=None, help="where the runs, granular.json and granular.png go (default bench_granular_out; "
                    "with --smoke a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="the code path on a tiny random shapes model (scripts/smoke.py): one "
                    "iteration per method, branch steps [0, 1], one held-out prompt per category")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.smoke:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from smoke import shapes_overrides, tiny_shapes_model

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_granular-smoke-")))
            args.overrides = [*shapes_overrides(tiny_shapes_model(tmp / "model")), "rollout.granular.branch_steps=[0,1]",
                              *args.overrides]
            args.per_category, args.train_seed, args.out = 1, args.train_seed[:1], args.out or str(tmp / "out")
        return run(args)


def run(args) -> int:
    from flowrl.runs import load_run_policy
    from flowrl.cli import main as cli_main
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.sampling.granular import granular_nfe, sequential_calls
    from flowrl.runtime.budget import machine_name
    from flowrl.train.evaluate import evaluate
    from flowrl.train.prompts import read_prompt_file
    from flowrl.runtime.run_dir import RunDir
    from rewards import MultiReward

    print(f"bench_granular: {machine_name()}, torch {torch.__version__}", flush=True)
    for lam in ([1, 2], [1, 2, 3]):
        calls, nfe = sequential_calls(16, range(8), lam), granular_nfe(16, range(8), lam, 12)
        # the reference runs every forward at batch 1, and recomputes the branch forward for each of the G samples
        reference = nfe + 12 * 8
        print(f"FLUX.1-dev preset settings, granularities {lam}: {calls} sequential network calls per prompt "
              f"({nfe} network evaluations in batches) vs the reference's {reference} at batch 1: {reference / calls:.0f}x fewer; "
              f"goal at most 2T + 2 = 34: {'met' if calls <= 34 else 'not met'}")
    if args.minutes <= 0:
        return 0

    out = Path(args.out or "bench_granular_out")
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [*COMMON, *args.overrides])
    T = cfg.sampling.num_steps
    prompts = read_prompt_file("builtin:shapes-heldout", per_category=args.per_category)
    reward = MultiReward.from_config(cfg.reward)
    base = evaluate(cfg, load_policy(cfg.model), reward, prompts, seed=args.eval_seed).category_table()["overall"]["strict"]
    print(f"base held-out strict {base:.3f} ({len(prompts)} prompts, eval seeds from {args.eval_seed})", flush=True)
    results = {"machine": machine_name(), "minutes": args.minutes, "base": base, "runs": []}
    for seed in args.train_seed:
        for method, extra in METHODS.items():
            run_dir = out / f"{method}_s{seed}"
            t0 = time.perf_counter()
            code = cli_main(["train", *COMMON, *extra, *args.overrides, f"trainer.seed={seed}", f"trainer.max_minutes={args.minutes}",
                             "--run-dir", str(run_dir)])
            if code != 0:
                raise SystemExit(f"bench_granular: {method} training failed (exit {code})")
            minutes = (time.perf_counter() - t0) / 60
            rows = RunDir(run_dir).read_metrics()
            nfe = [nfe_per_iteration(r, T) for r in rows]
            _, policy, ckpt = load_run_policy(run_dir)
            strict = evaluate(cfg, policy, reward, prompts, seed=args.eval_seed).category_table()["overall"]["strict"]
            run = {"method": method, "seed": seed, "iterations": len(rows), "minutes": minutes, "nfe_per_iteration": nfe[0],
                   "total_nfe": sum(nfe), "strict": strict, "gain": strict - base, "checkpoint": ckpt.name,
                   "reward_curve": [[sum(nfe[: i + 1]), r["reward_mean"]] for i, r in enumerate(rows)]}
            results["runs"].append(run)
            print(f"{method:<9} seed {seed}: {len(rows)} iterations in {minutes:.1f} min, {nfe[0]} NFE per iteration, "
                  f"{sum(nfe)} in all; held-out strict {strict:.3f} ({strict - base:+.3f})", flush=True)
    (out / "granular.json").write_text(json.dumps(results, indent=1))
    _plot(results, out / "granular.png")
    for method in METHODS:
        gains = [r["gain"] for r in results["runs"] if r["method"] == method]
        print(f"{method}: mean held-out strict gain {sum(gains) / len(gains):+.3f} over {len(gains)} training seed(s)")
    print(f"wrote {out / 'granular.json'} and {out / 'granular.png'}")
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in results["runs"]:
        curve = run["reward_curve"]
        window = max(1, len(curve) // 20)  # a running mean, so the trend shows through the per-iteration noise
        ys = [sum(y for _, y in curve[max(0, i - window + 1): i + 1]) / len(curve[max(0, i - window + 1): i + 1]) for i in range(len(curve))]
        ax.plot([x for x, _ in curve], ys, label=f"{run['method']} seed {run['seed']} (held-out {run['gain']:+.3f})")
    ax.set_xlabel("network evaluations while sampling (cumulative)")
    ax.set_ylabel("training reward (running mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"G2RPO vs flat Flow-GRPO on the shapes model, {results['minutes']:g} min each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
