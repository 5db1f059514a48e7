"""scripts/screen_shapes.py: the recipe file, the run pool (with stand-in commands), the summary."""

import json
import sys

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def screen():
    return load_script("screen_shapes")


def test_recipes_file_lines_become_names_and_overrides(screen):
    text = "# screen\npreset:\n\nstrict2: reward.weights.shapes=2.0   # strict weighted twice\nkl: trainer.kl_beta=0.2 trainer.lr=5e-4\n"
    assert screen.parse_recipes(text) == [("preset", []), ("strict2", ["reward.weights.shapes=2.0"]),
                                          ("kl", ["trainer.kl_beta=0.2", "trainer.lr=5e-4"])]


@pytest.mark.parametrize("text, message", [
    ("strict2 reward.weights.shapes=2.0", "line 1: expected 'name: override"),
    ("a b: x=1", "line 1: expected 'name: override"),
    ("preset:\nbad: trainer.lr", "line 2: overrides are key=value; got 'trainer.lr'"),
    ("a: x=1\na: x=2", "line 2: recipe 'a' is named twice"),
    ("# nothing\n\n", "holds no recipes"),
    ("a: trainer.seed=4", "line 1: trainer.seed comes from --seeds"),
])
def test_bad_recipes_file_lines_are_named(screen, text, message):
    with pytest.raises(ValueError, match=message):
        screen.parse_recipes(text, "recipes.txt")


def test_bench_command_runs_bench_shapes_with_the_recipe_after_the_common_overrides(screen, tmp_path):
    cmd = screen.bench_command(tmp_path / "r_s1", 1, ["reward.weights.shapes=2.0"], ["run.cpu_processes=1"], 100, [10000, 20000])
    assert cmd[1].endswith("bench_shapes.py")
    assert cmd[2:] == ["--per-category", "100", "--seed", "10000", "20000", "--run-dir", str(tmp_path / "r_s1"),
                       "run.cpu_processes=1", "reward.weights.shapes=2.0", "trainer.seed=1"]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_pool_reports_done_failed_stopped_and_not_started(screen, tmp_path):
    jobs = {"ok": _py("print('hello')"), "fails": _py("import sys; sys.exit(3)"), "slow": _py("import time; time.sleep(60)")}
    status = screen.run_all(jobs, tmp_path, parallel=3, minutes=2 / 60, threads=1, poll_s=0.1)
    assert status == {"ok": "done", "fails": "failed (exit 3)", "slow": "stopped"}
    assert (tmp_path / "ok.log").read_text().strip() == "hello"
    # one at a time: the slow run holds the only slot until the minutes are up
    status = screen.run_all({"slow": jobs["slow"], "ok": jobs["ok"]}, tmp_path, parallel=1, minutes=1 / 60, threads=1, poll_s=0.1)
    assert status == {"slow": "stopped", "ok": "not started"}


def test_pool_never_runs_more_than_parallel_at_once(screen, tmp_path):
    # each run appends its start and end to one file; at most two may overlap
    trace = tmp_path / "trace"
    code = f"import time, sys; open({str(trace)!r}, 'a').write('+'); time.sleep(0.5); open({str(trace)!r}, 'a').write('-')"
    status = screen.run_all({f"j{i}": _py(code) for i in range(5)}, tmp_path, parallel=2, minutes=1, threads=1, poll_s=0.05)
    assert set(status.values()) == {"done"}
    depth, deepest = 0, 0
    for mark in trace.read_text():
        depth += 1 if mark == "+" else -1
        deepest = max(deepest, depth)
    assert deepest == 2


def test_summary_reads_each_runs_eval_sets_and_averages_a_recipe(screen, tmp_path):
    run = tmp_path / "strict2_s0"
    run.mkdir()
    (run / "bench_shapes.json").write_text(json.dumps({"eval_sets": {"10000": {"gain": 0.095}, "20000": {"gain": 0.067}}}))
    assert screen.gains_of(run) == {"10000": 0.095, "20000": 0.067}
    assert screen.gains_of(tmp_path / "missing") is None
    gains = {("strict2", 0): {"10000": 0.095, "20000": 0.067}, ("strict2", 1): {"10000": 0.1, "20000": 0.107},
             ("preset", 0): {"10000": 0.057, "20000": 0.093}, ("preset", 1): None}
    table = screen.summary_table(["preset", "strict2"], [0, 1], [10000, 20000], gains, {("preset", 1): "stopped"})
    preset, strict2 = table.splitlines()[2:]
    assert preset.split() == ["preset", "+0.057/+0.093", "stopped", "+0.075", "1/2"]
    assert strict2.split() == ["strict2", "+0.095/+0.067", "+0.100/+0.107", "+0.092", "2/2"]
