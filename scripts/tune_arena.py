#!/usr/bin/env python3
"""One tuning budget for every arena cell, spent by Optuna: per cell, a study over the 2-3 settings
that matter for it, within the same wall-clock minutes of the box, scored on a tuning set that the
arena's reported eval sets never use (docs/arena.md, "Tuning").

    python scripts/tune_arena.py --cells flow_grpo,nft --budget-minutes 30   # two cells, 30 minutes of the box each
    python scripts/tune_arena.py                                             # every reference cell
    python scripts/tune_arena.py --report                                    # docs/arena.md's tuning table
    python scripts/tune_arena.py --smoke --cells nft --trials 3 --runs /tmp/t --out /tmp/t.jsonl --presets-out /tmp/p   # seconds

Per cell, one Optuna study (TPE, seeded; successive halving as the pruner) over the cell's search
space (SPACES: ranges around the reference preset's values). Its first trial is the cell's
reference settings (enqueued), so the tuned recipe never scores below the reference on the tuning
set, and that trial's run directory serves scripts/run_diagnostics.py. A trial trains the cell's
arena preset (configs/arena/<cell>.yaml) with the trial's settings for --trial-minutes (4) of
`trainer.budget_minutes`, in two halves: `trainer.max_minutes` cuts the run at half its budget,
the half's checkpoint is scored and reported to the pruner, and an unpruned trial resumes
(`flowrl train --resume`, the budget's clock and plan restored) to its end, which is scored too.
The score is held-out strict accuracy (the arena's Judge: the trained weights, the default preset's 20-step
ODE, loaded eager: no compile warm-up per score) on the tuning set: builtin:shapes-heldout, 25
prompts per category, eval seed 50000 (the arena reports eval seeds 10000 and 20000). The editing
world's cell, edit_shapes (`--cells edit_shapes --trial-minutes 8`), trains configs/edit_shapes.yaml
and is scored with that preset's eval settings on the first 25 edits of each edit type of
builtin:shapes-edit-heldout, eval seed 50000 (bench_shapes reports eval seeds 10000 and 20000);
its tuned preset is written as <presets-out>/edit_shapes_tuned.yaml.

The budget (--budget-minutes, 30) counts the box's seconds per cell: every trial's training, model
loads and scoring, and gdro_offline's group store (built once per study, timed). A trial starts
when its first half fits what is left (at the mean cost of the recorded trials' first halves), and
goes on past the half only when its second half fits too (at the reference trial's cost); otherwise
it ends at the half, recorded as pruned by the budget. The base model's score on the tuning set is
taken once and cached (RUNS/base_eval.json), outside every cell's budget.

Every trial appends one JSON line to --out (docs/experiments/arena-tuning.jsonl). A study is named
by its cell, the preset's resolved config, the search space, the trial budget and the tuning set;
a rerun rebuilds it from its lines (optuna's add_trial) and goes on where it stopped: a trial that
did not finish runs again (its directory moved aside) with the same settings, since each trial's
sampler is seeded by its cell and number. A cell whose budget is spent is skipped. At the end of each cell
its best trial is written as configs/arena/<cell>_tuned.yaml (--presets-out): the reference preset
with the tuned values and a comment naming the study; scripts/arena.py runs it as the cell
`<cell>_tuned`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the arena's pieces
import arena  # noqa: E402
from arena import (ALLOCATOR_CELLS, BACKSTOP, DPO_ALLOCATOR_CELLS, EDIT_CELLS, EDIT_HELD_OUT, EVAL_SEEDS, OFFLINE_CELLS, PRESETS, REFERENCE_CELLS, ROOT, SMALL, SMOKE, SMOKE_CELL, SMOKE_STORE_PROMPTS,  # noqa: E402
                   STORE_PROMPTS, TUNED, Judge, arena_lock, config_hash, describe_identity, last_checkpoint, preset, recorded,
                   run_each, run_identity, set_aside)

OUT = ROOT / "docs" / "experiments" / "arena-tuning.jsonl"
RUNS = ROOT / "runs" / "tuning"
DOC = ROOT / "docs" / "arena.md"
TABLE_START, TABLE_END = "<!-- arena:tuning -->", "<!-- /arena:tuning -->"
BUDGET_MINUTES = 30.0  # of the box, per cell: training, scoring, store builds, everything
TRIAL_MINUTES = 4.0  # trainer.budget_minutes of one trial; reported at its half and its end
TUNING_SEED = 50_000  # the tuning set's eval seed: image j is sampled from seed 50000 + j
PER_CATEGORY = 25  # 100 held-out prompts in the tuning set
TRAIN_SEED = 0
SAMPLER_SEED = 0  # trial n of the cell at position i of the arena's cells draws with a TPE sampler seeded SAMPLER_SEED + 1000 i + n:
# a resumed study draws what an unbroken one would, and the cells do not share their random draws
STARTUP_TRIALS = 3  # TPE's random start (the enqueued reference is the first), then TPE proper
HALF, END = 1, 2  # the steps reported to the pruner


class Param(NamedTuple):  # not a dataclass: tests load this file as a module outside sys.modules
    """One tuned setting: a config key, drawn on a log or linear scale between `low` and `high`
    times the reference preset's value (capped at `cap`), or from `choices`. A `named` setting
    draws one of several named groups of values under `key` (a window: its strategy, start and size)."""

    key: str
    scale: str  # log | linear | choice | named
    low: float = 0.0
    high: float = 0.0
    cap: float | None = None
    choices: tuple = ()
    named: tuple = ()  # scale named: (name, {subkey: value, ...}) pairs; the choices are the names

    def bounds(self, reference: float) -> tuple[float, float]:
        high = reference * self.high if self.cap is None else min(reference * self.high, self.cap)
        return reference * self.low, high

    def describe(self, reference) -> str:
        if self.scale == "named":
            return f"{self.key} in " + ", ".join(f"{n} {values}" for n, values in self.named)
        if self.scale == "choice":
            return f"{self.key} in {list(self.choices)}"
        low, high = self.bounds(reference)
        return f"{self.key} {low:.3g}-{high:.3g} ({self.scale})"

    def values(self, value) -> dict:
        """The config keys and values that a drawn value stands for."""
        if self.scale != "named":
            return {self.key: value}
        return {f"{self.key}.{k}": v for k, v in dict(self.named)[value].items()}

    def reference(self, cfg):
        """The preset's value of this setting: for a named one, the name whose values it holds."""
        if self.scale != "named":
            return get(cfg, self.key)
        names = [n for n, values in self.named if all(get(cfg, k) == v for k, v in self.values(n).items())]
        if not names:
            raise SystemExit(f"tune_arena: the preset's {self.key} is none of {[n for n, _ in self.named]}")
        return names[0]


# ---- the search spaces: each cell's 2-3 settings, around its reference preset's values ------------
LR = Param("trainer.lr", "log", 0.1, 10)
CLIP = Param("objective.grpo.clip_range", "log", 0.1, 10)  # the PPO ratio clip
NOISE = Param("sampling.noise_level", "linear", 0.5, 1.5)  # the SDE's noise: how far the group's chains spread
CPS_NOISE = Param("sampling.noise_level", "linear", 0.5, 1.5, cap=1.0)  # CPS: std = sigma' sin(noise x pi/2), so 1 is the most
KL = Param("trainer.kl_beta", "log", 0.1, 10)  # the KL to the base network (only where the preset has one)
# Which of the 10 steps are SDE and trained (the rest ODE): every step (flat Flow-GRPO's reference), or the
# first 3 or 5, where the noise is largest (Flow-GRPO-Fast's and Flow-DPPO's choice; in the learning tests
# flat Flow-GRPO learned on its first half and not on every step: docs/arena.md)
WINDOW = Param("sampling.window", "named", named=(
    ("all", {"strategy": "all"}), ("first_3", {"strategy": "fixed", "start": 0, "size": 3}),
    ("first_5", {"strategy": "fixed", "start": 0, "size": 5})))
SPACES: dict[str, tuple[Param, ...]] = {
    "flow_grpo": (LR, CLIP, WINDOW),  # the window before the noise: the learning tests' lead
    "mixgrpo": (LR, CLIP, NOISE),
    "branchgrpo": (LR, CLIP, NOISE),  # DanceGRPO's SDE between the splits
    "g2rpo": (LR, CLIP, NOISE),
    "flow_grpo_fast": (LR, CLIP, CPS_NOISE),
    "flow_dppo": (LR, Param("objective.grpo.divergence_threshold", "log", 0.1, 10), CPS_NOISE),  # its trust region, no clip
    "sol_rl": (LR, Param("rollout.two_stage.candidates", "choice", choices=(16, 24, 32, 48, 64))),  # >= data.group_size 8
    "nft": (LR, Param("objective.nft.beta", "log", 0.1, 10), KL),  # beta: the implicit policies' step
    "dgpo": (LR, Param("objective.dgpo.beta", "log", 0.1, 10), KL),  # beta: the implicit reward's scale
    "dgpo_reference": (LR, Param("objective.dgpo.beta", "log", 0.1, 10), KL),
    # no KL in the preset. beta reaches 1000x under the paper's 6: on this task the paper's beta on errors summed over
    # 3,072 dimensions swings the implicit rewards by tens to hundreds between iterations (the learning tests' probe,
    # docs/arena.md), so the useful scale may lie far below the 0.1x the other cells' ranges reach
    "gdro_offline": (LR, Param("objective.gdro.beta", "log", 0.001, 1)),
    "dpo": (LR, Param("objective.dpo.beta", "log", 0.1, 10)),  # DPO's beta is its tie to the reference; no KL
    # the policy samples its own pairs: at the reference lr (3e-4) seed 1 collapsed (docs/arena.md), and
    # Flow-Factory ships 1e-5, under the 0.1x the other cells reach, so its lr range starts at 0.03x
    "dpo_online": (Param("trainer.lr", "log", 0.03, 3), Param("objective.dpo.beta", "log", 0.1, 10)),
    "awm": (LR, Param("objective.awm.beta", "log", 0.1, 10)),  # awm's KL to the base network
    # the pairings, around dgpo_tuned's settings: how far a tree's leaves spread (the SDE's noise between the splits and
    # the splits' own), and how many candidates the two stages select their high-contrast groups from
    "tree_dgpo": (LR, NOISE, Param("rollout.tree.split_noise_scale", "log", 0.1, 1)),
    "two_stage_dgpo": (LR, Param("objective.dgpo.beta", "log", 0.1, 10),
                       Param("rollout.two_stage.candidates", "choice", choices=(16, 24, 32, 48, 64))),
    "tree_dpo": (LR, Param("objective.dpo.beta", "log", 0.1, 10), NOISE),
    "two_stage_dpo": (LR, Param("objective.dpo.beta", "log", 0.1, 10),
                      Param("rollout.two_stage.candidates", "choice", choices=(16, 24, 32, 48, 64))),
    # the allocator pairings, around dgpo_tuned's settings (the allocators' own options at their defaults)
    **{cell: (LR, Param("objective.dgpo.beta", "log", 0.1, 10)) for cell in ALLOCATOR_CELLS},
    **{cell: (LR, Param("objective.dpo.beta", "log", 0.1, 10)) for cell in DPO_ALLOCATOR_CELLS},  # around the dpo cell's
    # the editing world (configs/edit_shapes.yaml: the default preset's DGPO settings, tuned on the SD3 shapes model, never
    # on this model or task): the step and beta around them, and where the adapter acts (only at the sigmas DGPO trains,
    # or at every step: whether an edit's late steps, which keep the source's details, want the adapter too)
    "edit_shapes": (Param("trainer.lr", "log", 0.25, 4), Param("objective.dgpo.beta", "log", 0.1, 10),
                    Param("lora.acts_at", "choice", choices=("trained", "all"))),
}
TUNABLE = (*REFERENCE_CELLS, *EDIT_CELLS)  # the arena's cells, then the other worlds' (the order of the report)

# --smoke: every code path in seconds on a CPU, on a tiny random shapes model (scripts/smoke.py): the arena's
# smoke overrides, 2 iterations per trial, the first cut off as the "half". Nothing it records is a result.
SMOKE_TRIAL_MINUTES, SMOKE_CUT_MINUTES, SMOKE_PER_CATEGORY, SMOKE_BUDGET = 1.0, 1e-4, 2, 60.0


def tiny_overrides(model_dir: Path | str) -> list[str]:  # a directory, or a builtin: name
    return [f"model.path={model_dir}", "lora.rank=2", "lora.alpha=2", "trainer.iterations=2"]


def smoke_overrides(cell: str, tiny: Path) -> list[str]:
    """A smoke trial's: the arena's smoke settings on a tiny random model of the cell's world."""
    if cell in EDIT_CELLS:
        return [*SMOKE, *SMALL, *tiny_overrides("builtin:tiny-shapes-edit")]
    return [*SMOKE, *SMOKE_CELL[cell], *tiny_overrides(tiny)]


def log(start: float, text: str) -> None:
    print(f"[tune {(time.perf_counter() - start) / 60:6.1f} min] {text}", flush=True)


def get(cfg, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


def override(key: str, value) -> str:
    return f"{key}={value!r}"


def param_values(space, params: dict) -> dict:
    """A trial's drawn values as the config keys and values they stand for."""
    by_key = {p.key: p for p in space}
    return {k: v for key, value in params.items() for k, v in by_key[key].values(value).items()}


# ---- a cell's study ----------------------------------------------------------------------------------
class Cell:
    """What a cell's study is made of: its space around the reference values, its training
    overrides, its name (a hash of all that defines it) and its recorded trials."""

    def __init__(self, cell: str, args, judge: Judge, tiny: Path | None):
        from flowrl.config import load_config

        self.cell, self.args, self.judge = cell, args, judge
        self.space = SPACES[cell]
        self.base = [*(smoke_overrides(cell, tiny) if args.smoke else []), f"trainer.seed={args.seed}",
                     "run.progress=false"]
        cfg = load_config(preset(cell), self.base, validate_paths=False)  # gdro_offline's store is built below
        reference = load_config(preset(cell), validate_paths=False)  # the preset's own values (a smoke run's overrides aside)
        self.reference = {p.key: p.reference(reference) for p in self.space}
        self.minutes = args.trial_minutes
        self.cut = SMOKE_CUT_MINUTES if args.smoke else self.minutes / 2  # where trainer.max_minutes cuts the first half
        self.tuning_set = {"prompts": judge.set_name, "per_category": judge.per_category, "seed": args.tuning_seed,
                           "eval_num_steps": judge.cfg.sampling.eval_num_steps}
        self.config_hash = config_hash(cfg)
        spec = {"config": self.config_hash, "space": [p.describe(self.reference[p.key]) for p in self.space],
                "trial_minutes": self.minutes, "tuning_set": self.tuning_set, "smoke": args.smoke,
                "sampler": f"tpe seed {sampler_seed(cell, 0)} + trial, {STARTUP_TRIALS} startup", "pruner": self.pruner_name()}
        self.name = f"{cell}-{hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]}"
        self.dir = Path(args.runs) / self.name
        self.store = self.dir / "store" if cell in OFFLINE_CELLS else None
        self.lines = sorted((r for r in recorded(Path(args.out)) if r.get("task") == "tuning" and r.get("study") == self.name),
                            key=lambda r: r["trial"])

    @staticmethod
    def pruner_name() -> str:
        return "successive halving (min resource 1 = the half, reduction factor 2)"

    def distributions(self) -> dict:
        from optuna.distributions import CategoricalDistribution, FloatDistribution

        out = {}
        for p in self.space:
            if p.scale in ("choice", "named"):
                out[p.key] = CategoricalDistribution(p.choices or tuple(n for n, _ in p.named))
            else:
                out[p.key] = FloatDistribution(*p.bounds(self.reference[p.key]), log=p.scale == "log")
        return out

    def study(self):
        """The study, rebuilt from its recorded trials (with the pruner's rung values), or new with
        the reference settings enqueued as its first trial."""
        import optuna
        from optuna.trial import TrialState

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(study_name=self.name, direction="maximize", pruner=optuna.pruners.SuccessiveHalvingPruner(
            min_resource=1, reduction_factor=2, min_early_stopping_rate=0))
        dists = self.distributions()
        for r in self.lines:
            states = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "failed": TrialState.FAIL}
            scores = {p["step"]: p["score"] for p in r["intermediate"]}
            study.add_trial(optuna.trial.create_trial(
                state=states[r["state"]], value=r["score"] if r["state"] == "complete" else None, params=r["params"],
                distributions=dists, intermediate_values=scores,
                system_attrs={"completed_rung_0": scores[HALF]} if HALF in scores else {}))
        if not self.lines:
            study.enqueue_trial(self.reference)
        return study

    # ---- the budget -------------------------------------------------------------------------------
    def spent(self) -> float:
        return sum(r["seconds"] + r.get("setup_seconds", 0.0) for r in self.lines)

    def half_cost(self) -> float:
        return statistics.mean(r["half_seconds"] for r in self.lines)

    def second_half_cost(self) -> float:
        """The reference trial's seconds after its half."""
        return self.lines[0]["seconds"] - self.lines[0]["half_seconds"]

    def budget_s(self) -> float:
        return self.args.budget_minutes * 60

    def another_fits(self) -> str | None:
        """None when another trial may start; else why not."""
        n = len(self.lines)
        if self.args.trials and n >= self.args.trials:
            return f"{n} trials, as --trials asks"
        if n and self.spent() + self.half_cost() > self.budget_s():
            return (f"{self.spent() / 60:.1f} of its {self.args.budget_minutes:g} minutes spent; a trial's first half "
                    f"({self.half_cost() / 60:.1f} min) does not fit the rest")
        return None


def sampler_seed(cell: str, trial: int) -> int:
    # an arena cell's position among the arena's cells; another world's cells from position 100, so that a cell the
    # arena gains later does not move their seeds (nor their studies' names)
    position = 100 + list(EDIT_CELLS).index(cell) if cell in EDIT_CELLS else REFERENCE_CELLS.index(cell)
    return SAMPLER_SEED + 1000 * position + trial


def ask(c: Cell, study):
    """The study's next trial, its settings drawn (or the enqueued reference's) by a TPE sampler
    seeded by the cell and the trial's number: the same settings after a resume."""
    import optuna

    n = len(study.trials)
    study.sampler = optuna.samplers.TPESampler(seed=sampler_seed(c.cell, n), n_startup_trials=STARTUP_TRIALS)
    return study.ask(c.distributions())


def checkpoint_minutes(run_dir: Path, iteration: int) -> float:
    """The budget's clock at a checkpoint (from the trainer's start: model load, probe, iterations)."""
    state = json.loads((run_dir / "checkpoints" / f"iter_{iteration:06d}" / "state.json").read_text())
    return state["budget"]["elapsed_s"] / 60


def planned(run_dir: Path) -> int | None:
    from flowrl.runtime.budget import PLAN_FILE

    plan = run_dir / PLAN_FILE
    return json.loads(plan.read_text())["planned"] if plan.is_file() else None


def build_store(c: Cell) -> float:
    """gdro_offline's group store, once per study (built aside, then moved in place: a store that
    exists is whole); the seconds it took, 0 when it was there."""
    if c.store.is_dir():
        return 0.0
    partial = c.store.with_name("store.partial")
    set_aside(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    minutes = arena.build_store(c.cell, c.base, partial, SMOKE_STORE_PROMPTS if c.args.smoke else STORE_PROMPTS)
    partial.rename(c.store)
    return minutes * 60


def train(argv: list[str], run_dir: Path) -> None:
    """`flowrl train ARGV` (arena.train), except that an interrupted run (Ctrl-C, exit 130) stops the
    study instead of failing the trial: the rerun starts that trial again."""
    from flowrl.cli import main as cli_main
    from flowrl.runtime.processes import EXIT_INTERRUPTED

    code = cli_main(["train", *argv])
    if code == EXIT_INTERRUPTED:
        raise KeyboardInterrupt
    if code != 0:
        raise SystemExit(f"tune_arena: training {run_dir} failed")


def score(c: Cell, run_dir: Path, iteration: int) -> float:
    return c.judge.checkpoint(run_dir, iteration, [c.args.tuning_seed])[c.args.tuning_seed]


def run_trial(c: Cell, study, trial, start: float, setup_s: float) -> dict:
    """Train, score and report one trial; its JSON line."""
    from optuna.trial import TrialState

    t0 = time.perf_counter()
    params = dict(trial.params)
    run_dir = c.dir / f"trial-{trial.number:03d}"
    set_aside(run_dir)
    overrides = [*c.base, *(override(k, v) for k, v in param_values(c.space, params).items()), *([f"data.offline={c.store}"] if c.store else [])]
    points, state, pruned_by, error, half_s = [], "complete", None, None, None
    log(start, f"{c.cell} trial {trial.number}{' (the reference settings)' if trial.number == 0 else ''}: "
               + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()))

    def point(step: int) -> float:
        iteration = last_checkpoint(run_dir)
        value = score(c, run_dir, iteration)
        points.append({"step": step, "minutes": checkpoint_minutes(run_dir, iteration), "iteration": iteration, "score": value})
        trial.report(value, step)
        return value

    try:
        train([preset(c.cell), *overrides, f"trainer.budget_minutes={c.minutes!r}", f"trainer.max_minutes={c.cut!r}",
                     "run.checkpoint_at_minutes=[]", "--run-dir", str(run_dir)], run_dir)
        point(HALF)
        half_s = time.perf_counter() - t0
        ended = points[-1]["iteration"] >= (planned(run_dir) or math.inf)  # the plan was done by the half
        if trial.should_prune() and trial.number > 0:  # the reference always runs to its end (and is the first: never pruned)
            state, pruned_by = "pruned", "pruner"
        elif not ended and trial.number > 0 and c.spent() + setup_s + half_s + c.second_half_cost() > c.budget_s():
            state, pruned_by = "pruned", "budget"
        elif not ended:
            left = c.minutes * (1 + BACKSTOP) - points[-1]["minutes"]  # max_minutes counts from the resumed loop's start
            train(["--resume", str(run_dir), f"trainer.max_minutes={max(left, 0.01)!r}"], run_dir)
            point(END)
    except (Exception, SystemExit) as exc:  # a diverged run (non-finite gradients) is a failed trial, not a failed study
        state, error = "failed", f"{type(exc).__name__}: {exc}"
        half_s = time.perf_counter() - t0 if half_s is None else half_s
    if state == "complete":
        study.tell(trial, points[-1]["score"])
    else:
        study.tell(trial, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
    return {"task": "tuning", "study": c.name, "cell": c.cell, "trial": trial.number, "reference": trial.number == 0,
            "params": params, "state": state, "pruned_by": pruned_by, "error": error, "intermediate": points,
            "score": points[-1]["score"] if state == "complete" else None,
            "iterations": points[-1]["iteration"] if points else 0, "seconds": time.perf_counter() - t0,
            "half_seconds": half_s, "setup_seconds": setup_s}


def tune_cell(cell: str, args, judge: Judge, base: float, ident: dict, start: float, tiny: Path | None) -> None:
    from flowrl.runtime.budget import machine_name

    c = Cell(cell, args, judge, tiny)
    study = c.study()
    log(start, f"{cell}: study {c.name}, {len(c.lines)} trial(s) recorded, {c.spent() / 60:.1f} of {args.budget_minutes:g} "
               f"minutes spent; space: " + "; ".join(p.describe(c.reference[p.key]) for p in c.space))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recorded_before = len(c.lines)
    if c.another_fits() is None and (warm := arena.warm_compile_cache(cell, c.base, c.dir)):
        log(start, f"{cell}: its compiled graphs cached in {warm:.1f} min, outside the budget (one iteration)")
    while (why := c.another_fits()) is None:
        trial = ask(c, study)
        setup_s = build_store(c) if c.store is not None else 0.0
        record = run_trial(c, study, trial, start, setup_s)
        if record["state"] == "failed" and trial.number == 0:  # not recorded: a rerun tries the reference again
            raise SystemExit(f"tune_arena: {cell}'s reference trial failed ({record['error']}); the cell cannot be tuned")
        record.update({"budget_minutes": args.budget_minutes, "trial_minutes": c.minutes, "tuning_set": c.tuning_set,
                       "base": base, "config_hash": c.config_hash, "space": [p.describe(c.reference[p.key]) for p in c.space],
                       "sampler": f"TPE, seed {sampler_seed(cell, trial.number)} ({SAMPLER_SEED} + 1000 x the cell's position + the trial), "
                                  f"{STARTUP_TRIALS} startup trials",
                       "pruner": c.pruner_name(), "machine": machine_name(), "commit": ident["commit"], "dirty": ident["dirty"],
                       "code": ident["code"], "smoke": args.smoke, "run_dir": str(c.dir / f"trial-{trial.number:03d}"),
                       "date": time.strftime("%Y-%m-%d %H:%M")})
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        c.lines.append(record)
        scores = ", ".join(f"{p['score']:.3f} at {p['minutes']:.1f} min" for p in record["intermediate"]) or "none"
        state = record["state"] + (f" by the {record['pruned_by']}" if record["pruned_by"] else "")
        state += f" ({record['error']})" if record["error"] else ""
        log(start, f"{cell} trial {trial.number}: {state}; held-out strict {scores}; {record['seconds'] / 60:.1f} min "
                   f"({c.spent() / 60:.1f} of {args.budget_minutes:g} spent)")
        if len(c.lines) >= 3 and all(r["state"] == "failed" for r in c.lines[-3:]):
            raise SystemExit(f"tune_arena: {cell}'s last three trials failed (the last: {record['error']}); stopping the cell")
    log(start, f"{cell}: done ({why})" + ("; nothing left to run: skipped" if len(c.lines) == recorded_before else ""))
    path = write_tuned(c, Path(args.presets_out))
    if path is not None:
        log(start, f"{cell}: wrote {path}")


# ---- the tuned preset --------------------------------------------------------------------------------
def write_tuned(c: Cell, presets: Path) -> Path | None:
    """configs/arena/<cell>_tuned.yaml: the reference preset with the best trial's settings (the
    reference trial's own when it scored best), and a comment naming the study."""
    from omegaconf import OmegaConf

    from flowrl.config import load_config

    done = [r for r in c.lines if r["state"] == "complete"]
    if not done:
        return None
    best = max(done, key=lambda r: (r["score"], -r["trial"]))  # a tie goes to the earlier trial (the reference first)
    ref = next((r for r in c.lines if r["trial"] == 0), None)
    raw = OmegaConf.load(preset(c.cell))
    settings = param_values(c.space, best["params"])
    for key, value in settings.items():
        OmegaConf.update(raw, key, value, merge=True)
    counts = {s: sum(r["state"] == s for r in c.lines) for s in ("complete", "pruned", "failed")}
    ts = c.tuning_set
    lines = [
        f"{c.cell}{TUNED}: {Path(preset(c.cell)).relative_to(ROOT)} with the settings its tuning chose (scripts/tune_arena.py; "
        "docs/arena.md, \"Tuning\"); written by the script, not by hand.",
        f"Study {c.name}: {len(c.lines)} trials ({counts['pruned']} pruned, {counts['failed']} failed) of {c.minutes:g} "
        f"minutes of training each in a {c.args.budget_minutes:g}-minute budget ({c.spent() / 60:.1f} spent); TPE + successive halving;",
        f"on {c.lines[-1]['machine']}, commit {c.lines[-1]['commit'][:10]}{'+' if c.lines[-1]['dirty'] else ''}, "
        f"{c.lines[0]['date']} to {c.lines[-1]['date']}{' (smoke: not a result)' if c.args.smoke else ''}.",
        f"Tuning set: {ts['prompts']}, {ts['per_category']} {'edits per edit type' if c.cell in EDIT_CELLS else 'prompts per category'}, "
        f"eval seed {ts['seed']}, {ts['eval_num_steps']}-step ODE (the reported results use eval seeds 10000 and 20000).",
        f"Best: trial {best['trial']}, held-out strict {best['score']:.3f} on the tuning set"
        + (f" (the reference settings, trial 0: {ref['score']:.3f}; the base model: {best['base']:.3f})." if ref and ref["score"] is not None
           else "."),
        *(f"  {k}: {v!r} (reference {c.reference[k]!r})" for k, v in best["params"].items()),
    ]
    text = "".join(f"# {line}\n" for line in lines) + OmegaConf.to_yaml(raw)
    draft = c.dir / f"{c.cell}{TUNED}.yaml"  # checked before it goes beside the presets
    draft.write_text(text)
    cfg = load_config(draft, validate_paths=False)  # it loads, and holds the tuned values
    assert all(get(cfg, k) == v for k, v in settings.items()), f"{draft} does not hold {settings}"
    presets.mkdir(parents=True, exist_ok=True)
    path = presets / draft.name
    path.write_text(text)
    return path


# ---- the whole run -----------------------------------------------------------------------------------
def run_tuning(args) -> int:
    from flowrl.runtime.budget import machine_name

    start = time.perf_counter()
    ident = run_identity()
    runs = Path(args.runs)
    with arena_lock(runs):
        tiny = None
        if args.smoke:
            from smoke import tiny_shapes_model  # scripts/smoke.py

            tiny = runs / "tiny-shapes"
            if not (tiny / "model_index.json").is_file():
                tiny_shapes_model(tiny)
        log(start, f"{len(args.cells)} cell(s), {args.budget_minutes:g} minutes each, trials of {args.trial_minutes:g} minutes of "
                   f"training, on {machine_name()}, {describe_identity(ident)}")
        judges: dict[str, tuple[Judge, float]] = {}

        def tune(cell: str) -> None:
            world = preset(cell) if cell in EDIT_CELLS else "shapes"  # the arena's cells share the default preset's judge
            if world not in judges:
                judges[world] = judged(cell, args, runs, tiny, start)
            tune_cell(cell, args, *judges[world], ident, start, tiny)

        return run_each([(cell, functools.partial(tune, cell)) for cell in args.cells], args.out, start, log)


def judged(cell: str, args, runs: Path, tiny: Path | None, start: float) -> tuple[Judge, float]:
    """The judge of a cell's world and the base model's score on its tuning set: the arena's cells on held-out shapes
    prompts with the default preset's eval settings, an editing cell on the held-out edits with its own preset's."""
    eager = ["model.compile=none"]  # the same network (BENCHMARKS.md, bench_compile) without a compile warm-up per score
    if cell in EDIT_CELLS:
        model = ["model.path=builtin:tiny-shapes-edit"] if args.smoke else []
        judge = Judge(runs, args.per_category, args.smoke, [*eager, *model], eager, edits=EDIT_HELD_OUT, config=preset(cell))
    else:
        judge = Judge(runs, args.per_category, args.smoke, [*eager, *([f"model.path={tiny}"] if tiny else [])], eager)
    t0 = time.perf_counter()
    base = judge.base([args.tuning_seed])[args.tuning_seed]
    log(start, f"base held-out strict on the tuning set of {cell} ({len(judge.prompts)} of {judge.set_name}, eval seed "
               f"{args.tuning_seed}): {base:.3f} ({time.perf_counter() - t0:.1f} s, or the cache)")
    return judge, base


# ---- --report ----------------------------------------------------------------------------------------
def studies(lines: list[dict], smoke: bool) -> dict[str, list[dict]]:
    """Each cell's latest study (the one with the latest trial), its trials in order."""
    by_study: dict[str, list[dict]] = {}
    for r in lines:
        if r.get("task") == "tuning" and bool(r.get("smoke")) == smoke:
            by_study.setdefault(r["study"], []).append(r)
    latest: dict[str, list[dict]] = {}
    for rs in by_study.values():
        cell = rs[0]["cell"]
        if cell not in latest or rs[-1]["date"] >= latest[cell][-1]["date"]:
            latest[cell] = sorted(rs, key=lambda r: r["trial"])
    return {cell: latest[cell] for cell in TUNABLE if cell in latest}


def table(by_cell: dict[str, list[dict]]) -> str:
    def short(v) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    out = ["| cell | trials (pruned, failed) | minutes | reference trial | best | best - reference | best settings (reference) |",
           "|---|---|---|---|---|---|---|"]
    for cell in TUNABLE:
        rs = by_cell.get(cell)
        if not rs:
            out.append(f"| {cell} | 0 | pending | pending | pending | pending | pending |")
            continue
        done = [r for r in rs if r["state"] == "complete"]
        ref = next((r for r in rs if r["trial"] == 0 and r["state"] == "complete"), None)
        best = max(done, key=lambda r: (r["score"], -r["trial"])) if done else None
        pruned, failed = (sum(r["state"] == s for r in rs) for s in ("pruned", "failed"))
        minutes = sum(r["seconds"] + r.get("setup_seconds", 0.0) for r in rs) / 60
        ref_params = rs[0]["params"] if rs[0]["trial"] == 0 else {}
        settings = "; ".join(f"{k.rsplit('.', 1)[-1]} {short(v)} ({short(ref_params.get(k, '?'))})" for k, v in best["params"].items()) \
            if best else "none finished"
        ref_text = f"{ref['score']:.3f}" if ref else "pending"
        best_text = f"{best['score']:.3f} (trial {best['trial']})" if best else "none"
        gain = f"{best['score'] - ref['score']:+.3f}" if best and ref else "pending"
        out.append(f"| {cell} | {len(rs)} ({pruned}, {failed}) | {minutes:.1f} | {ref_text} | {best_text} | {gain} | {settings} |")
    text = "\n".join(out) + "\n"
    rows = [r for rs in by_cell.values() for r in rs]
    if rows:
        last = {}  # per tuning set, its latest trial: the arena's cells share one, the editing cell has its own
        for x in rows:
            last[x["tuning_set"]["prompts"]] = x
        sets = []
        for r in last.values():
            ts, unit = r["tuning_set"], "edits per edit type" if r["cell"] in EDIT_CELLS else "prompts per category"
            cells = "the editing cell" if r["cell"] in EDIT_CELLS else "the arena's cells"
            sets.append(f"{cells}: {ts['prompts']}, {ts['per_category']} {unit}, eval seed {ts['seed']}, where the base model "
                        f"scores {r['base']:.3f}; trials of {r['trial_minutes']:g} training minutes in a budget of "
                        f"{r['budget_minutes']:g} minutes per cell")
        machines = sorted({x["machine"] for x in rows})
        commits = sorted({x["commit"][:10] + ("+" if x.get("dirty") else "") for x in rows})
        text += (f"\nHeld-out strict on the tuning set at the end of each trial ({'; '.join(sets)}). Generated by "
                 f"`scripts/tune_arena.py --report` from {len(rows)} trials; commit(s) {', '.join(commits)} (+: with uncommitted "
                 f"changes); machine(s): {'; '.join(machines)}.\n")
    else:
        text += "\nNo tuning is recorded yet: every cell is pending.\n"
    return text


def write_report(args) -> int:
    text = table(studies(recorded(Path(args.out)), args.smoke))
    print(text)
    doc = Path(args.doc)
    block = f"{TABLE_START}\n{text}{TABLE_END}"
    if doc.is_file():
        old = doc.read_text()
        if TABLE_START not in old or TABLE_END not in old:
            print(f"tune_arena: {doc} has no {TABLE_START} ... {TABLE_END} block for the table", file=sys.stderr)
            return 2
        head, _, rest = old.partition(TABLE_START)
        new = head + block + rest.partition(TABLE_END)[2]
    else:
        new = f"# Arena tuning\n\n{block}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(new)
    print(f"wrote {doc}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=list(REFERENCE_CELLS),
                    help="which reference cells, by name, with commas or spaces (default: all, in the arena's order)")
    ap.add_argument("--budget-minutes", type=float, default=None,
                    help=f"minutes of the box per cell, everything counted (default {BUDGET_MINUTES:g}; --smoke: {SMOKE_BUDGET:g})")
    ap.add_argument("--trial-minutes", type=float, default=None,
                    help=f"trainer.budget_minutes of one trial, reported at its half and end (default {TRIAL_MINUTES:g})")
    ap.add_argument("--trials", type=int, default=0, help="at most this many trials per cell (default: as many as the budget fits)")
    ap.add_argument("--per-category", type=int, default=None, help=f"tuning-set prompts per category (default {PER_CATEGORY})")
    ap.add_argument("--tuning-seed", type=int, default=TUNING_SEED, help="the tuning set's eval seed")
    ap.add_argument("--seed", type=int, default=TRAIN_SEED, help="every trial's training seed")
    ap.add_argument("--runs", default=str(RUNS), help="where the trials' run directories, stores and caches go")
    ap.add_argument("--out", default=str(OUT), help="the trials, one JSON line each")
    ap.add_argument("--presets-out", default=str(PRESETS), help="where <cell>_tuned.yaml is written")
    ap.add_argument("--smoke", action="store_true", help="seconds per trial on a CPU and a tiny model (not a result)")
    ap.add_argument("--report", action="store_true", help="write --doc's tuning table from --out, and train nothing")
    ap.add_argument("--doc", default=str(DOC))
    args = ap.parse_args(argv)
    cells = [c for text in args.cells for c in text.split(",") if c]
    unknown = [c for c in cells if c not in SPACES]
    if unknown or not cells:
        print(f"tune_arena: --cells takes reference cells of the arena ({', '.join(REFERENCE_CELLS)}) or the editing world's "
              f"({', '.join(EDIT_CELLS)}); "
              f"got {', '.join(repr(c) for c in unknown) or 'none'}", file=sys.stderr)
        return 2
    args.cells = list(dict.fromkeys(cells))
    defaults = {"budget_minutes": (SMOKE_BUDGET, BUDGET_MINUTES), "trial_minutes": (SMOKE_TRIAL_MINUTES, TRIAL_MINUTES),
                "per_category": (SMOKE_PER_CATEGORY, PER_CATEGORY)}
    for name, (smoke, real) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else real)
    for name in ("budget_minutes", "trial_minutes"):
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):
            print(f"tune_arena: --{name.replace('_', '-')} must be a positive number of minutes; got {value}", file=sys.stderr)
            return 2
    reported = [s for s in EVAL_SEEDS if args.tuning_seed < s + 4 * PER_CATEGORY and s < args.tuning_seed + 4 * args.per_category]
    if reported:
        print(f"tune_arena: --tuning-seed {args.tuning_seed} draws seeds the arena's reported eval set {reported[0]} uses "
              f"({reported[0]}-{reported[0] + 4 * PER_CATEGORY - 1}); tune on seeds of their own", file=sys.stderr)
        return 2
    if args.report:
        return write_report(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flowrl.quiet import silence_known_messages

    silence_known_messages()
    if not args.smoke:
        return run_tuning(args)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a smoke run shares the machine with others (tests)
    try:
        return run_tuning(args)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
