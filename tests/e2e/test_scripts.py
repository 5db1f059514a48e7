"""Every script in scripts/ runs: each one's smoke mode (--smoke, or the tiny option it already
had) on the tiniest workload, checked by what it prints or writes; and every script is either
smoke-tested here or named below with the test elsewhere that runs it, so that a new script
without one fails the suite.

The smoke runs are in-process (load_script(name).main([...])) except where the script itself
starts fresh interpreters (bench_async's `flowrl train`; check_metrics_unchanged's runs in a
process forked from the test's, script_loader.forked_flowrl). They write only under pytest's tmp_path."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from script_loader import SCRIPTS, forked_flowrl, load_script

TESTS = Path(__file__).resolve().parents[1]

# ---- which test runs each script -----------------------------------------------------------------
# script -> the test in this file that runs its smoke mode
SMOKE_TESTS = {
    "artefact_curve": "test_artefact_curve_scores_the_base_and_every_checkpoint",
    "bench_allocation": "test_bench_allocation_asserts_the_capped_budgets_and_reports_the_uncapped_spending",
    "bench_async": "test_bench_async_trains_a_part_in_a_fresh_process_and_judges_it",
    "bench_granular": "test_bench_granular_trains_both_methods_and_writes_its_results",
    "bench_hacking": "test_bench_hacking_trains_every_arm_under_the_monitor_and_plots_the_curves",
    "bench_offline": "test_bench_offline_trains_dgpo_and_gdro_from_its_store",
    "bench_rollout": "test_bench_rollout_prints_the_overhead_and_runs_the_gpu_iteration_code",
    "bench_search": "test_bench_search_searches_with_every_method_and_writes_its_rows",
    "bench_shapes": "test_screen_shapes_smoke_runs_bench_shapes_smoke_with_the_command_it_builds",
    "bench_text": "test_bench_text_runs_rl_sft_and_the_allocators",
    "bench_tree": "test_bench_tree_times_every_method_trains_them_and_samples_a_tree",
    "bench_two_stage": "test_bench_two_stage_measures_fidelity_trains_both_methods_and_runs_the_gpu_code",
    "check_metrics_unchanged": "test_check_metrics_unchanged_compares_a_fresh_run_with_the_record",
    "pretrain_text": "test_pretrain_text_exports_a_model",
    "probe_relations": "test_probe_relations_prints_both_measures",
    "readme_figures": "test_readme_figures_draws_both_figures_of_a_run",
    "run_diagnostics": "test_run_diagnostics_reads_a_runs_signals_and_its_lora_update",
    "gradient_signal": "test_gradient_signal_measures_each_steps_gradient_and_its_permuted_control",
    "reward_transfer": "test_reward_transfer_scores_base_live_and_ema_under_each_condition",
    "screen_shapes": "test_screen_shapes_smoke_runs_bench_shapes_smoke_with_the_command_it_builds",
    # the shapes scripts' shared --smoke model and overrides (a helper without a main)
    "smoke": "test_screen_shapes_smoke_runs_bench_shapes_smoke_with_the_command_it_builds",
}
# script -> (test file, test) elsewhere whose test runs the script's main path (or, for a helper
# module without a main, the scripts that import it) on a tiny workload
COVERED_ELSEWHERE = {
    # bench_ray --smoke on the Ray test module's cluster (one cluster start for the module)
    "bench_ray": ("train/test_ray_rollouts.py", "test_bench_ray_times_the_local_producer_and_ray_workers_side_by_side"),
    "check_ray_faults": ("train/test_ray_rollouts.py", "test_check_ray_faults_kills_a_worker_and_compares_with_the_undisturbed_run"),
    # the memory features' GPU check (gpu_checks.sh memory_features), its --cpu-smoke in process
    "bench_memory_features": ("e2e/test_gpu_checks.py", "test_bench_memory_features_runs_every_configuration_against_its_plan"),
    # the GPU checks' one command, with --cpu-smoke
    "gpu_checks": ("e2e/test_gpu_checks.py", "test_gpu_checks_runs_the_default_checks_in_order_and_records_each_status"),
    # the arenas' --smoke: one cell end to end, its JSON line, resume and report
    "arena": ("e2e/test_arena.py", "test_smoke_run_records_one_line_resumes_and_reports"),
    "arena_text": ("e2e/test_arena.py", "test_text_arena_smoke_run_records_resumes_and_reports"),
    # more points of a recorded run: the arena smoke run's end scored again
    "arena_curve": ("e2e/test_arena.py", "test_smoke_run_records_one_line_resumes_and_reports"),
    # the arena's tuning: a smoke study on a tiny model, its lines, pruning, resume, tuned preset and report
    "tune_arena": ("e2e/test_tune_arena.py", "test_smoke_study_prunes_resumes_and_writes_a_tuned_preset_the_arena_trains"),
    # gpu_checks.sh --cpu-smoke runs bench_explore --cpu-smoke, bench_compile (eager, 2 iterations on a
    # random_pipeline.py --tiny pipeline) and bench_fsdp_memory --cpu-smoke, each through gpu_bench.py
    "bench_compile": ("e2e/test_gpu_checks.py", "test_the_default_checks_commands_run_their_cpu_smoke_and_record_it"),
    "bench_explore": ("e2e/test_gpu_checks.py", "test_the_default_checks_commands_run_their_cpu_smoke_and_record_it"),
    "bench_fsdp_memory": ("e2e/test_gpu_checks.py", "test_the_default_checks_commands_run_their_cpu_smoke_and_record_it"),
    "random_pipeline": ("e2e/test_gpu_checks.py", "test_the_default_checks_commands_run_their_cpu_smoke_and_record_it"),
    "gpu_bench": ("e2e/test_gpu_checks.py", "test_the_default_checks_commands_run_their_cpu_smoke_and_record_it"),
    "bench_presets": ("e2e/test_gpu_checks.py", "test_bench_presets_trains_every_algorithms_preset_from_a_saved_random_pipeline"),
    "bench_text_preset": ("e2e/test_gpu_checks.py", "test_bench_text_preset_trains_the_qwen_preset_from_a_saved_random_model"),
    "bench_families": ("models/test_models.py", "test_the_families_bench_trains_each_family_through_the_trainer_on_the_cpu"),
    "plan_memory": ("train/test_distributed.py", "test_plan_memory_script_prints_the_table_and_refuses_bad_launches"),
    "pretrain_shapes": ("models/test_shapes_model.py", "test_pretraining_is_deterministic_and_resumes_exactly"),
    "pretrain_shapes_edit": ("models/test_shapes_edit_model.py",
                             "test_pretraining_is_deterministic_resumes_exactly_and_exports_a_pipeline_the_adapter_loads"),
    # the converters' convert() (all their main does besides parsing two paths) on tiny checkpoints the tests save
    "convert_aesthetic_head": ("reward/test_rewards.py", "test_aesthetic_converter_turns_the_original_pth_into_safetensors"),
    "convert_hps_checkpoint": ("reward/test_rewards.py", "test_hps_converter_keeps_the_state_dict"),
    "convert_imagereward_checkpoint": ("reward/test_imagereward.py", "test_converted_vision_tower_matches_blip_vit"),
    # the documentation site's mkdocs hooks, run by a strict build of the site
    "mkdocs_hooks": ("e2e/test_docs_site.py", "test_the_site_builds_strict_with_the_api_parts_and_presets"),
}


def test_every_script_is_smoke_tested_here_or_covered_by_a_named_test():
    scripts = sorted(p.stem for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh"))
    missing = [s for s in scripts if s not in SMOKE_TESTS and s not in COVERED_ELSEWHERE]
    assert not missing, f"scripts without a smoke test in tests/e2e/test_scripts.py (SMOKE_TESTS) or a named test elsewhere: {missing}"
    assert not set(SMOKE_TESTS) & set(COVERED_ELSEWHERE)
    assert sorted(set(SMOKE_TESTS) | set(COVERED_ELSEWHERE)) == scripts, "an entry names a script that is gone"
    here = globals()
    assert all(callable(here.get(test)) for test in SMOKE_TESTS.values())
    for script, (path, test) in COVERED_ELSEWHERE.items():
        text = (TESTS / path).read_text()
        assert f"def {test}(" in text, f"{script}: tests/{path} has no {test}"


@pytest.fixture(autouse=True)
def _fresh_state(restore_threads):
    """One torch thread (the tiny models ran some twenty times slower on two threads of a 2-core machine
    busy with other work), put back afterwards like accelerate's state, which keeps one precision per process."""
    import torch
    from accelerate.state import AcceleratorState

    torch.set_num_threads(1)
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def ratio(text: str, pattern: str) -> float:
    """The number in the printed line `pattern` (a regex with one group) matches."""
    found = re.search(pattern, text, re.MULTILINE)
    assert found, f"no line matches {pattern!r} in:\n{text[-3000:]}"
    return float(found.group(1))


# ---- the smoke runs ----------------------------------------------------------------------------------
def test_artefact_curve_scores_the_base_and_every_checkpoint(tmp_path, capsys):
    curve = load_script("artefact_curve")
    mean, se, n = curve.mean_and_se([1.0, 2.0, 3.0, float("nan")])  # NaN: a measure undefined on that image
    assert (mean, n) == (2.0, 3) and se == pytest.approx((1.0 / 3) ** 0.5)
    out = tmp_path / "points.jsonl"
    assert curve.main(["--smoke", "--out", str(out), "--image", str(tmp_path / "curve.png")]) == 0
    points = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["iteration"] for p in points] == [0, 1, 2] and points[0]["run"].startswith("base:")
    assert all(p[m]["n"] >= 1 for p in points for m in ("strict", "patch energy"))  # 4 images, one per category
    assert 0.0 <= points[2]["strict"]["mean"] <= 1.0 and points[1]["minutes"] > 0
    table = capsys.readouterr().out
    assert "| run base | 0 | 0 |" in table and "background impurity" in table and (tmp_path / "curve.png").stat().st_size > 0
    assert curve.main(["--smoke", "--gaps"]) == 0
    gaps = capsys.readouterr().out
    assert gaps.count("\n| 0.") + gaps.count("\n| 1.") == 3  # one row per step of the tiny run's 3-step grid


def test_bench_allocation_asserts_the_capped_budgets_and_reports_the_uncapped_spending(capsys):
    assert load_script("bench_allocation").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    # every allocator ran; the capped ones spent exactly the budget (asserted inside), the uncapped report theirs
    assert ratio(out, r"^vade degenerate ([\d.]+)x uniform$") > 0
    assert ratio(out, r"^successive_elimination informative ([\d.]+)x uniform$") > 0
    assert ratio(out, r"^dars rollouts ([\d.]+)x uniform \(uncapped\)$") > 1  # DARS tops up its hard prompts
    assert ratio(out, r"^reinforce_ada rollouts ([\d.]+)x uniform \(uncapped\)$") > 1
    assert re.search(r"^dars_budget +degenerate [\d.]+ .* rollouts/iteration 128 ", out, re.MULTILINE)
    assert re.search(r"^goal: .* -> (PASS|FAIL)$", out, re.MULTILINE)


def test_screen_shapes_smoke_runs_bench_shapes_smoke_with_the_command_it_builds(tmp_path, capsys, monkeypatch):
    # the screen end to end with its runs in this process: bench_shapes.main gets the very command line the
    # screen builds (run_all, which starts them as processes, is tested in test_screen_shapes.py)
    screen, bench = load_script("screen_shapes"), load_script("bench_shapes")
    commands = []

    def in_process(jobs, out, parallel, minutes, threads):
        for name, cmd in jobs.items():
            assert cmd[1] == str(screen.BENCH) and cmd[2] == "--smoke"
            commands.append(cmd)
            assert bench.main(cmd[2:]) == 0
        return {name: "done" for name in jobs}

    monkeypatch.setattr(screen, "run_all", in_process)
    recipes = tmp_path / "recipes.txt"
    recipes.write_text("kl: trainer.kl_beta=0.1\n")
    out = tmp_path / "screen"
    assert screen.main([str(recipes), "--seeds", "3", "--eval-seeds", "10000", "--smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (cmd,) = commands
    assert cmd[-2:] == ["trainer.kl_beta=0.1", "trainer.seed=3"]
    summary = json.loads((out / "kl_s3" / "bench_shapes.json").read_text())
    assert summary["iterations"] == 1 and summary["rollouts"] == 4
    assert summary["trained"]["overall"]["n"] == 4  # one held-out prompt per category
    assert summary["gain"] == pytest.approx(summary["trained"]["overall"]["strict"] - summary["base"]["overall"]["strict"])
    assert f"held-out strict gain {summary['gain']:+.3f}" in printed
    row = next(line for line in printed.splitlines() if line.startswith("kl "))
    assert row.split()[1:] == [f"{summary['gain']:+.3f}", f"{summary['gain']:+.3f}", "1/1"]


def test_bench_granular_trains_both_methods_and_writes_its_results(tmp_path, capsys):
    assert load_script("bench_granular").main(["--smoke", "--out", str(tmp_path)]) == 0
    assert "goal at most 2T + 2 = 34: met" in capsys.readouterr().out
    results = json.loads((tmp_path / "granular.json").read_text())
    runs = {r["method"]: r for r in results["runs"]}
    assert list(runs) == ["flat", "granular"] and all(r["iterations"] == 1 and 0 <= r["strict"] <= 1 for r in runs.values())
    # flat: 4 chains x 3 steps; G2RPO's two branch steps add branches and tails to each prompt's anchor
    assert runs["flat"]["nfe_per_iteration"] == 12 and runs["granular"]["nfe_per_iteration"] > 12
    assert (tmp_path / "granular.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_offline_trains_dgpo_and_gdro_from_its_store(tmp_path, capsys):
    out = tmp_path / "offline.json"
    assert load_script("bench_offline").main(["--smoke", "--out", str(out)]) == 0
    assert "store-s0: 2 groups of 2" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert list(results["base"]) == ["10000"]
    runs = {r["method"]: r for r in results["runs"]}
    assert list(runs) == ["dgpo", "gdro"] and all(r["iterations"] == 1 for r in runs.values())
    assert runs["gdro"]["build_minutes"] > 0 == runs["dgpo"]["build_minutes"]
    assert runs["gdro"]["gain"] == pytest.approx(runs["gdro"]["trained"]["10000"] - results["base"]["10000"])


def test_bench_search_searches_with_every_method_and_writes_its_rows(tmp_path):
    assert load_script("bench_search").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "search.json").read_text())["rows"]
    # three methods at budgets of 1 and 2 samples of 3 steps, on the 4 prompts
    assert [(r["method"], r["budget_nfe"]) for r in rows] == [(m, b) for m in ("bon", "smc", "dts_star") for b in (3, 6)]
    assert all(r["nfe_per_prompt"] <= r["budget_nfe"] and 0 <= r["strict"] <= 1 for r in rows)
    assert (tmp_path / "search.png").read_bytes()[:4] == b"\x89PNG"


def test_probe_relations_prints_both_measures(capsys):
    assert load_script("probe_relations").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert 0 <= ratio(out, r": 2 position samples, strict ([\d.]+), objects right") <= 1
    assert 0 <= ratio(out, r"mean pixel difference ([\d.]+) of 255$") <= 255


def test_pretrain_text_exports_a_model(tmp_path):
    assert load_script("pretrain_text").main(["--smoke", "--out", str(tmp_path / "model")]) == 0
    info = json.loads((tmp_path / "model" / "pretrain.json").read_text())
    assert info["step"] == 1 and info["parameters"] > 10**6 and 0 <= info["held_out_exact_match"] <= 1
    assert (tmp_path / "model" / "model.safetensors").is_file() and (tmp_path / "model" / "tokenizer.json").is_file()


def test_bench_rollout_prints_the_overhead_and_runs_the_gpu_iteration_code(capsys):
    assert load_script("bench_rollout").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert ratio(out, r"^rollout overhead ([\d.]+)x bare forwards") > 0
    assert ratio(out, r"^sampling [\d.]+ s \+ training [\d.]+ s = ([\d.]+) s per iteration$") > 0
    assert "through flowrl's Trainer" in out and "rollout.flat + objective.grpo" in out  # the library's iteration, not a copy


def test_bench_tree_times_every_method_trains_them_and_samples_a_tree(capsys):
    assert load_script("bench_tree").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for method in ("tree", "tree+depth", "mix"):
        assert ratio(out, rf"^{re.escape(method)} ([\d.]+)x flat$") > 0
    edges = {m: int(ratio(out, rf"^{re.escape(m)} +[\d.]+ +(\d+) ")) for m in ("flat", "tree", "tree+depth", "mix")}
    assert edges["flat"] == 4 * 4 and edges["tree+depth"] < edges["tree"]  # 4 leaves x 4 steps; pruning trains fewer
    assert out.count(": 1 iterations in ") == 4 and ratio(out, r"^untrained: eval reward (-?[\d.]+)$") < 0
    assert ratio(out, r"^tree sampling ([\d.]+)x flat$") > 0


def test_bench_two_stage_measures_fidelity_trains_both_methods_and_runs_the_gpu_code(capsys):
    assert load_script("bench_two_stage").main(["--smoke", "--gpu"]) == 0
    out = capsys.readouterr().out
    assert -1 <= ratio(out, r"^spearman (-?[\d.]+) +\(nvfp4") <= 1
    # one iteration of one prompt x K=2; two-stage explored M=4 candidates for 4 steps in nvfp4
    assert re.search(r"^flat +1 +2 +8 +0 ", out, re.MULTILINE) and re.search(r"^two_stage +1 +2 +8 +16 ", out, re.MULTILINE)
    # --gpu's code on the CPU: the preset's policy (no fp8 / nvfp4 kernels here, so only it is measured)
    assert ratio(out, r"^  float32 \(training precision, the policy and its LoRA\) +([\d.]+) images/s$") > 0


def test_bench_text_runs_rl_sft_and_the_allocators(tmp_path):
    out = tmp_path / "text.json"
    assert load_script("bench_text").main(["--smoke", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["rl"]["0"]["iterations"] == 1 and results["rl"]["0"]["rollouts"] == 4
    assert results["sft"]["0"]["steps"] == 1
    assert list(results["allocators"]) == ["uniform", "vade", "successive_elimination"]
    assert all(0 <= r["held_out"]["all"] <= 1 for part in ("rl", "sft", "allocators") for r in results[part].values())


def test_readme_figures_draws_both_figures_of_a_run(tmp_path, capsys):
    assert load_script("readme_figures").main(["--smoke", "--out", str(tmp_path)]) == 0
    for name in ("default_before_after.png", "default_reward_curve.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert re.search(r"^training reward: iteration 0 -?[\d.]+, iteration 0 -?[\d.]+$", capsys.readouterr().out, re.MULTILINE)


def test_run_diagnostics_reads_a_runs_signals_and_its_lora_update(tmp_path, tiny_sd3_dir, capsys):
    from flowrl.cli import main
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", f"model.path={tiny_sd3_dir}", "run.tracker=none", "run.progress=false", "run.sample_every=0",
                 "sampling.num_steps=2", "data.prompts_per_iteration=2", "data.group_size=2", "sampling.batch_size=4",
                 "lora.rank=2", "lora.alpha=4", "trainer.iterations=2", "run.checkpoint_every=1", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    diagnostics = load_script("run_diagnostics")
    assert diagnostics.main([str(run), "--image", str(tmp_path / "d.png")]) == 0
    out = capsys.readouterr().out
    assert "| run | iterations | reward |" in out and f"| {run.name} | 2 |" in out
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    # the update's norm written out: (alpha / r) B A per adapted layer, from the last checkpoint
    weights = load_file(str(run / "checkpoints" / "iter_000002" / "trainable.safetensors"))
    expected = sum(float((2.0 * weights[k.replace("lora_A", "lora_B")] @ weights[k]).square().sum()) for k in weights if "lora_A" in k)
    row = diagnostics.diagnose(run)
    assert row["LoRA update"][1] == pytest.approx(expected ** 0.5, rel=1e-5) and row["LoRA update"][1] > 0
    assert row["clipped"] is not None and row["tied groups"] is not None
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        diagnostics.main([str(tmp_path)])


def test_gradient_signal_measures_each_steps_gradient_and_its_permuted_control(tmp_path, tiny_sd3_dir, capsys):
    import torch

    signal = load_script("gradient_signal")
    # the statistics: parallel vectors agree fully, orthogonal ones not at all
    e = torch.eye(4)
    same = signal.cosine_stats([e[0], 2 * e[0], 3 * e[0]])
    assert same["cosine"] == pytest.approx(1.0) and same["coherence"] == pytest.approx(1.0)
    apart = signal.cosine_stats([e[0], e[1], e[2], e[3]])
    assert apart["cosine"] == pytest.approx(0.0) and apart["coherence"] == pytest.approx(0.5)  # 1 / sqrt(4)
    # the control shuffles each group's advantages among its own samples only
    adv, groups = torch.tensor([1.0, 2.0, 3.0, -1.0, -2.0, -3.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    shuffled = signal.permuted_within_groups(adv, groups, torch.Generator().manual_seed(0))
    assert sorted(shuffled[:3].tolist()) == [1.0, 2.0, 3.0] and sorted(shuffled[3:].tolist()) == [-3.0, -2.0, -1.0]
    # a tiny run: each step's gradient is that of -sum A log p over the step's transitions (ratio 1 at these weights)
    overrides = [f"model.path={tiny_sd3_dir}", "sampling.num_steps=3", "data.prompts_per_iteration=2", "data.group_size=4",
                 "sampling.batch_size=4", "lora.rank=2", "lora.alpha=4", "run.progress=false", "trainer.kl_beta=0",
                 "objective.grpo.clip_range=0.2"]
    out = tmp_path / "signal.json"
    assert signal.main(["tiny_jpeg", *overrides, "--iterations", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| step 0 |" in printed and "| total |" in printed and "| all but last |" in printed and "split-half" in printed
    result = json.loads(out.read_text())
    assert result["steps"] == [0, 1]  # 3 steps, the last sampled but not trained (trained_fraction 0.99)
    shares = [r["norm_share"] for r in result["rows"] if r["part"].startswith("step ")]
    assert sum(shares) == pytest.approx(1.0)
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer

    trainer = Trainer(load_config("tiny_jpeg", ["run.tracker=none", *overrides]), run_dir=tmp_path / "run")
    experience, _ = trainer.next_experience()
    params = list(trainer.params.values())
    ours = signal.step_gradients(trainer.objective, params, experience.transitions)
    for step in (0, 1):
        batches = [mb for g in experience.transitions for mb in g if mb.step == step]
        halves = []
        for side in (0, 1):  # each group's even and odd samples
            loss = sum(-(mb.advantages * (mb.index % 2 == side) * mb.evaluate().log_prob).sum() for mb in batches)
            halves.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        torch.testing.assert_close(ours[step][0], halves[0], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(ours[step][1], halves[1], rtol=1e-4, atol=1e-7)
    with pytest.raises(SystemExit, match="clean samples"):
        signal.measure("tiny_jpeg", [*overrides, "objective.kind=nft", "sampling.sampler=ode"], 2, 0, str(tmp_path / "nft"), False)


def test_reward_transfer_scores_base_live_and_ema_under_each_condition(tmp_path, capsys, monkeypatch):
    from flowrl.cli import main
    from flowrl.runs import load_run_policy
    from flowrl.train.images import ode_images
    from flowrl.train.prompts import builtin_prompts

    import torch
    from safetensors.torch import load_file, save_file

    smoke = load_script("smoke")
    run = tmp_path / "run"
    assert main(["train", *smoke.shapes_overrides(smoke.tiny_shapes_model(tmp_path / "model")), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    # a random model's rewards tie, so its adapter stays at zero: give the live and EMA adapters weights of their own
    for k, name in enumerate(("trainable", "ema")):
        path = run / "checkpoints" / "iter_000001" / f"{name}.safetensors"
        weights, gen = load_file(str(path)), torch.Generator().manual_seed(k)
        save_file({n: (0.3 * torch.randn(w.shape, generator=gen) if "lora_B" in n else w) for n, w in weights.items()}, str(path))
    transfer = load_script("reward_transfer")
    assert transfer.main([str(run), "--per-category", "1", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "| run | weights | held-out ODE (strict / reward) | held-out rollout (strict / reward) | training ODE" in out
    assert all(f"| run | {m} |" in out for m in ("base", "live", "EMA"))
    # which images each condition scores: the rewards of a random model's images tie, so score their moments instead
    monkeypatch.setattr(transfer, "score", lambda cfg, reward, images, prompts: (float(images.mean()), float(images.square().mean())))
    rows = {r["model"]: r for r in transfer.measure(run, 1, 7)}
    assert list(rows) == ["base", "live", "EMA"]
    # the ODE condition draws `flowrl eval`'s images (flowrl.train.evaluate's ode_images, same prompts and seeds)
    cfg, policy, ckpt = load_run_policy(run, ["model.compile=none"])
    policy.transformer.load_state_dict(load_file(str(ckpt / "ema.safetensors")), strict=False)
    prompts, s = builtin_prompts("builtin:shapes-heldout", "--per-category", per_category=1), cfg.sampling
    images = ode_images(policy, prompts, [7 + j for j in range(len(prompts))], policy.sigmas(s.eval_num_steps, s.schedule, s.shift),
                        s.batch_size)
    assert rows["EMA"]["held-out ODE"] == pytest.approx((float(images.mean()), float(images.square().mean())))
    # the three weights, the two samplers and the two prompt sets are different images
    assert len({r["held-out ODE"] for r in rows.values()}) == 3
    assert rows["live"]["held-out rollout"] != rows["live"]["held-out ODE"] != rows["live"]["training ODE"]


# ---- the scripts that start `flowrl train` as a process of its own ---------------------------------
@pytest.mark.slow  # a training run of one iteration, in a process of its own
def test_check_metrics_unchanged_compares_a_fresh_run_with_the_record(capsys, monkeypatch):
    check = load_script("check_metrics_unchanged")
    monkeypatch.setattr(check, "subprocess", forked_flowrl())  # its `flowrl train`, forked: no interpreter's start-up
    # the comparison names every kind of difference
    assert check.compare("r", [{"a": 1, "b": 2}], [{"a": 1, "c": 3}, {}]) == [
        "r: 1 iterations, recorded 2", "r iteration 0: 'b' is new (2)", "r iteration 0: 'c' missing (recorded 3)"]
    # one iteration through the CLI in a fresh process; bit for bit only on the recording kind of machine
    code = check.main(["--smoke"])
    out = capsys.readouterr().out
    found = re.search(r"^tiny_jpeg: (identical|(\d+) differences) \(1 iterations, against commit \w+\)$", out, re.MULTILINE)
    assert found, out
    assert code == (0 if found.group(1) == "identical" else 1)


@pytest.mark.slow
def test_bench_async_trains_a_part_in_a_fresh_process_and_judges_it(tmp_path, capsys):
    out = tmp_path / "async.jsonl"
    assert load_script("bench_async").main(["--smoke", "--out", str(out), "--runs", str(tmp_path / "runs")]) == 0
    base, row = [json.loads(line) for line in out.read_text().splitlines()]
    assert base["part"] == "base" and 0 <= base["held_out"] <= 1
    # a trainer beside one producer: the batches it trained on were at most one update old
    assert (row["part"], row["iterations"]) == ("async1", 2) and 0 <= row["staleness"] <= 1 and 0 <= row["held_out"] <= 1
    assert re.search(r"^async1 +1 +[+-][\d.]+ +\d+ +2 ", capsys.readouterr().out, re.MULTILINE)


@pytest.mark.slow
def test_bench_hacking_trains_every_arm_under_the_monitor_and_plots_the_curves(tmp_path, capsys):
    out = tmp_path / "out"
    assert load_script("bench_hacking").main(["--smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "hacking.json").read_text())
    assert set(results["arms"]) == {"unguarded", "guarded", "gardo"} and results["reward"] == "brightness"
    for arm, r in results["arms"].items():
        assert r["iterations"] == 2 and len(r["curves"]["heldout/shapes/strict"]) == 2  # evaluated after each iteration
        assert len(r["curves"]["monitor/colour_entropy"]) == 2 and r["base"]["stats"]["brightness"] >= 0
        assert re.search(rf"^{arm} +2 iterations; gold \(held-out strict\) at the end [\d.]+, best [\d.]+ at iteration \d", printed,
                         re.MULTILINE)
    assert (out / "hacking.png").stat().st_size > 0
    gardo_rows = [json.loads(line) for line in (out / "gardo" / "metrics.jsonl").read_text().splitlines()]
    assert all("gardo_kappa" in row for row in gardo_rows)  # the GARDO arm trained with the regulariser
    assert load_script("bench_hacking").main(["--summarize", str(out)]) == 0
    table = capsys.readouterr().out
    for arm in ("unguarded", "guarded", "gardo"):
        assert re.search(rf"^\| 0 \| {arm} \| 2 \| ", table, re.MULTILINE)
        assert f"{arm}: gold at the end {results['arms'][arm]['gold_end']:.3f}" in table
    # one arm run again into the same --out replaces its own entry and keeps the others'
    shutil.rmtree(out / "guarded")
    assert load_script("bench_hacking").main(["--smoke", "--out", str(out), "--arms", "guarded"]) == 0
    again = json.loads((out / "hacking.json").read_text())
    assert set(again["arms"]) == {"unguarded", "guarded", "gardo"} and again["arms"]["gardo"] == results["arms"]["gardo"]
