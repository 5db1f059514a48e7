#!/usr/bin/env python3
"""Synchronous against asynchronous rollouts at equal wall-clock, on the text default or the
shapes default.

    python scripts/bench_async.py --minutes 10 --seeds 0 1 2                        # text: sync2, async1, async4
    python scripts/bench_async.py --task shapes --minutes 10 --seeds 0 1 2          # the shapes default
    python scripts/bench_async.py --minutes 2 --seeds 0 --parts async1              # one part, one seed
    python scripts/bench_async.py --smoke                                           # the code path in seconds

Parts, each using both cores of the 2-core box:
- `sync2`: the synchronous trainer as two processes of one thread each (run.cpu_processes=2),
  the fastest synchronous setting there (docs/text.md, "Several processes"; the shapes default
  runs so already);
- `async4_april` (text): async4 with run.over_provision 1.5, APRIL's partial rollouts (not in
  the default --parts);
- `sync2_compiled`: sync2 with model.compile=blocks (the held-out check before the default
  preset compiles; not in the default --parts);
- `async2_producers2`: a trainer beside two producers sampling in turn (run.producers 2,
  max_staleness 2; three processes, so on the 2-core box it oversubscribes the cores; meant for
  a GPU, where they share the card; not in the default --parts);
- `async1`, `async4`: one trainer process of one thread beside one producer process of one
  thread (run.async_rollouts), run.max_staleness 1 and 4; text trains AReaL's decoupled loss,
  the shapes default's DGPO trains on the clean samples as they come (it has no behaviour ratio).

Text: `flowrl train configs/text_add.yaml` from the shipped checkpoint, stopped by
trainer.max_minutes (the preset's budget plan off), judged by greedy exact match on the 500
held-out problems. Shapes: `flowrl train` (the default preset) with its wall-clock budget set to
--minutes (each part plans the iterations that fit at its own speed and ends its cosine decay),
judged by held-out strict accuracy on the arena's two eval sets of 400 prompts (scripts/arena.py).
Each (part, seed) appends a line to --out as it finishes, and a rerun skips the pairs already
there; the table at the end gives, per part, the held-out gain (mean and standard error over
seeds), samples per minute of the training loop, iterations, the mean staleness and effective
sample size, and the trainer's and producer's idle fractions.

--smoke: the code path in seconds, measuring nothing: one seed of async1 (unless --parts), two
iterations of two prompts x two (text; the shapes task one iteration on a tiny random model,
scripts/smoke.py), judged on a sixteenth of the held-out problems (text) or one prompt per
category at 4 ODE steps (shapes); --out and --runs default to a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = {
    "sync2": ["run.cpu_processes=2", "trainer.threads=1"],
    "async1": ["run.cpu_processes=1", "run.async_rollouts=true", "run.max_staleness=1", "trainer.threads=1"],
    "async4": ["run.cpu_processes=1", "run.async_rollouts=true", "run.max_staleness=4", "trainer.threads=1"],
    # async4 with APRIL's partial rollouts (text only): 1.5x the groups in flight, unfinished completions carried over
    "async4_april": ["run.cpu_processes=1", "run.async_rollouts=true", "run.max_staleness=4", "trainer.threads=1",
                     "run.over_provision=1.5"],
    # two producers in turn (run.producers), staleness 2 so both can sample at once; on a GPU they share the card
    "async2_producers2": ["run.cpu_processes=1", "run.async_rollouts=true", "run.max_staleness=2", "run.producers=2",
                          "trainer.threads=1"],
    # sync2 with the transformer blocks compiled: issue 48's held-out check before the default compiles
    "sync2_compiled": ["run.cpu_processes=2", "trainer.threads=1", "model.compile=blocks"],
}


def held_out_strict(run: Path | None, runs: Path, smoke: bool) -> float:
    """The shapes default's held-out strict accuracy, the mean over the arena's two eval sets (its
    base scores cached in RUNS/base_eval.json)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("arena", ROOT / "scripts" / "arena.py")
    arena = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arena)
    judge = arena.Judge(runs, 1 if smoke else arena.PER_CATEGORY, smoke=smoke)
    if run is None:
        scores = judge.base(arena.EVAL_SEEDS)
    else:
        scores = judge.checkpoint(run, None, arena.EVAL_SEEDS)  # the latest checkpoint, the run's end
    return statistics.mean(scores.values())


def held_out_exact_match(run: Path | None, runs: Path, smoke: bool) -> float:
    from flowrl.text.arithmetic import exact_match_by_bucket, held_out
    from flowrl.text.cli import policy_for

    _, policy, _ = policy_for(str(run) if run else None, None if run else str(ROOT / "configs" / "text_add.yaml"), [])
    return exact_match_by_bucket(policy.model, policy.tokenizer, held_out()[:: 32 if smoke else 1])["all"]


def smoke_overrides(task: str, tmp: Path) -> list[str]:
    """--smoke's training overrides, after the task's and the part's: two tiny iterations (text, without the
    CLI's held-out test at the end), or one on a tiny random shapes model."""
    if task == "text":
        return ["trainer.iterations=2", "data.prompts_per_iteration=2", "data.group_size=2", "data.eval_split=''"]
    sys.path.insert(0, str(ROOT / "scripts"))
    from smoke import shapes_overrides, tiny_shapes_model

    return shapes_overrides(tiny_shapes_model(tmp / "model"))


TASKS = {
    # the preset and how long it trains: text stops at max_minutes; the shapes default plans its budget
    "text": {"train": lambda minutes: [str(ROOT / "configs" / "text_add.yaml"), "trainer.budget_minutes=0",
                                      "trainer.iterations=1000000", f"trainer.max_minutes={minutes}", "run.checkpoint_every=0"],
             "judge": held_out_exact_match, "out": "async-text.jsonl", "score": "exact match"},
    # shapes: eager unless the part compiles (the default preset compiles its blocks since 2026-11-28; the rows before were eager)
    "shapes": {"train": lambda minutes: [f"trainer.budget_minutes={minutes}", f"trainer.max_minutes={minutes + 1.5}",
                                        "run.sample_every=0", "run.tracker=none", "model.compile=none"],
               "judge": held_out_strict, "out": "async-shapes.jsonl", "score": "strict"},
}


def train(task: str, part: str, seed: int, minutes: float, run: Path, smoke: list[str] = ()) -> dict:
    args = [sys.executable, "-m", "flowrl.cli", "train", *TASKS[task]["train"](minutes), *PARTS[part], *smoke,
            f"trainer.seed={seed}", "run.progress=false", "--run-dir", str(run)]
    start = time.perf_counter()
    subprocess.run(args, check=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loop_s = sum(r["time_iteration"] for r in rows)
    out = {"part": part, "seed": seed, "minutes": minutes, "iterations": len(rows), "loop_minutes": loop_s / 60, "wall_minutes": wall / 60,
           "samples_per_minute": sum(r["samples"] for r in rows) / (loop_s / 60)}
    if "staleness" in rows[0]:
        stale = [r["off_policy/ess"] for r in rows if "off_policy/ess" in r]  # the loss's, where it has a behaviour ratio
        out.update(staleness=statistics.mean(r["staleness"] for r in rows), **({"ess": statistics.mean(stale)} if stale else {}),
                   trainer_idle=sum(r["time_trainer_wait"] for r in rows) / loop_s,
                   producer_idle=sum(r["time_producer_idle"] for r in rows) / sum(r["time_producer_idle"] + r["time_producer_busy"] for r in rows))
    return out


def mean_se(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:+.3f}"
    return f"{statistics.mean(values):+.3f} ± {statistics.stdev(values) / len(values) ** 0.5:.3f}"


def table(results: list[dict], base: float, score: str) -> str:
    lines = [f"base held-out {score} {base:.3f}",
             f"{'part':<14} {'seeds':>5} {'gain':>15} {'samples/min':>11} {'iters':>6} {'staleness':>9} {'ess':>6} {'trainer idle':>12} {'producer idle':>13}"]
    for part in PARTS:
        rs = [r for r in results if r["part"] == part]
        if not rs:
            continue

        def avg(key, fmt):
            values = [r[key] for r in rs if key in r]
            return format(statistics.mean(values), fmt) if values else "-"

        lines.append(f"{part:<14} {len(rs):>5} {mean_se([r['held_out'] - base for r in rs]):>15} {avg('samples_per_minute', '.0f'):>11} "
                     f"{avg('iterations', '.0f'):>6} {avg('staleness', '.2f'):>9} {avg('ess', '.3f'):>6} {avg('trainer_idle', '.2f'):>12} "
                     f"{avg('producer_idle', '.2f'):>13}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="text", choices=list(TASKS))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--parts", nargs="+", default=None, choices=list(PARTS), help="default: sync2 async1 async4 (--smoke: async1)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/experiments/async-TASK.jsonl")
    ap.add_argument("--runs", type=Path, default=None, help="default: runs/bench-async")
    ap.add_argument("--smoke", action="store_true", help="the code path in seconds, measuring nothing (see above)")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        smoke: list[str] = []
        if args.smoke:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_async-smoke-")))
            smoke = smoke_overrides(args.task, tmp)
            args.seeds, args.parts = args.seeds[:1], args.parts or ["async1"]
            args.out, args.runs = args.out or tmp / "results.jsonl", args.runs or tmp / "runs"
        return bench(args, smoke)


def bench(args, smoke: list[str]) -> int:
    task = TASKS[args.task]
    args.parts = args.parts or ["sync2", "async1", "async4"]
    args.out = args.out or ROOT / "docs" / "experiments" / task["out"]
    args.runs = args.runs or ROOT / "runs" / "bench-async"

    results = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.is_file() else []
    for r in results:  # the text records name their samples completions
        if "completions_per_minute" in r:
            r["samples_per_minute"] = r.pop("completions_per_minute")
    done = {(r["part"], r["seed"], r["minutes"]) for r in results}
    base = next((r["held_out"] for r in results if r["part"] == "base"), None)
    if base is None:
        base = task["judge"](None, args.runs, args.smoke)
        results.append({"part": "base", "seed": None, "minutes": 0, "held_out": base})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(results[-1]) + "\n")
    for seed in args.seeds:
        for part in args.parts:
            if (part, seed, args.minutes) in done:
                continue
            run = args.runs / f"{part}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            result = train(args.task, part, seed, args.minutes, run, smoke)
            result["held_out"] = task["judge"](run, args.runs, args.smoke)
            print(json.dumps(result), flush=True)
            results.append(result)
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
    print(table([r for r in results if r["part"] != "base" and r["minutes"] == args.minutes], base, task["score"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
