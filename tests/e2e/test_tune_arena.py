"""The arena's tuning (scripts/tune_arena.py): every cell's search space sits around its reference
preset and validates at both ends; a smoke study on a tiny model records one JSON line per trial,
the reference settings first, prunes at the half, resumes without running a recorded trial again,
writes the tuned preset that the arena trains as a cell, and reports; a bad cell is refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from flowrl.config import load_config
from script_loader import load_script

REFERENCE = {"trainer.lr": 3e-4, "objective.nft.beta": 1.0, "trainer.kl_beta": 0.1}  # configs/arena/nft.yaml's


@pytest.fixture(autouse=True)
def _one_thread(restore_threads):
    import torch
    from accelerate.state import AcceleratorState

    torch.set_num_threads(1)
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def read(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_cell_has_a_space_around_its_reference_that_validates_at_both_ends():
    tune = load_script("tune_arena")
    assert sorted(tune.SPACES) == sorted(tune.TUNABLE)
    for cell, space in tune.SPACES.items():
        assert 2 <= len(space) <= 3 and space[0].key == "trainer.lr"
        cfg = load_config(tune.preset(cell), validate_paths=False)
        lows, highs = [], []
        for p in (p for p in space if p.scale == "named"):  # every named group of values loads, and holds its values
            assert p.reference(cfg) in dict(p.named), (cell, p.key)
            for name, _ in p.named:
                values = p.values(name)
                named = load_config(tune.preset(cell), [tune.override(k, v) for k, v in values.items()], validate_paths=False)
                assert {k: tune.get(named, k) for k in values} == values and p.reference(named) == name
        for p in (p for p in space if p.scale != "named"):
            ref = tune.get(cfg, p.key)
            if p.scale == "choice":
                low, high = min(p.choices), max(p.choices)
                assert ref in p.choices, (cell, p.key)
            else:
                low, high = p.bounds(ref)
                # log scales need a positive reference; a range may end at it (gdro_offline's beta searches below it)
                assert 0 < low <= ref <= high and low < high, (cell, p.key, ref, low, high)
            lows.append(tune.override(p.key, low))
            highs.append(tune.override(p.key, high))
        for ends in (lows, highs):  # the space's corners are settings the cell accepts
            corner = load_config(tune.preset(cell), ends, validate_paths=False)
            assert [tune.override(p.key, tune.get(corner, p.key)) for p in space if p.scale != "named"] == ends


def test_a_named_setting_trains_as_the_config_values_it_stands_for():
    tune = load_script("tune_arena")
    drawn = {"trainer.lr": 1e-4, "objective.grpo.clip_range": 2e-4, "sampling.window": "first_5"}
    assert tune.param_values(tune.SPACES["flow_grpo"], drawn) == {
        "trainer.lr": 1e-4, "objective.grpo.clip_range": 2e-4, "sampling.window.strategy": "fixed",
        "sampling.window.start": 0, "sampling.window.size": 5}


@pytest.mark.slow
def test_smoke_study_prunes_resumes_and_writes_a_tuned_preset_the_arena_trains(tmp_path, monkeypatch, capsys):
    tune = load_script("tune_arena")
    out, runs, presets = tmp_path / "tuning.jsonl", tmp_path / "runs", tmp_path / "presets"
    real, scored = tune.score, []

    def score(c, run_dir, iteration):  # the real score, moved so that trial 1 loses at its half and trial 2 wins
        value = real(c, run_dir, iteration)
        assert 0 <= value <= 1
        scored.append((run_dir.name, iteration))
        return value + {"trial-001": -1.0, "trial-002": 1.0}.get(run_dir.name, 0.0)

    monkeypatch.setattr(tune, "score", score)
    argv = ["--smoke", "--cells", "nft", "--runs", str(runs), "--out", str(out), "--presets-out", str(presets)]
    assert tune.main([*argv, "--trials", "2"]) == 0
    ref, pruned = read(out)
    # the reference settings first, run to its end: the half (iteration 1, cut by trainer.max_minutes) and the end
    assert (ref["cell"], ref["trial"], ref["reference"], ref["state"], ref["params"]) == ("nft", 0, True, "complete", REFERENCE)
    assert [(p["step"], p["iteration"]) for p in ref["intermediate"]] == [(1, 1), (2, 2)] and ref["iterations"] == 2
    assert ref["score"] == ref["intermediate"][-1]["score"] and 0 < ref["intermediate"][0]["minutes"] < ref["intermediate"][1]["minutes"]
    assert ref["tuning_set"] == {"prompts": "builtin:shapes-heldout", "per_category": 2, "seed": 50000, "eval_num_steps": 4}
    assert {"machine", "commit", "date", "seconds", "study", "base", "run_dir"} <= set(ref) and ref["smoke"] is True
    assert ref["seconds"] > ref["half_seconds"] > 0
    # trial 1: TPE's draw within the space, pruned at its half (below the reference there), so never resumed
    assert (pruned["trial"], pruned["state"], pruned["pruned_by"], pruned["score"]) == (1, "pruned", "pruner", None)
    assert [p["step"] for p in pruned["intermediate"]] == [1] and pruned["study"] == ref["study"]
    assert pruned["params"] != REFERENCE and 3e-5 <= pruned["params"]["trainer.lr"] <= 3e-3
    assert not (Path(pruned["run_dir"]) / "checkpoints" / "iter_000002").exists()
    assert scored == [("trial-000", 1), ("trial-000", 2), ("trial-001", 1)]
    assert (presets / "nft_tuned.yaml").is_file()  # the reference's settings, for now

    # resumed: the recorded trials are not run again; the rebuilt study (the pruner's values included) adds trial 2
    assert tune.main([*argv, "--trials", "3"]) == 0
    lines = read(out)
    assert [r["trial"] for r in lines] == [0, 1, 2] and lines[:2] == [ref, pruned]
    best = lines[2]
    assert best["state"] == "complete" and best["score"] > ref["score"] and best["params"] not in (REFERENCE, pruned["params"])
    assert scored[3:] == [("trial-002", 1), ("trial-002", 2)]
    # had the run been killed during trial 2, the study rebuilt from the first two lines would draw trial 2's settings again
    (tmp_path / "killed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    args = SimpleNamespace(smoke=True, seed=0, trial_minutes=1.0, tuning_seed=50000, runs=str(runs), out=str(tmp_path / "killed.jsonl"))
    judge = SimpleNamespace(per_category=2, set_name="builtin:shapes-heldout", cfg=SimpleNamespace(sampling=SimpleNamespace(eval_num_steps=4)))
    cell = tune.Cell("nft", args, judge, runs / "tiny-shapes")
    assert cell.name == ref["study"] and [r["trial"] for r in cell.lines] == [0, 1]
    again = tune.ask(cell, cell.study())
    assert (again.number, again.params) == (2, best["params"])
    capsys.readouterr()
    assert tune.main([*argv, "--trials", "3"]) == 0  # finished: nothing runs
    assert len(read(out)) == 3 and "done (3 trials, as --trials asks); nothing left to run: skipped" in capsys.readouterr().out and len(scored) == 5

    # the tuned preset: the reference preset with trial 2's settings, and where they come from
    path = presets / "nft_tuned.yaml"
    text = path.read_text()
    assert f"Study {ref['study']}: 3 trials (1 pruned, 0 failed)" in text and "eval seed 50000" in text and "Best: trial 2" in text
    tuned, reference = load_config(path), load_config(tune.preset("nft"))
    assert {k: tune.get(tuned, k) for k in REFERENCE} == best["params"]
    assert yaml.safe_load(text)["trainer"] == {**yaml.safe_load(Path(tune.preset("nft")).read_text())["trainer"],
                                              "lr": best["params"]["trainer.lr"], "kl_beta": best["params"]["trainer.kl_beta"]}
    for key, value in REFERENCE.items():  # nothing else differs
        section, _, name = key.rpartition(".")
        setattr(tune.get(tuned, section), name, value)
    assert tuned == reference

    # the arena knows the cell nft_tuned and trains it: one smoke iteration with the arena's overrides
    arena = tune.arena
    assert arena.tuned_cells(presets) == ("nft_tuned",) and arena.reference_cell("nft_tuned") == "nft"
    run = tmp_path / "arena-run"
    overrides = [*arena.cell_overrides("nft_tuned", 0, 0.1, smoke=True), *tune.tiny_overrides(runs / "tiny-shapes"),
                 "trainer.iterations=1"]
    arena.train([arena.preset("nft_tuned", presets), *overrides, "--run-dir", str(run)], run)
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["iteration"] == 0 and load_config(run / "config.yaml").trainer.lr == best["params"]["trainer.lr"]

    # the report: the study's row between the markers, the rest of the page kept
    doc = tmp_path / "arena.md"
    doc.write_text(f"# The arena\n\n## Tuning\n\n{tune.TABLE_START}\nold\n{tune.TABLE_END}\n\nmore prose\n")
    assert tune.main(["--report", "--smoke", "--out", str(out), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# The arena\n\n## Tuning\n") and text.endswith("more prose\n") and "\nold\n" not in text
    gain = best["score"] - ref["score"]
    assert "| nft | 3 (1, 0) |" in text and f"| {ref['score']:.3f} | {best['score']:.3f} (trial 2) | {gain:+.3f} |" in text
    assert "| flow_grpo | 0 | pending |" in text


@pytest.mark.slow
def test_the_editing_cell_trains_its_preset_and_is_scored_on_held_out_edits_of_every_type(tmp_path):
    from collections import Counter

    from rewards.shapes_edit import edit_type_of

    tune = load_script("tune_arena")
    out, presets = tmp_path / "tuning.jsonl", tmp_path / "presets"
    assert tune.main(["--smoke", "--cells", "edit_shapes", "--trials", "1", "--runs", str(tmp_path / "runs"), "--out", str(out),
                      "--presets-out", str(presets)]) == 0
    (ref,) = read(out)
    reference = load_config(tune.preset("edit_shapes"))
    assert (ref["cell"], ref["state"], ref["iterations"]) == ("edit_shapes", "complete", 2)
    assert ref["params"] == {"trainer.lr": reference.trainer.lr, "objective.dgpo.beta": reference.objective.dgpo.beta,
                             "lora.acts_at": "trained"}
    assert ref["tuning_set"] == {"prompts": "builtin:shapes-edit-heldout", "per_category": 2, "seed": 50000, "eval_num_steps": 4}
    trained = load_config(Path(ref["run_dir"]) / "config.yaml")
    assert trained.data.edits == "builtin:shapes-edit-train" and trained.reward.weights == {"shapes_edit": 1.0}
    edits = tune.arena.first_of_each_type("builtin:shapes-edit-heldout", 2)  # what the judge scored
    assert Counter(map(edit_type_of, edits)) == {t: 2 for t in ("recolour", "add", "remove", "move", "count")}
    assert load_config(presets / "edit_shapes_tuned.yaml") == reference  # the reference won: the preset's own settings


def test_a_tuning_set_on_the_arenas_reported_seeds_is_refused(capsys):
    assert load_script("tune_arena").main(["--cells", "nft", "--tuning-seed", "10050"]) == 2
    assert capsys.readouterr().err.startswith("tune_arena: --tuning-seed 10050 draws seeds the arena's reported eval set 10000 uses")


@pytest.mark.parametrize("cells", [["nft,bogus"], ["nft_tuned"], [","]])
def test_a_bad_cell_is_one_sentence_and_exit_2(cells, capsys):
    tune = load_script("tune_arena")
    assert tune.main(["--smoke", "--cells", *cells]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tune_arena: --cells takes reference cells of the arena (flow_grpo, ")
