#!/usr/bin/env python3
"""Group objectives on the embedded shapes task: DGPO online and GDRO offline (with its store's
build time), judged as the default's recipes are (held-out strict, GenEval-style).

    python scripts/bench_offline.py --seeds 0 1 2 --per-category 100 --eval-seeds 10000 20000
    python scripts/bench_offline.py --methods gdro --store-prompts 512 --seeds 0
    python scripts/bench_offline.py --smoke       # the code path in seconds: a tiny random model, one iteration each

Evaluates the base model once per eval set, then for each training seed and method: trains
(`flowrl train` with the default preset plus the method's overrides; GDRO first builds a group
store with `flowrl offline build`, timed), evaluates the run's EMA weights on the same prompts
and seeds, and prints one line per run: the minutes (build + training), the iterations and the
held-out strict gain (mean over the eval sets). The last lines give each method's mean gain
over seeds with its standard error, and its mean minutes. Results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl.runtime.budget import machine_name

# each method: the overrides of the default preset that make it (docs/algorithms.md section 10)
# DGPO's adapter at every sigma, as the recorded comparison ran it (the default preset gates it since issue 88)
DGPO = ["objective.kind=dgpo", "trainer.iterations=90", "trainer.budget_fill=false", "trainer.kl_beta=0.02", "lora.acts_at=all"]
GDRO = ["objective.kind=gdro", "rollout.kind=offline", "trainer.iterations=150", "trainer.budget_fill=false", "trainer.kl_beta=0"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["dgpo", "gdro"], choices=["dgpo", "gdro"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=[10_000, 20_000], help="first seed of each eval set")
    ap.add_argument("--per-category", type=int, default=100)
    ap.add_argument("--store-prompts", type=int, default=256, help="GDRO: groups in the store (data.group_size each)")
    ap.add_argument("--dgpo", nargs="*", default=[], help="extra overrides for DGPO")
    ap.add_argument("--gdro", nargs="*", default=[], help="extra overrides for GDRO")
    ap.add_argument("--root", default=None, help="where the stores and runs go (default runs/bench-offline-<time>; with "
                    "--smoke a temporary directory)")
    ap.add_argument("--out", default=None, help="JSON results (default ROOT/bench_offline.json)")
    ap.add_argument("--smoke", action="store_true", help="the code path on a tiny random shapes model (scripts/smoke.py): one "
                    "iteration per method, a store of two groups, one eval set of one held-out prompt per category, one seed")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.smoke:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from smoke import shapes_overrides, tiny_shapes_model

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_offline-smoke-")))
            tiny = shapes_overrides(tiny_shapes_model(tmp / "model"))
            args.common = tiny
            args.dgpo, args.gdro = [*tiny, *args.dgpo], [*tiny, *args.gdro]
            args.seeds, args.eval_seeds, args.per_category, args.store_prompts = args.seeds[:1], args.eval_seeds[:1], 1, 2
            args.root = args.root or str(tmp / "runs")
        else:
            args.common = []
        return run(args)


def run(args) -> int:
    from flowrl.runs import load_run_policy
    from flowrl.cli import main as cli_main
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.train.evaluate import evaluate
    from flowrl.train.prompts import builtin_prompts
    from flowrl.runtime.run_dir import RunDir
    from rewards import MultiReward

    root = Path(args.root or f"runs/bench-offline-{time.strftime('%Y%m%d-%H%M%S')}")
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [*args.common, "run.progress=false"])
    prompts = builtin_prompts("builtin:shapes-heldout", "--prompts", per_category=args.per_category)
    reward = MultiReward.from_config(cfg.reward)
    print(f"bench_offline: {len(prompts)} held-out images per eval set, eval sets {args.eval_seeds}, training seeds {args.seeds}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads on {machine_name()}", flush=True)
    base_policy = load_policy(cfg.model)
    base = {s: evaluate(cfg, base_policy, reward, prompts, seed=s).category_table()["overall"]["strict"] for s in args.eval_seeds}
    del base_policy
    print("base held-out strict: " + ", ".join(f"{s} {v:.3f}" for s, v in base.items()), flush=True)

    results = []
    for method in args.methods:
        for seed in args.seeds:
            run = root / f"{method}-s{seed}"
            overrides = [*(DGPO + args.dgpo if method == "dgpo" else GDRO + args.gdro), f"trainer.seed={seed}", "run.progress=false"]
            build_minutes = 0.0
            if method == "gdro":
                store = root / f"store-s{seed}"
                overrides.append(f"data.offline={store}")  # the training config names the store the build writes
                t0 = time.perf_counter()
                if cli_main(["offline", "build", *overrides, "-o", str(store), "--num-prompts", str(args.store_prompts)]) != 0:
                    raise SystemExit(f"bench_offline: building the store {store} failed")
                build_minutes = (time.perf_counter() - t0) / 60
            t0 = time.perf_counter()
            if cli_main(["train", *overrides, "--run-dir", str(run)]) != 0:
                raise SystemExit(f"bench_offline: training {run} failed")
            train_minutes = (time.perf_counter() - t0) / 60
            history = RunDir(run).read_metrics()
            run_cfg, policy, _ = load_run_policy(run)
            trained = {s: evaluate(run_cfg, policy, reward, prompts, seed=s).category_table()["overall"]["strict"] for s in args.eval_seeds}
            gains = {s: trained[s] - base[s] for s in args.eval_seeds}
            row = {"method": method, "seed": seed, "iterations": len(history), "build_minutes": build_minutes,
                   "train_minutes": train_minutes, "minutes": build_minutes + train_minutes, "trained": trained,
                   "gain": statistics.mean(gains.values()), "gains": gains, "run": str(run)}
            results.append(row)
            print(f"{method} seed {seed}: {row['minutes']:.1f} min ({build_minutes:.1f} build + {train_minutes:.1f} train), "
                  f"{len(history)} iterations, held-out strict gain {row['gain']:+.3f} "
                  f"({', '.join(f'{s} {g:+.3f}' for s, g in gains.items())})", flush=True)
    out = Path(args.out) if args.out else root / "bench_offline.json"
    out.write_text(json.dumps({"base": base, "runs": results}, indent=1))
    for method in args.methods:
        rows = [r for r in results if r["method"] == method]
        g = [r["gain"] for r in rows]
        se = statistics.stdev(g) / len(g) ** 0.5 if len(g) > 1 else float("nan")
        print(f"{method}: mean held-out strict gain {statistics.mean(g):+.3f} +- {se:.3f} (standard error, {len(g)} seeds), "
              f"mean {statistics.mean(r['minutes'] for r in rows):.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
