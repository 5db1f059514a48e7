"""run.cluster ray: the producers of asynchronous rollouts as Ray actors on a placement group.
One cluster for the module, of two nodes on this machine (a head and a second raylet that holds
the custom resource `rollout_node`), every process of it on 127.0.0.1. With max_staleness 0 a run
on Ray workers is the synchronous one, column for column and weight for weight, on both trainers
and with one or two workers; a worker killed mid-batch is restarted and its batch redone, so the
run still ends with the synchronous run's weights; a worker that cannot be restarted stops the
run with one sentence; workers go where their resources put them."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.text.config import load_text_config
from run_checks import assert_same_weights, final_weights, run_metrics, trainable

ray = pytest.importorskip("ray")

IMAGE = ["tiny_jpeg", "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
         "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
         "run.checkpoint_every=0", "trainer.threads=1"]
TEXT = ["configs/text_add.yaml", "data.prompts_per_iteration=4", "data.group_size=4", "run.progress=false", "trainer.micro_batch=8",
        "trainer.threads=1", "run.checkpoint_every=0"]
RAY = ["run.cluster=ray", "run.max_staleness=0"]
# one xdist worker runs the module (make test: --dist loadgroup), so its one cluster serves every test
pytestmark = pytest.mark.xdist_group("ray")


def test_a_cluster_that_is_not_there_stops_the_run_in_one_sentence(tmp_path, capsys, monkeypatch):
    """run.ray.address names a port nothing listens on (on loopback), in a process with no Ray
    connection yet (the module's cluster may be up: this process is made to look as if not)."""
    import socket

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["train", *TEXT, "trainer.iterations=1", *RAY, f"run.ray.address=127.0.0.1:{port}",
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"could not connect to the Ray cluster at run.ray.address '127.0.0.1:{port}'" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def cluster():
    """A head (4 logical CPUs) and a second node (1 CPU and the resource rollout_node), both on
    loopback: Ray turns a loopback address into the machine's network address unless told not to
    (flowrl.runtime.ray_cluster.loopback_only), and nothing of the suite's may leave loopback."""
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    loopback = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
    with pytest.MonkeyPatch.context() as mp:  # what loopback_only does, undone after the module
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, **loopback})
        second = c.add_node(num_cpus=1, resources={"rollout_node": 1}, **loopback)
        ray.init(address=c.address, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR")
        try:
            yield second.node_id
        finally:
            ray.shutdown()
            c.shutdown()


def kill_worker_at(monkeypatch, iteration: int) -> list:
    """Kill the rollout worker sampling batch `iteration` when the trainer asks for that batch (the
    worker is in the middle of it), as an out-of-memory kill would."""
    from flowrl.runtime.ray_rollouts import RayProducer

    take, killed = RayProducer.take, []

    def take_after_kill(self, i):
        if i == iteration:
            os.kill(self.started[self.worker_of(i)]["pid"], signal.SIGKILL)
            killed.append(i)
        return take(self, i)

    monkeypatch.setattr(RayProducer, "take", take_after_kill)
    return killed


def same_run(sync, run, iterations: int) -> None:
    """Every synchronous column but the clock's, float for float, and the trained weights bit for bit."""
    rows, ray_rows = run_metrics(sync), run_metrics(run)
    assert [{k: r[k] for k in s if not k.startswith("time")} for s, r in zip(rows, ray_rows)] == \
        [{k: v for k, v in s.items() if not k.startswith("time")} for s in rows] and len(ray_rows) == iterations
    assert [r["staleness"] for r in ray_rows] == [0] * iterations
    a, b = trainable(sync, iterations), trainable(run, iterations)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_worker_killed_mid_batch_is_restarted_and_the_run_is_still_the_synchronous_one(tmp_path, tiny_sd3_dir, cluster,
                                                                                           monkeypatch, restore_threads):
    """One worker, at max_staleness 0, with an allocator whose state moves with every batch
    (successive elimination): the restarted worker samples batch 2 again with the weights' version
    it needs and the allocator state batch 1 left. The rows report the weights by version: the
    LoRA tensors once per update, fetched before every batch."""
    args = [*IMAGE, f"model.path={tiny_sd3_dir}", "trainer.iterations=3", "allocator.kind=successive_elimination"]
    sync, run = tmp_path / "sync", tmp_path / "ray"
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    killed = kill_worker_at(monkeypatch, 2)
    assert main(["train", *args, *RAY, "--run-dir", str(run)]) == 0
    assert killed == [2]
    same_run(sync, run, 3)
    rows, weights = run_metrics(run), trainable(sync, 3)
    published = rows[0]["weights_published_bytes"]
    assert published == sum(t.numel() * t.element_size() for t in weights.values())
    assert [r["weights_fetched_bytes"] for r in rows] == [published] * 3


@pytest.mark.slow
def test_the_text_trainer_on_a_worker_of_the_second_node_is_the_synchronous_run(tmp_path, cluster, monkeypatch, restore_threads):
    """worker_resources {CPU: 1, rollout_node: 1} puts the placement group's bundle, and so the
    worker, on the second node (as the worker's runtime context says); every node of the cluster
    reports 127.0.0.1, and so does the worker."""
    from flowrl.runtime.ray_cluster import node_addresses
    from flowrl.runtime.ray_rollouts import RayProducer

    assert node_addresses() == ["127.0.0.1", "127.0.0.1"]
    seen, close = [], RayProducer.close

    def close_after_looking(self):
        seen.extend((w["node"], w["ip"]) for w in getattr(self, "started", []))
        close(self)

    monkeypatch.setattr(RayProducer, "close", close_after_looking)
    args = [*TEXT, "trainer.iterations=3"]
    sync, run = tmp_path / "sync", tmp_path / "ray"
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    assert main(["train", *args, *RAY, "run.ray.worker_resources={CPU: 1, rollout_node: 1}", "--run-dir", str(run)]) == 0
    assert seen == [(cluster, "127.0.0.1")]
    rows, ray_rows = run_metrics(sync), run_metrics(run)
    assert [{k: r[k] for k in s} for s, r in zip(rows, ray_rows)] == rows
    assert_same_weights(final_weights(run), final_weights(sync))


@pytest.mark.slow
def test_a_worker_that_cannot_be_restarted_stops_the_run_in_one_sentence(tmp_path, cluster, capsys, monkeypatch, restore_threads):
    kill_worker_at(monkeypatch, 1)
    run = tmp_path / "run"
    assert main(["train", *TEXT, "trainer.iterations=3", *RAY, "run.ray.max_restarts=0", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "the Ray rollout worker died and was not restarted (run.ray.max_restarts 0) before batch 1 reached the trainer" in err
    assert "flowrl train --resume RUN" in err and "Traceback" not in err
    assert len(run_metrics(run)) == 1


@pytest.mark.parametrize("override, message", [
    (["run.cluster=slurm"], "run.cluster must be one of local, ray; got 'slurm'"),
    (["run.cluster=ray", "run.ray.rollout_workers=0"], "run.ray.rollout_workers must be a finite number >= 1"),
    (["run.cluster=ray", "run.ray.worker_resources={CPU: -1}"], "run.ray.worker_resources must name"),
    (["run.cluster=ray", "run.ray.placement=EVERYWHERE"], "run.ray.placement must be one of"),
    (["run.cluster=ray", "run.producers=2"], "leave run.producers at 1"),
    (["run.cluster=ray", "run.ray.rollout_workers=2", "allocator.kind=vade"], "run.ray.rollout_workers 2 splits the batches"),
    (["reward.placement=ray"], "reward.placement ray puts the reward models on the run's Ray cluster; set run.cluster: ray"),
    (["run.cluster=ray", "reward.placement=ray", "reward.ray.resources={}"], "reward.ray.resources must name"),
    (["run.producer_port=29600"], "config key 'run.producer_port' in the command line has moved to 'run.ray.address'"),
])
def test_ray_settings_that_cannot_work_are_refused_in_one_sentence(override, message):
    loaders = [(load_config, "tiny_jpeg")] + ([] if override[-1].startswith("reward.") else [(load_text_config, "configs/text_add.yaml")])
    for load, base in loaders:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(base, override)


@pytest.mark.slow
def test_bench_ray_times_the_local_producer_and_ray_workers_side_by_side(cluster, capsys, restore_threads):
    from script_loader import load_script

    assert load_script("bench_ray").main(["--smoke", "--parts", "local", "ray1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split() and line.split()[0] in ("local", "ray1")}
    assert sorted(rows) == ["local", "ray1"]
    assert all(int(r[0]) == 2 and float(r[1]) > 0 for r in rows.values())
    assert rows["local"][2] == "1.000" and rows["local"][4] == "-"  # no weights by version without Ray
    assert float(rows["ray1"][2]) > 0 and float(rows["ray1"][4]) > 0  # its ratio to local; the adapter's MB per version


@pytest.mark.slow
def test_check_ray_faults_kills_a_worker_and_compares_with_the_undisturbed_run(cluster, capsys, restore_threads):
    """Two rollout workers taking turns and reward.placement ray (the jpeg reward in two Ray actors
    of its own, which the rollout workers find by name), one of the four killed mid-run: the run
    is the synchronous one with the reward inline, and the reward workers stop with it."""
    from script_loader import load_script

    assert load_script("check_ray_faults").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  0  same     (rollout|reward) worker at ", out, re.MULTILINE)
    assert "1 of 1 disturbed runs ended with the synchronous run's metrics and weights" in out
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("reward-")]
