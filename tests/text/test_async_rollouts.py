"""run.async_rollouts on the text default: a producer process collects ahead of the trainer.
With max_staleness 0 the run is the synchronous one, loss for loss and weight for weight (so the
weights reach the producer after every update); a resume repeats it; with a slow trainer the
producer runs ahead by exactly the bound and never past it; a killed producer stops the run with
one sentence."""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
import torch

from flowrl.cli import main
from flowrl.errors import ConfigError
from run_checks import assert_same_weights, final_weights, run_metrics

# one thread in the trainer and in the producer: the synchronous run samples in the trainer's
# process, and the two must sum in the same order to agree bit for bit
FAST = ["configs/text_add.yaml", "data.prompts_per_iteration=4", "data.group_size=4", "run.progress=false", "trainer.micro_batch=8",
        "trainer.threads=1"]


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_run_and_resumes_exactly(tmp_path, restore_threads):
    sync, straight, stopped = tmp_path / "sync", tmp_path / "async", tmp_path / "stopped"
    args = [*FAST, "trainer.iterations=4", "run.checkpoint_every=2"]
    assert main(["train", *args, "--run-dir", str(sync)]) == 0
    async_args = [*args, "run.async_rollouts=true", "run.max_staleness=0"]
    assert main(["train", *async_args, "--run-dir", str(straight)]) == 0
    rows, async_rows = run_metrics(sync), run_metrics(straight)
    assert [{k: r[k] for k in s} for s, r in zip(rows, async_rows)] == rows  # every synchronous column, float for float
    assert all(r["staleness"] == 0 and r["off_policy/ess"] == 1.0 for r in async_rows)
    weights = final_weights(sync)  # and the trained weights, bit for bit
    assert_same_weights(final_weights(straight), weights)
    # a resume restarts the producer from the checkpoint's weights and allocator
    assert main(["train", *async_args, "trainer.iterations=2", "--run-dir", str(stopped)]) == 0
    assert main(["train", "--resume", str(stopped), "trainer.iterations=4"]) == 0
    assert run_metrics(stopped) == async_rows
    assert_same_weights(final_weights(stopped), weights)


@pytest.mark.slow
def test_the_producer_runs_ahead_within_the_bound_and_a_killed_one_stops_the_run(tmp_path, capsys, monkeypatch, restore_threads):
    from flowrl.runtime.producers import RolloutProducer
    from flowrl.text.objective import TokenPolicyGradient

    update = TokenPolicyGradient.update

    def slow_update(self, exp, proximal=None):  # a trainer slower than the producer: it runs ahead as far as allowed
        time.sleep(1.5)
        return update(self, exp, proximal)

    take = RolloutProducer.take

    def take_then_kill(self, iteration):
        if iteration == 5:
            os.kill(self.processes[0].pid, signal.SIGKILL)
            self.processes[0].join()
            while True:  # what it had collected ahead is lost with it
                try:
                    self.queue.get(timeout=0.2)
                except queue.Empty:
                    break
        return take(self, iteration)

    monkeypatch.setattr(TokenPolicyGradient, "update", slow_update)
    monkeypatch.setattr(RolloutProducer, "take", take_then_kill)
    run = tmp_path / "run"
    assert main(["train", *FAST, "trainer.iterations=8", "run.checkpoint_every=2", "run.async_rollouts=true",
                 "run.max_staleness=2", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "the rollout producer process stopped (exit code -9) before batch 5 reached the trainer" in err
    assert "Traceback" not in err
    rows = run_metrics(run)
    assert len(rows) == 5 and [r["staleness"] for r in rows][2:] == [2, 2, 2]  # the bound reached, never passed
    assert all(0 < r["off_policy/ess"] <= 1 for r in rows) and rows[-1]["off_policy/ess"] < 1
    assert (run / "checkpoints" / "iter_000004").is_dir()


@pytest.mark.parametrize("override, message", [
    ("run.cpu_processes=2", "one text trainer process beside its producers"),
    ("loss.ratio_level=sequence", "set loss.ratio_level: token"),
    ("loss.off_policy=gspo", "loss.off_policy"),
    ("loss.aggregation=seq_mean_token_mean loss.off_policy=m2po", "m2po is a token-mean objective"),
])
def test_async_settings_that_cannot_work_are_refused(override, message):
    from flowrl.text.config import load_text_config

    with pytest.raises(ConfigError, match=message):
        load_text_config("configs/text_add.yaml", ["run.async_rollouts=true", *override.split()])
    with pytest.raises(ConfigError, match="run.max_staleness must be a finite number >= 0"):
        load_text_config("configs/text_add.yaml", ["run.max_staleness=-1"])


def test_a_stale_batch_takes_its_proximal_log_probs_from_the_steps_first_forward(tmp_path, restore_threads):
    """AReaL's proximal policy is the weights at the start of the optimizer step: each completion's
    first training forward of the step has exactly those, so its detached log-probs are what a
    separate forward would recompute, and a second inner epoch (other weights) keeps them."""
    from flowrl.text.config import load_text_config
    from flowrl.text.objective import StepProximal
    from flowrl.text.train import TextTrainer

    cfg = load_text_config(FAST[0], [*FAST[1:], "trainer.inner_epochs=2", "trainer.micro_batch=6", "run.checkpoint_every=0"])
    trainer = TextTrainer(cfg, run_dir=tmp_path / "run")
    exp = trainer.collector.collect(0)
    gen, rows, temp = exp.gen, torch.arange(len(exp.gen.texts)), cfg.generation.temperature
    with torch.no_grad():  # what AReaL's `recompute` does: one forward of the batch with the step's starting weights
        recomputed = trainer.policy.log_probs(gen, rows, temp)[0].float() * gen.completion_mask
    proximal = StepProximal(gen)
    stats = trainer.objective.update(exp, proximal)
    assert bool(proximal.taken.all()) and stats["off_policy/ess"] > 0
    assert torch.allclose(proximal.log_probs, recomputed, atol=1e-5)
    with torch.no_grad():  # the update moved the weights: the live policy is not the proximal one any more
        after = trainer.policy.log_probs(gen, rows, temp)[0].float() * gen.completion_mask
    assert (after - recomputed).abs().max() > 1e-4
    fresh = StepProximal(gen, known=True)  # fresh samples: the behaviour log-probs are kept as they are
    assert torch.equal(fresh.of(rows, after), gen.log_probs.float())


def test_m2po_in_the_trainer_is_the_core_objective_on_a_stale_batch(tmp_path, restore_threads):
    """loss.off_policy m2po through the trainer: a batch drawn by older weights, trained by newer
    ones, gets M2PO's second-moment mask over (behaviour - proximal)^2 and its unclipped
    token-mean objective, as flowrl/core/off_policy.py writes them."""
    from flowrl.core.off_policy import m2po_mask, m2po_policy_loss
    from flowrl.text.config import load_text_config
    from flowrl.text.objective import StepProximal
    from flowrl.text.train import TextTrainer

    cfg = load_text_config(FAST[0], [*FAST[1:], "loss.off_policy=m2po", "trainer.micro_batch=16", "run.checkpoint_every=0"])
    trainer = TextTrainer(cfg, run_dir=tmp_path / "run")
    exp = trainer.collector.collect(0)  # drawn by these weights: the behaviour policy
    with torch.no_grad():  # the trainer has moved on since: newer weights
        g = torch.Generator().manual_seed(0)
        for p in trainer.params.values():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    gen, rows = exp.gen, torch.arange(len(exp.gen.texts))
    with torch.no_grad():
        proximal = trainer.policy.log_probs(gen, rows, cfg.generation.temperature)[0].float() * gen.completion_mask
    mask = gen.completion_mask & exp.local_valid.unsqueeze(1)
    keep = m2po_mask(proximal, gen.log_probs.float(), mask, cfg.loss.m2po_tau)
    expected = m2po_policy_loss(proximal, gen.log_probs.float(), exp.local_advantages, mask, keep).loss
    assert 0 < int(keep.sum()) < int(mask.sum())  # stale enough that the mask drops tokens
    stats = trainer.objective.update(exp, StepProximal(gen))
    assert stats["loss"] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


# ---- APRIL's partial rollouts (run.over_provision) -------------------------------------------
def test_a_completion_stopped_and_continued_is_the_one_generated_straight(tmp_path, restore_threads):
    """continue_generation: a row stopped after two tokens and continued later (its prompt and
    tokens prefilled again, its generator where it stopped) draws the tokens and behaviour
    log-probs of one uninterrupted generation with the same weights and seed."""
    from flowrl.text.config import load_text_config
    from flowrl.text.generate import Partial, continue_generation, generate
    from flowrl.text.policy import load_text_policy

    cfg = load_text_config(FAST[0], [*FAST[1:], "generation.max_new_tokens=8"])
    policy = load_text_policy(cfg, device="cpu")
    model, tok, g = policy.model.eval(), policy.tokenizer, cfg.generation
    prompts, seeds = policy.format(["12+34=", "5+6=", "12+34="]), [7, 8, 9]
    straight = generate(model, tok, prompts, seeds, 8, g.temperature, g.top_p)
    rows = [Partial(p, s) for p, s in zip(prompts, seeds)]
    steps = []
    continue_generation(model, tok, rows, 8, g.temperature, g.top_p, (), enough=lambda done: steps.append(1) or len(steps) == 2)
    assert [len(r.tokens) for r in rows] == [2, 2, 2] and not any(r.done(8) for r in rows)
    continue_generation(model, tok, rows, 8, g.temperature, g.top_p, ())
    for i, r in enumerate(rows):
        n = int(straight.lengths[i])
        assert r.tokens == straight.completion_ids[i, :n].tolist() and r.ended == (not bool(straight.truncated[i]))
        assert torch.allclose(torch.tensor(r.log_probs), straight.log_probs[i, :n], atol=1e-5)


def test_partial_rollouts_carry_unfinished_groups_and_restart_what_the_bound_forbids(tmp_path, restore_threads):
    """The collector with run.over_provision 2: a batch is the first P groups to finish, the other
    groups stay in flight with their tokens, continued in the next batch with newer weights; a
    completion whose first token would be staler than run.max_staleness starts over."""
    from flowrl.text.collect import TextCollector, build_text_collector
    from flowrl.text.config import load_text_config
    from flowrl.runtime.processes import plain_accelerator

    cfg = load_text_config(FAST[0], [*FAST[1:], "run.async_rollouts=true", "run.max_staleness=1", "run.over_provision=2",
                                     "generation.max_new_tokens=6"])
    collector: TextCollector = build_text_collector(cfg, plain_accelerator(True, "test", mixed_precision="no"))
    p, k = cfg.data.prompts_per_iteration, cfg.data.group_size
    collector.version = 0
    exp = collector.collect(0)
    assert len(exp.prompt_ids) == p * k and exp.oldest_version == 0 and bool(exp.gen.completion_mask.any(1).all())
    assert exp.rollout_metrics["april/in_flight_groups"] == 2 * p and exp.rollout_metrics["april/carried_groups"] == p
    carried = [(list(r.tokens), r) for _, group in collector.in_flight for r in group]
    # the next batch, with weights of version 1: what was carried keeps its tokens (as a prefix) and its version 0
    collector.version = 1
    exp = collector.collect(1)
    kept = [r for tokens, r in carried if tokens and r.tokens[: len(tokens)] == tokens and r.version == 0]
    assert kept and exp.oldest_version in (0, 1) and exp.rollout_metrics["april/restarted_rows"] == 0
    # two versions later (batch 3 with max_staleness 1): a version-0 token may not be trained, so those rows start over
    stale = [r for _, group in collector.in_flight for r in group if r.tokens and r.version == 0]
    collector.version = 3
    exp = collector.collect(3)
    assert exp.oldest_version >= 2 and exp.rollout_metrics["april/restarted_rows"] == len(stale)


def test_partial_rollouts_train_within_the_bound_end_to_end(tmp_path, restore_threads):
    run = tmp_path / "run"
    assert main(["train", *FAST, "trainer.iterations=4", "run.checkpoint_every=0", "run.async_rollouts=true",
                 "run.max_staleness=2", "run.over_provision=1.5", "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert len(rows) == 4 and all(0 <= r["staleness"] <= 2 for r in rows) and all(r["samples"] == 16 for r in rows)
    assert all("april/carried_groups" in r for r in rows) and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.parametrize("override, message", [
    ("run.over_provision=2", "run.over_provision carries unfinished completions into later batches, which needs run.async_rollouts"),
    ("run.over_provision=2 run.async_rollouts=true run.max_staleness=0", "max_staleness 0"),
    ("run.over_provision=2 run.async_rollouts=true allocator.kind=vade", "set allocator.kind: uniform"),
    ("run.over_provision=2 run.async_rollouts=true run.producers=2", "needs one producer; set run.producers: 1"),
    ("run.over_provision=0.5", "run.over_provision must be >= 1"),
])
def test_partial_rollout_settings_that_cannot_work_are_refused(override, message):
    from flowrl.text.config import load_text_config

    with pytest.raises(ConfigError, match=message):
        load_text_config("configs/text_add.yaml", override.split())
