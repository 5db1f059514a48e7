#!/usr/bin/env python3
"""What Ray costs the asynchronous rollouts: the same run with the local producer process and with
1 and 2 Ray rollout workers (run.cluster ray, a cluster of the trainer's own on 127.0.0.1), side
by side in one invocation.

    python scripts/bench_ray.py                                   # the default preset, 30 iterations per part
    python scripts/bench_ray.py --iterations 60 --parts local ray1
    python scripts/bench_ray.py --smoke                           # the code path: tiny_jpeg, 2 iterations

Every part trains the preset from the same seed as one trainer process of one thread (the trainer and each
producer or worker one thread; on the 2-core box `ray2` oversubscribes the cores), the budget plan
off, run.max_staleness 1, no sample grids. Iterations per minute are counted over the rows after
the first --warmup (start-up and compilation excluded), from the rows' own time_iteration. The
Ray parts also give the weights' bytes per version and the median seconds to publish and to fetch
one. The table ends with each part's ratio to `local` (goal for ray1: at least 0.95).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = {
    "local": ["run.async_rollouts=true"],
    "ray1": ["run.cluster=ray", "run.ray.rollout_workers=1"],
    "ray2": ["run.cluster=ray", "run.ray.rollout_workers=2"],
}
COMMON = ["run.cpu_processes=1", "trainer.threads=1", "trainer.budget_minutes=0", "run.max_staleness=1", "run.sample_every=0", "run.tracker=none",
          "run.checkpoint_every=0", "monitor.enabled=false"]


def train(preset: str, part: str, iterations: int, runs: Path, extra: list[str]) -> list[dict]:
    from flowrl.cli import main

    run = runs / part
    code = main(["train", preset, *COMMON, *PARTS[part], f"trainer.iterations={iterations}", *extra, "--run-dir", str(run)])
    if code != 0:
        raise SystemExit(f"bench_ray: part {part} stopped with exit code {code}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict], warmup: int) -> dict:
    timed = rows[warmup:] or rows
    out = {"iterations": len(rows), "iterations_per_minute": 60 * len(timed) / sum(r["time_iteration"] for r in timed),
           "trainer_wait_s": statistics.median(r["time_trainer_wait"] for r in timed)}
    if "weights_published_bytes" in rows[0]:
        out.update(weights_mb=rows[0]["weights_published_bytes"] / 2**20,
                   publish_s=statistics.median(r["time_weights_publish"] for r in timed),
                   fetch_s=statistics.median(r["time_weights_fetch"] for r in timed if r["weights_fetched_bytes"]) if any(
                       r["weights_fetched_bytes"] for r in timed) else 0.0)
    return out


def table(results: dict[str, dict]) -> str:
    base = results.get("local", {}).get("iterations_per_minute")
    lines = ["part    iterations  it/min   x local  trainer wait s  weights MB  publish s  fetch s"]
    for part, r in results.items():
        ratio = f"{r['iterations_per_minute'] / base:7.3f}" if base else "      -"
        ray = (f"{r['weights_mb']:10.3f}  {r['publish_s']:9.4f}  {r['fetch_s']:7.4f}" if "weights_mb" in r
               else f"{'-':>10}  {'-':>9}  {'-':>7}")
        lines.append(f"{part:<7} {r['iterations']:10d}  {r['iterations_per_minute']:6.2f}  {ratio}  {r['trainer_wait_s']:14.3f}  {ray}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=["local", "ray1", "ray2"])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="rows left out of the speed (start-up, compilation)")
    p.add_argument("--runs", help="where the run directories go (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="the code path in seconds: tiny_jpeg, 2 iterations, no warm-up")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for every part")
    args = p.parse_args(argv)
    preset, iterations, warmup, extra = args.preset, args.iterations, args.warmup, list(args.overrides)
    if args.smoke:
        preset, iterations, warmup = "tiny_jpeg", 2, 0
        extra += ["sampling.num_steps=2", "data.prompts_per_iteration=2", "data.group_size=2", "sampling.batch_size=4",
                  "run.progress=false"]
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        runs = Path(args.runs) if args.runs else Path(tmp)
        results = {part: summary(train(preset, part, iterations, runs, extra), warmup) for part in args.parts}
    print(f"bench_ray: {preset}, {iterations} iterations per part, the first {warmup} left out of the speed")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
