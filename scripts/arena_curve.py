#!/usr/bin/env python3
"""More points of recorded arena runs: how a long run's curve bends between the half and the end
that scripts/arena.py scores.

    python scripts/arena_curve.py --cells flow_grpo_tuned g2rpo_tuned --seeds 0 --budget-minutes 36

For each run of --cells and --seeds that --out records at --budget-minutes (the latest, as the
arena's report takes it), the saved checkpoint nearest each of budget x k / --points minutes
(k = 1 .. points - 1) is scored as the arena scores (the trained weights on the two eval sets,
against the record's base), unless it is the record's half or end. Each point is one line of
--curve-out; a rerun skips the points there. The points, with the record's base, half and end,
are printed as a table and drawn into --image. Train nothing; run it on a quiet machine between
timed runs (it loads each checkpoint and samples 2 x 400 images per point).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the arena's pieces
from arena import (CELLS, EVAL_SEEDS, OUT, PER_CATEGORY, ROOT, SMOKE_PER_CATEGORY, Judge, arena_lock, log, recorded,  # noqa: E402
                   summarise)

CURVES = ROOT / "docs" / "experiments" / "arena-curves.jsonl"
IMAGE = ROOT / "docs" / "images" / "arena-curves.png"
POINTS = 3  # a 36-minute run: scored at 12 and 24 minutes besides its half (18) and end


def checkpoint_minutes(run_dir: Path) -> dict[int, float]:
    """Training minutes at each saved checkpoint: the sum of the iteration times before it (within about 1% of
    the run's clock, which also counts the launch and the checkpoint writes)."""
    from flowrl.runtime.checkpoint import checkpoint_iterations
    from flowrl.runtime.run_dir import RunDir

    times = {r["iteration"]: r["time_iteration"] for r in RunDir(run_dir).read_metrics() if "time_iteration" in r}
    done, total = {0: 0.0}, 0.0
    for it in sorted(times):
        total += times[it]
        done[it + 1] = total / 60  # checkpoint N holds the weights after N iterations
    return {n: done[n] for n in checkpoint_iterations(RunDir(run_dir).checkpoints) if n in done}


def curve_points(record: dict, minutes: dict[int, float], budget: float, points: int) -> list[tuple[float, int]]:
    """(mark, iteration): the checkpoint nearest each mark budget x k / points, k = 1 .. points - 1, but for
    the iterations the record already scored (its half and end) and repeats."""
    chosen, scored = [], {record["half_iteration"], record["end_iteration"]}
    for k in range(1, points):
        mark = budget * k / points
        iteration = min(minutes, key=lambda n: (abs(record["build_minutes"] + minutes[n] - mark), n))
        if iteration not in scored:
            scored.add(iteration)
            chosen.append((mark, iteration))
    return chosen


def run_curves(args) -> int:
    """Score the missing points of every chosen run, then print their table and draw them."""
    start = time.perf_counter()
    by_cell = summarise(recorded(Path(args.out)), args.budget_minutes, args.smoke)
    todo = [r for cell in args.cells for r in by_cell.get(cell, []) if r["seed"] in args.seeds]
    if not todo:
        raise SystemExit(f"arena_curve: {args.out} records no run of {' '.join(args.cells)} with seeds "
                         f"{' '.join(map(str, args.seeds))} at --budget-minutes {args.budget_minutes:g}")
    curves = Path(args.curve_out)
    done = {(c["run_dir"], c["iteration"]) for c in recorded(curves)}
    seeds = list(args.eval_seeds)
    with arena_lock(Path(args.runs)):
        judge = Judge(Path(args.runs), args.per_category, args.smoke)
        for r in todo:
            scored = r.get("eval", {})
            if scored.get("per_category") != judge.per_category or scored.get("seeds") != seeds:
                raise SystemExit(f"arena_curve: {r['cell']} seed {r['seed']} was scored with {scored.get('per_category')} "
                                 f"prompts per category on eval seeds {scored.get('seeds')}; pass the same "
                                 "--per-category and --eval-seeds, so its points share the record's base")
            run_dir = Path(r["run_dir"])
            minutes = checkpoint_minutes(run_dir)
            for mark, iteration in curve_points(r, minutes, args.budget_minutes, args.points):
                if (str(run_dir), iteration) in done:
                    continue
                scores = judge.checkpoint(run_dir, iteration, seeds)
                line = {"cell": r["cell"], "seed": r["seed"], "budget_minutes": args.budget_minutes, "smoke": args.smoke,
                        "run_dir": str(run_dir), "config_hash": r["config_hash"], "mark_minutes": mark,
                        "iteration": iteration, "minutes": r["build_minutes"] + minutes[iteration],
                        "eval1": scores[seeds[0]], "eval2": scores[seeds[-1]],
                        "gain": statistics.mean([scores[seeds[0]] - r["base_eval1"], scores[seeds[-1]] - r["base_eval2"]]),
                        "date": time.strftime("%Y-%m-%d %H:%M")}
                curves.parent.mkdir(parents=True, exist_ok=True)
                with open(curves, "a") as f:
                    f.write(json.dumps(line) + "\n")
                done.add((str(run_dir), iteration))
                log(start, f"{r['cell']} seed {r['seed']}: iteration {iteration} ({line['minutes']:.1f} min) "
                           f"held-out strict gain {line['gain']:+.3f}")
    rows = curve_rows(todo, recorded(curves))
    print(curve_table(rows))
    plot_curves(rows, args.budget_minutes, Path(args.image))
    print(f"wrote {args.image}")
    return 0


def curve_rows(records: list[dict], lines: list[dict]) -> dict[str, list[tuple[float, int, float]]]:
    """Per run ("cell seed S"): (minutes, iteration, gain) from the base through every scored point to the end."""
    out = {}
    for r in records:
        points = [(0.0, 0, 0.0), (r["half_minutes"], r["half_iteration"], r["gain_half"]),
                  (r["wall_minutes"], r["end_iteration"], r["gain_end"])]
        points += [(c["minutes"], c["iteration"], c["gain"]) for c in lines if c["run_dir"] == r["run_dir"]]
        out[f"{r['cell']} seed {r['seed']}"] = sorted(set(points), key=lambda p: p[1])
    return out


def curve_table(rows: dict[str, list[tuple[float, int, float]]]) -> str:
    out = ["| run | held-out strict gain at minutes (iteration) |", "|---|---|"]
    for name, points in rows.items():
        out.append(f"| {name} | " + ", ".join(f"{g:+.3f} at {m:.1f} ({i})" for m, i, g in points[1:]) + " |")
    return "\n".join(out)


def plot_curves(rows: dict[str, list[tuple[float, int, float]]], budget: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, points in rows.items():
        ax.plot([m for m, _, _ in points], [g for _, _, g in points], marker="o", label=name)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("training minutes")
    ax.set_ylabel("held-out strict gain over the base (mean of the two eval sets)")
    ax.set_title(f"Runs of {budget:g} minutes, scored at more checkpoints")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", required=True, choices=CELLS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds")
    ap.add_argument("--budget-minutes", type=float, required=True, help="the recorded runs' budget")
    ap.add_argument("--points", type=int, default=POINTS, help="marks at budget x k / points minutes, k = 1 .. points - 1")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "arena"), help="the arena's --runs (its base scores' cache)")
    ap.add_argument("--out", default=str(OUT), help="the arena's results")
    ap.add_argument("--curve-out", default=str(CURVES), help="the points, one JSON line each")
    ap.add_argument("--image", default=str(IMAGE))
    ap.add_argument("--per-category", type=int, default=None, help=f"as the runs were scored (default {PER_CATEGORY})")
    ap.add_argument("--eval-seeds", type=int, nargs=2, default=list(EVAL_SEEDS))
    ap.add_argument("--smoke", action="store_true", help="the arena's --smoke records (the test's)")
    args = ap.parse_args(argv)
    if args.points < 2:
        ap.error(f"--points must be 2 or more; got {args.points}")
    if args.per_category is None:
        args.per_category = SMOKE_PER_CATEGORY if args.smoke else PER_CATEGORY
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flowrl.quiet import silence_known_messages

    silence_known_messages()
    return run_curves(args)


if __name__ == "__main__":
    sys.exit(main())
