#!/usr/bin/env python3
"""Inference-time search on the embedded shapes model: held-out strict accuracy against network evaluations.

    python scripts/bench_search.py                                  # base model, bon / smc / dts_star
    python scripts/bench_search.py --run runs/default-preset-run    # and the RL-trained default, with and without search
    python scripts/bench_search.py --methods dts_star --samples 4 16 --prompts builtin:shapes-train --per-category 8
    python scripts/bench_search.py --smoke                          # the code path in seconds: a tiny random model

Every method searches the continuous `shapes_quality` reward (search.reward) on `search.num_steps`
SDE steps, for each held-out prompt at budgets of 1, 4, 16 and 64 samples' worth of network
evaluations (NFE = samples x steps), and each chosen image is judged by the shapes reward's
strict channel (GenEval-style held-out accuracy, which the search never sees). Best-of-N and the
tree searches are anytime (the result at a budget is what one run had when it reached it); SMC's
particle count follows the budget, so it runs once per budget. Also marked: DTS* at a third of
best-of-16's NFE, the issue's goal. Prints one row per (method, budget), a goal line, writes
`search.json` and `search.png` (accuracy against NFE and against wall time) to --out.
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

METHODS = ("bon", "smc", "dts_star")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="dot-list overrides of the default preset (search.lam=20 ...)")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=("bon", "smc", "dts", "dts_star"),
                    help=f"search methods on the base model (default {' '.join(METHODS)}; none: only --run); put overrides before this option")
    ap.add_argument("--samples", type=int, nargs="+", default=[1, 4, 16, 64], help="budgets in samples' worth of NFE per prompt")
    ap.add_argument("--prompts", default="builtin:shapes-heldout")
    ap.add_argument("--per-category", type=int, default=16)
    ap.add_argument("--seed", type=int, default=10_000, help="prompt j is searched from seed SEED + j")
    ap.add_argument("--run", help="also search with this run's checkpoint (the RL-trained default)")
    ap.add_argument("--run-methods", nargs="+", default=None, choices=("bon", "smc", "dts", "dts_star"),
                    help="methods for --run (default: the last of --methods)")
    ap.add_argument("--out", default=None, help="folder for search.json and search.png (default bench_search_out; with --smoke "
                    "a temporary directory)")
    ap.add_argument("--merge", metavar="JSON", help="rows of an earlier run (its search.json) to report and plot with this one's")
    ap.add_argument("--smoke", action="store_true", help="the code path on a tiny random shapes model (scripts/smoke.py): "
                    "one held-out prompt per category, budgets of 1 and 2 samples")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.smoke:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from smoke import shapes_overrides, tiny_shapes_model

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_search-smoke-")))
            args.overrides = [*shapes_overrides(tiny_shapes_model(tmp / "model")), *args.overrides]
            args.per_category, args.samples, args.out = 1, [1, 2], args.out or str(tmp / "out")
        return run(args)


def run(args) -> int:
    from flowrl.runs import load_run_policy
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.search.policy import search_policy, search_steps
    from flowrl.runtime.budget import machine_name
    from flowrl.train.evaluate import score_images
    from flowrl.train.prompts import read_prompt_file
    from rewards import MultiReward

    if not args.smoke:  # a smoke run's tiny model keeps torch's thread count
        torch.set_num_threads(2)
    overrides = ["search.reward=shapes_quality", *args.overrides]
    cfg = load_config(None, overrides)
    prompts = read_prompt_file(args.prompts, per_category=args.per_category)
    seeds = [args.seed + j for j in range(len(prompts))]
    T = search_steps(cfg)
    budgets = sorted(s * T for s in args.samples)
    judge = MultiReward.from_config(cfg.reward)  # shapes (strict, partial) and shapes_quality
    q = cfg.search
    print(f"bench_search: {machine_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompts)} prompts "
          f"({args.prompts}), {T} {q.sampler} steps (noise {q.noise_level}), searched reward {q.reward}, lam {q.lam}; "
          f"smc: {q.potential} potential every {q.resample_every} steps, {q.resample} {q.resampling} resampling; "
          f"dts: branch every {q.branch_every}, width {q.width_c} N^{q.width_alpha}, uct {q.uct_c}, {q.in_flight} in flight", flush=True)

    rows = json.loads(Path(args.merge).read_text())["rows"] if args.merge else []
    out = Path(args.out or "bench_search_out")
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every method, so a stopped run keeps what it measured
        (out / "search.json").write_text(json.dumps({"machine": machine_name(), "overrides": overrides, "prompts": args.prompts,
                                                     "num_prompts": len(prompts), "steps": T, "run": args.run, "rows": rows}, indent=1))

    def run(label: str, policy, method: str) -> None:
        cfg.search.method = method
        marks = list(budgets)
        if method == "dts_star" and 16 * T in budgets:
            marks = sorted(set(marks) | {16 * T // 3})  # the goal's budget: a third of best-of-16's NFE
        t0 = time.perf_counter()
        result, problem = search_policy(cfg, policy, prompts, seeds, marks, progress=True)
        for k, budget in enumerate(result.budgets):
            scores = score_images(cfg, judge, problem.images(result.latents[k]), prompts)
            table = scores.category_table()
            totals = result.totals(k)
            row = {"model": label, "method": method, "budget_nfe": budget, "samples_worth": budget / T,
                   "nfe_per_prompt": totals["nfe"] / len(prompts), "decodes_per_prompt": totals["decodes"] / len(prompts),
                   "strict": table["overall"]["strict"], "partial": table["overall"]["partial"],
                   "searched_reward": float(result.rewards[k].mean()), "seconds": result.seconds[k],
                   "seconds_per_prompt": result.seconds[k] / len(prompts), "categories": table}
            rows.append(row)
            print(f"{label:<8} {method:<9} {budget:>5} NFE ({budget / T:>5.2f} samples) spent {row['nfe_per_prompt']:>6.1f}  "
                  f"decodes {row['decodes_per_prompt']:>6.1f}  strict {row['strict']:.3f}  partial {row['partial']:.3f}  "
                  f"shapes_quality {row['searched_reward']:.3f}  {row['seconds']:>6.1f} s", flush=True)
        print(f"  ({method} on {label}: {time.perf_counter() - t0:.0f} s)", flush=True)
        save()

    if args.methods:
        base = load_policy(cfg.model)
        for method in args.methods:
            run("base", base, method)
    if args.run:
        _, trained, ckpt = load_run_policy(Path(args.run))
        for method in args.run_methods or args.methods[-1:]:
            run("trained", trained, method)

    save()
    _plot(rows, out / "search.png", T)
    _goal(rows, T)
    print(f"wrote {out / 'search.json'} and {out / 'search.png'}")
    return 0


def _goal(rows, T: int) -> None:
    def strict(model, method, budget):
        return next((r["strict"] for r in rows if (r["model"], r["method"], r["budget_nfe"]) == (model, method, budget)), None)

    bon16 = strict("base", "bon", 16 * T)
    if bon16 is None:
        return
    star = sorted((r["budget_nfe"], r["strict"]) for r in rows if (r["model"], r["method"]) == ("base", "dts_star"))
    reached = next((b for b, s in star if s >= bon16), None)
    third = strict("base", "dts_star", 16 * T // 3)
    if third is not None:
        print(f"goal: DTS* at a third of best-of-16's NFE ({16 * T // 3}) strict {third:.3f} vs best-of-16 {bon16:.3f}: "
              f"{'met' if third >= bon16 else 'not met'}")
    if reached is not None:
        print(f"DTS* first reaches best-of-16's strict at {reached} NFE ({reached / (16 * T):.2f}x best-of-16's)")


def _plot(rows, path: Path, T: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (model, method) in dict.fromkeys((r["model"], r["method"]) for r in rows):
        mine = sorted((r for r in rows if (r["model"], r["method"]) == (model, method)), key=lambda r: r["budget_nfe"])
        style = "-" if model == "base" else "--"
        for ax, key in zip(axes, ("nfe_per_prompt", "seconds_per_prompt")):
            ax.plot([r[key] for r in mine], [r["strict"] for r in mine], style, marker="o", label=f"{method} ({model})")
    axes[0].set_xlabel(f"network evaluations per prompt ({T} per sample)")
    axes[1].set_xlabel("wall seconds per prompt (batched over prompts)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_ylabel("held-out strict accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("inference-time search on the shapes model (searched: shapes_quality; judged: shapes strict)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
