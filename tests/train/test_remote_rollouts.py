"""run.producer_port: the producer of asynchronous rollouts on another machine (here another
process of this one, joined over localhost exactly as across machines: a TCPStore and a Gloo
process group). With max_staleness 0 the run is the synchronous one, column for column and
weight for weight, on both trainers; a producer that dies, a producer with no trainer and a
trainer with no producer each stop with one sentence; the settings are checked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.text.config import load_text_config
from run_checks import assert_same_weights, final_weights, run_metrics, trainable

IMAGE = ["tiny_jpeg", "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
         "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
         "run.checkpoint_every=0", "trainer.threads=1"]
TEXT = ["configs/text_add.yaml", "data.prompts_per_iteration=4", "data.group_size=4", "run.progress=false", "trainer.micro_batch=8",
        "trainer.threads=1", "run.checkpoint_every=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def producer(port: int, *extra: str) -> subprocess.Popen:
    """`flowrl produce` in a fresh interpreter on one thread (as the trainer's synchronous run samples)."""
    return subprocess.Popen([sys.executable, "-m", "flowrl.cli", "produce", f"127.0.0.1:{port}", "--threads", "1", *extra],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_a_producer_on_another_machine_at_staleness_zero_is_the_synchronous_run(tmp_path, restore_threads):
    """The text trainer's; the image trainer's is the two-producer test below (one producer is its N = 1)."""
    args = TEXT
    sync, remote = tmp_path / "sync", tmp_path / "remote"
    assert main(["train", *args, "trainer.iterations=3", "--run-dir", str(sync)]) == 0
    port = free_port()
    proc = producer(port)
    try:
        assert main(["train", *args, "trainer.iterations=3", "run.async_rollouts=true", "run.max_staleness=0",
                     f"run.producer_port={port}", "--run-dir", str(remote)]) == 0
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "the trainer stopped the run" in err
    rows, remote_rows = run_metrics(sync), run_metrics(remote)
    assert [{k: r[k] for k in s} for s, r in zip(rows, remote_rows)] == rows  # every synchronous column, float for float
    assert [r["staleness"] for r in remote_rows] == [0, 0, 0]
    assert_same_weights(final_weights(remote), final_weights(sync))  # the weights reached the producer after every update


@pytest.mark.slow
def test_two_producers_on_other_machines_take_turns_and_a_third_is_turned_away(tmp_path, tiny_sd3_dir, capfd, restore_threads):
    from flowrl.runtime.processes import ForkedProcess

    args = [*IMAGE, f"model.path={tiny_sd3_dir}", "trainer.iterations=3"]
    sync, remote = tmp_path / "sync", tmp_path / "remote"
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    port = free_port()
    # two in fresh interpreters, as on other machines, and one forked from this process (one start-up saved, about
    # 6 s of CPU): of the two that join first and take turns, at least one is fresh
    procs = [producer(port) for _ in range(2)]
    forked = ForkedProcess(lambda: main(["produce", f"127.0.0.1:{port}", "--threads", "1"]), {})
    capfd.readouterr()
    try:
        assert main(["train", *args, "run.async_rollouts=true", "run.max_staleness=0", "run.producers=2", f"run.producer_port={port}",
                     "--run-dir", str(remote)]) == 0
        errs = [p.communicate(timeout=60)[1] for p in procs]
        codes = [p.returncode for p in procs] + [forked.wait()]
    finally:
        for p in procs:
            p.kill()
        if forked.poll() is None:
            os.kill(forked.pid, signal.SIGKILL)
            forked.wait()
    errs.append(capfd.readouterr().err)  # the forked producer's, after the trainer's own lines
    assert sorted(codes) == [0, 0, 2]  # whichever joined third was not needed
    assert "has its 2 producer(s) (run.producers) already" in errs[codes.index(2)]
    assert sorted("from batch 0, one batch in 2 (" in e for e in errs) == [False, False, True]  # one starts at batch 0, one at 1
    rows, remote_rows = run_metrics(sync), run_metrics(remote)
    assert [{k: r[k] for k in s} for s, r in zip(rows, remote_rows)] == rows and len(remote_rows) == 3
    a, b = trainable(sync, 3), trainable(remote, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the weights reached both producers after every update


def test_a_producer_that_dies_stops_the_run_in_one_sentence(tmp_path, tiny_sd3_dir, capsys, monkeypatch, restore_threads):
    from flowrl.runtime.processes import ForkedProcess
    from flowrl.runtime.remote_producers import RemoteProducer

    port = free_port()
    # `flowrl produce` forked from this process: how the producer dies is the point here, and the tests above
    # run producers in fresh interpreters, as on another machine (this saves one's start-up, about 6 s of CPU)
    proc = ForkedProcess(lambda: main(["produce", f"127.0.0.1:{port}", "--threads", "1"]), {})
    take = RemoteProducer.take

    def kill() -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def take_after_kill(self, iteration):
        if iteration == 2:
            kill()
        return take(self, iteration)

    monkeypatch.setattr(RemoteProducer, "take", take_after_kill)
    run = tmp_path / "run"
    try:
        assert main(["train", *IMAGE, f"model.path={tiny_sd3_dir}", "trainer.iterations=4", "run.async_rollouts=true",
                     "run.max_staleness=0", f"run.producer_port={port}", "--run-dir", str(run)]) == 2
    finally:
        kill()
    err = capsys.readouterr().err
    assert "the rollout producer on" in err and "disconnected before batch 2 reached the trainer" in err
    assert "Traceback" not in err
    assert len(run_metrics(run)) == 2


def test_a_producer_with_no_trainer_and_a_trainer_with_no_producer_each_stop_in_one_sentence(tmp_path, capsys):
    port = free_port()
    alone = subprocess.run([sys.executable, "-m", "flowrl.cli", "produce", f"127.0.0.1:{port}", "--wait-minutes", "0.01"],
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and f"no trainer listens on 127.0.0.1:{port}" in alone.stderr
    assert "Traceback" not in alone.stderr
    assert main(["train", *TEXT, "trainer.iterations=1", "run.async_rollouts=true", f"run.producer_port={port}",
                 "run.producer_wait_minutes=0.01", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"0 of 1 rollout producer(s) joined on port {port} within 0.01 minutes (run.producer_wait_minutes)" in err
    assert main(["produce", "trainer-without-port"]) == 2
    assert "must be HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    (["run.producer_port=29600"], "run.producer_port 29600 waits for a producer of asynchronous rollouts; set run.async_rollouts"),
    (["run.async_rollouts=true", "run.producer_port=70000"], "run.producer_port must be in [0, 65535]"),
    (["run.async_rollouts=true", "run.producer_port=29600", "run.producer_wait_minutes=0"], "run.producer_wait_minutes must be"),
])
def test_remote_producer_settings_that_cannot_work_are_refused(override, message):
    for load, base in ((load_config, "tiny_jpeg"), (load_text_config, "configs/text_add.yaml")):
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[").replace("(", r"\(")):
            load(base, override)
