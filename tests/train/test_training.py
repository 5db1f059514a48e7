"""The GRPO trainer end to end on tiny models: learning, exact resume, several processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.train.loop import Trainer
from flowrl.sampling.schedules import window_steps
from flowrl.train.rollouts.common import training_spec
from run_checks import assert_resume_repeats, run_metrics, trainable

FAST = [
    "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
    "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8",
]


@pytest.mark.parametrize("allocator, options", [
    ("uniform", []),
    ("vade", []),  # the allocator's posteriors travel in the checkpoint too
    # bitsandbytes' 8-bit AdamW, its quantised moments too; full fine-tuning, since only tensors of 4096+ values (10
    # of the tiny transformer's, none of its LoRA's) get 8-bit moments
    ("uniform", ["trainer.optimizer=adamw8bit", "lora.enabled=false"]),
])
def test_resume_repeats_an_uninterrupted_run(tmp_path, tiny_sd3_dir, allocator, options):
    common = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=2", "trainer.kl_beta=0.01",
                     f"allocator.kind={allocator}", *options]
    straight = tmp_path / "straight"
    assert main(["train", "tiny_jpeg", *common, "trainer.iterations=4", "--run-dir", str(straight)]) == 0
    assert_resume_repeats(["tiny_jpeg", *common], straight, tmp_path / "stopped")
    moments = load_file(str(straight / "checkpoints" / "iter_000002" / "optimizer.safetensors"))
    assert any(t.dtype == torch.uint8 for t in moments.values()) == ("trainer.optimizer=adamw8bit" in options)


def test_nft_trains_on_ode_samples_and_resumes_exactly(tmp_path, tiny_sd3_dir):
    # DiffusionNFT needs no log-probs: deterministic ODE rollouts, then flow matching on the clean
    # samples; its forward-process noise and sigmas are keyed like everything else, so resume is exact
    common = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=2", "objective.kind=nft",
                     "trainer.kl_beta=0", "sampling.sampler=ode", "objective.nft.timesteps=2", "lora.sigma_range=[0.5, 1.0]"]
    straight = tmp_path / "straight"
    assert main(["train", "tiny_jpeg", *common, "trainer.iterations=4", "--run-dir", str(straight)]) == 0
    rows = run_metrics(straight)
    assert all(r["trained_steps"] == 0 and r["trained_transitions"] == 2 * 2 for r in rows)  # 2 batches x 2 sigmas
    assert_resume_repeats(["tiny_jpeg", *common], straight, tmp_path / "stopped")
    a = trainable(straight, 4)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)  # the adapter moved off its zero init


def test_nft_old_policy_lags_the_trained_weights_and_resumes_exactly(tmp_path, tiny_sd3_dir):
    # nft_old_policy sampling: the weights that sample (and give v_old) are soft-updated after each
    # iteration, old <- d old + (1 - d) new with d = 0 while the optimizer steps n taken so far are below
    # 2, else min(0.6, 0.15 (n - 2)); two steps an iteration, so n = 2, 4, 6 and d = 0, 0.3, 0.6 after
    # iterations 0, 1, 2: equal to the trained weights after iteration 0, lagging them after; they travel
    # in the checkpoint
    common = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=1", "objective.kind=nft",
                     "trainer.kl_beta=0", "sampling.sampler=ode", "objective.nft.timesteps=1", "objective.nft.old_policy=sampling",
                     "objective.nft.old_decay=0.6", "objective.nft.old_decay_rate=0.15", "objective.nft.old_decay_flat=2",
                     "objective.nft.adaptive_weight=true", "trainer.inner_epochs=2", "trainer.lr=1e-2"]
    straight = tmp_path / "straight"
    assert main(["train", "tiny_jpeg", *common, "trainer.iterations=4", "--run-dir", str(straight)]) == 0
    # the reference's stepping: each pass accumulates its 2 batches x 1 sigma into one step
    assert all(r["optimizer_steps"] == 2 and r["trained_transitions"] == 2 * 2 for r in run_metrics(straight))

    def old(i: int) -> dict[str, torch.Tensor]:
        return load_file(str(straight / "checkpoints" / f"iter_{i:06d}" / "nft_old.safetensors"))

    assert all(torch.equal(old(1)[k], trainable(straight, 1)[k]) for k in old(1))
    for i, d in ((2, 0.3), (3, 0.6)):
        new, prev = trainable(straight, i), old(i - 1)
        assert all(torch.allclose(old(i)[k], d * prev[k] + (1 - d) * new[k], atol=1e-6) for k in new)
    assert any(not torch.allclose(old(3)[k], trainable(straight, 3)[k]) for k in old(3))
    assert_resume_repeats(["tiny_jpeg", *common], straight, tmp_path / "stopped")


def test_nft_steps_once_per_epoch_with_the_references_mean_gradient(tmp_path, tiny_sd3_dir):
    """DiffusionNFT's code divides each (batch, timestep) loss by gradient_accumulation_steps x
    num_train_timesteps and steps once per epoch: the step's gradient is the mean over every pair.
    flowrl's micro_batch stepping steps per batch. At a negligible learning rate both runs see the
    same weights throughout: the same pairs and losses, and the reference's one gradient norm is
    the norm of the mean of the two batches' gradients, below the mean of their norms."""
    common = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "objective.kind=nft",
                     "trainer.kl_beta=0", "sampling.sampler=ode", "objective.nft.timesteps=2", "trainer.iterations=1",
                     "trainer.lr=1e-12", "trainer.max_grad_norm=1e9"]
    runs = {}
    for stepping in ("iteration", "micro_batch"):
        run = tmp_path / stepping
        assert main(["train", "tiny_jpeg", *common, f"objective.nft.stepping={stepping}", "--run-dir", str(run)]) == 0
        runs[stepping] = run_metrics(run)[0]
    assert runs["iteration"]["optimizer_steps"] == 1 and runs["micro_batch"]["optimizer_steps"] == 2
    assert runs["iteration"]["trained_transitions"] == runs["micro_batch"]["trained_transitions"] == 2 * 2
    assert runs["iteration"]["loss"] == pytest.approx(runs["micro_batch"]["loss"], rel=1e-6)  # the same pairs
    # |mean of two gradients| <= the mean of their norms, equal only if they are parallel
    assert runs["iteration"]["grad_norm"] < runs["micro_batch"]["grad_norm"]


def test_nft_positive_half_trains_without_the_old_policy_forward(tmp_path, tiny_sd3_dir):
    # objective.nft.negatives=false at nft_beta 1: the loss is max(2r - 1, 0) ||v - u||^2, in which
    # v_old cancels, so the old policy is never swapped in for a forward; at nft_beta 0.5 it is needed again
    overrides = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "objective.kind=nft",
                        "trainer.kl_beta=0", "sampling.sampler=ode", "objective.nft.timesteps=1", "objective.nft.old_policy=sampling",
                        "objective.nft.negatives=false", "trainer.iterations=2", "trainer.lr=1e-2"]
    swaps = {}
    for beta in (1.0, 0.5):
        trainer = Trainer(load_config("tiny_jpeg", [*overrides, f"objective.nft.beta={beta}"]), run_dir=tmp_path / f"b{beta}")
        calls = []
        swapped_in = trainer.objective.old.swapped_in
        trainer.objective.old.swapped_in = lambda params: calls.append(1) or swapped_in(params)
        rows = trainer.train()
        swaps[beta] = len(calls)
        assert all(math.isfinite(r["loss"]) for r in rows)
        assert any(p.abs().sum() > 0 for n, p in trainer.params.items() if "lora_B" in n)  # it trained
    # sampling swaps the old policy in once per iteration either way; the training forwards only at beta 0.5
    assert swaps[0.5] > swaps[1.0]


def test_nft_guidance_scale_sets_the_trained_velocity_and_leaves_sampling_alone(tmp_path, tiny_sd3_dir):
    # objective.nft.guidance_scale=1: the loss, v_old and the KL reference use the conditional velocity,
    # while rollouts keep model.guidance_scale
    overrides = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "objective.kind=nft",
                        "trainer.kl_beta=0.1", "sampling.sampler=ode", "objective.nft.timesteps=1", "objective.nft.old_policy=sampling",
                        "trainer.iterations=1", "model.guidance_scale=3.0", "objective.nft.guidance_scale=1"]
    trainer = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / "run")
    seen = []
    velocity = trainer.policy._velocity
    trainer.policy._velocity = lambda x, sigma, cond: seen.append((torch.is_grad_enabled(), trainer.policy.guidance_scale)) or velocity(x, sigma, cond)
    trainer.train()
    with_grad = {g for grad, g in seen if grad}
    assert with_grad == {1.0}  # the trained forwards
    assert 3.0 in {g for grad, g in seen if not grad}  # the rollouts
    assert trainer.policy.guidance_scale == 3.0 and trainer.cfg.model.guidance_scale == 3.0  # restored, config untouched


def test_nft_group_max_scaling_reaches_the_update_with_zero_sum_groups(tmp_path, tiny_sd3_dir):
    overrides = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "objective.kind=nft",
                        "trainer.kl_beta=0", "sampling.sampler=ode", "objective.nft.timesteps=1", "trainer.iterations=1",
                        "data.group_size=6", "sampling.batch_size=12"]
    seen = {}
    for scale in ("clip", "group_max"):
        trainer = Trainer(load_config("tiny_jpeg", [*overrides, f"objective.nft.r_scale={scale}"]), run_dir=tmp_path / scale)
        optimality = trainer.objective.optimality
        trainer.objective.optimality = lambda e, scale=scale: seen.setdefault(scale, (e.prompt_ids, optimality(e)))[1]
        trainer.train()
    ids, adv = seen["group_max"]
    _, raw = seen["clip"]  # "clip" clips inside the loss: the update gets the raw advantages
    assert raw.abs().max() > 1.01
    for p in ids.unique():
        group = ids == p
        # zero up to fp32 rounding of the group-normalised advantages (1.9e-5 on an Intel Xeon box)
        assert abs(float(adv[group].sum())) < 1e-4 and float(adv[group].abs().max()) <= 1.0 + 1e-6
    # the same samples and rewards, each group divided by one factor >= 1: same signs, no larger
    assert torch.equal(adv.sign(), raw.sign()) and (adv.abs() <= raw.abs() + 1e-6).all()


def test_nft_under_bf16_autocast_keeps_fp32_weights(tmp_path, tiny_sd3_dir):
    # trainer.mixed_precision=bf16 on CPU: accelerate's autocast runs the transformer's matmuls in
    # bf16 (sampling and training alike) while the adapter, its optimizer and checkpoints stay fp32
    common = FAST + [f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=1", "objective.kind=nft",
                     "trainer.kl_beta=0.1", "sampling.sampler=ode", "objective.nft.timesteps=1",
                     "objective.nft.old_policy=sampling", "trainer.iterations=2", "trainer.lr=1e-2"]
    runs = {mp: tmp_path / mp for mp in ("no", "bf16")}
    assert main(["train", "tiny_jpeg", *common, "--run-dir", str(runs["no"])]) == 0
    # accelerate keeps one precision per process: its state is cleared before the bf16 run and after
    # it, as accelerate's own tests do (cheaper than a fresh interpreter's 20 s start-up)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    try:
        assert main(["train", "tiny_jpeg", *common, "trainer.mixed_precision=bf16", "--run-dir", str(runs["bf16"])]) == 0
    finally:
        AcceleratorState._reset_state()
    fp32, bf16 = run_metrics(runs["no"]), run_metrics(runs["bf16"])
    # the same seeds sample nearly, not exactly, the same images: autocast was on, and nothing broke
    assert fp32[0]["reward_mean"] != bf16[0]["reward_mean"]
    assert bf16[0]["reward_mean"] == pytest.approx(fp32[0]["reward_mean"], rel=0.05)
    assert all(math.isfinite(r["loss"]) and r["kl"] > 0 for r in bf16[1:])
    weights = trainable(runs["bf16"], 2)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert any(weights[k].abs().sum() > 0 for k in weights if "lora_B" in k)


def test_auto_mixed_precision_is_bf16_only_where_the_device_computes_it_natively(tmp_path, tiny_sd3_dir, monkeypatch):
    import flowrl.sampling.precision as precision

    for native, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(precision, "native_bf16", lambda cpu, native=native: native)
        assert precision.autocast_precision("auto", cpu=True) == expected
        assert precision.autocast_precision("no", cpu=True) == "no"
        assert precision.autocast_precision("fp16", cpu=True) == "fp16"
    # the trainer hands accelerate the resolved precision (no native bf16 patched in: fp32)
    cfg = load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}", "trainer.mixed_precision=auto"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    assert trainer.mixed_precision == "no" and trainer.accelerator.mixed_precision == "no"


def test_lr_schedule_decays_the_rate_over_the_run(tmp_path, tiny_sd3_dir):
    # linear: iteration i of 4 trains at lr (1 - i / 4); what the optimizer used is in each row
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0",
                 "trainer.iterations=4", "trainer.lr=1e-3", "trainer.lr_schedule=linear", "--run-dir", str(run)]) == 0
    assert [r["lr"] for r in run_metrics(run)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_the_reward_curve_is_redrawn_at_the_first_and_last_checkpoint_of_a_short_run(tmp_path, tiny_sd3_dir, monkeypatch):
    # a checkpoint every iteration: the curve (about 0.1 s a draw) is redrawn at most once a minute
    # (RunManager.curve_every_s) and always at the end
    from flowrl.runtime.run_dir import RunDir

    drawn, plot = [], RunDir.plot_reward_curve
    monkeypatch.setattr(RunDir, "plot_reward_curve", lambda self, rows, out=None: drawn.append(len(rows)) or plot(self, rows, out))
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=1",
                 "trainer.iterations=3", "--run-dir", str(run)]) == 0
    assert drawn == [1, 3] and (run / "reward_curve.png").stat().st_size > 0


def test_run_directory_contents(tmp_path, tiny_sd3_dir, capsys):
    run = tmp_path / "run"
    args = FAST + [f"model.path={tiny_sd3_dir}", "trainer.iterations=2", "run.sample_every=1", "run.checkpoint_every=1",
                   "run.tracker=tensorboard", "trainer.ema_decay=0.5"]  # an EMA two steps from the base still moves `flowrl eval`'s score
    assert main(["train", "tiny_jpeg", *args, "--run-dir", str(run)]) == 0
    assert (run / "config.yaml").is_file() and load_config(run / "config.yaml").trainer.iterations == 2
    assert len(run_metrics(run)) == 2
    assert (run / "reward_curve.png").stat().st_size > 0
    assert {p.name for p in (run / "samples").iterdir()} >= {"iter_000000_before.png", "iter_000001.png", "iter_000002.png"}
    assert any((run / "tracker").rglob("events.out.tfevents*"))
    # the sample grids reach the tracker too, each at its iteration, as the PNG in samples/ has it
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((run / "tracker").rglob("events.out.tfevents*")).parent), size_guidance={"images": 0})
    events.Reload()
    pictures = events.Images("samples")
    assert [e.step for e in pictures] == [0, 1, 2]
    assert (pictures[-1].width, pictures[-1].height) == Image.open(run / "samples" / "iter_000002.png").size
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert ckpt.name == "iter_000002"
    for name in ("trainable.safetensors", "optimizer.safetensors", "ema.safetensors", "rng.safetensors", "state.json", "allocator.safetensors",
                 "lora/pytorch_lora_weights.safetensors", "ema_lora/pytorch_lora_weights.safetensors"):
        assert (ckpt / name).is_file(), name
    assert not list((run / "checkpoints").glob(".tmp-*"))
    # the exports are the live weights and the EMA's, each as the checkpoint keeps them (on a CPU the
    # EMA export once aliased the live weights, so both held the live ones)
    exported = lambda k: "transformer." + k.replace(".default.", ".")  # noqa: E731  (peft's adapter name dropped)
    for export, kept in (("lora", "trainable"), ("ema_lora", "ema")):
        weights, saved = (load_file(str(p)) for p in (ckpt / export / "pytorch_lora_weights.safetensors", ckpt / f"{kept}.safetensors"))
        assert set(weights) == {exported(k) for k in saved} and all(torch.equal(weights[exported(k)], v) for k, v in saved.items())
    live, ema = (load_file(str(ckpt / f"{kept}.safetensors")) for kept in ("trainable", "ema"))
    assert any(not torch.equal(live[k], ema[k]) for k in live)
    from flowrl.runs import load_run_policy

    for which, kept in (("ema", ema), ("live", live)):  # what `flowrl eval` loads, and what the arena asks for
        params = dict(load_run_policy(run, weights=which)[1].transformer.named_parameters())
        assert all(torch.equal(params[k], v) for k, v in kept.items())
    with pytest.raises(ValueError, match="'ema' or 'live'"):
        load_run_policy(run, weights="trained")

    out = tmp_path / "grid.png"
    assert main(["sample", "--run", str(run), "--prompt", "a red circle", "-n", "2", "--out", str(out)]) == 0
    from PIL import Image

    assert Image.open(out).size[0] > 2 * 64

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\na blue square\n")
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--prompts", str(prompts)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["channel", "base", "run", "change"]  # the run beside the base model (adapter disabled)
    base, trained, change = (float(v) for v in next(line for line in lines if line.startswith("weighted sum")).split()[2:5])
    assert change == pytest.approx(trained - base, abs=2e-4) and base != trained
    assert any(line.startswith("patch energy ") and len(line.split()) == 5 for line in lines)  # shapes prompts: beside the base
    assert main(["eval", "--run", str(run), "--prompts", str(prompts), "model.guidance_scale=2.5", "--no-base"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] != "channel"  # the run alone
    assert main(["eval", "--run", str(run), "--prompts", str(prompts), "model.bogus=1"]) == 2
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--prompts", str(prompts), "--checkpoint", "1"]) == 0
    assert "iter_000001" in capsys.readouterr().out  # an earlier checkpoint, not the latest
    assert main(["eval", "--run", str(run), "--prompts", str(prompts), "--checkpoint", "7"]) == 2
    assert "it has 1, 2" in capsys.readouterr().err


def test_the_closing_line_averages_the_first_and_last_tenth_of_the_run(tmp_path):
    # single iterations draw different prompts: their first-against-last difference reads as noise
    from flowrl.runtime.run_dir import RunDir
    from flowrl.runtime.run_manager import RunManager

    manager = RunManager.__new__(RunManager)
    manager.run, manager.iteration = RunDir(tmp_path), 0
    assert manager.closing_line() == f"0 iterations; run: {tmp_path}; evaluate it: flowrl eval --run {tmp_path}"
    for i in range(25):
        manager.run.append_metrics({"iteration": i, "reward_mean": float(i)})
    assert manager.closing_line() == ("mean training reward 0.5 over the first 2 iterations, 23.5 over the last 2 iterations "
                                      f"(25 iterations); run: {tmp_path}; evaluate it: flowrl eval --run {tmp_path}")


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tiny_sd3_dir, capsys):
    run = tmp_path / "run"
    args = FAST + [f"model.path={tiny_sd3_dir}", "trainer.iterations=1", "run.sample_every=0"]
    assert main(["train", "tiny_jpeg", *args, "--run-dir", str(run)]) == 0
    (run / "checkpoints" / "iter_000001" / "optimizer.safetensors").write_bytes(b"not a safetensors file")
    assert main(["train", "--resume", str(run), "trainer.iterations=2"]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert len(run_metrics(run)) == 1  # nothing already written is lost


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo launch is tested on Linux")
def test_two_processes_end_with_identical_weights(tmp_path, tiny_sd3_dir):
    # on a machine without GPUs, accelerate's --multi_gpu launcher starts CPU processes joined by gloo
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).resolve().parents[1] / "dist_worker.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(worker), str(tmp_path), tiny_sd3_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
    m0, m1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert m0["world"] == 2
    # rewards and group statistics are gathered: both processes log the same global numbers
    for a, b in zip(m0["history"], m1["history"]):
        assert a["reward_mean"] == b["reward_mean"] and a["samples"] == 8
    # and training moved the weights away from the initial adapter
    assert any(r0[k].abs().sum() > 0 for k in r0 if "lora_B" in k)


@pytest.mark.parametrize("sampler", ["flow_grpo", "dance_grpo", "cps"])
def test_every_sampler_trains_within_its_window(tmp_path, tiny_sd3_dir, sampler):
    overrides = [*FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "trainer.iterations=1",
                 f"sampling.sampler={sampler}", "sampling.noise_level=0.5", "sampling.window.strategy=fixed",
                 "sampling.window.size=2", "sampling.window.start=1", "trainer.kl_beta=0.01"]
    trainer = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    row = trainer.train()[0]
    assert row["trained_steps"] == 2 and row["first_ratio_deviation"] < 1e-5
    assert any(not torch.equal(before[n], p) for n, p in trainer.params.items())
    assert training_spec(trainer.cfg, 0, trainer.policy).trained_steps() == [1, 2]


def test_a_scattered_window_samples_and_trains_its_steps_only(tmp_path, tiny_sd3_dir):
    # Flow-DPPO's step draw: 2 distinct steps of the first half of 8, not necessarily consecutive, SDE there, ODE elsewhere
    overrides = [*FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "trainer.iterations=1",
                 "sampling.num_steps=8", "sampling.window.strategy=scattered", "sampling.window.size=2", "trainer.seed=1"]
    trainer = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / "run")
    steps = training_spec(trainer.cfg, 0, trainer.policy).trained_steps()
    assert steps == window_steps("scattered", 8, 2, 0, 0, 1) and len(steps) == 2 and set(steps) <= {0, 1, 2, 3}
    row = trainer.train()[0]
    assert row["trained_steps"] == 2 and row["first_ratio_deviation"] < 1e-5


def test_existing_run_directory_is_not_overwritten(tmp_path, tiny_sd3_dir, capsys):
    args = [*FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=1", "run.sample_every=0", "--run-dir", str(tmp_path / "r")]
    assert main(["train", "tiny_jpeg", *args]) == 0
    assert main(["train", "tiny_jpeg", *args]) == 2
    assert "--resume" in capsys.readouterr().err
    assert len(run_metrics(tmp_path / "r")) == 1


def test_gradient_accumulation_takes_fewer_optimizer_steps(tmp_path, tiny_sd3_dir):
    rows = {}
    for accum in (1, 2):
        overrides = [*FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0",
                     "trainer.iterations=1", "sampling.batch_size=2", f"trainer.gradient_accumulation_steps={accum}",
                     "trainer.inner_epochs=2"]
        rows[accum] = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / f"a{accum}").train()[0]
    # 8 samples in batches of 2 = 4 micro-batches per epoch, 2 epochs
    assert rows[1]["optimizer_steps"] == 8 and rows[2]["optimizer_steps"] == 4


@pytest.mark.parametrize("allocator", ["uniform", "vade", "xrpo", "dars_budget", "successive_elimination", "sqrt"])
def test_allocators_drive_the_trainer(tmp_path, tiny_sd3_dir, allocator):
    overrides = [*FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "trainer.iterations=2",
                 "data.prompts_per_iteration=2", "data.group_size=6", "sampling.batch_size=4", "sampling.num_steps=2",
                 f"allocator.kind={allocator}", *([f"allocator.{allocator}.round_size=2"] if allocator in ("dars_budget", "successive_elimination") else [])]
    history = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / "run").train()
    for row in history:
        assert row["samples"] == 12  # the budget, exactly, whatever the stages
        assert row["group_size_min"] >= 2
        assert sum(int(k) * v for k, v in row["group_size_histogram"].items()) == 12
    if allocator in ("dars_budget", "successive_elimination"):
        assert max(r["allocation_stages"] for r in history) > 1


@pytest.mark.parametrize("kind", ["grpo", "mc_grpo", "gdpo", "rank", "reinforce_ada"])
def test_advantage_kinds_train(tmp_path, tiny_sd3_dir, kind):
    overrides = [*FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "trainer.iterations=1",
                 "data.group_size=5", "sampling.batch_size=5", "sampling.num_steps=2", f"advantage.kind={kind}",
                 "reward.weights={jpeg_compressibility: 1.0, brightness: 10.0}"]
    row = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / "run").train()[0]
    assert row["samples"] == 10 and row["first_ratio_deviation"] < 1e-5
    # odd groups: MC-GRPO's pivot and the middle rank carry no gradient
    assert row["nonzero_advantage_samples"] == (8 if kind in ("mc_grpo", "rank") else 10)


def test_rewards_score_each_batch_as_it_finishes_and_invalid_ones_drop(tmp_path, tiny_sd3_dir):
    """The reward sees one sampling batch per call (so scoring overlaps the next batch's
    sampling), and with reward.on_invalid=drop a NaN score removes that sample from the
    advantage instead of stopping the run."""
    import threading

    from rewards import register

    calls = []

    @register("test_flaky", "mean pixel value, NaN for the first sample of the first call")
    def flaky(images, prompts, metadata=None):
        calls.append((len(prompts), threading.current_thread().name))
        scores = images.mean(dim=(1, 2, 3))
        if len(calls) == 1:
            scores[0] = float("nan")
        return scores

    overrides = [*FAST, f"model.path={tiny_sd3_dir}", "run.sample_every=0", "run.checkpoint_every=0", "trainer.iterations=1",
                 "reward.weights={test_flaky: 1.0}", "reward.on_invalid=drop"]
    trainer = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / "run")
    row = trainer.train()[0]
    assert [n for n, _ in calls] == [4, 4] and all(name.startswith("reward") for _, name in calls)
    assert row["dropped_samples"] == 1 and row["samples"] == 8
    assert math.isfinite(row["loss"]) and math.isfinite(row["reward_mean"])
    assert row["time_reward"] > 0 and row["time_reward_wait"] >= 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked processes are Linux's")
def test_cpu_processes_get_their_rank_and_threads_and_the_first_failure_is_returned(tmp_path, capfd):
    """run_cpu_processes: forked children see torchrun's environment and compute on one thread
    (GNU OpenMP's threads do not survive a fork); one that fails or raises stops the launch with
    its exit code; fresh interpreters (several threads each, or off Linux) run `flowrl ARGV`."""
    from flowrl.runtime.processes import LAUNCHER_PID_ENV, run_cpu_processes

    def report() -> int:
        rank = os.environ["RANK"]
        (tmp_path / f"rank{rank}").write_text(f"{os.environ['WORLD_SIZE']} {torch.get_num_threads()} {os.environ[LAUNCHER_PID_ENV]}")
        return 0

    assert run_cpu_processes(2, report) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [f"2 1 {os.getpid()}"] * 2
    assert run_cpu_processes(2, lambda: 3 if os.environ["RANK"] == "1" else 0) == 3
    assert run_cpu_processes(2, lambda: 1 / 0 if os.environ["RANK"] == "0" else time.sleep(60)) == 1  # the other is stopped
    assert "ZeroDivisionError" in capfd.readouterr().err
    assert run_cpu_processes(2, ["--version"]) == 0 and run_cpu_processes(1, ["no-such-command"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo launch is tested on Linux")
def test_a_user_error_inside_cpu_processes_keeps_its_one_sentence_and_exit_code(tmp_path, tiny_sd3_dir):
    # the relaunch itself (once, rank 0 alone drawing grids) is checked on the uninterrupted run of
    # test_reliability's kill -9 test; here the processes it starts meet a run directory that already
    # holds a run: each refuses it, and the launcher prints one sentence and exits 2
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    cmd = [sys.executable, "-m", "flowrl.cli", "train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "model.device=cpu",
           "trainer.iterations=2", "run.cpu_processes=2", "--run-dir", str(run)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "FLOWRL_LAUNCHED")}
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)  # a hang (a collective only one rank enters) fails here
    assert again.returncode == 2 and again.stderr.count("flowrl: error:") == 1 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert "launching 2 CPU processes" in again.stderr and "already holds a run" in again.stderr
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 0}\n'  # nothing already written is lost


def test_nft_takes_its_references_kl_weight_unless_the_preset_or_command_line_sets_one(tmp_path):
    # DiffusionNFT's train.beta is 1e-4 where Flow-GRPO's (the schema's trainer.kl_beta) is 0.04
    plain = tmp_path / "plain.yaml"
    plain.write_text("model: {path: builtin:tiny-sd3}\ndata: {prompts: [a cat]}\nsampling: {sampler: ode}\nobjective: {kind: nft}\n")
    assert load_config(plain, validate_paths=False).trainer.kl_beta == 1e-4
    default = load_config(None, ["objective.kind=nft", "sampling.sampler=ode"])  # the preset sets its own
    assert default.trainer.kl_beta == load_config(None).trainer.kl_beta and default.trainer.kl_beta != 1e-4
    assert load_config(plain, ["trainer.kl_beta=0.5"], validate_paths=False).trainer.kl_beta == 0.5
    assert load_config(plain, ["objective.kind=grpo", "sampling.sampler=flow_grpo"], validate_paths=False).trainer.kl_beta == 0.04
