#!/usr/bin/env python3
"""Screen recipe changes of the shapes preset: many bench_shapes runs at once, on one GPU or a large CPU box.

    python scripts/screen_shapes.py recipes.txt --seeds 0 1 2 --parallel 13 --minutes 8 \\
        --common run.cpu_processes=1 sampling.batch_size=32
    python scripts/screen_shapes.py recipes.txt --seeds 0 --smoke   # every run a bench_shapes --smoke run (seconds)

recipes.txt holds one recipe per line, `name: override override ...` (`preset:` with nothing after
it runs the preset itself; blank lines and # comments are skipped). Every recipe runs once per
training seed (`trainer.seed=S`). Each run is `scripts/bench_shapes.py --per-category N --seed E...
--run-dir OUT/NAME_sS COMMON OVERRIDES`, one process with --threads CPU threads, its output in
OUT/NAME_sS.log. Runs still going after --minutes are stopped and reported as such. Printed at the
end: the held-out strict gain of every run on every eval set, and each recipe's mean.

One run's gain moves by several hundredths with the rounding alone (a GPU run and a CPU run of the
same seed differed by up to 0.065; BENCHMARKS.md), so screen with two or more training seeds and
two eval sets, and confirm on the target machine. The 2026-11-26 screen on an H200 (a shell loop
that ran these same commands, before this script) ran 13 runs at once, one CPU thread each, under
CUDA MPS (`nvidia-cuda-mps-control -d`, started by hand): about 5 minutes for 270 iterations each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_shapes.py"
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_recipes(text: str, source: str = "recipes") -> list[tuple[str, list[str]]]:
    """`name: override ...` lines -> [(name, overrides)]; a bad line is a ValueError naming it."""
    recipes: list[tuple[str, list[str]]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, colon, rest = line.partition(":")
        name = name.strip()
        if not colon or not NAME.match(name):
            raise ValueError(f"{source} line {number}: expected 'name: override ...' with a name of letters, digits, '_', '.', '-'; got '{raw.strip()}'")
        overrides = rest.split()
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"{source} line {number}: overrides are key=value; got '{bad[0]}'")
        if any(o.startswith("trainer.seed=") for o in overrides):
            raise ValueError(f"{source} line {number}: trainer.seed comes from --seeds; remove it from the recipe")
        if name in {n for n, _ in recipes}:
            raise ValueError(f"{source} line {number}: recipe '{name}' is named twice")
        recipes.append((name, overrides))
    if not recipes:
        raise ValueError(f"{source} holds no recipes")
    return recipes


def bench_command(run_dir: Path, seed: int, overrides: list[str], common: list[str], per_category: int, eval_seeds: list[int],
                  smoke: bool = False) -> list[str]:
    return [sys.executable, str(BENCH), *(["--smoke"] if smoke else []), "--per-category", str(per_category),
            "--seed", *map(str, eval_seeds), "--run-dir", str(run_dir), *common, *overrides, f"trainer.seed={seed}"]


def run_all(jobs: dict[str, list[str]], out: Path, parallel: int, minutes: float, threads: int, poll_s: float = 2.0) -> dict[str, str]:
    """Runs the commands, at most `parallel` at a time, each logging to OUT/NAME.log; returns
    NAME -> 'done' | 'failed (exit N)' | 'stopped' (still running when the minutes ran out) | 'not started'."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    deadline = time.monotonic() + 60 * minutes
    waiting, running, status = list(jobs), {}, {}
    while waiting or running:
        while waiting and len(running) < parallel and time.monotonic() < deadline:
            name = waiting.pop(0)
            log = open(out / f"{name}.log", "w")
            # a session of its own, so that stopping it stops bench_shapes' training processes too
            running[name] = (subprocess.Popen(jobs[name], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), log)
        for name, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                status[name] = "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
                del running[name]
        if time.monotonic() >= deadline:
            for name, (proc, log) in running.items():
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
                log.close()
                status[name] = "stopped"
            status.update({name: "not started" for name in waiting})
            break
        if running:
            time.sleep(poll_s)
    return status


def gains_of(run_dir: Path) -> dict[str, float] | None:
    """Eval set -> held-out strict gain, from the run's bench_shapes.json (None if it has none)."""
    path = run_dir / "bench_shapes.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return {s: v["gain"] for s, v in summary["eval_sets"].items()}


def summary_table(recipes: list[str], seeds: list[int], eval_seeds: list[int], gains: dict[tuple[str, int], dict[str, float] | None],
                  status: dict[tuple[str, int], str]) -> str:
    """One row per recipe: each training seed's gains (eval sets separated by '/'), then the mean
    over every gain of the recipe."""
    sets = "/".join(map(str, eval_seeds))
    lines = [f"held-out strict gain by training seed (eval sets {sets}), and the mean of each recipe's gains"]
    width = max(len(r) for r in recipes)
    lines.append(f"{'recipe':<{width}}  " + "  ".join(f"{'seed ' + str(s):<{8 * len(eval_seeds)}}" for s in seeds) + "  mean   runs")
    for r in recipes:
        cells, pooled = [], []
        for s in seeds:
            g = gains.get((r, s))
            if g is None:
                cells.append(f"{status.get((r, s), 'missing'):<{8 * len(eval_seeds)}}")
                continue
            values = [g[str(e)] for e in eval_seeds]
            pooled += values
            cells.append(f"{'/'.join(f'{v:+.3f}' for v in values):<{8 * len(eval_seeds)}}")
        mean = f"{sum(pooled) / len(pooled):+.3f}" if pooled else "  -   "
        done = sum(gains.get((r, s)) is not None for s in seeds)
        lines.append(f"{r:<{width}}  " + "  ".join(cells) + f"  {mean}  {done}/{len(seeds)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", help="a text file: one `name: override ...` per line")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds, each recipe runs once per seed")
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=[10_000, 20_000], help="bench_shapes --seed: one eval set each")
    ap.add_argument("--per-category", type=int, default=100)
    ap.add_argument("--common", nargs="*", default=[], help="overrides for every run (before the recipe's own)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    ap.add_argument("--minutes", type=float, default=60.0, help="stop runs still going after this long")
    ap.add_argument("--out", default=None, help="where runs and logs go (default runs/screen-<time>; with --smoke a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="every run is bench_shapes --smoke (a tiny random model, one iteration): "
                    "the screen's code path in seconds per run")
    args = ap.parse_args(argv)

    try:
        recipes = parse_recipes(Path(args.recipes).read_text(encoding="utf-8"), args.recipes)
    except (OSError, ValueError) as exc:
        print(f"screen_shapes: error: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.out is None and args.smoke:
            args.out = stack.enter_context(tempfile.TemporaryDirectory(prefix="screen_shapes-smoke-"))
        return screen(args, recipes)


def screen(args, recipes: list[tuple[str, list[str]]]) -> int:
    out = Path(args.out or f"runs/screen-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    jobs = {f"{name}_s{s}": bench_command(out / f"{name}_s{s}", s, overrides, args.common, args.per_category, args.eval_seeds, args.smoke)
            for name, overrides in recipes for s in args.seeds}
    print(f"screen_shapes: {len(recipes)} recipes x {len(args.seeds)} seeds = {len(jobs)} runs, {args.parallel} at a time, "
          f"{args.threads} thread(s) each, at most {args.minutes:g} min; logs in {out}", flush=True)
    t0 = time.perf_counter()
    status = run_all(jobs, out, args.parallel, args.minutes, args.threads)
    keyed = {(name, s): status[f"{name}_s{s}"] for name, _ in recipes for s in args.seeds}
    gains = {(name, s): gains_of(out / f"{name}_s{s}") for name, _ in recipes for s in args.seeds}
    print(f"{sum(v == 'done' for v in status.values())} of {len(jobs)} runs done in {(time.perf_counter() - t0) / 60:.1f} min")
    print(summary_table([n for n, _ in recipes], args.seeds, args.eval_seeds, gains, keyed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
