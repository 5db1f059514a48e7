"""scripts/gpu_checks.sh --cpu-smoke: every default GPU check's code path on tiny models, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_accelerate():
    """The presets train in bf16 autocast and accelerate keeps one precision per process: the in-process
    benches start from, and leave, a cleared state (as test_training's bf16 run does)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


@pytest.mark.slow
def test_gpu_checks_cpu_smoke_runs_every_default_check_and_records_it(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(["bash", "scripts/gpu_checks.sh", "--cpu-smoke"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # the shell's status line per check, in priority order, each finished (not stopped at its cap)
    assert [(r["check"], r["exit"], r["cpu_smoke"]) for r in rows if "exit" in r] == [
        ("explore", 0, True), ("grpo_compile", 0, True), ("fsdp_memory", 0, True)]
    explore = {r["variant"]: r for r in rows if r["check"] == "explore" and "variant" in r}
    assert list(explore) == ["bf16", "fp8+preview+fbc", "fp8", "fp8+preview"]
    assert explore["fp8"]["label"] == "fp8-emulated-row" and explore["fp8"]["quantized_linears"] > 0
    assert explore["fp8+preview+fbc"]["label"].startswith("fp8-emulated-row+fbc") and "cache_reused" in explore["fp8+preview+fbc"]
    assert all(explore[v]["relative_rms_vs_bf16"] > 0 and explore[v]["vs_bf16"] > 0 for v in ("fp8", "fp8+preview", "fp8+preview+fbc"))
    compiled = [r for r in rows if r["check"] == "compile"]
    assert [r["mode"] for r in compiled] == ["none"] and compiled[0]["config"] == "sd35_medium_pickscore_1gpu"
    fsdp = next(r for r in rows if r["check"] == "fsdp_memory" and "plan_gib" in r)
    assert fsdp["plan_gib"] > 0 and "peak_gib" not in fsdp  # no memory reading on the CPU
    log = (out / "fsdp_memory.log").read_text()
    assert "fsdp2, full fine-tuning" in log and "iteration 0:" in log and "skipped 0" in log
    assert "=== results" in done.stdout


@pytest.mark.slow
def test_bench_presets_trains_every_algorithms_preset_from_a_saved_random_pipeline(tmp_path, capsys, fresh_accelerate):
    # the `presets` GPU check on tiny transformers: each preset's own objective and rollout (GDRO from the
    # store it builds first) trains two iterations from a pipeline directory, and its plan is computed
    from script_loader import load_script

    bench = load_script("bench_presets")
    out = tmp_path / "results.jsonl"
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["algorithm"] for r in rows] == list(bench.PRESETS)
    assert {r["algorithm"]: r["model"] for r in rows} == {"grpo": "sd35", "dgpo": "sd35", "nft": "sd35", "tree": "sd35",
                                                          "g2rpo": "flux1", "gdro": "flux1"}
    assert all(r["plan_gib"] > 0 and r["seconds_per_iteration"] > 0 and "peak_gib" not in r for r in rows)
    printed = capsys.readouterr().out
    assert all(f"{name} iteration 1:" in printed for name in bench.PRESETS)


def test_bench_text_preset_trains_the_qwen_preset_from_a_saved_random_model(tmp_path, fresh_accelerate):
    # the `text_preset` GPU check on a narrow Qwen2 with the real vocabulary: ids the one-character
    # tokenizer lacks decode to nothing, and the preset trains its two iterations
    from script_loader import load_script

    out = tmp_path / "results.jsonl"
    assert load_script("bench_text_preset").main(["--cpu-smoke", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["preset"] == "qwen25_05b_gsm8k_1gpu" and row["completions_per_iteration"] == 4 and row["max_new_tokens"] == 4
    assert row["params"] > 151936 * 32 and row["seconds_per_iteration"] > 0 and "peak_gib" not in row


def test_bench_memory_features_runs_every_configuration_against_its_plan(tmp_path, fresh_accelerate):
    # the `memory_features` GPU check on a tiny SD3: each configuration trains one iteration and is planned; cached
    # prompts change nothing the iteration computes (the same loss), the NF4 base does; the plans rank as they should
    from script_loader import load_script

    bench = load_script("bench_memory_features")
    out = tmp_path / "results.jsonl"
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == list(bench.CONFIGS) and all("peak_gib" not in r and r["cpu_smoke"] for r in rows.values())
    assert rows["cached"]["loss"] == rows["adamw_bf16"]["loss"] and rows["nf4"]["loss"] != rows["adamw_bf16"]["loss"]
    plans = {name: r["plan_gib"] for name, r in rows.items()}
    assert plans["nf4"] < plans["adamw_bf16"] and plans["cached"] < plans["adamw_bf16"]
    assert plans["all"] < min(plans["nf4"], plans["cached"])
