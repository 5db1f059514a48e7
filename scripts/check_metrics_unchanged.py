#!/usr/bin/env python3
"""Do refactors leave training bit for bit where it was? The first iterations of five image runs
and the text default, compared with metrics recorded on an earlier commit.

Each run is `flowrl train` (through the CLI, so the default preset runs as its two CPU
processes) with the overrides below and no sample grids. Every metric except wall-clock ones
(`time_*`, `*_per_s`) must equal the recorded value exactly; the script prints each difference
and exits 1 if there is any.

    .venv/bin/python scripts/check_metrics_unchanged.py            # compare with the record
    .venv/bin/python scripts/check_metrics_unchanged.py --record   # rewrite the record (after an intended change)
    .venv/bin/python scripts/check_metrics_unchanged.py --only tree
    .venv/bin/python scripts/check_metrics_unchanged.py --smoke    # the code path: tiny_jpeg's first iteration only
    .venv/bin/python scripts/check_metrics_unchanged.py --ray 2 --only default text   # on 2 Ray rollout workers

--ray N trains the runs on N Ray rollout workers at max_staleness 0 (run.cluster ray, a local
cluster on 127.0.0.1) and compares them with the synchronous record: the same numbers, plus the
asynchronous columns (staleness, weights by version), which are not differences.

The record (scripts/reference_metrics.json) names the commit, machine and date it was made on.
Floating-point results depend on the CPU's instruction set and thread count, so compare on the
kind of machine that recorded it (the 2-core dev box). About 2 minutes there.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "scripts" / "reference_metrics.json"
QUIET = ["run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0"]
SMALL = ["sampling.num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4", "sampling.batch_size=4",
         "lora.rank=4", "lora.alpha=8"]
# the GRPO runs were recorded before issue 90 made Flow-GRPO's last-step and KL conventions the defaults: flowrl's
# earlier choices, by name (docs/algorithms.md section 2)
BEFORE_ISSUE_90 = ["sampling.window.trained_fraction=1.0", "objective.grpo.kl_form=exact"]
RUNS = {
    # the default preset: DGPO on the shapes model, two CPU processes
    "default": [None, "trainer.iterations=3"],
    "tiny_jpeg": ["tiny_jpeg", "trainer.iterations=3", "trainer.kl_beta=0.04", *BEFORE_ISSUE_90],
    # recorded before the tree's defaults became the reference code's (docs/algorithms.md section 3): flowrl's variants
    "tree": ["tiny_jpeg", "trainer.iterations=3", *SMALL, "sampling.batch_size=3", "rollout.kind=tree",
             "rollout.tree.split_steps=[0,2]", "rollout.tree.branching=[2]", "trainer.kl_beta=0.01",
             "rollout.tree.split_noise_scale=1", "rollout.tree.leaf_reward=final_latent", "rollout.tree.depth_unit=split",
             "rollout.tree.edge_order=by_step", *BEFORE_ISSUE_90],
    "two_stage": ["tiny_jpeg", "trainer.iterations=3", *SMALL, "rollout.kind=two_stage", "rollout.two_stage.candidates=8",
                  "rollout.two_stage.explore_precision=nvfp4", "rollout.two_stage.fidelity_every=2",
                  *BEFORE_ISSUE_90],
    "tiny_allocated": ["tiny_jpeg", "trainer.iterations=3", *SMALL, "allocator.kind=dars_budget", "allocator.dars_budget.round_size=2",
                       "trainer.gradient_accumulation_steps=2", "trainer.inner_epochs=2", *BEFORE_ISSUE_90],
    # the text default: RLVR on the shipped arithmetic model (its config has no trackers or sample grids)
    "text": ["text_add", "trainer.iterations=3"],
}
TEXT_QUIET = ["run.progress=false", "run.checkpoint_every=0"]


def is_timing(key: str) -> bool:
    return key.startswith("time_") or key.endswith("_per_s")


def run(name: str, tmp: Path, extra: list[str] = ()) -> list[dict]:
    config, *overrides = RUNS[name]
    overrides += extra
    quiet = TEXT_QUIET if name == "text" else QUIET
    args = [sys.executable, "-m", "flowrl.cli", "train", *([config] if config else []), *overrides, *quiet,
            "--run-dir", str(tmp / name)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: flowrl train failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows]


def compare(name: str, got: list[dict], want: list[dict]) -> list[str]:
    problems = []
    if len(got) != len(want):
        problems.append(f"{name}: {len(got)} iterations, recorded {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        for key in sorted(set(g) | set(w)):
            if key not in g:
                problems.append(f"{name} iteration {i}: '{key}' missing (recorded {w[key]!r})")
            elif key not in w:
                problems.append(f"{name} iteration {i}: '{key}' is new ({g[key]!r})")
            elif g[key] != w[key]:
                problems.append(f"{name} iteration {i}: '{key}' = {g[key]!r}, recorded {w[key]!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record", action="store_true", help="write the record instead of comparing")
    p.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only")
    p.add_argument("--allow-new", action="store_true", help="metrics the record lacks are not differences")
    p.add_argument("--ray", type=int, default=0, metavar="N", help="train on N Ray rollout workers at max_staleness 0 "
                   "(implies --allow-new)")
    p.add_argument("--smoke", action="store_true", help="the code path in seconds: the first iteration of tiny_jpeg (or of "
                   "--only's runs), compared with the record's first")
    args = p.parse_args(argv)
    if (args.smoke or args.ray) and args.record:
        p.error("--smoke and --ray record nothing: the record is the synchronous run's")
    names = args.only or (["tiny_jpeg"] if args.smoke else list(RUNS))
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name in names:
            print(f"running {name} ...", flush=True)
            ray = ["run.cluster=ray", "run.max_staleness=0", f"run.ray.rollout_workers={args.ray}"] if args.ray else []
            results[name] = run(name, Path(tmp), [*ray, *(["trainer.iterations=1"] if args.smoke else [])])
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        old = json.loads(RECORD.read_text())["runs"] if RECORD.exists() else {}
        record = {"commit": commit, "date": date.today().isoformat(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
                  "runs": {**old, **results}}
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print(f"recorded {', '.join(names)} in {RECORD}")
        return 0
    record = json.loads(RECORD.read_text())
    problems = []
    for name in names:
        found = compare(name, results[name], record["runs"][name][: 1 if args.smoke else None])
        if args.allow_new or args.ray:
            found = [f for f in found if "is new" not in f]
        problems += found
        print(f"{name}: {'identical' if not found else f'{len(found)} differences'} "
              f"({len(results[name])} iterations, against commit {record['commit']})")
    for line in problems:
        print("  " + line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
