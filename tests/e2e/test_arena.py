"""The arena (scripts/arena.py): every arena preset validates on the default preset's world, the
loop writes a checkpoint when its clock passes a mark of run.checkpoint_at_minutes, and the
script's smoke mode runs one cell end to end and writes one valid JSON line and a report."""

from __future__ import annotations

from dataclasses import replace

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import flowrl.runtime.budget as budget
import flowrl.runtime.run_manager as run_manager
from flowrl.config import ConfigError, load_config
from flowrl.presets import CONFIG_DIR
from flowrl.train.loop import Trainer
from script_loader import load_script

ARENA_DIR = CONFIG_DIR / "arena"
REFERENCE_CELLS = ("flow_grpo", "mixgrpo", "branchgrpo", "g2rpo", "sol_rl", "nft", "dgpo", "gdro_offline", "awm", "dgpo_reference",
                   "flow_grpo_fast", "dpo", "dpo_online", "flow_dppo", "tree_dgpo", "two_stage_dgpo",
                   "tree_dpo", "two_stage_dpo", "vade_dgpo", "dars_budget_dgpo", "prompt_gdro_dgpo", "successive_elimination_dgpo",
                   "vade_dpo")
# the allocator pairings: cell -> (its allocator, the cell it is whole but for the allocator, that cell's objective)
ALLOCATOR_CELLS = {"vade_dgpo": ("vade", "dgpo_tuned", "dgpo"), "dars_budget_dgpo": ("dars_budget", "dgpo_tuned", "dgpo"),
                   "prompt_gdro_dgpo": ("prompt_gdro", "dgpo_tuned", "dgpo"),
                   "successive_elimination_dgpo": ("successive_elimination", "dgpo_tuned", "dgpo"), "vade_dpo": ("vade", "dpo", "dpo")}
# a cell X_tuned once scripts/tune_arena.py has written its preset (tests/e2e/test_tune_arena.py)
TUNED_CELLS = tuple(f"{c}_tuned" for c in REFERENCE_CELLS if (ARENA_DIR / f"{c}_tuned.yaml").is_file())
CELLS = REFERENCE_CELLS + TUNED_CELLS
FAST = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0"]


# ---- the presets ----------------------------------------------------------------------
def test_every_cell_has_a_preset_and_nothing_else_is_there():
    assert sorted(p.stem for p in ARENA_DIR.glob("*.yaml")) == sorted(CELLS)
    arena = load_script("arena")
    assert (tuple(arena.CELLS), arena.REFERENCE_CELLS, arena.tuned_cells()) == (CELLS, REFERENCE_CELLS, TUNED_CELLS)
    assert sorted(arena.SMOKE_CELL) == sorted(REFERENCE_CELLS)  # every cell has its --smoke shape


@pytest.mark.parametrize("cell", CELLS)
def test_arena_preset_validates_on_the_default_world(cell):
    default = load_config(None)
    cfg = load_config(ARENA_DIR / f"{cell}.yaml", validate_paths=False)  # gdro_offline's store is built by the arena
    # the default preset's world: the same model, prompts, rewards and eval sampler in every cell
    # compiled blocks: the same network and numerics, 1.2x the iterations per minute (bench_compile)
    assert cfg.model.compile == "blocks" and replace(cfg.model, compile=default.model.compile) == default.model
    assert cfg.reward == default.reward
    assert (cfg.data.prompt_file, cfg.data.eval_prompts) == (default.data.prompt_file, default.data.eval_prompts)
    assert (cfg.sampling.num_steps, cfg.sampling.eval_num_steps, cfg.sampling.shift) == (10, 20, 1.0)
    # the budget ends the run, with a backstop (gdro_offline's: what a typical store build leaves of 12 minutes);
    # the half-budget checkpoint is the arena's to ask for
    t = cfg.trainer
    assert t.budget_minutes == (10.25 if cell.removesuffix("_tuned") == "gdro_offline" else 12) and t.budget_minutes < t.max_minutes <= t.budget_minutes + 1
    assert t.iterations >= 270
    assert cfg.run.checkpoint_at_minutes == [] and cfg.run.cpu_processes == default.run.cpu_processes
    n = cfg.data.prompts_per_iteration * cfg.data.group_size
    assert n % cfg.sampling.batch_size == 0


@pytest.mark.parametrize("cell", TUNED_CELLS)
def test_a_tuned_cell_is_its_reference_cell_but_for_the_tuned_settings(cell):
    tune = load_script("tune_arena")
    reference = cell.removesuffix("_tuned")
    tuned, cfg = (load_config(ARENA_DIR / f"{c}.yaml", validate_paths=False) for c in (cell, reference))
    for p in tune.SPACES[reference]:
        section, _, name = p.key.rpartition(".")
        setattr(tune.get(tuned, section), name, tune.get(cfg, p.key))
    assert tuned == cfg


def test_a_tuned_cell_whose_study_kept_the_reference_settings_reports_the_reference_row(tmp_path):
    arena = load_script("arena")
    text = (ARENA_DIR / "mixgrpo.yaml").read_text()
    (tmp_path / "mixgrpo.yaml").write_text(text)
    (tmp_path / "mixgrpo_tuned.yaml").write_text("# the study's header\n" + text)
    (tmp_path / "flow_grpo.yaml").write_text((ARENA_DIR / "flow_grpo.yaml").read_text())
    (tmp_path / "flow_grpo_tuned.yaml").write_text((ARENA_DIR / "flow_grpo.yaml").read_text().replace("lr: 3.0e-4", "lr: 1.0e-4"))
    assert arena.kept_reference("mixgrpo_tuned", tmp_path) and not arena.kept_reference("flow_grpo_tuned", tmp_path)
    assert not arena.kept_reference("mixgrpo", tmp_path)
    rows = arena.table({c: [] for c in ("mixgrpo", "mixgrpo_tuned", "flow_grpo_tuned")}, 12, None, tmp_path).splitlines()
    assert rows[3].startswith("| mixgrpo_tuned | as mixgrpo (its study kept the reference settings) |")
    assert rows[4] == "| flow_grpo_tuned | 0 | pending | pending | pending | pending | pending | pending |"


def test_the_cells_are_the_algorithms_they_name():
    cfg = {cell: load_config(ARENA_DIR / f"{cell}.yaml", validate_paths=False) for cell in REFERENCE_CELLS}
    # the default preset is the arena's leader, DGPO, with its tuned cell's settings (README, docs/arena.md)
    default, tuned = load_config(None), load_config(ARENA_DIR / "dgpo_tuned.yaml", validate_paths=False)
    assert tuned.objective == default.objective and tuned.rollout == default.rollout == cfg["dgpo"].rollout
    assert (tuned.trainer.kl_beta, tuned.trainer.lr, tuned.trainer.lr_schedule) == (
        default.trainer.kl_beta, default.trainer.lr, default.trainer.lr_schedule)
    assert cfg["nft"].rollout.kind == "flat"
    # the two DGPO cells differ in their stepping alone: flowrl's (measured first) and the reference's
    assert (cfg["dgpo"].objective.dgpo.stepping, cfg["dgpo_reference"].objective.dgpo.stepping) == ("micro_batch", "iteration")
    cfg["dgpo_reference"].objective.dgpo.stepping = "micro_batch"
    assert cfg["dgpo_reference"] == cfg["dgpo"]
    assert {c: cfg[c].objective.kind for c in REFERENCE_CELLS} == {
        "flow_grpo": "grpo", "mixgrpo": "grpo", "branchgrpo": "grpo", "g2rpo": "grpo", "sol_rl": "nft", "nft": "nft",
        "dgpo": "dgpo", "gdro_offline": "gdro", "awm": "awm", "dgpo_reference": "dgpo", "flow_grpo_fast": "grpo",
        "dpo": "dpo", "dpo_online": "dpo", "flow_dppo": "grpo", "tree_dgpo": "dgpo", "two_stage_dgpo": "dgpo",
        "tree_dpo": "dpo", "two_stage_dpo": "dpo", **{c: objective for c, (_, _, objective) in ALLOCATOR_CELLS.items()}}
    assert {c: cfg[c].rollout.kind for c in REFERENCE_CELLS} == {
        "flow_grpo": "flat", "mixgrpo": "flat", "branchgrpo": "tree", "g2rpo": "granular", "sol_rl": "two_stage", "nft": "flat",
        "dgpo": "flat", "gdro_offline": "offline", "awm": "flat", "dgpo_reference": "flat", "flow_grpo_fast": "flat",
        "dpo": "flat", "dpo_online": "flat", "flow_dppo": "flat", "tree_dgpo": "tree", "two_stage_dgpo": "two_stage",
        "tree_dpo": "tree", "two_stage_dpo": "two_stage", **{c: "flat" for c in ALLOCATOR_CELLS}}
    # the allocator pairings: dgpo_tuned (or dpo) whole, but for the allocator (at its defaults)
    for cell, (kind, source, _) in ALLOCATOR_CELLS.items():
        assert cfg[cell].allocator.kind == kind and cfg[cell].allocator.success_threshold is None
        whole = tuned if source == "dgpo_tuned" else cfg[source]
        assert replace(cfg[cell], allocator=whole.allocator) == whole, cell
    assert {c: cfg[c].allocator.kind for c in REFERENCE_CELLS if c not in ALLOCATOR_CELLS} == {c: "uniform" for c in REFERENCE_CELLS
                                                                                              if c not in ALLOCATOR_CELLS}
    # the pairings: the tuned DGPO or the reference DPO whole (objective and trainer), the rollout and its sampler as the
    # rollout's reference cell
    pairings = {"tree_dgpo": ("branchgrpo", tuned), "two_stage_dgpo": ("sol_rl", tuned), "tree_dpo": ("branchgrpo", cfg["dpo"]),
                "two_stage_dpo": ("sol_rl", cfg["dpo"])}
    for cell, (rollout_cell, objective_cell) in pairings.items():
        assert (cfg[cell].objective, cfg[cell].trainer) == (objective_cell.objective, objective_cell.trainer)
        theirs = cfg[rollout_cell]
        assert (cfg[cell].sampling, cfg[cell].selection) == (theirs.sampling, theirs.selection)
        if rollout_cell == "branchgrpo":  # its depth pruning concerns the edges, which the clean-sample objectives do not train on
            assert cfg[cell].rollout.tree == replace(cfg["branchgrpo"].rollout.tree, prune_depths=[])
        else:
            assert cfg[cell].rollout.two_stage == cfg["sol_rl"].rollout.two_stage
    assert cfg["flow_grpo"].sampling.sampler == "flow_grpo" and cfg["flow_grpo"].sampling.window.strategy == "all"
    assert cfg["mixgrpo"].sampling.window.strategy == "progressive"
    fast = cfg["flow_grpo_fast"].sampling
    assert (fast.sampler, fast.window.strategy, fast.window.size, fast.window.choices) == ("cps", "random", 3, [0, 1, 2])
    assert cfg["branchgrpo"].rollout.tree.prune_depths
    two = cfg["sol_rl"].rollout.two_stage
    assert two.preview_steps > 0 and two.regenerate and two.explore_precision == "nvfp4"
    # the two DPO cells: Flow-GRPO's (the reference weights sample on its SDE) and Flow-Factory's (the policy, ODE)
    assert (cfg["dpo"].objective.dpo.sampler, cfg["dpo"].sampling.sampler) == ("reference", "flow_grpo")
    assert (cfg["dpo_online"].objective.dpo.sampler, cfg["dpo_online"].sampling.sampler) == ("policy", "ode")
    assert cfg["dpo"].trainer.kl_beta == cfg["dpo_online"].trainer.kl_beta == 0.0
    dppo, g = cfg["flow_dppo"].sampling, cfg["flow_dppo"].objective.grpo
    assert (dppo.sampler, dppo.noise_level, dppo.window.strategy, dppo.window.size, dppo.window.choices) == ("cps", 0.7, "scattered", 3,
                                                                                                             list(range(6)))
    assert (g.trust_region, g.divergence_threshold, cfg["flow_dppo"].trainer.kl_beta) == ("divergence_mask", 1e-6, 0.0)


# ---- run.checkpoint_at_minutes ------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_a_checkpoint_is_written_when_the_clock_first_passes_each_mark(tmp_path, tiny_sd3_dir, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(run_manager, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(budget, "time", SimpleNamespace(perf_counter=clock.perf_counter))  # the marks' clock
    cfg = load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=4", "run.checkpoint_every=0",
                                    "run.checkpoint_at_minutes=[0.2,0.1]"])
    trainer = Trainer(cfg, tmp_path / "run")
    collect = trainer.rollout.collect

    def slow(iteration):  # every iteration takes 4 s on the loop's clock
        clock.now += 4.0
        return collect(iteration)

    trainer.rollout.collect = slow
    rows = trainer.train()
    # 6 s is first passed after iteration 2 (8 s), 12 s after iteration 3 (12 s); the end writes iteration 4
    assert sorted(int(p.name[5:]) for p in (tmp_path / "run" / "checkpoints").glob("iter_*")) == [2, 3, 4]
    marked = [(r["iteration"], r["checkpoint_at_minutes"], r["elapsed_minutes"]) for r in rows if "checkpoint_at_minutes" in r]
    assert marked == [(1, 0.1, pytest.approx(8 / 60)), (2, 0.2, pytest.approx(12 / 60))]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("checkpoint_at_minutes") for r in logged] == [None, 0.1, 0.2, None]


def test_checkpoint_marks_must_be_positive(tiny_sd3_dir):
    with pytest.raises(ConfigError, match="run.checkpoint_at_minutes"):
        load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "run.checkpoint_at_minutes=[0]"])


# ---- the script's smoke mode -----------------------------------------------------------------
def test_a_compiled_cell_warms_the_compile_cache_once_outside_its_budget(tmp_path, monkeypatch):
    arena = load_script("arena")
    trained = []

    def train(argv, run_dir):  # what a warm-up trains, without training it
        trained.append(argv)
        run_dir.mkdir(parents=True)

    monkeypatch.setattr(arena, "train", train)
    monkeypatch.setattr(arena, "WARMED", set())
    overrides = arena.cell_overrides("nft", 0, 12, smoke=False)
    assert arena.warm_compile_cache("nft", overrides, tmp_path) >= 0 and len(trained) == 1
    argv = trained[0]
    assert argv[0] == arena.preset("nft") and argv[1:1 + len(overrides)] == overrides
    # one iteration with no budget, no backstop and no marks, after the cell's own overrides (the last of a key wins)
    assert argv[1 + len(overrides):-2] == ["trainer.iterations=1", "trainer.budget_minutes=0", "trainer.max_minutes=0",
                                           "run.checkpoint_every=0", "run.checkpoint_at_minutes=[]"]
    assert not (tmp_path / "compile-warmup" / "nft").exists()  # the warm-up's run is not kept
    assert arena.warm_compile_cache("nft", overrides, tmp_path) == 0.0  # once per cell and process
    assert arena.warm_compile_cache("dgpo", [*overrides, "model.compile=none"], tmp_path) == 0.0  # nothing compiled
    assert arena.warm_compile_cache("gdro_offline", arena.cell_overrides("gdro_offline", 0, 12, smoke=False), tmp_path) == 0.0
    assert len(trained) == 1


@pytest.mark.slow
def test_smoke_run_records_one_line_resumes_and_reports(tmp_path, capsys, monkeypatch):
    arena = load_script("arena")
    out, runs = tmp_path / "arena.jsonl", tmp_path / "runs"
    argv = ["--smoke", "--cells", "nft", "--seeds", "0", "--runs", str(runs), "--out", str(out)]
    assert arena.main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 1
    r = lines[0]
    assert {"task", "cell", "seed", "commit", "machine", "config_hash", "budget_minutes", "iterations", "nfe_per_iteration",
            "compiled", "wall_minutes", "base_eval1", "base_eval2", "half_eval1", "half_eval2", "end_eval1", "end_eval2",
            "gain_half", "gain_end"} <= set(r)
    assert (r["task"], r["cell"], r["seed"], r["smoke"], r["budget_minutes"]) == ("image", "nft", 0, True, 0.1)
    assert r["iterations"] >= 1 and 1 <= r["end_iteration"] == r["iterations"] and r["half_iteration"] <= r["end_iteration"]
    assert r["compiled"] in ("none", "False", "True") and r["wall_minutes"] > 0
    # measured: 2 prompts x 4 samples x 10 ODE steps sampled; each of the 8 samples trained at 3 noise levels
    # with the policy, the old policy and the base network
    assert (r["nfe_sampling"], r["nfe_training"], r["nfe_per_iteration"]) == (80, 72, 152)
    for point in ("base", "half", "end"):
        assert all(0 <= r[f"{point}_eval{k}"] <= 1 for k in (1, 2))
    assert r["gain_end"] == pytest.approx((r["end_eval1"] + r["end_eval2"] - r["base_eval1"] - r["base_eval2"]) / 2)
    assert (runs / "base_eval.json").is_file()
    marked = [row for row in map(json.loads, (Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines())
              if "checkpoint_at_minutes" in row]
    assert r["half_at"] == "checkpoint" and [m["checkpoint_at_minutes"] for m in marked] == [0.05]
    capsys.readouterr()

    assert arena.main(argv) == 0  # resumable: recorded for this code and config, so skipped
    assert "skipped" in capsys.readouterr().out and len(out.read_text().splitlines()) == 1

    doc, image = tmp_path / "docs" / "arena.md", tmp_path / "docs" / "images" / "arena.png"
    doc.parent.mkdir()
    doc.write_text(f"# The arena\n\nprose\n\n{arena.TABLE_START}\nold\n{arena.TABLE_END}\n\nmore prose\n")
    report = ["--report", "--smoke", "--budget-minutes", "0.1", "--out", str(out), "--doc", str(doc), "--image", str(image)]
    assert arena.main(report) == 0
    text = doc.read_text()
    assert text.startswith("# The arena\n\nprose\n") and text.endswith("more prose\n") and "\nold\n" not in text
    assert "| nft | 1 (0) |" in text and "| dgpo | 0 | pending |" in text and "](images/arena.png)" in text
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # arena_curve.py: the end checkpoint scored again as a curve point reproduces the record's end (seeded evaluation)
    arena_curve = load_script("arena_curve")
    monkeypatch.setattr(arena_curve, "curve_points", lambda record, minutes, budget, points: [(budget, record["end_iteration"])])
    curves, curve_image = tmp_path / "curves.jsonl", tmp_path / "curves.png"
    curve = ["--smoke", "--cells", "nft", "--seeds", "0", "--budget-minutes", "0.1", "--runs", str(runs), "--out", str(out),
             "--curve-out", str(curves), "--image", str(curve_image)]
    capsys.readouterr()
    assert arena_curve.main(curve) == 0
    (c,) = [json.loads(line) for line in curves.read_text().splitlines()]
    assert (c["cell"], c["seed"], c["iteration"]) == ("nft", 0, r["end_iteration"]) and c["gain"] == pytest.approx(r["gain_end"])
    assert curve_image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "| nft seed 0 |" in capsys.readouterr().out
    assert arena_curve.main(curve) == 0 and len(curves.read_text().splitlines()) == 1  # resumable: scored points are kept
    with pytest.raises(SystemExit, match="records no run of dgpo"):
        arena_curve.main([*curve[:2], "dgpo", *curve[3:]])


def test_curve_points_pick_the_checkpoint_nearest_each_mark_and_skip_the_recorded_ones(tmp_path):
    arena = load_script("arena_curve")
    run = tmp_path / "run"
    for n in (2, 4, 6):
        (run / "checkpoints" / f"iter_{n:06d}").mkdir(parents=True)
    # iterations of 30 s, then 90 s from iteration 4 on: checkpoints after 1, 2 and 5 minutes of training
    run.joinpath("metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "time_iteration": 30.0 if i < 4 else 90.0}) + "\n"
                                                     for i in range(6)) + json.dumps({"iteration": 5, "eval": 1}) + "\n")
    minutes = arena.checkpoint_minutes(run)
    assert minutes == pytest.approx({2: 1.0, 4: 2.0, 6: 5.0})
    record = {"build_minutes": 0.5, "half_iteration": 4, "end_iteration": 6}
    # marks 1.5, 3, 4.5 minutes; with the 0.5-minute build the checkpoints stand at 1.5, 2.5 and 5.5
    assert arena.curve_points(record, minutes, 6.0, 4) == [(1.5, 2)]  # 2.5 is the half's, 5.5 the end's
    assert arena.curve_points({**record, "half_iteration": 6}, minutes, 6.0, 4) == [(1.5, 2), (3.0, 4)]


# ---- the text arena (scripts/arena_text.py) ---------------------------------------------------
def test_text_arena_smoke_run_records_resumes_and_reports(tmp_path, capsys):
    arena_text = load_script("arena_text")
    out, runs, doc = tmp_path / "arena.jsonl", tmp_path / "runs", tmp_path / "arena.md"
    argv = ["--smoke", "--pools", "wide", "--losses", "dapo", "--allocators", "reinforce_ada", "--seeds", "0",
            "--runs", str(runs), "--out", str(out)]
    assert arena_text.main(argv) == 0
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (r["task"], r["cell"], r["pool"], r["loss"], r["allocator"], r["seed"]) == (
        "text", "wide/dapo/reinforce_ada", "wide", "dapo", "reinforce_ada", 0)
    assert r["iterations"] >= 1 and r["samples"] >= r["samples_trained"] == 16 * r["iterations"]  # 4 prompts x 4 kept
    assert r["gain_end"] == pytest.approx(r["end"]["all"] - r["base"]["all"])
    assert set(r["gain_by_bucket"]) <= {str(b) for b in range(1, 8)} and (runs / "text_base_eval.json").is_file()
    capsys.readouterr()
    assert arena_text.main(argv) == 0  # recorded for this code and config: skipped
    assert "skipped" in capsys.readouterr().out and len(out.read_text().splitlines()) == 1
    doc.write_text("# The arena\n\nprose\n")
    assert arena_text.main(["--report", "--smoke", "--out", str(out), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# The arena\n\nprose\n") and "| wide/dapo/reinforce_ada | 1 (0) |" in text
    assert arena_text.main(["--report", "--smoke", "--out", str(out), "--doc", str(doc)]) == 0  # the block is replaced
    assert doc.read_text() == text
