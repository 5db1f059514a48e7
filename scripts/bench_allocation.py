#!/usr/bin/env python3
"""Simulated benchmark of flowrl's rollout allocators (docs/algorithms.md section 7).

A pool of --prompts prompts (default 512) with pass/fail outcomes. Prompt i's initial success
probability is spread evenly from 0.01 to 0.99; its logit then drifts over --iterations
(default 200): a shared improvement trend (the policy gets better, +--trend logits over the
whole run) plus an independent Gaussian random walk per prompt (std --walk per iteration).
The drift is drawn once from --seed and is the same for every allocator; each allocator's
outcomes come from its own generator seeded identically, so every allocator faces the same
pool and the same noise stream.

Every iteration has a budget of --per-iteration x --group rollouts (default 16 x 8 = 128).
Each allocator in ALLOCATORS (flowrl.core.allocation.make_allocator) runs through
run_stages with the simulated outcome and learns from allocator.observe. The allocators whose
authors cap the budget (`exact_budget`: uniform, vade, dars_budget, successive_elimination, ...)
must spend exactly it every iteration; dars and reinforce_ada run as their authors run them,
uncapped (DARS tops hard prompts up to its schedule's totals, Reinforce-Ada samples in rounds until
a prompt has signal), so their spending is reported, not asserted. Per allocator:

  degenerate   fraction of sampled groups (a prompt's rollouts in one iteration) whose outcomes
               are all successes or all failures (no GRPO signal);
  informative  rollouts in non-degenerate groups per 1000 rollouts;
  rollouts     rollouts spent per iteration (mean and most), and the mean's ratio to the budget;

each also as a ratio to the uniform allocator (`vade degenerate 0.31x uniform`). The last line
checks the goal: VADE and successive_elimination at most 0.5x uniform's degenerate fraction
(PASS / FAIL).

With --real, instead: one real comparison on the embedded default task. The default preset
(`flowrl train` with no config, plus any dot-list overrides after --real) trains twice from the
same base model and seed, once with the uniform allocator and once with --real-allocator
(default successive_elimination, the best in the simulation), with the same rollout budget per
iteration. A rollout succeeds when its strict channel is 1 (allocator.success_threshold 1.4 on
the default's strict + 0.5 partial). It prints the training reward against rollouts spent and,
at the end, held-out strict accuracy of both runs' EMA weights on the same prompts and seeds.

Usage:  .venv/bin/python scripts/bench_allocation.py [--seed 0] [--iterations 200]
        .venv/bin/python scripts/bench_allocation.py --smoke      # the code path: 64 prompts, 5 iterations
        .venv/bin/python scripts/bench_allocation.py --real [--real-iterations 40] [OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.core.allocation import ALLOCATORS, make_allocator, run_stages  # noqa: E402

GOAL_KINDS = ("vade", "successive_elimination")
GOAL_RATIO = 0.5


def drift_logits(num_prompts: int, iterations: int, seed: int, trend: float, walk: float) -> torch.Tensor:
    """[iterations, num_prompts] success logits: evenly spread start, shared trend, random walk."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.linspace(0.01, 0.99, num_prompts, dtype=torch.float64)
    start = torch.log(p0 / (1 - p0))
    steps = torch.randn(iterations, num_prompts, generator=g, dtype=torch.float64) * walk
    steps[0] = 0
    shared = torch.linspace(0.0, trend, iterations, dtype=torch.float64)[:, None]
    return start[None, :] + shared + steps.cumsum(0)


def simulate(kind: str, logits: torch.Tensor, budget: int, per_iteration: int, seed: int) -> dict[str, float]:
    iterations, num_prompts = logits.shape
    alloc = make_allocator(kind, num_prompts=num_prompts, budget=budget, prompts_per_iteration=per_iteration, seed=seed)
    noise = torch.Generator().manual_seed(seed + 1)
    groups = degenerate = rollouts = informative = most = 0
    for it in range(iterations):
        p = torch.sigmoid(logits[it])
        seen_ids, seen_success = [], []

        def outcome(ids: torch.Tensor) -> torch.Tensor:
            s = torch.rand(ids.numel(), generator=noise, dtype=torch.float64) < p[ids]
            seen_ids.append(ids)
            seen_success.append(s)
            return s

        counts, _ = run_stages(alloc, it, outcome)
        ids, success = torch.cat(seen_ids), torch.cat(seen_success)
        alloc.observe(ids, success)
        spent = int(counts.sum())
        if alloc.exact_budget and spent != budget:  # a capped allocator: exactly the budget, every iteration
            raise AssertionError(f"{kind} spent {spent} rollouts at iteration {it}, budget {budget}")
        most = max(most, spent)
        succ = torch.bincount(ids, weights=success.double(), minlength=num_prompts).long()
        sampled = counts > 0
        dead = sampled & ((succ == 0) | (succ == counts))
        groups += int(sampled.sum())
        degenerate += int(dead.sum())
        rollouts += int(counts.sum())
        informative += int(counts[sampled & ~dead].sum())
    return {
        "groups": groups,
        "degenerate": degenerate / groups,
        "informative": 1000.0 * informative / rollouts,
        "groups_per_iteration": groups / iterations,
        "capped": alloc.exact_budget,
        "rollouts_per_iteration": rollouts / iterations,
        "most_rollouts": most,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--per-iteration", type=int, default=16, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="rollouts per prompt in the uniform baseline")
    ap.add_argument("--trend", type=float, default=1.5, help="shared logit improvement over the run")
    ap.add_argument("--walk", type=float, default=0.1, help="per-iteration std of each prompt's logit walk")
    ap.add_argument("--real", action="store_true", help="the real comparison on the embedded default task instead")
    ap.add_argument("--real-allocator", default="successive_elimination")
    ap.add_argument("--real-iterations", type=int, default=40)
    ap.add_argument("--real-eval-per-category", type=int, default=100)
    ap.add_argument("--run-root", default="runs/bench-allocation")
    ap.add_argument("--smoke", action="store_true", help="the simulation's code path on 64 prompts for 5 iterations (no reading)")
    args, overrides = ap.parse_known_args(argv)
    if args.smoke:
        args.prompts, args.iterations = 64, 5
    if args.real:
        return real_comparison(args, overrides)
    if overrides:
        ap.error(f"unrecognised arguments: {' '.join(overrides)}")
    # the tensors here are tiny: intra-op threads only add pool overhead (torch.repeat_interleave
    # in run_stages takes ~6 ms with 2 threads on a busy 2-core machine, ~6 us with one)
    torch.set_num_threads(1)

    budget = args.per_iteration * args.group
    logits = drift_logits(args.prompts, args.iterations, args.seed, args.trend, args.walk)
    p_start, p_end = torch.sigmoid(logits[0]), torch.sigmoid(logits[-1])
    print(f"pool {args.prompts} prompts, {args.iterations} iterations, budget {budget} rollouts/iteration "
          f"({args.per_iteration} x {args.group}), seed {args.seed}")
    print(f"success probability: start mean {p_start.mean():.3f} (min {p_start.min():.3f}, max {p_start.max():.3f}), "
          f"end mean {p_end.mean():.3f} (min {p_end.min():.3f}, max {p_end.max():.3f})")

    results = {}
    for kind in ALLOCATORS:
        t0 = time.perf_counter()
        results[kind] = simulate(kind, logits, budget, args.per_iteration, args.seed)
        r = results[kind]
        spending = (f"{budget}" if r["capped"] else
                    f"{r['rollouts_per_iteration']:.1f} (most {r['most_rollouts']}; {r['rollouts_per_iteration'] / budget:.2f}x the budget, uncapped)")
        print(f"{kind:<24s} degenerate {r['degenerate']:.3f}  informative {r['informative']:.1f}/1000 rollouts  "
              f"groups/iteration {r['groups_per_iteration']:.1f}  rollouts/iteration {spending}  ({time.perf_counter() - t0:.1f} s)")

    base = results["uniform"]
    for kind in ALLOCATORS:
        r = results[kind]
        print(f"{kind} degenerate {r['degenerate'] / base['degenerate']:.2f}x uniform")
        print(f"{kind} informative {r['informative'] / base['informative']:.2f}x uniform")
        if not r["capped"]:
            print(f"{kind} rollouts {r['rollouts_per_iteration'] / base['rollouts_per_iteration']:.2f}x uniform (uncapped)")

    ratios = {k: results[k]["degenerate"] / base["degenerate"] for k in GOAL_KINDS}
    ok = all(v <= GOAL_RATIO for v in ratios.values())
    detail = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    print(f"goal: vade and successive_elimination degenerate <= {GOAL_RATIO}x uniform: {detail} -> {'PASS' if ok else 'FAIL'}")
    return 0


def real_comparison(args, overrides: list[str]) -> int:
    from flowrl.runs import load_run_policy
    from flowrl.config import load_config
    from flowrl.train.evaluate import evaluate
    from flowrl.train.prompts import builtin_prompts
    from flowrl.train.loop import Trainer
    from rewards import MultiReward

    common = ["run.progress=false", "run.sample_every=0", "run.tracker=none", "trainer.max_minutes=0",
              f"trainer.iterations={args.real_iterations}", "trainer.budget_fill=false", f"trainer.seed={args.seed}",
              "allocator.success_threshold=1.4", *overrides]
    heldout = builtin_prompts("builtin:shapes-heldout", "--real", per_category=args.real_eval_per_category)
    curves, finals = {}, {}
    for kind in ("uniform", args.real_allocator):
        cfg = load_config(None, common + [f"allocator.kind={kind}"])
        run_dir = Path(args.run_root) / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
        t0 = time.perf_counter()
        history = Trainer(cfg, run_dir=run_dir).train()
        minutes = (time.perf_counter() - t0) / 60
        spent = torch.tensor([row["samples"] for row in history]).cumsum(0)
        strict = torch.tensor([row["reward/shapes/strict"] for row in history])
        degenerate = sum(row["degenerate_groups"] for row in history) / len(history)
        curves[kind] = (spent, strict)
        _, policy, _ = load_run_policy(run_dir)
        reward = MultiReward.from_config(cfg.reward)
        finals[kind] = evaluate(cfg, policy, reward, heldout, seed=10_000).category_table()["overall"]["strict"]
        print(f"{kind:<24s} {len(history)} iterations, {int(spent[-1])} rollouts, {minutes:.1f} min, "
              f"degenerate groups {degenerate:.3f}, held-out strict {finals[kind]:.3f} (run {run_dir})", flush=True)

    print("training strict reward (mean over the last 5 iterations) against rollouts spent:")
    print(f"{'rollouts':>9s}" + "".join(f" {k:>24s}" for k in curves))
    for frac in (0.25, 0.5, 0.75, 1.0):
        i = max(0, round(frac * args.real_iterations) - 1)
        row = f"{int(curves['uniform'][0][i]):>9d}"
        for spent, strict in curves.values():
            row += f" {strict[max(0, i - 4): i + 1].mean().item():>24.3f}"
        print(row)
    base = finals["uniform"]
    print(f"held-out strict: uniform {base:.3f}, {args.real_allocator} {finals[args.real_allocator]:.3f} "
          f"({finals[args.real_allocator] - base:+.3f}) at equal rollouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
