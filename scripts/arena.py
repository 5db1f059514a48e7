#!/usr/bin/env python3
"""The arena: each algorithm trained on the shapes task for the same wall-clock budget on the same
machine, judged by held-out strict accuracy at half the budget and at its end.

    python scripts/arena.py                                   # every cell, training seeds 0 1 2, 12 minutes each
    python scripts/arena.py --cells nft flow_grpo --seeds 0   # some of them
    python scripts/arena.py --report                          # docs/arena.md's table and docs/images/arena.png
    python scripts/arena.py --smoke --cells nft --runs /tmp/arena-runs --out /tmp/arena.jsonl   # seconds (the test)

A cell is a preset of configs/arena/ (one per algorithm, all on the default preset's model,
prompts and rewards). A cell X_tuned is configs/arena/X_tuned.yaml, X's preset with the settings
scripts/tune_arena.py chose for it, once that file exists. For each cell and training seed, one
after another (never two at once): `flowrl train` with the preset, `trainer.budget_minutes` set
to the budget (gdro_offline first builds its group store with `flowrl offline build`, timed, and
trains for what is left), and `run.checkpoint_at_minutes` at half the budget, so the run writes
a checkpoint when its clock first passes the half. After the run (not counted in the budget) the half-budget and final
checkpoints (the trained weights, not their EMA) are scored on the two eval sets bench_shapes uses (400 held-out prompts
each, 20-step ODE, eval seeds from 10000 and 20000); the base model is scored once per eval set
and cached in the --runs directory. Each finished (cell, seed) appends one JSON line to --out;
a rerun skips what is recorded there for the same code (the git tree of the flowrl package, so
committing results or docs does not invalidate them), config hash and eval sets, so a stopped
arena resumes by running the same command again (an unfinished run starts over).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

# the tuned DGPO on flat groups whose prompts and sizes an allocator chooses (its defaults)
ALLOCATOR_CELLS = ("vade_dgpo", "dars_budget_dgpo", "prompt_gdro_dgpo", "successive_elimination_dgpo")
# the reference DPO (cell dpo) on the groups of the allocator that led the DGPO pairings' screen
DPO_ALLOCATOR_CELLS = ("vade_dpo",)
REFERENCE_CELLS = ("flow_grpo", "mixgrpo", "branchgrpo", "g2rpo", "sol_rl", "nft", "dgpo", "gdro_offline", "awm", "dgpo_reference",
                   "flow_grpo_fast", "dpo", "dpo_online", "flow_dppo",  # each algorithm with its reference's settings
                   # Arena III, pairings: the leading objective (DGPO, tuned) and the better of AWM and DPO (DPO, its reference
                   # settings), each fed by another rollout at that rollout's reference settings
                   "tree_dgpo", "two_stage_dgpo", "tree_dpo", "two_stage_dpo", *ALLOCATOR_CELLS, *DPO_ALLOCATOR_CELLS)
OFFLINE_CELLS = ("gdro_offline",)  # train from a group store that the arena builds, timed, inside the budget
PRESETS = ROOT / "configs" / "arena"
# cells of another world than the arena's, which scripts/tune_arena.py tunes on their own preset and held-out set: the
# editing world's (docs/editing.md), scored on its held-out edits
EDIT_CELLS = {"edit_shapes": ROOT / "configs" / "edit_shapes.yaml"}
EDIT_HELD_OUT = "builtin:shapes-edit-heldout"
TUNED = "_tuned"  # cell X_tuned: configs/arena/X_tuned.yaml, written by scripts/tune_arena.py


def tuned_cells(presets: Path = PRESETS) -> tuple[str, ...]:
    """The X_tuned cells whose preset exists in `presets`, in the reference cells' order."""
    return tuple(f"{c}{TUNED}" for c in REFERENCE_CELLS if (presets / f"{c}{TUNED}.yaml").is_file())


def reference_cell(cell: str) -> str:
    """The reference cell a cell belongs to: X for X_tuned, the cell itself otherwise."""
    base = cell.removesuffix(TUNED)
    return base if base in REFERENCE_CELLS else cell


CELLS = REFERENCE_CELLS + tuned_cells()
EVAL_SEEDS = (10_000, 20_000)  # bench_shapes' two eval sets: image j of a set with seed S is sampled from seed S + j
PER_CATEGORY = 100  # 400 held-out prompts per eval set
STORE_PROMPTS = 256  # gdro_offline's store: 256 prompts x data.group_size samples (bench_offline's)
BACKSTOP = 1 / 24  # trainer.max_minutes = budget x (1 + BACKSTOP): 12.5 minutes for a 12-minute budget
OUT = ROOT / "docs" / "experiments" / "arena.jsonl"
DOC = ROOT / "docs" / "arena.md"
IMAGE = ROOT / "docs" / "images" / "arena.png"
TABLE_START, TABLE_END = "<!-- arena:results -->", "<!-- /arena:results -->"

# --smoke: every cell in seconds on a CPU (the test's mode): small groups, a 2-iteration probe, one process,
# 8 held-out prompts per eval set on a 4-step ODE. Nothing it records is a result.
SMOKE = ["trainer.budget_probe=2", "run.cpu_processes=1", "model.compile=none"]  # no compile warm-up in seconds-long checks
SMOKE_EVAL = ["sampling.eval_num_steps=4"]
SMALL = ["data.prompts_per_iteration=2", "data.group_size=4", "sampling.batch_size=8"]
SMOKE_CELL = {
    "flow_grpo": SMALL, "flow_grpo_fast": SMALL, "mixgrpo": SMALL, "nft": SMALL, "dgpo": SMALL, "dgpo_reference": SMALL, "gdro_offline": SMALL, "awm": SMALL,
    "dpo": SMALL, "dpo_online": SMALL, "flow_dppo": SMALL,
    "branchgrpo": ["data.prompts_per_iteration=1", "sampling.batch_size=8"],  # one tree of 8 leaves
    "g2rpo": ["data.prompts_per_iteration=1", "sampling.batch_size=4"],
    "sol_rl": [*SMALL, "rollout.two_stage.candidates=8"],
    "tree_dgpo": ["data.prompts_per_iteration=1", "sampling.batch_size=8"],
    "two_stage_dgpo": [*SMALL, "rollout.two_stage.candidates=8"],
    "tree_dpo": ["data.prompts_per_iteration=1", "sampling.batch_size=8"],
    "two_stage_dpo": [*SMALL, "rollout.two_stage.candidates=8"],
    **{cell: SMALL for cell in (*ALLOCATOR_CELLS, *DPO_ALLOCATOR_CELLS)},
}
SMOKE_BUDGET, SMOKE_PER_CATEGORY, SMOKE_STORE_PROMPTS = 0.1, 2, 4


def log(start: float, text: str) -> None:
    print(f"[arena {(time.perf_counter() - start) / 60:6.1f} min] {text}", flush=True)


# ---- identities: the code, the config, the eval ----------------------------------------------------
def git_commit() -> tuple[str, bool, str]:
    """HEAD's commit, whether the flowrl package differs from it (uncommitted code in the tree), and
    the git tree hash of HEAD's flowrl package (the code a result belongs to; "+dirty" when it differs)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head, tree = git("rev-parse", "HEAD"), git("rev-parse", "HEAD:flowrl")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "flowrl") != ""
        return head, dirty, tree + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True, "unknown"


def run_identity() -> dict:
    """What a result belongs to: HEAD's commit, whether flowrl differs from it, flowrl's tree hash, torch."""
    import torch

    commit, dirty, code = git_commit()
    return {"commit": commit, "dirty": dirty, "code": code, "torch": torch.__version__}


def describe_identity(ident: dict) -> str:
    return f"commit {ident['commit'][:10]}{' (with uncommitted changes)' if ident['dirty'] else ''}, torch {ident['torch']}"


def config_hash(cfg, drop=()) -> str:
    """sha256 of the resolved config, less where things are written (run.output_dir, run.name,
    data.offline: the store's path) and the progress bar; `drop` leaves out more ("trainer.seed")."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.structured(cfg))
    for key in ("run.output_dir", "run.name", "run.progress", "data.offline", *drop):
        section, _, name = key.partition(".")
        data[section].pop(name, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def compiled_value(cfg) -> str:
    """model.compile where the config has that key (a later addition), else "none"."""
    value = getattr(cfg.model, "compile", None)
    return "none" if value is None else str(value)


def fmt(x: float) -> str:
    return repr(round(float(x), 6))


# ---- the cells -----------------------------------------------------------------------------------
def cell_overrides(cell: str, seed: int, budget: float, smoke: bool) -> list[str]:
    """The overrides of the cell's preset that the arena sets: the config hash is taken over them.
    gdro_offline's run then replaces its budget with what the store's build left."""
    return [*(SMOKE + SMOKE_CELL[reference_cell(cell)] if smoke else []), f"trainer.seed={seed}", *budget_overrides(budget, budget / 2),
            "run.progress=false"]


def budget_overrides(train_budget: float, half_mark: float) -> list[str]:
    marks = f"[{fmt(half_mark)}]" if half_mark > 0 else "[]"
    return [f"trainer.budget_minutes={fmt(train_budget)}", f"trainer.max_minutes={fmt(train_budget * (1 + BACKSTOP))}",
            f"run.checkpoint_at_minutes={marks}"]


def preset(cell: str, presets: Path = PRESETS) -> str:
    if cell in EDIT_CELLS:
        return str(EDIT_CELLS[cell])
    return str(presets / f"{cell}.yaml")


def kept_reference(cell: str, presets: Path = PRESETS) -> bool:
    """Whether X_tuned's study kept X's settings: its preset resolves to X's config, so X's runs are its runs."""
    from flowrl.config import load_config

    reference = reference_cell(cell)
    if reference == cell:
        return False
    return load_config(preset(cell, presets), validate_paths=False) == load_config(preset(reference, presets), validate_paths=False)


def train(argv: list[str], run_dir: Path) -> None:
    """`flowrl train ARGV` in this process (it launches its CPU processes itself); a failure stops the run."""
    from flowrl.cli import main as cli_main

    if cli_main(["train", *argv]) != 0:
        raise SystemExit(f"arena: training {run_dir} failed")


def build_store(cell: str, overrides: list[str], store: Path, prompts: int) -> float:
    """`flowrl offline build` of the cell's group store (`prompts` groups from the base model) at
    `store`; the minutes it took."""
    from flowrl.cli import main as cli_main

    t0 = time.perf_counter()
    if cli_main(["offline", "build", preset(cell), *overrides, "-o", str(store), "--num-prompts", str(prompts)]) != 0:
        raise SystemExit(f"arena: building the group store {store} failed")
    return (time.perf_counter() - t0) / 60


WARMED: set[str] = set()  # the cells whose compiled graphs this process has put in the compile cache


def warm_compile_cache(cell: str, overrides: list[str], runs: Path) -> float:
    """One iteration of the cell outside every budget, once per cell and process, so that the first
    timed run does not pay the cold compile: Inductor's on-disk cache then holds the cell's graphs
    (a flow_grpo trial's first iteration took 95 s cold and 25 s warm, which left it 8 iterations of
    a 4-minute budget against 14-15 for the trials after it). An offline cell warms nothing (its
    store is built, timed, inside the budget), nor does a cell that does not compile. The minutes it took."""
    import shutil

    from flowrl.config import load_config

    cfg = load_config(preset(cell), overrides, validate_paths=False)
    if cell in WARMED or cfg.model.compile == "none" or reference_cell(cell) in OFFLINE_CELLS:
        return 0.0
    t0 = time.perf_counter()
    run_dir = runs / "compile-warmup" / cell
    if run_dir.exists():
        shutil.rmtree(run_dir)
    train([preset(cell), *overrides, "trainer.iterations=1", "trainer.budget_minutes=0", "trainer.max_minutes=0",
           "run.checkpoint_every=0", "run.checkpoint_at_minutes=[]", "--run-dir", str(run_dir)], run_dir)
    shutil.rmtree(run_dir)
    WARMED.add(cell)
    return (time.perf_counter() - t0) / 60


def last_checkpoint(run_dir: Path) -> int:
    """The iteration of the run's last checkpoint."""
    from flowrl.runtime.checkpoint import checkpoint_iterations
    from flowrl.runtime.run_dir import RunDir

    return checkpoint_iterations(RunDir(run_dir).checkpoints)[-1]


def set_aside(path: Path) -> None:
    """An unfinished run (or store) of an earlier arena under --runs is moved aside, not deleted."""
    if path.exists():
        target = path.with_name(f"{path.name}.unfinished-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(target)
        print(f"arena: moved the unfinished {path} to {target}", flush=True)


@contextlib.contextmanager
def counted_velocities():
    """Counts every velocity the policies evaluate (FlowPolicy.velocity, the exploration copies'
    included): rows, one per sample; a guided pair of forwards counts once, as NFE does."""
    from flowrl.models.base import FlowPolicy

    original, counts = FlowPolicy.velocity, {"rows": 0, "calls": 0}

    def counted(self, x, sigma, cond):
        counts["rows"] += int(x.shape[0])
        counts["calls"] += 1
        return original(self, x, sigma, cond)

    FlowPolicy.velocity = counted
    try:
        yield counts
    finally:
        FlowPolicy.velocity = original


def measure_nfe(cell: str, overrides: list[str], work: Path) -> dict:
    """Network evaluations per iteration, measured: one extra iteration of the cell's config in
    this process (one process, no budget), with every velocity counted, split into sampling
    (`rollout.collect`) and training (`objective.update`)."""
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer

    cfg = load_config(preset(cell), [*overrides, "run.cpu_processes=1", "run.tracker=none", "trainer.budget_minutes=0",
                                     "trainer.max_minutes=0", "run.checkpoint_at_minutes=[]"])
    trainer = Trainer(cfg, run_dir=work)
    collect, split = trainer.rollout.collect, {}
    with counted_velocities() as counts:
        def counted_collect(iteration):
            experience = collect(iteration)
            split["sampling"] = counts["rows"]
            return experience

        trainer.rollout.collect = counted_collect
        trainer.train_iteration()
    trainer.rollout.close()
    trainer.reward_runner.close()
    sampling = split["sampling"]
    return {"nfe_per_iteration": counts["rows"], "nfe_sampling": sampling, "nfe_training": counts["rows"] - sampling}


# ---- evaluation ----------------------------------------------------------------------------------
def first_of_each_type(edits: str, n: int) -> list:
    """The first `n` edits of each edit type in the edit set `edits` (data.edits' forms), in the set's order."""
    from flowrl.train.edit_data import read_edits
    from rewards.shapes_edit import edit_type_of

    taken: dict[str, int] = {}
    out = []
    for edit in read_edits(edits, field="the held-out edits"):
        kind = edit_type_of(edit)
        if taken.get(kind, 0) < n:
            taken[kind] = taken.get(kind, 0) + 1
            out.append(edit)
    return out


class Judge:
    """Held-out strict accuracy on the eval sets, with the default preset's eval settings for
    every cell; the base model's scores cached in RUNS/base_eval.json."""

    def __init__(self, runs: Path, per_category: int, smoke: bool, overrides=(), load_overrides=(), edits: str | None = None,
                 config: str | None = None):
        from flowrl.config import load_config
        from flowrl.train.prompts import builtin_prompts
        from rewards import MultiReward

        # `overrides`: more of the default preset's, or of `config`'s (a smoke run's tiny model); `load_overrides`: of a
        # run's config when its checkpoint is loaded (model.compile=none: no compile warm-up for one evaluation)
        self.cfg = load_config(config, ["run.progress=false", *(SMOKE_EVAL if smoke else []), *overrides])
        self.load_overrides = list(load_overrides)
        if edits is None:
            self.prompts = builtin_prompts("builtin:shapes-heldout", "--per-category", per_category=per_category)
        else:  # the editing world: the first `per_category` held-out edits of each edit type
            self.prompts = first_of_each_type(edits, per_category)
        self.reward = MultiReward.from_config(self.cfg.reward)
        self.per_category = per_category
        self.cache_file = runs / "base_eval.json"
        self.key = f"{config_hash(self.cfg)}|{per_category}" + (f"|{edits}" if edits else "")
        self.set_name = edits or "builtin:shapes-heldout"

    def strict(self, policy, seed: int) -> float:
        from flowrl.train.evaluate import evaluate

        return evaluate(self.cfg, policy, self.reward, self.prompts, seed=seed).category_table()["overall"]["strict"]

    def base(self, seeds) -> dict[int, float]:
        from flowrl.models import load_policy

        cache = json.loads(self.cache_file.read_text()) if self.cache_file.is_file() else {}
        missing = [s for s in seeds if f"{self.key}|{s}" not in cache]
        if missing:
            policy = load_policy(self.cfg.model)
            for s in missing:
                cache[f"{self.key}|{s}"] = self.strict(policy, s)
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            self.cache_file.write_text(json.dumps(cache, indent=1) + "\n")
        return {s: cache[f"{self.key}|{s}"] for s in seeds}

    def checkpoint(self, run: Path, iteration: int, seeds) -> dict[int, float]:
        from flowrl.runs import load_run_policy

        # the live weights: what every arena result has scored (until the CPU export fix, a run's `ema_lora` export
        # held them too), so the rows stay comparable
        _, policy, _ = load_run_policy(run, self.load_overrides, iteration=iteration, weights="live")
        return {s: self.strict(policy, s) for s in seeds}


# ---- one (cell, seed) ------------------------------------------------------------------------------
def run_cell(cell: str, seed: int, args, judge: Judge, base: dict, start: float, ident: dict) -> dict | None:
    from flowrl.config import load_config
    from flowrl.runtime.budget import PLAN_FILE, machine_name
    from flowrl.runtime.run_dir import RunDir

    runs, budget = Path(args.runs), args.budget_minutes
    overrides = cell_overrides(cell, seed, budget, args.smoke)
    cfg = load_config(preset(cell), overrides, validate_paths=False)  # the offline store is not built yet
    chash = config_hash(cfg)
    tag = f"{cell}-s{seed}-{chash[:8]}"
    run_dir, store = runs / tag, runs / f"store-{tag}"
    warm = warm_compile_cache(cell, overrides, runs)
    if warm:
        log(start, f"{cell}: its compiled graphs cached in {warm:.1f} min, outside the budget (one iteration)")
    log(start, f"{cell} seed {seed}: start ({budget:g} min budget, run {run_dir})")
    set_aside(run_dir)
    t0 = time.perf_counter()
    build_minutes, train_overrides = 0.0, list(overrides)
    offline = reference_cell(cell) in OFFLINE_CELLS
    if offline:
        set_aside(store)
        train_overrides.append(f"data.offline={store}")
        build_minutes = build_store(cell, train_overrides, store, SMOKE_STORE_PROMPTS if args.smoke else args.store_prompts)
        left = budget - build_minutes
        if left <= 0 and args.smoke:  # a smoke run checks the path, not the budget: it trains for half the budget anyway
            left = budget / 2
        elif left <= 0:
            raise SystemExit(f"arena: {cell}'s store build took {build_minutes:.1f} of the {budget:g}-minute budget; nothing is "
                             "left to train (lower --store-prompts or raise --budget-minutes)")
        train_overrides += budget_overrides(left, budget / 2 - build_minutes)
    t1 = time.perf_counter()
    train([preset(cell), *train_overrides, "--run-dir", str(run_dir)], run_dir)
    train_minutes = (time.perf_counter() - t1) / 60
    wall_minutes = (time.perf_counter() - t0) / 60

    rows = RunDir(run_dir).read_metrics()
    end_iteration = last_checkpoint(run_dir)
    marked = next((r for r in rows if "checkpoint_at_minutes" in r), None)
    seeds = args.eval_seeds
    end = judge.checkpoint(run_dir, end_iteration, seeds)
    if marked is not None:  # the checkpoint of the iteration that first ended past half the budget
        half_iteration, half_minutes = marked["iteration"] + 1, build_minutes + marked["elapsed_minutes"]
        half = dict(end) if half_iteration == end_iteration else judge.checkpoint(run_dir, half_iteration, seeds)
        half_at = "checkpoint"
    elif budget / 2 <= build_minutes:  # the store's build took half the budget: at the half, the base model
        half_iteration, half_minutes, half, half_at = 0, budget / 2, dict(base), "base (the store build passed the half)"
    else:  # the run ended before the half: its final weights are the weights at the half
        half_iteration, half_minutes, half, half_at = end_iteration, wall_minutes, dict(end), "end (the run ended before the half)"

    nfe_file = runs / f"nfe-{cell}-{config_hash(cfg, drop=('trainer.seed',))[:8]}.json"
    if nfe_file.is_file():
        nfe = json.loads(nfe_file.read_text())
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="nfe-", dir=runs) as work:  # a scratch run directory
            nfe = measure_nfe(cell, train_overrides if offline else overrides, Path(work) / "run")
        nfe_file.write_text(json.dumps(nfe) + "\n")
    plan_file = run_dir / PLAN_FILE
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else {}
    mean = statistics.mean
    s1, s2 = seeds[0], seeds[-1]
    record = {
        "task": "image", "cell": cell, "seed": seed, "commit": ident["commit"], "dirty": ident["dirty"], "code": ident["code"],
        "machine": machine_name(),
        "config_hash": chash, "preset": f"configs/arena/{cell}.yaml", "smoke": args.smoke,
        "eval": {"prompts": "builtin:shapes-heldout", "per_category": judge.per_category, "seeds": list(seeds),
                 "eval_num_steps": judge.cfg.sampling.eval_num_steps},
        "budget_minutes": budget, "build_minutes": build_minutes, "train_minutes": train_minutes, "wall_minutes": wall_minutes,
        "iterations": len(rows), "planned": plan.get("planned"), "nominal_iterations": cfg.trainer.iterations,
        "capped": len(rows) >= cfg.trainer.iterations,  # the count, not the budget, ended the run
        **nfe, "nfe_source": "measured: velocity rows (one per sample, a guided pair once) over one extra iteration, one process",
        "compiled": compiled_value(cfg),
        "half_iteration": half_iteration, "half_minutes": half_minutes, "half_at": half_at, "end_iteration": end_iteration,
        "base_eval1": base[s1], "base_eval2": base[s2], "half_eval1": half[s1], "half_eval2": half[s2],
        "end_eval1": end[s1], "end_eval2": end[s2],
        "gain_half": mean([half[s] - base[s] for s in seeds]), "gain_end": mean([end[s] - base[s] for s in seeds]),
        **reward_spread(rows),
        "run_dir": str(run_dir), "date": time.strftime("%Y-%m-%d %H:%M"), "torch": ident["torch"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    capped = " (the iteration count, not the budget, ended it: raise trainer.iterations)" if record["capped"] else ""
    log(start, f"{cell} seed {seed}: done in {wall_minutes:.1f} min ({build_minutes:.1f} build + {train_minutes:.1f} train), "
               f"{len(rows)} iterations{capped}, {nfe['nfe_per_iteration']} NFE per iteration; held-out strict gain "
               f"half {record['gain_half']:+.3f}, end {record['gain_end']:+.3f}")
    return record


def reward_spread(rows: list[dict]) -> dict:
    """The within-group std of the training rewards (what a group objective's preferences are made
    of): over the first 5 iterations (the rollout's own spread on the base model) and the whole run."""
    std = [r["group_reward_std"] for r in rows if "group_reward_std" in r]
    return {"group_reward_std_first": statistics.mean(std[:5]), "group_reward_std": statistics.mean(std)} if std else {}


def recorded(out: Path) -> list[dict]:
    if not out.is_file():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def already_done(lines: list[dict], cell: str, seed: int, chash: str, ident: dict, judge: Judge, seeds) -> bool:
    return any(r.get("cell") == cell and r.get("seed") == seed and r.get("config_hash") == chash and r.get("code") == ident["code"]
               and r.get("eval", {}).get("per_category") == judge.per_category and r.get("eval", {}).get("seeds") == list(seeds)
               for r in lines)


@contextlib.contextmanager
def arena_lock(runs: Path):
    """One arena at a time per --runs directory: two would share the machine and the budgets."""
    import fcntl

    runs.mkdir(parents=True, exist_ok=True)
    with open(runs / "arena.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SystemExit(f"arena: another arena is running on {runs} (arena.lock); cells never run side by side") from None
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def run_arena(args) -> int:
    from flowrl.config import load_config
    from flowrl.runtime.budget import machine_name

    start = time.perf_counter()
    ident = run_identity()
    runs = Path(args.runs)
    with arena_lock(runs):
        judge = Judge(runs, args.per_category, args.smoke)
        lines = recorded(Path(args.out))
        todo = []
        for cell in args.cells:
            for seed in args.seeds:
                cfg = load_config(preset(cell), cell_overrides(cell, seed, args.budget_minutes, args.smoke), validate_paths=False)
                if already_done(lines, cell, seed, config_hash(cfg), ident, judge, args.eval_seeds):
                    log(start, f"{cell} seed {seed}: recorded for this code (flowrl tree {ident['code'][:10]}) and config; skipped")
                else:
                    todo.append((cell, seed))
        log(start, f"{len(todo)} of {len(args.cells) * len(args.seeds)} runs to do, {args.budget_minutes:g} min each, on "
                   f"{machine_name()}, {describe_identity(ident)}")
        if not todo:
            return 0
        base = judge.base(args.eval_seeds)
        log(start, "base held-out strict: " + ", ".join(f"eval seeds {s} {v:.3f}" for s, v in base.items()))
        runs = [(f"{cell} seed {seed}", lambda cell=cell, seed=seed: run_cell(cell, seed, args, judge, base, start, ident))
                for cell, seed in todo]
        return run_each(runs, args.out, start, log)


def run_each(runs: list, out: str, start: float, say) -> int:
    """Run each (name, run) in turn, one at a time; one run's failure does not stop the others (a
    rerun of the same command retries it). 1 when any failed. Both arenas' loop."""
    failed = []
    for i, (name, run) in enumerate(runs):
        say(start, f"run {i + 1} of {len(runs)}")
        try:
            run()
        except (Exception, SystemExit) as exc:
            failed.append(name)
            say(start, f"{name}: FAILED ({type(exc).__name__}: {exc}); going on with the next run")
    if failed:
        say(start, f"done, {len(failed)} run(s) failed ({', '.join(failed)}); run the same command again to retry them")
        return 1
    say(start, f"done; results in {out} (summarise with --report)")
    return 0


# ---- --report ------------------------------------------------------------------------------------------
def mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    m = statistics.mean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan)


def pm(values: list[float], signed: bool = True) -> str:
    m, se = mean_se(values)
    if math.isnan(m):
        return "pending"
    text = f"{m:+.3f}" if signed else f"{m:.3f}"
    return text + (f" ± {se:.3f}" if not math.isnan(se) else " (one seed)")


def summarise(lines: list[dict], budget: float, smoke: bool) -> dict[str, list[dict]]:
    """The latest line of every (cell, seed) at this budget, by cell."""
    latest: dict[tuple[str, int], dict] = {}
    for r in lines:
        if r.get("task") == "image" and r.get("budget_minutes") == budget and bool(r.get("smoke")) == smoke:
            latest[(r["cell"], r["seed"])] = r
    return {cell: [r for (c, _), r in sorted(latest.items()) if c == cell] for cell in CELLS}


def table(by_cell: dict[str, list[dict]], budget: float, image: str | None, presets: Path = PRESETS) -> str:
    rows = [r for rs in by_cell.values() for r in rs]
    out = [f"| cell | seeds done | iterations | NFE per iteration (sampling + training) | gain at half ({budget / 2:g} min) | "
           f"gain at end ({budget:g} min) | minutes (store build) | within-group reward std (first 5 iterations; run) |",
           "|---|---|---|---|---|---|---|---|"]
    for cell, rs in by_cell.items():
        if not rs and cell.endswith(TUNED) and kept_reference(cell, presets):
            same = f"as {reference_cell(cell)}"  # the same config: running it again would repeat the reference's runs
            out.append(f"| {cell} | {same} (its study kept the reference settings) | {same} | {same} | {same} | {same} | {same} | "
                       f"{same} |")
            continue
        if not rs:
            out.append(f"| {cell} | 0 | pending | pending | pending | pending | pending | pending |")
            continue
        spreads = [r for r in rs if "group_reward_std" in r]  # recorded since the pairings (Arena III)
        spread_text = (f"{statistics.mean(r['group_reward_std_first'] for r in spreads):.3f}; "
                       f"{statistics.mean(r['group_reward_std'] for r in spreads):.3f}") if spreads else "not recorded"
        nfe = sorted({(r["nfe_per_iteration"], r["nfe_sampling"], r["nfe_training"]) for r in rs})
        nfe_text = ", ".join(f"{a:,} ({b:,} + {c:,})" for a, b, c in nfe)
        iters = [r["iterations"] for r in rs]
        capped = " (capped)" if any(r.get("capped") for r in rs) else ""
        minutes = statistics.mean(r["wall_minutes"] for r in rs)
        build = statistics.mean(r["build_minutes"] for r in rs)
        spread = f" ({min(iters)}-{max(iters)})" if min(iters) != max(iters) else ""
        out.append(f"| {cell} | {len(rs)} ({', '.join(str(r['seed']) for r in rs)}) | {statistics.mean(iters):.0f}{spread}{capped} | "
                   f"{nfe_text} | {pm([r['gain_half'] for r in rs])} | "
                   f"{pm([r['gain_end'] for r in rs])} | {minutes:.1f}{f' ({build:.1f})' if build else ''} | {spread_text} |")
    text = "\n".join(out) + "\n"
    if rows:
        base1, base2 = rows[-1]["base_eval1"], rows[-1]["base_eval2"]
        commits = sorted({r["commit"][:10] + ("+" if r.get("dirty") else "") for r in rows})
        machines = sorted({r["machine"] for r in rows})
        text += (f"\nGains are held-out strict minus the base model's ({base1:.3f} and {base2:.3f} on the two eval sets), the "
                 f"mean of the two sets, then the mean ± standard error over training seeds. Generated by `scripts/arena.py "
                 f"--report` from {len(rows)} runs; commit(s) {', '.join(commits)} (+: with uncommitted changes); machine(s): "
                 f"{'; '.join(machines)}.\n")
        if image:
            text += f"\n![Held-out strict against wall-clock minutes per cell]({image})\n"
    else:
        text += "\nNo arena run is recorded yet: every cell is pending.\n"
    return text


def plot(by_cell: dict[str, list[dict]], budget: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.2))
    # one colour and marker per algorithm, its tuned cell in the same ones but dashed and hollow: tab20's ten strong
    # colours first, then its ten light ones with another marker, so no two algorithms look alike
    tab20 = plt.get_cmap("tab20").colors
    palette = tab20[0::2] + tab20[1::2]
    algorithms = list(REFERENCE_CELLS) + sorted({reference_cell(c) for c in by_cell} - set(REFERENCE_CELLS))
    for cell, rs in by_cell.items():
        if not rs:
            continue
        strict = lambda r, point: (r[f"{point}_eval1"] + r[f"{point}_eval2"]) / 2  # noqa: E731
        xs = [0.0, statistics.mean(r["half_minutes"] for r in rs), statistics.mean(r["wall_minutes"] for r in rs)]
        stats = [mean_se([strict(r, p) for r in rs]) for p in ("base", "half", "end")]
        tuned, k = cell.endswith(TUNED), algorithms.index(reference_cell(cell)) % len(palette)
        ax.errorbar(xs, [m for m, _ in stats], yerr=[0 if math.isnan(se) else se for _, se in stats], capsize=3,
                    color=palette[k], ls="--" if tuned else "-", marker="o" if k < 10 else "^",
                    mfc="white" if tuned else palette[k], label=f"{cell} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
    ax.axvline(budget, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("wall-clock minutes (store build included; the end point includes the launch)")
    ax.set_ylabel("held-out strict (mean of the two eval sets)")
    ax.set_title(f"The arena: every algorithm for {budget:g} minutes on the shapes task (dashed, hollow: tuned)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(args) -> int:
    by_cell = summarise(recorded(Path(args.out)), args.budget_minutes, args.smoke)
    doc, image = Path(args.doc), Path(args.image)
    have = any(by_cell.values())
    if have:
        plot(by_cell, args.budget_minutes, image)
    link = os.path.relpath(image, doc.parent) if have else None
    block = f"{TABLE_START}\n{table(by_cell, args.budget_minutes, link)}{TABLE_END}"
    if doc.is_file():
        text = doc.read_text()
        if TABLE_START not in text or TABLE_END not in text:
            raise SystemExit(f"arena: {doc} has no {TABLE_START} ... {TABLE_END} block for the table")
        head, _, rest = text.partition(TABLE_START)
        text = head + block + rest.partition(TABLE_END)[2]
    else:
        text = f"# Arena results\n\n{block}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    print(f"wrote {doc}" + (f" and {image}" if have else " (no results yet, no figure)"))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS, help="which cells (default: all, in this order)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    ap.add_argument("--budget-minutes", type=float, default=None,
                    help=f"wall-clock minutes per run, store builds and probes included (default 12; --smoke: {SMOKE_BUDGET})")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "arena"), help="where run directories, stores and caches go")
    ap.add_argument("--out", default=str(OUT), help="the results, one JSON line per (cell, seed)")
    ap.add_argument("--per-category", type=int, default=None, help=f"held-out prompts per category and eval set (default {PER_CATEGORY})")
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=list(EVAL_SEEDS), help="first seed of each eval set")
    ap.add_argument("--store-prompts", type=int, default=STORE_PROMPTS, help="gdro_offline: groups in the store")
    ap.add_argument("--smoke", action="store_true", help="seconds per cell on a CPU: tiny groups, budget and eval (not a result)")
    ap.add_argument("--report", action="store_true", help="write --doc's table and --image from --out, and train nothing")
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--image", default=str(IMAGE))
    args = ap.parse_args(argv)
    if args.budget_minutes is None:
        args.budget_minutes = SMOKE_BUDGET if args.smoke else 12.0
    if args.per_category is None:
        args.per_category = SMOKE_PER_CATEGORY if args.smoke else PER_CATEGORY
    if not (args.budget_minutes > 0 and math.isfinite(args.budget_minutes)):
        ap.error(f"--budget-minutes must be a positive number; got {args.budget_minutes}")
    if len(args.eval_seeds) != 2:
        ap.error("--eval-seeds takes the first seeds of two eval sets (the records name eval1 and eval2)")
    if args.report:
        return write_report(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flowrl.quiet import silence_known_messages

    silence_known_messages()  # third-party messages known to be harmless, as `flowrl` itself drops them
    if not args.smoke:
        return run_arena(args)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a smoke run shares the machine with others (tests), where two threads each spin
    try:
        return run_arena(args)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
