"""No non-finite number reaches the weights: non-finite config numbers are refused by name, a step
with a NaN or inf gradient is skipped, several in a row stop the run, and no checkpoint is
written with a non-finite tensor."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from flowrl.cli import main
from flowrl.config import ConfigError, load_config
from flowrl.errors import UserError
from flowrl.runtime.checkpoint import latest_checkpoint, save_checkpoint
from flowrl.runtime.processes import ForkedProcess
from flowrl.train.loop import Trainer
from run_checks import run_metrics, trainable

FAST = [
    "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
    "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
]


@pytest.mark.parametrize("bad, key", [
    ("trainer.lr=inf", "trainer.lr"), ("trainer.lr=nan", "trainer.lr"), ("trainer.max_grad_norm=nan", "trainer.max_grad_norm"),
    ("trainer.kl_beta=nan", "trainer.kl_beta"), ("trainer.max_minutes=inf", "trainer.max_minutes"),
    ("reward.weights={jpeg_compressibility: .nan}", "reward.weights.jpeg_compressibility"),
    ("reward.channel_weights={jpeg_compressibility: .inf}", "reward.channel_weights.jpeg_compressibility"),
])
def test_non_finite_config_numbers_are_refused_by_name(tiny_sd3_dir, bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + r" must be a finite number"):
        load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}", bad])


def test_non_finite_config_number_is_one_sentence_at_the_cli(tiny_sd3_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "trainer.lr=inf", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "trainer.lr must be a finite number" in err and "Traceback" not in err and not run.exists()


def poison_gradients(trainer: Trainer, iterations) -> None:
    """Turn the gradient of one LoRA weight into NaN in every backward pass of the given iterations."""
    name = next(n for n in trainer.params if "lora_B" in n)
    trainer.params[name].register_hook(lambda g: g * float("nan") if trainer.iteration in iterations else g)


def test_a_nan_gradient_skips_its_step_and_the_run_goes_on(tmp_path, tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=3", "run.checkpoint_every=0",
                                    "trainer.max_skipped_steps=10"])
    trainer = Trainer(cfg, tmp_path / "run")
    poison_gradients(trainer, {1})
    rows = trainer.train()
    assert rows[0]["skipped_steps"] == rows[2]["skipped_steps"] == 0
    assert rows[1]["skipped_steps"] == rows[1]["optimizer_steps"] > 0  # every step of iteration 1, and only those
    assert all(torch.isfinite(p).all() for p in trainer.params.values())
    last = trainable(tmp_path / "run", 3)
    assert all(torch.isfinite(t).all() for t in last.values()) and any(t.abs().sum() > 0 for k, t in last.items() if "lora_B" in k)


def test_non_finite_steps_in_a_row_stop_the_run_at_a_finite_checkpoint(tmp_path, tiny_sd3_dir):
    cfg = load_config("tiny_jpeg", [*FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=6", "run.checkpoint_every=2",
                                    "trainer.max_skipped_steps=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    poison_gradients(trainer, set(range(3, 100)))  # iterations 0-2 train, then the first step of iteration 3 is non-finite
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    with pytest.raises(UserError, match=r"iteration 3: 1 optimizer steps in a row had a non-finite gradient norm .*iter_000002"):
        trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.params.items()}
    assert not all(torch.equal(before[n], after[n]) for n in before)  # the first three iterations trained
    assert all(torch.isfinite(p).all() for p in after.values())
    assert [r["skipped_steps"] for r in run_metrics(tmp_path / "run")] == [0, 0, 0]  # iteration 3's row was never written
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "iter_000002"


def test_a_checkpoint_with_a_non_finite_tensor_is_never_written(tmp_path):
    root = tmp_path / "checkpoints"
    params = {"w": torch.ones(3)}
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))]).state_dict()
    save_checkpoint(root, 2, params, opt, None, {})
    with pytest.raises(UserError, match=r"checkpoint iter_000004 was not written: ema tensor 'w' holds NaN or inf; .*iter_000002"):
        save_checkpoint(root, 4, params, opt, {"w": torch.tensor([1.0, float("inf"), 0.0])}, {})
    assert latest_checkpoint(root).name == "iter_000002" and sorted(p.name for p in root.iterdir()) == ["iter_000002", "latest"]


# ---- bad input: one sentence, exit 2, no traceback, nothing left behind -------------------------------------

def _fails_with(capsys, argv: list[str], *fragments: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("flowrl: error:") == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.mark.parametrize("override, fragment", [
    ("trainer.adam_beta1=1.5", "trainer.adam_beta1 must be in [0, 1)"),
    ("trainer.adam_beta2=-0.1", "trainer.adam_beta2 must be in [0, 1)"),
    ("trainer.adam_eps=-1", "trainer.adam_eps must be a finite number > 0"),
    ("model.max_sequence_length=-1", "model.max_sequence_length must be a finite number >= 0"),
    ("trainer.max_skipped_steps=0", "trainer.max_skipped_steps"),
    ("model.device=banana", "model.device must be auto, cpu, cuda or cuda:N; got 'banana'"),
])
def test_bad_config_values_name_their_field(tmp_path, tiny_sd3_dir, capsys, override, fragment):
    run = tmp_path / "run"
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", override, "--run-dir", str(run)], fragment)
    assert not run.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused(tmp_path, tiny_sd3_dir, capsys):
    run = tmp_path / "run"
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "model.device=cuda", "--run-dir", str(run)],
                "model.device is 'cuda' but torch sees no CUDA device")
    assert not run.exists()


def test_a_model_of_the_other_kind_names_the_kind_to_set(tmp_path, tiny_sd3_dir, tiny_flux_dir, tiny_qwen_image_dir,
                                                         tiny_z_image_dir, capsys):
    run = tmp_path / "run"
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "model.kind=flux", "--run-dir", str(run)],
                "holds a StableDiffusion3Pipeline", "set model.kind=sd3")
    assert not run.exists()
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_flux_dir}", "model.kind=sd3", "--run-dir", str(run)],
                "holds a FluxPipeline", "set model.kind=flux")
    assert not run.exists()
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_qwen_image_dir}", "model.kind=flux", "--run-dir", str(run)],
                "holds a QwenImagePipeline", "set model.kind=qwen_image")
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_z_image_dir}", "model.kind=qwen_image", "--run-dir", str(run)],
                "holds a ZImagePipeline", "set model.kind=z_image")
    assert not run.exists()


def test_paths_that_cannot_be_written_are_refused(tmp_path, tiny_sd3_dir, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "--run-dir", str(a_file / "run")], "is a file")
    _fails_with(capsys, ["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "--run-dir", str(a_file)], "is a file")
    listed = tmp_path / "list.yaml"
    listed.write_text("- model\n- trainer\n")
    _fails_with(capsys, ["train", str(listed)], "must hold a mapping of sections", "not a list")
    _fails_with(capsys, ["serve-reward", "jpeg_compressibility", "--port", "99999"],
                "argument --port: must be an integer in 0-65535; got '99999'")
    _fails_with(capsys, ["sample", "--run", str(tmp_path), "--prompt", "a cat", "-n", "two"], "argument -n: must be an integer >= 1")
    _fails_with(capsys, ["sample", "--run", str(tmp_path), "--prompt", "x", "--bogus", "1"], "unrecognized arguments: --bogus")
    assert a_file.read_text() == "not a folder"


def test_sample_arguments_are_checked(tmp_path, tiny_sd3_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=1", "--run-dir", str(run)]) == 0
    for steps in ("-1", "0"):
        _fails_with(capsys, ["sample", "--run", str(run), "--prompt", "a cat", "--steps", steps],
                    f"argument --steps: must be an integer >= 1; got '{steps}'")
    (tmp_path / "a_file").write_text("x")
    _fails_with(capsys, ["sample", "--run", str(run), "--prompt", "a cat", "--out", str(tmp_path / "a_file" / "grid.png")], "is a file")
    # a corrupt EMA adapter: one sentence naming the checkpoint, not a traceback
    (run / "checkpoints" / "iter_000001" / "ema_lora" / "pytorch_lora_weights.safetensors").write_bytes(b"\x00" * 40)
    _fails_with(capsys, ["sample", "--run", str(run), "--prompt", "a cat"], "iter_000001", "unreadable or mismatched LoRA")


# ---- resume ---------------------------------------------------------------------------------------------------

def _straight(tmp_path, tiny_sd3_dir, iterations=4) -> tuple[list[str], object]:
    common = ["tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "run.checkpoint_every=2", "trainer.kl_beta=0.01"]
    straight = tmp_path / "straight"
    assert main(["train", *common, f"trainer.iterations={iterations}", "--run-dir", str(straight)]) == 0
    return common, straight


def test_resume_drops_a_metrics_row_cut_by_the_crash(tmp_path, tiny_sd3_dir, capsys):
    common, straight = _straight(tmp_path, tiny_sd3_dir)
    stopped = tmp_path / "stopped"
    assert main(["train", *common, "trainer.iterations=3", "--run-dir", str(stopped)]) == 0
    metrics = stopped / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])  # the crash cut the third row
    # `latest` names iter_000003; it went missing with the crash: resume falls back to iter_000002
    import shutil

    shutil.rmtree(stopped / "checkpoints" / "iter_000003")
    capsys.readouterr()
    assert main(["train", "--resume", str(stopped), "trainer.iterations=4"]) == 0
    assert "was cut short" in capsys.readouterr().err
    assert run_metrics(stopped) == run_metrics(straight)
    a, b = trainable(straight, 4), trainable(stopped, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_another_lora_rank_names_the_weight_and_shapes(tmp_path, tiny_sd3_dir, capsys):
    _, straight = _straight(tmp_path, tiny_sd3_dir, iterations=2)
    _fails_with(capsys, ["train", "--resume", str(straight), "lora.rank=8"], "of shape", "where the configured model has")
    assert len(run_metrics(straight)) == 2


def test_a_run_stopped_before_its_first_checkpoint_starts_over_in_place(tmp_path, tiny_sd3_dir, capsys):
    common, straight = _straight(tmp_path, tiny_sd3_dir)
    stopped = tmp_path / "stopped"
    assert main(["train", *common, "trainer.iterations=2", "run.checkpoint_every=0", "--run-dir", str(stopped)]) == 0
    import shutil

    shutil.rmtree(stopped / "checkpoints")  # as if killed after its metrics rows, before any checkpoint
    written = (stopped / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(stopped), "trainer.iterations=4", "run.checkpoint_every=2"]) == 0
    err = capsys.readouterr().err
    assert "has no checkpoint yet; training it again from iteration 0" in err and str(stopped) in err
    assert (stopped / "restart-1" / "metrics.jsonl").read_text() == written  # nothing written is lost
    assert run_metrics(stopped) == run_metrics(straight)
    a, b = trainable(straight, 4), trainable(stopped, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- the command line -----------------------------------------------------------------------------------------

def test_overrides_anywhere_version_presets_and_config_show(tmp_path, tiny_sd3_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", "--run-dir", str(run), *FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=1"]) == 0
    assert len(run_metrics(run)) == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("flowrl ")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "presets (CONFIG): default" in capsys.readouterr().out.replace("\n", " ")
    assert main(["config", "show", "trainer.lr=0.002"]) == 0
    shown = capsys.readouterr().out
    assert "  lr: 0.002" in shown and "  budget_minutes: 28.0  # > 0: time the first budget_probe iterations" in shown
    assert "  kind: dgpo" in shown and "  weights: {\"shapes\": 1.0, \"shapes_quality\": 1.0}" in shown
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(OmegaConf.create(shown))["trainer"]["lr"] == 0.002  # what it prints is YAML


def test_sample_grids_carry_their_prompts(tmp_path):
    from PIL import Image

    from flowrl.train.images import save_grid

    images = torch.zeros(4, 3, 32, 32)
    plain = Image.open(save_grid(images, tmp_path / "plain.png", columns=2))
    captioned = Image.open(save_grid(images, tmp_path / "captioned.png", columns=2, captions=["a red circle"] * 2 + ["x"] * 2))
    assert plain.size[0] == captioned.size[0] and captioned.size[1] > plain.size[1]
    strip = torch.tensor(list(captioned.crop((0, 128 + 8, 128, 128 + 20)).getdata())).float()
    assert (strip < 128).any()  # dark text under the first image


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its exit status waits to be read


def _wait_for(condition, proc: ForkedProcess, poll: float = 0.005, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (exit code {proc.returncode}) before the moment to kill it"
        assert time.monotonic() < deadline, "the moment to kill the run never came"
        time.sleep(poll)


def _kill_launcher(proc: ForkedProcess, run: Path, training: bool = True) -> None:
    """kill -9 of the launcher: its training processes (two, when `training`; perhaps none yet
    otherwise) end with it and write nothing more."""
    workers = _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    try:
        while any(_alive(p) for p in workers):
            assert time.monotonic() < deadline, "a training process outlived its launcher"
            time.sleep(0.1)
    finally:  # never leave a failed test's orphans training
        for p in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    assert len(workers) == 2 or not training, workers
    before = {f: f.stat().st_mtime_ns for f in run.rglob("*") if f.is_file()}
    time.sleep(0.5)
    assert {f: f.stat().st_mtime_ns for f in run.rglob("*") if f.is_file()} == before  # nobody writes the run any more


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_run(tmp_path, tiny_sd3_dir, capfd):
    # two CPU processes, a checkpoint every 2 of 4 iterations. One run is killed with kill -9 of its
    # launcher three times, each time continued as a user would (`--resume` once the run directory
    # holds a config, else the same command again): once both processes train, before the first
    # checkpoint; while a checkpoint is being written; at a seeded random moment of the third launch.
    # Every kill takes the training processes with it; the run then finishes with the uninterrupted
    # run's metrics and weights. (A chain of kills, not three runs killed once, and each launch forked
    # from this process rather than a fresh interpreter: the same main(), without the start-up of
    # about 7 s of CPU per launch that test_training's user-error test pays once for the fresh launcher.)
    import random

    args = ["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "model.device=cpu", "trainer.iterations=4",
            "run.checkpoint_every=2", "run.cpu_processes=2", "trainer.kl_beta=0.01", "run.sample_every=1"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    t0 = time.monotonic()
    capfd.readouterr()
    assert main([*args, "--run-dir", str(straight)]) == 0  # this process launches the two processes
    whole = time.monotonic() - t0
    # run.cpu_processes relaunches `flowrl train` once as that many processes, which do not launch again
    assert capfd.readouterr().err.count("launching 2 CPU processes") == 1
    assert json.loads((straight / "checkpoints" / "iter_000004" / "state.json").read_text())["num_processes"] == 2
    assert [(r["iteration"], r["samples"]) for r in run_metrics(straight)] == [(i, 8) for i in range(4)]
    # rank 0 alone draws the sample grids: a forward that synchronised the processes would hang
    assert sorted(f.name for f in (straight / "samples").iterdir()) == ["iter_000000_before.png", *(f"iter_00000{i}.png" for i in range(1, 5))]

    def launch() -> ForkedProcess:  # what a user types next, run as `flowrl` runs it: main(argv) in a process of its own
        again = ["train", "--resume", str(run)] if (run / "config.yaml").is_file() else [*args, "--run-dir", str(run)]
        return ForkedProcess(lambda: main(again), {})

    checkpoints = run / "checkpoints"
    proc = launch()  # 1: both processes train, no checkpoint yet
    _wait_for(lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size > 0, proc)
    _kill_launcher(proc, run)
    assert latest_checkpoint(checkpoints) is None
    proc = launch()  # 2: a checkpoint is being written (its temporary directory is there)
    _wait_for(lambda: checkpoints.is_dir() and any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()), proc)
    _kill_launcher(proc, run)
    proc = launch()  # 3: anywhere, the start-up included
    time.sleep(random.Random(0).uniform(0.3, 1.0) * whole)
    if proc.poll() is None:
        _kill_launcher(proc, run, training=False)
    done = latest_checkpoint(checkpoints)
    assert done is None or (done / "state.json").is_file()  # a checkpoint is there whole or not at all
    assert proc.returncode == 0 or main(["train", "--resume", str(run)]) == 0
    assert run_metrics(run) == run_metrics(straight)
    a, b = trainable(straight, 4), trainable(run, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
