"""run.async_rollouts on the image path: a producer process samples flat rollouts ahead of the
trainer. With max_staleness 0 the run is the synchronous one, column for column and weight for
weight (so the weights, NFT's old copy included, reach the producer after every update); with a
slow trainer the producer runs ahead by exactly the bound; a stale batch trains with the
off-policy loss, which with fresh samples is Flow-GRPO's clipped surrogate exactly."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.core import clipped_policy_loss
from flowrl.errors import ConfigError, UserError
from flowrl.train.objectives.grpo import GRPOOptions
from flowrl.train.objectives.grpo import off_policy_loss
from run_checks import assert_resume_repeats, run_metrics, trainable

# one thread in the trainer and in the producer: the synchronous run samples in the trainer's
# process, and both must sum in the same order to agree bit for bit
FAST = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
        "run.checkpoint_every=2", "trainer.threads=1"]


@pytest.mark.slow
@pytest.mark.parametrize("objective", [["trainer.kl_beta=0.01"], ["objective.kind=nft", "sampling.sampler=ode"]],
                         ids=["grpo", "nft"])
def test_staleness_zero_is_the_synchronous_run_and_resumes_exactly(tmp_path, tiny_sd3_dir, objective, restore_threads):
    """GRPO with its KL, and NFT, whose producer samples with the old copy the trainer publishes."""
    args = ["tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", *objective, "trainer.iterations=4"]
    sync, straight = tmp_path / "sync", tmp_path / "async"
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    async_args = [*args, "run.async_rollouts=true", "run.max_staleness=0"]
    assert main(["train", *async_args, "--run-dir", str(straight)]) == 0
    rows, async_rows = run_metrics(sync), run_metrics(straight)
    assert [{k: r[k] for k in s} for s, r in zip(rows, async_rows)] == rows  # every synchronous column, float for float
    assert all(r["staleness"] == 0 for r in async_rows)
    a, b = trainable(sync, 4), trainable(straight, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a resume starts a fresh producer from the checkpoint's weights and allocator
    assert_resume_repeats(async_args, straight, tmp_path / "stopped")


# the rollouts other than flat that a producer samples ahead: BranchGRPO's trees, G2RPO's branches, Sol-RL's two stages
AHEAD = {
    "tree": ["rollout.kind=tree", "rollout.tree.split_steps=[0,2]", "rollout.tree.branching=[2]", "sampling.batch_size=3"],
    "granular": ["rollout.kind=granular", "rollout.granular.branch_steps=[0,1]", "data.group_size=2"],
    "two_stage": ["rollout.kind=two_stage", "rollout.two_stage.candidates=8", "rollout.two_stage.explore_precision=bf16"],
}


@pytest.mark.parametrize("rollout", sorted(AHEAD))
def test_every_rollout_that_runs_ahead_is_the_synchronous_run_at_staleness_zero(tmp_path, tiny_sd3_dir, rollout, monkeypatch,
                                                                                 restore_threads):
    """Its batch drawn in the producer (explorer, allocator and scoring there) and its Experience
    built in the trainer give the synchronous run, column for column and weight for weight."""
    from flowrl.sampling.precision import ExplorationCopy

    built, init = [], ExplorationCopy.__init__

    def counted(self, *a, **k):  # the copies built in this (the trainer's) process; the producer is another
        built.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(ExplorationCopy, "__init__", counted)
    args = ["tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", *AHEAD[rollout], "trainer.iterations=2", "run.checkpoint_every=0"]
    sync, straight = tmp_path / "sync", tmp_path / "async"
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    explorers_sync = len(built)
    assert main(["train", *args, "run.async_rollouts=true", "run.max_staleness=0", "--run-dir", str(straight)]) == 0
    assert explorers_sync == (rollout == "two_stage") and len(built) == explorers_sync  # an async trainer explores nothing
    rows, async_rows = run_metrics(sync), run_metrics(straight)
    assert [{k: r[k] for k in s} for s, r in zip(rows, async_rows)] == rows
    assert [r["staleness"] for r in async_rows] == [0, 0]
    a, b = trainable(sync, 2), trainable(straight, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_producers_in_turn_at_staleness_zero_are_the_synchronous_run(tmp_path, tiny_sd3_dir, restore_threads):
    """Batch i from producer i mod 2, each with its own allocator: the trainer replays both
    producers' observations in batch order, so even the pool's coverage is the synchronous run's."""
    args = ["tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=3", "run.checkpoint_every=0"]
    sync, straight = tmp_path / "sync", tmp_path / "async"
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    assert main(["train", *args, "run.async_rollouts=true", "run.max_staleness=0", "run.producers=2", "--run-dir", str(straight)]) == 0
    rows, async_rows = run_metrics(sync), run_metrics(straight)
    assert [{k: r[k] for k in s} for s, r in zip(rows, async_rows)] == rows
    assert [r["pool_covered"] for r in rows] == sorted(r["pool_covered"] for r in rows) and rows[-1]["pool_covered"] > rows[0]["pool_covered"]
    a, b = trainable(sync, 3), trainable(straight, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_trainer_processes_beside_a_producer_are_the_synchronous_run_until_a_killed_producer_stops_both(
        tmp_path, tiny_sd3_dir, capfd, monkeypatch, restore_threads):
    """The first trainer process takes each batch from the producer and hands it to the other; each
    trains its contiguous share, as the synchronous processes sample theirs. Killed before batch 2
    (one run for both claims: its producer, beside two trainer processes, is a fresh interpreter),
    the producer stops every trainer process with one sentence, after two iterations and the
    checkpoint at 2 that are the synchronous run's."""
    from flowrl.runtime.producers import RolloutProducer

    take = RolloutProducer.take

    def take_after_kill(self, iteration):  # in the first trainer process, the one holding the producer
        if iteration == 2:
            os.kill(self.processes[0].pid, signal.SIGKILL)
            self.processes[0].join()
            while not self.queue.empty():
                self.queue.get()
        return take(self, iteration)

    args = ["tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=3", "run.cpu_processes=2"]
    sync, straight = tmp_path / "sync", tmp_path / "async"
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    monkeypatch.setattr(RolloutProducer, "take", take_after_kill)
    capfd.readouterr()
    assert main(["train", *args, "run.async_rollouts=true", "run.max_staleness=0", "--run-dir", str(straight)]) == 2
    err = capfd.readouterr().err  # the trainer processes write to the file descriptor
    assert err.count("the rollout producer process stopped (exit code -9) before batch 2 reached the trainer") == 1
    assert "Traceback" not in err
    rows, async_rows = run_metrics(sync), run_metrics(straight)
    assert [{k: r[k] for k in s} for s, r in zip(rows, async_rows)] == rows[:2] and len(async_rows) == 2
    a, b = trainable(sync, 2), trainable(straight, 2)  # the checkpoint at 2 (run.checkpoint_every 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_producer_device_is_the_one_gpu_its_process_sees():
    from flowrl.runtime.producers import visible_device

    assert visible_device("cuda:1", None) == "1"
    assert visible_device("cuda", None) == "0"
    assert visible_device("cuda:1", "4,6,7") == "6"  # counted among the trainer's visible GPUs
    assert visible_device("cpu", "0,1") == ""
    with pytest.raises(UserError, match="shows the trainer 2 GPU"):
        visible_device("cuda:2", "0,1")


def test_a_stale_tree_batch_trains_its_kept_edges_with_the_off_policy_loss(tmp_path, tiny_sd3_dir, monkeypatch, restore_threads):
    """Trees with pruned edges a version or two old: the proximal forward runs and the weight
    statistics count the kept edges only."""
    from flowrl.core import off_policy
    from flowrl.train.objectives.grpo import GRPO

    update, counted = GRPO.update, []
    stats = off_policy.behaviour_weight_stats

    def slow_update(self, experience):
        time.sleep(1.0)
        return update(self, experience)

    def counting_stats(prox, behaviour, mask, cap):
        counted.append((len(mask), int(mask.sum())))
        return stats(prox, behaviour, mask, cap)

    monkeypatch.setattr(GRPO, "update", slow_update)
    monkeypatch.setattr("flowrl.train.objectives.grpo.behaviour_weight_stats", counting_stats)
    run = tmp_path / "run"
    # edge_order by_step: its micro-batches hold the pruned edges beside the kept ones (shuffled ones leave them out)
    assert main(["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", *AHEAD["tree"], "rollout.tree.width_keep=0.5",
                 "rollout.tree.edge_order=by_step", "trainer.iterations=3", "run.checkpoint_every=0", "run.async_rollouts=true",
                 "run.max_staleness=2", "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert [r["staleness"] for r in rows] == [0, 1, 2]
    stale = [r for r in rows if r["staleness"] > 0]
    assert all(0 < r["off_policy/ess"] <= 1 for r in stale)
    assert len(counted) == len(stale) and all(0 < kept < total for total, kept in counted)  # width pruning left edges out


@pytest.mark.slow
def test_the_producer_runs_ahead_within_the_bound_and_a_killed_one_stops_the_run(tmp_path, tiny_sd3_dir, capsys, monkeypatch,
                                                                                  restore_threads):
    from flowrl.runtime.producers import RolloutProducer
    from flowrl.train.objectives.grpo import GRPO

    update = GRPO.update
    proximal_calls = []

    def slow_update(self, experience):  # a trainer slower than the producer: it runs ahead as far as allowed
        time.sleep(1.0)
        return update(self, experience)

    recompute = GRPO.proximal_log_probs

    def counted(self, groups):
        proximal_calls.append(len(groups))
        return recompute(self, groups)

    take = RolloutProducer.take

    def take_then_kill(self, iteration):
        if iteration == 5:
            os.kill(self.processes[0].pid, signal.SIGKILL)
            self.processes[0].join()
            while not self.queue.empty():  # what it had sampled ahead is lost with it
                self.queue.get()
        return take(self, iteration)

    monkeypatch.setattr(GRPO, "update", slow_update)
    monkeypatch.setattr(GRPO, "proximal_log_probs", counted)
    monkeypatch.setattr(RolloutProducer, "take", take_then_kill)
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", *FAST, f"model.path={tiny_sd3_dir}", "trainer.iterations=8", "run.async_rollouts=true",
                 "run.max_staleness=2", "objective.grpo.behaviour_weight=truncate", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "the rollout producer process stopped (exit code -9) before batch 5 reached the trainer" in err
    assert "Traceback" not in err
    rows = run_metrics(run)
    assert len(rows) == 5 and [r["staleness"] for r in rows][2:] == [2, 2, 2]  # the bound reached, never passed
    stale = [r for r in rows if r["staleness"] > 0]
    assert len(proximal_calls) == len(stale)  # a proximal forward for stale batches only
    assert all(0 < r["off_policy/ess"] <= 1 and 0 <= r["off_policy/over_cap_fraction"] <= 1 for r in stale)
    assert all("off_policy/ess" not in r for r in rows if r["staleness"] == 0)


def _batch(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    behaviour = torch.randn(n, generator=g) * 0.5
    proximal = behaviour + torch.randn(n, generator=g) * 0.3
    current = (proximal + torch.randn(n, generator=g) * 0.2).requires_grad_()
    return current, proximal, behaviour, torch.randn(n, generator=g)


def test_the_off_policy_loss_with_fresh_samples_is_flow_grpos_surrogate():
    """With proximal = behaviour the loss is the reference's, Flow-GRPO's clipped surrogate, value and gradient."""
    current, _, behaviour, adv = _batch()
    g = GRPOOptions(clip_range=0.2)
    ours = off_policy_loss(g, current, behaviour, behaviour, adv, 0.2)
    ref = clipped_policy_loss(current, behaviour, adv, 0.2)
    assert torch.allclose(ours.loss, ref.loss, atol=1e-7) and torch.equal(ours.clipped, ref.clipped)
    grad_ours, = torch.autograd.grad(ours.loss, current)
    grad_ref, = torch.autograd.grad(clipped_policy_loss(current, behaviour, adv, 0.2).loss, current)
    assert torch.allclose(grad_ours, grad_ref, atol=1e-7)


def test_the_decoupled_loss_is_areals_formula_per_transition():
    """The reference, AReaL's decoupled PPO (its `ppo_actor_loss_fn`; docs/algorithms.md section 13),
    written out with TIS's truncation (verl's `tis_imp_ratio_cap`): the mean over transitions of
    w max(-A u, -A clip(u, 1 - eps, 1 + eps_high)), u = exp(logp - prox), w = min(exp(prox - behav), C)."""
    current, proximal, behaviour, adv = _batch()
    g = GRPOOptions(clip_range=0.2, behaviour_weight="truncate", behaviour_cap=1.1)
    ours = off_policy_loss(g, current, proximal, behaviour, adv, 0.3)
    u = torch.exp(current - proximal)
    w = torch.clamp(torch.exp(proximal - behaviour), max=1.1)
    ref = (w * torch.maximum(-adv * u, -adv * torch.clamp(u, 0.8, 1.3))).mean()
    assert torch.allclose(ours.loss, ref, atol=1e-6)
    assert bool((torch.exp(proximal - behaviour) > 1.1).any())  # the cap is on the path


def test_m2po_on_transitions_drops_the_largest_log_ratios_until_the_second_moment_fits():
    """The reference, M2PO as AReaL ports it (`_apply_m2po_masking`), written out: drop the largest
    (behav - prox)^2 until the mean of the rest is below tau, then -mean(M A exp(logp - behav)), no clip."""
    current, proximal, behaviour, adv = _batch()
    tau = 0.05
    ours = off_policy_loss(GRPOOptions(off_policy="m2po", m2po_tau=tau), current, proximal, behaviour, adv, 0.2)
    d2 = (behaviour - proximal).square()
    order = torch.argsort(d2, descending=True)
    drop = next(k for k in range(len(d2)) if d2[order[k:]].mean() < tau)
    keep = torch.ones(len(d2), dtype=torch.bool)
    keep[order[:drop]] = False
    assert 0 < drop < len(d2)
    ref = (-adv * torch.exp(current - behaviour) * keep).mean()
    assert torch.allclose(ours.loss, ref, atol=1e-6)


@pytest.mark.parametrize("override, named", [
    (["rollout.kind=offline", f"data.offline={os.path.dirname(__file__)}", "objective.kind=gdro"], "not 'offline'"),
    (["rollout.kind=tree", "sampling.num_steps=10", "data.group_size=16", "run.cpu_processes=2"],
     "rollout.kind flat, two_stage can do, not 'tree'; run one trainer process (run.cpu_processes: 1)"),
    (["run.distributed=fsdp2"], "run.async_rollouts trains with run.distributed: ddp"),
    (["objective.grpo.ratio_norm=true"], "objective.grpo.ratio_norm"),
    (["trainer.budget_minutes=5", "sampling.window.strategy=progressive", "sampling.window.size=2"], "progressive"),
    (["run.max_staleness=-1"], "run.max_staleness must be a finite number >= 0"),
    (["objective.grpo.off_policy=tis"], "objective.grpo.off_policy"),
    (["run.producers=2", "allocator.kind=vade"], "which only allocator.kind uniform allows; got 'vade'"),
    (["run.producers=2", "run.producer_devices=[cuda:1]"], "one device per producer (run.producers 2)"),
    (["run.producer_devices=[gpu1]"], "cpu, cuda or cuda:N; got 'gpu1'"),
    (["run.producers=0"], "run.producers must be a finite number >= 1"),
])
def test_what_async_rollouts_cannot_run_with_is_refused_in_one_sentence(override, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config("tiny_jpeg", ["run.async_rollouts=true", *override])


class _CountingCollector:
    """A collector with one weight, whose batches are its iteration."""

    def __init__(self):
        self.w = {"w": torch.zeros(1)}

    def weights(self):
        return self.w

    def collect(self, iteration):
        return iteration

    def state(self):
        return {}


def test_closing_after_the_producer_was_killed_while_waiting_for_weights_returns():
    """The producer waits for version 1 after batch 0 (staleness 0); killed there, closing the
    trainer's side must not wait for it (a multiprocessing Event's set() did, forever)."""
    from flowrl.runtime.producers import RolloutProducer

    producer = RolloutProducer(_CountingCollector, {"w": torch.zeros(1)}, max_staleness=0, start_iteration=0, threads=1)
    assert producer.take(0).experience == 0
    time.sleep(0.2)  # now inside its wait for weights of version 1
    os.kill(producer.processes[0].pid, signal.SIGKILL)
    producer.processes[0].join()
    t0 = time.perf_counter()
    producer.close()
    assert time.perf_counter() - t0 < 5
