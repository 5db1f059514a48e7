#!/usr/bin/env python3
"""The text arena: loss variants and rollout allocators trained on the arithmetic task for the same
wall-clock budget on the same machine, judged by held-out greedy exact match (docs/arena.md).

    python scripts/arena_text.py --pools add --losses grpo dapo dr_grpo gspo           # the loss variants, uniform
    python scripts/arena_text.py --pools wide --losses grpo --allocators uniform vade xrpo dars dars_budget \\
        successive_elimination reinforce_ada sqrt prompt_gdro                           # the allocators, harder pool
    python scripts/arena_text.py --report                                               # docs/arena.md's text table
    python scripts/arena_text.py --diagnostics                                          # where the rollouts went
    python scripts/arena_text.py --smoke --runs /tmp/t --out /tmp/t.jsonl               # seconds (the test)

A cell is POOL/LOSS/ALLOCATOR: the pool's preset (add: configs/text_add.yaml, wide:
configs/text_add_wide.yaml, the harder pool of 1-7-digit operands), a loss variant's settings
(LOSSES) and `allocator.kind` (reinforce_ada with its own global-statistics advantage). Every
(cell, seed) trains in this process for `trainer.budget_minutes` (default 5; the preset's
10-minute budget is replaced), one after another, never two at once. The final weights are then
scored on the pool's held-out problems (greedy, every bucket) against the base model's score,
cached in --runs; one JSON line per (cell, seed) goes to --out, `task: text`, beside the image
arena's lines. A rerun skips what --out records for the same code and config (the image arena's
rule), so a stopped arena resumes by running the same command again.

With inner_epochs 1 every ratio is exactly 1 when the gradient is taken, so clip ranges do not act:
the variants differ in how tokens and sequences are weighted (aggregation) and in the advantage's
scale (`std`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the image arena's helpers
from arena import ROOT, arena_lock, config_hash, describe_identity, fmt, pm, recorded, run_each, run_identity  # noqa: E402
from flowrl.core.allocation import ALLOCATORS  # noqa: E402

OUT = ROOT / "docs" / "experiments" / "arena.jsonl"
DOC = ROOT / "docs" / "arena.md"
TABLE_START, TABLE_END = "<!-- arena:text -->", "<!-- /arena:text -->"
POOLS = {"add": "configs/text_add.yaml", "wide": "configs/text_add_wide.yaml"}
# each loss variant as the text path writes it (docs/text.md, docs/algorithms.md)
LOSSES = {
    "grpo": ["loss.aggregation=seq_mean_token_mean", "advantage.std=group"],  # each sequence's token mean, then their mean
    "dapo": ["loss.aggregation=token_mean", "loss.clip_high=0.28", "loss.overlong_mask=true", "advantage.std=group"],
    "dr_grpo": ["loss.aggregation=seq_mean_token_sum_norm", "advantage.std=none"],  # sums over a constant, centred only
    "gspo": ["loss.ratio_level=sequence", "loss.aggregation=seq_mean_token_mean", "loss.clip_low=0.0003",
             "loss.clip_high=0.0004", "advantage.std=group"],
}
ALLOCATOR_NAMES = ALLOCATORS.names()  # every registered allocator
ALLOCATOR_EXTRA = {"reinforce_ada": ["advantage.kind=reinforce_ada"]}  # the authors' baseline over every sample drawn
BUDGET = 5.0
BACKSTOP = 1 / 24  # trainer.max_minutes = budget x (1 + BACKSTOP)
SMOKE = ["data.prompts_per_iteration=4", "data.group_size=4", "trainer.micro_batch=16", "trainer.budget_probe=2"]
SMOKE_BUDGET, SMOKE_EVAL_PROMPTS = 0.05, 40


def log(start: float, text: str) -> None:
    print(f"[arena-text {(time.perf_counter() - start) / 60:6.1f} min] {text}", flush=True)


def cell_name(pool: str, loss: str, allocator: str) -> str:
    return f"{pool}/{loss}/{allocator}"


def cell_overrides(pool: str, loss: str, allocator: str, seed: int, budget: float, smoke: bool) -> list[str]:
    return [*LOSSES[loss], f"allocator.kind={allocator}", *ALLOCATOR_EXTRA.get(allocator, []), f"trainer.seed={seed}",
            f"trainer.budget_minutes={fmt(budget)}", f"trainer.max_minutes={fmt(budget * (1 + BACKSTOP))}",
            "run.checkpoint_every=0", "run.progress=false", *(SMOKE if smoke else [])]


def held_out_set(cfg, smoke: bool):
    from flowrl.text.data import load_prompts

    d = cfg.data
    return load_prompts(d.source, d.eval_split, d.prompt_column, SMOKE_EVAL_PROMPTS if smoke else 0, d.subset, d.prompt_template)


def exact_match(policy, cfg, data) -> dict[str, float]:
    """Greedy held-out exact match, overall ("all") and per bucket."""
    from flowrl.text.train import evaluate_text
    from rewards.text import TextReward

    reward = TextReward({"exact_match": 1.0})
    scores = evaluate_text(policy, data, cfg, reward)
    return {k: v["exact_match"] for k, v in scores.items() if k != "count"}


def base_scores(runs: Path, pool: str, cfg, smoke: bool) -> dict[str, float]:
    from flowrl.text.policy import load_text_policy

    cache_file = runs / "text_base_eval.json"
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    key = f"{pool}|{cfg.model.path}|{cfg.data.source}|{'smoke' if smoke else 'full'}"
    if key not in cache:
        cache[key] = exact_match(load_text_policy(cfg, trainable=False), cfg, held_out_set(cfg, smoke))
        runs.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cache, indent=1) + "\n")
    return cache[key]


def run_cell(pool: str, loss: str, allocator: str, seed: int, args, start: float, ident: dict) -> dict:
    from flowrl.text.config import load_text_config
    from flowrl.text.train import TextTrainer
    from flowrl.runtime.budget import machine_name

    runs, budget, cell = Path(args.runs), args.budget_minutes, cell_name(pool, loss, allocator)
    cfg = load_text_config(ROOT / POOLS[pool], cell_overrides(pool, loss, allocator, seed, budget, args.smoke))
    chash = config_hash(cfg)
    run_dir = runs / f"text-{pool}-{loss}-{allocator}-s{seed}-{chash[:8]}"
    if run_dir.exists():  # an unfinished run of an earlier arena: kept aside
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.unfinished-{time.strftime('%Y%m%d-%H%M%S')}"))
    base = base_scores(runs, pool, cfg, args.smoke)
    log(start, f"{cell} seed {seed}: start ({budget:g} min budget, run {run_dir})")
    t0 = time.perf_counter()
    trainer = TextTrainer(cfg, run_dir=run_dir)
    rows = trainer.train()
    minutes = (time.perf_counter() - t0) / 60
    end = exact_match(trainer.policy, cfg, held_out_set(cfg, args.smoke))
    mean = statistics.mean
    record = {
        "task": "text", "cell": cell, "pool": pool, "loss": loss, "allocator": allocator, "seed": seed,
        "commit": ident["commit"], "dirty": ident["dirty"], "code": ident["code"], "machine": machine_name(),
        "config_hash": chash, "preset": POOLS[pool], "smoke": args.smoke, "budget_minutes": budget, "wall_minutes": minutes,
        "iterations": len(rows), "samples": sum(r["samples"] for r in rows),
        "samples_trained": sum(r.get("samples_trained", r["samples"]) for r in rows),
        "zero_variance": mean(r["zero_variance_fraction"] for r in rows),
        "base": base, "end": end, "gain_end": end["all"] - base["all"],
        "gain_by_bucket": {b: end[b] - base[b] for b in end if b != "all" and b in base},
        "run_dir": str(run_dir), "date": time.strftime("%Y-%m-%d %H:%M"), "torch": ident["torch"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    log(start, f"{cell} seed {seed}: {len(rows)} iterations, {record['samples']} samples in {minutes:.1f} min; held-out exact "
               f"match {base['all']:.3f} -> {end['all']:.3f} ({record['gain_end']:+.3f})")
    return record


def run_arena(args) -> int:
    from flowrl.text.config import load_text_config
    from flowrl.runtime.budget import machine_name

    start = time.perf_counter()
    ident = run_identity()
    runs = Path(args.runs)
    cells = [(p, lo, a) for p in args.pools for lo in args.losses for a in args.allocators]
    with arena_lock(runs):
        lines, todo = recorded(Path(args.out)), []
        for pool, loss, allocator in cells:
            for seed in args.seeds:
                cfg = load_text_config(ROOT / POOLS[pool], cell_overrides(pool, loss, allocator, seed, args.budget_minutes, args.smoke))
                chash = config_hash(cfg)
                if any(r.get("task") == "text" and r.get("cell") == cell_name(pool, loss, allocator) and r.get("seed") == seed
                       and r.get("config_hash") == chash and r.get("code") == ident["code"] for r in lines):
                    log(start, f"{cell_name(pool, loss, allocator)} seed {seed}: recorded for this code and config; skipped")
                else:
                    todo.append((pool, loss, allocator, seed))
        log(start, f"{len(todo)} of {len(cells) * len(args.seeds)} runs to do, {args.budget_minutes:g} min each, on "
                   f"{machine_name()}, {describe_identity(ident)}")
        runs = [(f"{cell_name(pool, loss, allocator)} seed {seed}",
                 lambda pool=pool, loss=loss, allocator=allocator, seed=seed: run_cell(pool, loss, allocator, seed, args, start, ident))
                for pool, loss, allocator, seed in todo]
        return run_each(runs, args.out, start, log)


# ---- --report ------------------------------------------------------------------------------------------
def table(lines: list[dict], budget: float, smoke: bool) -> str:
    latest: dict[tuple[str, int], dict] = {}
    for r in lines:
        if r.get("task") == "text" and r.get("budget_minutes") == budget and bool(r.get("smoke")) == smoke:
            latest[(r["cell"], r["seed"])] = r
    cells = sorted({c for c, _ in latest})
    if not cells:
        return "\nNo text arena run is recorded yet.\n"
    out = [f"| cell (pool/loss/allocator) | seeds | iterations | samples drawn per minute | zero-variance groups | "
           f"held-out exact match gain at {budget:g} min | gain per bucket (mean) |", "|---|---|---|---|---|---|---|"]
    for cell in cells:
        rs = [r for (c, _), r in sorted(latest.items()) if c == cell]
        buckets = sorted({b for r in rs for b in r["gain_by_bucket"]}, key=lambda b: (len(b), b))
        by_bucket = " / ".join(f"{statistics.mean(r['gain_by_bucket'][b] for r in rs if b in r['gain_by_bucket']):+.2f}"
                               for b in buckets)
        per_minute = statistics.mean(r["samples"] / r["wall_minutes"] for r in rs)
        out.append(f"| {cell} | {len(rs)} ({', '.join(str(r['seed']) for r in rs)}) | "
                   f"{statistics.mean(r['iterations'] for r in rs):.0f} | {per_minute:,.0f} | "
                   f"{statistics.mean(r['zero_variance'] for r in rs):.2f} | {pm([r['gain_end'] for r in rs])} | {by_bucket} |")
    rows = list(latest.values())
    machines = sorted({r["machine"] for r in rows})
    commits = sorted({r["commit"][:10] + ("+" if r.get("dirty") else "") for r in rows})
    return ("\n".join(out) + f"\n\nGains are greedy held-out exact match minus the base model's, the mean ± standard "
            f"error over training seeds; per bucket: operand digits 1, 2, ... Generated by `scripts/arena_text.py --report` "
            f"from {len(rows)} runs; commit(s) {', '.join(commits)} (+: with uncommitted changes); machine(s): "
            f"{'; '.join(machines)}.\n")


def diagnostics(lines: list[dict]) -> str:
    """Where each cell's rollouts went, from its runs' metrics (the run directories the rows name):
    per iteration, the samples drawn and trained, the samples with a nonzero advantage, the
    distinct prompts trained; the share of rollouts and the zero-variance fraction per operand-
    length bucket; and the pool covered at the end. Means over each run's iterations, then over seeds."""
    cells: dict[str, list[list[dict]]] = {}
    for r in lines:
        f = Path(r.get("run_dir", "")) / "metrics.jsonl"
        if r.get("task") == "text" and f.is_file():
            cells.setdefault(r["cell"], []).append([json.loads(x) for x in f.read_text().splitlines() if x.strip()])
    if not cells:
        return "no run directories with metrics"
    mean = statistics.mean
    out = []
    for pool in sorted({c.split("/")[0] for c in cells}):  # one table per pool: each has its own buckets
        pool_cells = {c: runs for c, runs in cells.items() if c.split("/")[0] == pool}
        buckets = sorted({k.split("/")[1] for runs in pool_cells.values() for rows in runs for k in rows[0]
                          if k.startswith("rollouts/")}, key=int)
        out += ["" if out else None, "| cell | runs | s / iteration | samples drawn / trained | nonzero-advantage samples | "
                f"prompts trained | rollout share, buckets {', '.join(buckets)} | zero-variance fraction, same buckets | "
                "pool covered at the end |", "|---|---|---|---|---|---|---|---|---|"]
        for cell, runs in sorted(pool_cells.items()):
            def avg(key, runs=runs):
                return mean(mean(r[key] for r in rows if key in r) for rows in runs if any(key in r for r in rows))
            share = [mean(mean(r.get(f"rollouts/{b}", 0) / r["samples"] for r in rows) for rows in runs) for b in buckets]
            dead = [mean(mean(r[f"zero_variance/{b}"] for r in rows if f"zero_variance/{b}" in r) for rows in runs
                         if any(f"zero_variance/{b}" in r for r in rows)) for b in buckets]
            out.append(f"| {cell} | {len(runs)} | {avg('time_iteration'):.2f} | {avg('samples'):.0f} / {avg('samples_trained'):.0f} | "
                       f"{avg('nonzero_advantage_samples'):.0f} | {avg('prompts_trained'):.1f} | "
                       f"{' / '.join(f'{x:.2f}' for x in share)} | {' / '.join(f'{x:.2f}' for x in dead)} | "
                       f"{mean(rows[-1].get('pool_covered', float('nan')) for rows in runs):.2f} |")
    out = [line for line in out if line is not None]
    return "\n".join(out)


def write_report(args) -> int:
    doc = Path(args.doc)
    block = f"{TABLE_START}\n{table(recorded(Path(args.out)), args.budget_minutes, args.smoke)}{TABLE_END}"
    text = doc.read_text() if doc.is_file() else "# Arena results\n"
    if TABLE_START in text and TABLE_END in text:
        head, _, rest = text.partition(TABLE_START)
        text = head + block + rest.partition(TABLE_END)[2]
    else:
        text = text.rstrip("\n") + f"\n\n## Text\n\n{block}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    print(f"wrote {doc}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", nargs="+", default=["add"], choices=sorted(POOLS), help="add (the default) or wide (1-7 digits)")
    ap.add_argument("--losses", nargs="+", default=["grpo"], choices=sorted(LOSSES))
    ap.add_argument("--allocators", nargs="+", default=["uniform"], choices=ALLOCATOR_NAMES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    ap.add_argument("--budget-minutes", type=float, default=None, help=f"wall-clock minutes per run (default {BUDGET:g}; "
                                                                       f"--smoke: {SMOKE_BUDGET})")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "arena"), help="where run directories and caches go")
    ap.add_argument("--out", default=str(OUT), help="the results, one JSON line per (cell, seed)")
    ap.add_argument("--smoke", action="store_true", help="seconds per cell: tiny groups, budget and eval (not a result)")
    ap.add_argument("--report", action="store_true", help="write --doc's text table from --out, and train nothing")
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--diagnostics", action="store_true", help="print where each cell's rollouts went (from its run "
                                                               "directories), and train nothing")
    args = ap.parse_args(argv)
    if args.budget_minutes is None:
        args.budget_minutes = SMOKE_BUDGET if args.smoke else BUDGET
    if not (args.budget_minutes > 0 and math.isfinite(args.budget_minutes)):
        ap.error(f"--budget-minutes must be a positive number; got {args.budget_minutes}")
    if args.report:
        return write_report(args)
    if args.diagnostics:
        print(diagnostics(recorded(Path(args.out))))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flowrl.quiet import silence_known_messages

    silence_known_messages()
    return run_arena(args)


if __name__ == "__main__":
    sys.exit(main())
