"""scripts/gpu_checks.sh --cpu-smoke: every default GPU check's code path on tiny models, end to end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flowrl.runtime.processes import ForkedProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_accelerate():
    """The presets train in bf16 autocast and accelerate keeps one precision per process: the in-process
    benches start from, and leave, a cleared state (as test_training's bf16 run does)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


# A stand-in for the interpreter: it records each command the script runs (one line, the arguments
# separated by \x1f), answers the version probe, writes a pipeline marker and one JSON row per
# check, and exits $SHIM_FAIL_EXIT for the check script named in $SHIM_FAIL.
SHIM = r"""#!/usr/bin/env bash
(IFS=$'\x1f'; echo "$*") >> "$SHIM_LOG"
case "$1" in
  -c) echo "torch shim diffusers shim" ;;
  scripts/random_pipeline.py) mkdir -p "$2" && touch "$2/model_index.json" ;;
  *) out=""; prev=""; for a in "$@"; do [ "$prev" = --out ] && out="$a"; prev="$a"; done
     echo "{\"check\": \"shim\", \"script\": \"$1\"}" >> "$out"
     [ "$1" = "scripts/$SHIM_FAIL.py" ] && exit "$SHIM_FAIL_EXIT" ;;
esac
exit 0
"""


def shell_smoke(tmp_path, *names: str, fail: str = "none") -> tuple[subprocess.CompletedProcess, list[list[str]], Path]:
    """gpu_checks.sh --cpu-smoke NAMES with the stand-in interpreter: its output, the commands it ran, $OUT."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shim, log, out = tmp_path / "python", tmp_path / "commands.log", tmp_path / "out"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PYTHON": str(shim), "SHIM_LOG": str(log), "SHIM_FAIL": fail, "SHIM_FAIL_EXIT": "3"}
    done = subprocess.run(["bash", "scripts/gpu_checks.sh", "--cpu-smoke", *names], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    return done, [line.split("\x1f") for line in log.read_text().splitlines()], out


def test_gpu_checks_runs_the_default_checks_in_order_and_records_each_status(tmp_path):
    done, commands, out = shell_smoke(tmp_path, fail="bench_explore")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the version probe, then each check's script in priority order (the SD3.5-sized pipeline built first for grpo_compile)
    assert [c[0] for c in commands] == ["-c", "scripts/bench_explore.py", "scripts/random_pipeline.py", "scripts/bench_compile.py",
                                        "scripts/bench_fsdp_memory.py"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # the shell's status line after each check's own rows; a failing check (exit 3) leaves the later ones to run
    assert [(r["check"], r.get("exit"), r.get("cpu_smoke")) for r in rows] == [
        ("shim", None, None), ("explore", 3, True), ("shim", None, None), ("grpo_compile", 0, True), ("shim", None, None),
        ("fsdp_memory", 0, True)]
    assert (out / "explore.log").is_file() and "=== results" in done.stdout and "cpu smoke run" in (out / "machine.txt").read_text()
    # named checks run alone, and only the named ones
    _, named, _ = shell_smoke(tmp_path / "named", "fsdp_memory")
    assert [c[0] for c in named] == ["-c", "scripts/bench_fsdp_memory.py"]


def check_commands(tmp_path) -> dict[str, list[str]]:
    """The default checks' commands as the script runs them under --cpu-smoke, by script name."""
    _, commands, _ = shell_smoke(tmp_path)
    return {Path(c[0]).stem: c[1:] for c in commands if c[0].startswith("scripts/")}


def with_out(args: list[str], out: Path) -> list[str]:
    return [str(out) if prev == "--out" else a for prev, a in zip(["", *args], args)]


@pytest.mark.slow
def test_the_default_checks_commands_run_their_cpu_smoke_and_record_it(tmp_path, fresh_accelerate, monkeypatch, capfd):
    # each command exactly as gpu_checks.sh --cpu-smoke gives it (the test above): the explore and compile benches in
    # this process (the compile bench's training run in a process of its own, forked), the FSDP2 one in a process forked
    # from this one (it starts a process group)
    from script_loader import forked_flowrl, load_script

    commands, out = check_commands(tmp_path / "shell"), tmp_path / "results.jsonl"
    pipe = commands["random_pipeline"][0]
    assert load_script("random_pipeline").main(commands["random_pipeline"]) in (0, None)
    assert (Path(pipe) / "model_index.json").is_file() and (Path(pipe) / "transformer").is_dir()
    assert load_script("bench_explore").main(with_out(commands["bench_explore"], out)) == 0
    bench_compile = load_script("bench_compile")
    monkeypatch.setattr(bench_compile, "subprocess", forked_flowrl(bench_compile.TRAIN))
    bench_compile.main(with_out(commands["bench_compile"], out))
    fsdp_memory = load_script("bench_fsdp_memory")
    capfd.readouterr()
    code = ForkedProcess(lambda: fsdp_memory.main(with_out(commands["bench_fsdp_memory"], out)), {}).wait()
    printed = capfd.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    explore = {r["variant"]: r for r in rows if r["check"] == "explore" and "variant" in r}
    assert list(explore) == ["bf16", "fp8+preview+fbc", "fp8", "fp8+preview"]
    assert explore["fp8"]["label"] == "fp8-emulated-row" and explore["fp8"]["quantized_linears"] > 0
    assert explore["fp8+preview+fbc"]["label"].startswith("fp8-emulated-row+fbc") and "cache_reused" in explore["fp8+preview+fbc"]
    assert all(explore[v]["relative_rms_vs_bf16"] > 0 and explore[v]["vs_bf16"] > 0 for v in ("fp8", "fp8+preview", "fp8+preview+fbc"))
    compiled = [r for r in rows if r["check"] == "compile"]
    assert [r["mode"] for r in compiled] == ["none"] and compiled[0]["config"] == "sd35_medium_pickscore_1gpu"
    fsdp = next(r for r in rows if r["check"] == "fsdp_memory" and "plan_gib" in r)
    assert fsdp["plan_gib"] > 0 and "peak_gib" not in fsdp  # no memory reading on the CPU
    assert "fsdp2, full fine-tuning" in printed.out and "iteration 0:" in printed.out and "skipped 0" in printed.out


@pytest.mark.slow
def test_bench_presets_trains_every_algorithms_preset_from_a_saved_random_pipeline(tmp_path, capsys, fresh_accelerate, monkeypatch):
    # the `presets` GPU check on tiny transformers: each preset's own objective and rollout (GDRO from the
    # store it builds first) trains two iterations from a pipeline directory, and its plan is computed
    from script_loader import forked_flowrl, load_script

    bench = load_script("bench_presets")
    monkeypatch.setattr(bench, "subprocess", forked_flowrl())  # GDRO's store: `flowrl offline build`, forked
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


@pytest.mark.slow
def test_bench_memory_features_runs_every_configuration_against_its_plan(tmp_path, fresh_accelerate):
    # the `memory_features` GPU check on a tiny SD3: each configuration trains one iteration and is planned; cached
    # prompts change nothing the iteration computes (the same samples and gradient), the NF4 base does; the plans rank as
    # they should. Not the loss: a first iteration's clipped loss is -mean(advantage) x ratio 1, zero for any base
    from script_loader import load_script

    bench = load_script("bench_memory_features")
    out = tmp_path / "results.jsonl"
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == list(bench.CONFIGS) and all("peak_gib" not in r and r["cpu_smoke"] for r in rows.values())
    fingerprint = {name: (r["reward_mean"], r["grad_norm"]) for name, r in rows.items()}
    assert fingerprint["cached"] == fingerprint["adamw_bf16"] and fingerprint["nf4"][0] != fingerprint["adamw_bf16"][0]
    assert fingerprint["nf4"][1] != fingerprint["adamw_bf16"][1]
    plans = {name: r["plan_gib"] for name, r in rows.items()}
    assert plans["nf4"] < plans["adamw_bf16"] and plans["cached"] < plans["adamw_bf16"]
    assert plans["all"] < min(plans["nf4"], plans["cached"])
