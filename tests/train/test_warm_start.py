"""rollout.kind warm_start on the tiny model: the store phase never samples and the online phase
does, DGPO and AWM train through both, a run stopped in the store phase resumes to the same
metrics and weights, and bad configs or stores are refused with one sentence."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import flowrl.sampling.rollout as sampling_rollout
from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError, UserError
from flowrl.offline.store import GroupStore
from flowrl.train.rollouts.warm_start import pool_ids, store_iterations
from run_checks import assert_resume_repeats, run_metrics, trainable

TINY = ["run.tracker=none", "run.progress=false", "run.sample_every=0", "lora.rank=4", "lora.alpha=8", "trainer.kl_beta=0",
        "sampling.sampler=ode", "sampling.num_steps=3", "sampling.eval_num_steps=3", "data.group_size=4", "sampling.batch_size=8",
        "run.cpu_processes=1"]
DGPO = ["objective.kind=dgpo", "objective.dgpo.timesteps=2", "objective.dgpo.grid_points=3"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_sd3_dir):
    """tiny_jpeg's 4 prompts, one group of 4 each: 2 iterations of data.prompts_per_iteration 2 per pass."""
    out = tmp_path_factory.mktemp("stores") / "store"
    assert main(["offline", "build", "tiny_jpeg", *TINY, *DGPO, f"model.path={tiny_sd3_dir}", "-o", str(out)]) == 0
    return out


def warm_start_args(tiny_sd3_dir, store, *extra: str) -> list[str]:
    return ["tiny_jpeg", *TINY, *DGPO, f"model.path={tiny_sd3_dir}", "rollout.kind=warm_start", f"data.offline={store}",
            "run.checkpoint_every=2", *extra]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_sd3_dir, store):
    """DGPO for 4 iterations, 3 of them from the store (a pass and a half): the run directory and
    the iterations the sampler was called at."""
    real, called = sampling_rollout.rollout, []

    def recording(*args, **kwargs):
        called.append(kwargs["policy_version"])
        return real(*args, **kwargs)

    run = tmp_path_factory.mktemp("runs") / "straight"
    with pytest.MonkeyPatch.context() as mp:
        for module in list(sys.modules.values()):  # every module that imported the sampler
            if getattr(module, "rollout", None) is real:
                mp.setattr(module, "rollout", recording)
        args = warm_start_args(tiny_sd3_dir, store, "rollout.warm_start.store_iterations=3", "trainer.iterations=4")
        assert main(["train", *args, "--run-dir", str(run)]) == 0
    return run, called


def test_the_store_phase_never_samples_and_the_online_phase_does(straight, store):
    run, called = straight
    rows = run_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert [r["warm_start_store"] for r in rows] == [1, 1, 1, 0]
    assert [r["sampled"] for r in rows] == [0, 0, 0, 8]
    assert set(called) == {3}  # the sampler ran for the online iteration only
    assert [r.get("store_pass") for r in rows] == [0, 0, 1, None]  # iteration 2 goes round the store again
    assert "allocation_stages" in rows[3] and "allocation_stages" not in rows[0]
    for r in rows[:3]:  # the row's reward columns are the online reward's, over the store's groups
        assert r["reward_mean"] == pytest.approx(r["store_reward_mean"], rel=1e-6)
        assert r["reward/jpeg_compressibility"] == pytest.approx(r["reward_mean"], rel=1e-6)
        assert r["prompts"] == 2 and r["samples"] == 8


def test_dgpo_trains_through_both_phases(straight):
    run, _ = straight
    rows = run_metrics(run)
    assert all(math.isfinite(r["loss"]) and r["optimizer_steps"] >= 1 for r in rows)
    after_store, after_online = trainable(run, 2), trainable(run, 4)
    lora_b = [k for k in after_store if "lora_B" in k]
    assert lora_b and any(after_store[k].abs().sum() > 0 for k in lora_b)  # the store phase moved the fresh adapter
    assert any(not torch.equal(after_store[k], after_online[k]) for k in after_store)


def test_a_run_stopped_in_the_store_phase_resumes_to_the_same_metrics_and_weights(tmp_path, straight, tiny_sd3_dir, store):
    run, _ = straight
    args = warm_start_args(tiny_sd3_dir, store, "rollout.warm_start.store_iterations=3")
    assert_resume_repeats(args, run, tmp_path / "stopped")


def test_awm_trains_from_the_store_then_online(tmp_path, tiny_sd3_dir, store):
    run = tmp_path / "run"
    args = ["tiny_jpeg", *TINY, f"model.path={tiny_sd3_dir}", "objective.kind=awm", "objective.awm.timesteps=1",
            "rollout.kind=warm_start", f"data.offline={store}", "rollout.warm_start.store_iterations=1", "trainer.iterations=2"]
    assert main(["train", *args, "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert [(r["warm_start_store"], r["sampled"]) for r in rows] == [(1, 0), (0, 8)]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)


def test_the_default_is_one_pass_over_the_store(tiny_sd3_dir, store):
    preset, *overrides = warm_start_args(tiny_sd3_dir, store)
    cfg = load_config(preset, overrides)
    assert cfg.rollout.warm_start.store_iterations == 0
    assert store_iterations(cfg, len(GroupStore.open(store))) == 2
    assert store_iterations(cfg, 5) == 3  # a last, partial iteration's groups come from the next pass
    assert store_iterations(load_config(preset, [*overrides, "rollout.warm_start.store_iterations=7"]), 4) == 7


@pytest.mark.parametrize("overrides, field", [
    (["data.offline=null"], "data.offline"),
    (["rollout.warm_start.store_iterations=-1"], "rollout.warm_start.store_iterations"),
])
def test_a_bad_config_gets_one_sentence_naming_the_field_and_the_cli_exits_2(tmp_path, tiny_sd3_dir, store, capsys, overrides,
                                                                              field):
    args = [*warm_start_args(tiny_sd3_dir, store), *overrides]
    with pytest.raises(ConfigError) as err:
        load_config(args[0], args[1:])
    msg = str(err.value)
    assert field in msg and "\n" not in msg and msg.count(". ") == 0
    assert main(["train", *args, "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"flowrl: error: {msg}"


def test_a_store_of_other_prompts_is_refused_with_one_sentence(tmp_path, tiny_sd3_dir, store, capsys):
    args = [*warm_start_args(tiny_sd3_dir, store), "data.prompts=[a red circle,a blue square]", "trainer.iterations=1"]
    assert main(["train", *args, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("flowrl: error: rollout.kind warm_start trains each group of data.offline")
    assert "2 of its 4 groups have no pool prompt of their own (the first: 'two green triangles')" in err


def test_store_groups_take_distinct_pool_ids_of_their_prompts():
    assert pool_ids(["b", "a", "b"], ["a", "b", "c", "b"], "x").tolist() == [1, 0, 3]
    with pytest.raises(UserError, match="1 of its 3 groups have no pool prompt of their own \\(the first: 'a'\\)"):
        pool_ids(["a", "b", "a"], ["a", "b"], "x")


def test_store_groups_come_under_their_pool_ids_with_the_online_channels_and_no_allocator_call(tmp_path, tiny_sd3_dir, store):
    from flowrl.train.loop import Trainer

    pool = ["an orange moon", *reversed([g.prompt for g in GroupStore.open(store).groups])]
    args = warm_start_args(tiny_sd3_dir, store)
    cfg = load_config(args[0], [*args[1:], f"data.prompts=[{','.join(pool)}]"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    try:
        def forbidden(*a, **k):
            raise AssertionError("the store phase called the allocator")

        for name in ("first_stage", "observe", "coverage"):
            setattr(trainer.allocator, name, forbidden)
        offline = trainer.rollout.offline.collect(0)
        experience = trainer.rollout.collect(0)
        assert experience.rewards.shape == (8, 1) and experience.metrics["warm_start_store"] == 1
        assert torch.equal(experience.advantages, offline.advantages)  # the same groups, as rollout.kind offline gives them
        assert torch.equal(experience.reward_totals, offline.reward_totals)
        for b in experience.samples:
            assert [pool[experience.prompt_ids[i]] for i in b.index.tolist()] == b.prompts
        assert torch.equal(experience.prompt_ids, 4 - offline.prompt_ids)  # store group j's prompt is pool[4 - j]
    finally:
        trainer.finish()
