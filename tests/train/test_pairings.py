"""Pairings nobody had run end to end (issue 85): the clean-sample objectives DGPO, AWM and DPO fed
by rollout.kind two_stage (Sol-RL: candidates explored in FP8, best/worst selected, regenerated in
the training precision or trained on as they are), and DGPO on the flat rollout under allocators
that give prompts groups of different sizes, Prompt-GDRO's (whose state holds "no history yet")
through a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.core.selection import select_per_group
from flowrl.sampling.precision import merged_state
from flowrl.train.loop import Trainer
from flowrl.train.registry import objective_class
from flowrl.train.rollouts.flat import FlatRollout
from run_checks import final_weights, run_metrics

TINY = ["run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0", "lora.rank=4", "lora.alpha=8",
        "trainer.kl_beta=0", "sampling.sampler=ode", "sampling.num_steps=4", "sampling.eval_num_steps=4",
        "data.prompts_per_iteration=2", "data.group_size=4", "sampling.batch_size=8", "trainer.iterations=2"]
TWO_STAGE = ["rollout.kind=two_stage", "rollout.two_stage.candidates=8", "rollout.two_stage.explore_precision=fp8",
             "rollout.two_stage.backend=emulated", "rollout.two_stage.fidelity_every=0"]
# each objective at its cheapest: few training sigmas per sample
OBJECTIVES = {"dgpo": ["objective.kind=dgpo", "objective.dgpo.timesteps=2"],
              "awm": ["objective.kind=awm", "objective.awm.timesteps=1"],
              "dpo": ["objective.kind=dpo", "objective.dpo.timesteps=2"]}


def record(monkeypatch, kind: str) -> tuple[list, list]:
    """Every stage the (two-stage) rollout samples and every experience the objective trains on."""
    stages, trained = [], []
    sample_stage, cls = FlatRollout.sample_stage, objective_class(kind)
    update = cls.update

    def recording_stage(self, *args, **kwargs):
        stages.append(sample_stage(self, *args, **kwargs))
        return stages[-1]

    def recording_update(self, experience):
        trained.append(experience)
        return update(self, experience)

    monkeypatch.setattr(FlatRollout, "sample_stage", recording_stage)
    monkeypatch.setattr(cls, "update", recording_update)
    return stages, trained


def best_worst_seeds(pool, weights: torch.Tensor, k: int) -> list[int]:
    """The seeds best_worst keeps of the pool's stage-1 rewards, k per prompt."""
    explore = pool.rewards.float() @ weights
    picked = select_per_group("best_worst", explore, pool.prompt_ids, {int(p): k for p in pool.prompt_ids.unique()})
    return pool.traj.seeds[picked].tolist()


def trained_seeds(experience) -> list[int]:
    return torch.cat([b.seeds for b in experience.samples]).tolist()


def lora_moved(run) -> bool:
    """LoRA's B starts at 0: any nonzero B is a trained update."""
    return any(v.abs().sum() > 0 for k, v in final_weights(run).items() if "lora_B" in k)


# ---- the clean-sample objectives on two-stage rollouts -------------------------------------
@pytest.mark.parametrize("kind", list(OBJECTIVES))
def test_clean_sample_objectives_train_on_the_regenerated_selection(tmp_path, tiny_sd3_dir, monkeypatch, kind):
    stages, trained = record(monkeypatch, kind)
    run = tmp_path / "run"
    assert main(["train", "tiny_jpeg", *TINY, *TWO_STAGE, *OBJECTIVES[kind], f"model.path={tiny_sd3_dir}", "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    weights = torch.ones(1)  # tiny_jpeg: one reward channel, weight 1
    assert [r["iteration"] for r in rows] == [0, 1] and len(stages) == 4 and len(trained) == 2
    for it, r in enumerate(rows):
        pool, regen = stages[2 * it], stages[2 * it + 1]
        # 16 candidates explored in FP8; the 2 prompts x 4 best/worst of them regenerated in fp32 and trained
        assert r["explore_precision"].startswith("fp8") and pool.traj.precision.startswith("fp8")
        assert r["candidates"] == 16 and r["samples"] == 8 and r["nfe_regenerate"] == 8 * 4
        assert regen.traj.precision == "float32" and trained[it].precision == "float32"
        assert trained_seeds(trained[it]) == regen.traj.seeds.tolist() == best_worst_seeds(pool, weights, 4)
        assert r["selection/selected_range"] == pytest.approx(r["selection/pool_range"])  # best and worst kept
        assert r["selection/selected_std"] >= r["selection/pool_std"]
        assert math.isfinite(r["loss"]) and r["optimizer_steps"] >= 1
    if kind == "dgpo":
        assert all(r["trained_groups"] == 2 for r in rows)  # both prompts' groups of 4, whole, in one micro-batch
    if kind == "dpo":
        assert all(r["trained_pairs"] == 2 for r in rows)  # one pair per prompt: its group's best and worst
    assert lora_moved(run)


def test_dpo_pairs_each_kept_groups_best_and_worst(tmp_path, tiny_sd3_dir):
    """Trained as they were explored (regenerate false), DPO's pair of a prompt is the pool's best
    and worst candidate: best_worst keeps both, and DPO pairs the kept group's ends."""
    cfg = load_config("tiny_jpeg", [*TINY, *TWO_STAGE, *OBJECTIVES["dpo"], f"model.path={tiny_sd3_dir}",
                                    "rollout.two_stage.regenerate=false", "trainer.iterations=1"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    pairs = []
    pair_batches = trainer.objective.pair_batches
    trainer.objective.pair_batches = lambda experience: pairs.extend(pair_batches(experience)) or pairs
    stages = []
    sample_stage = trainer.rollout.flat.sample_stage
    trainer.rollout.flat.sample_stage = lambda *a, **k: stages.append(sample_stage(*a, **k)) or stages[-1]
    row = trainer.train()[0]
    (pool,) = stages
    explore = (pool.rewards.float() @ trainer.reward_fn.channel_weights).tolist()
    assert row["trained_pairs"] == 2 and row["nfe_regenerate"] == 0 and row["samples"] == 8
    (batch,) = pairs  # 2 pairs: winners first, then their losers
    p = len(batch.seeds)
    for i, prompt in enumerate(batch.prompts[:p]):
        group = [j for j, pid in enumerate(pool.prompt_ids.tolist()) if trainer.prompts[pid] == prompt]  # its 8 candidates
        best, worst = max(group, key=explore.__getitem__), min(group, key=explore.__getitem__)
        assert torch.equal(batch.x0[i], pool.traj.final[best].float())
        assert torch.equal(batch.x0[p + i], pool.traj.final[worst].float())


# ---- regenerate: false with a low-precision explorer --------------------------------------
def test_dgpo_trains_on_the_selected_fp8_candidates_without_regenerating(tmp_path, tiny_sd3_dir, monkeypatch):
    # DGPO takes no log-prob of its samples (it flow-matches clean samples, as NFT does): the FP8
    # candidates themselves may be trained on
    stages, trained = record(monkeypatch, "dgpo")
    run = tmp_path / "run"
    args = [*TINY, *TWO_STAGE, *OBJECTIVES["dgpo"], f"model.path={tiny_sd3_dir}", "rollout.two_stage.regenerate=false"]
    assert main(["train", "tiny_jpeg", *args, "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert len(stages) == 2 and len(trained) == 2  # stage 1 only
    for it, r in enumerate(rows):
        pool = stages[it]
        assert r["nfe_regenerate"] == 0 and r["samples"] == 8 and r["candidates"] == 16
        assert trained[it].precision.startswith("fp8") and r["trained_groups"] == 2
        assert trained_seeds(trained[it]) == best_worst_seeds(pool, torch.ones(1), 4)
        assert math.isfinite(r["loss"])
    assert lora_moved(run)


def test_dgpos_old_weights_sample_through_the_exploration_copy(tmp_path, tiny_sd3_dir):
    """objective.dgpo.sample_with_old_after: after that many optimizer steps the EMA "old" weights
    sample; with two_stage they are what the exploration copy is merged from (and what regenerates)."""
    cfg = load_config("tiny_jpeg", [*TINY, *TWO_STAGE, *OBJECTIVES["dgpo"], f"model.path={tiny_sd3_dir}",
                                    "rollout.two_stage.explore_precision=bf16", "objective.dgpo.sample_with_old_after=1",
                                    "objective.dgpo.stepping=micro_batch", "objective.dgpo.sigmas_per_step=1", "trainer.iterations=3"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    trainer.train_iteration()  # 2 optimizer steps: the old weights sample from the next iteration on
    assert trainer.objective.steps == 2
    current = merged_state(trainer.policy.transformer)
    with trainer.objective.old.swapped_in(trainer.params):
        old = {n: t.clone() for n, t in merged_state(trainer.policy.transformer).items()}
    changed = [n for n in old if not torch.equal(old[n].bfloat16(), current[n].bfloat16())]
    assert changed  # the EMA lags the weights (decay 0.001 at the second step): the check below tells them apart
    trainer.train_iteration()  # resyncs the copy under the old weights, then trains
    copy_state = trainer.rollout.explorer.net.state_dict()
    assert all(torch.equal(copy_state[n], old[n].to(copy_state[n].dtype)) for n in changed)


# ---- DGPO under allocators that vary the group sizes ---------------------------------------
# vade picks prompts, not counts: equal groups. successive_elimination (rounds of 2) and dars_budget
# (a uniform first half, top-ups for the hard prompts) give prompts groups of different sizes
ALLOCATORS = {"vade": ["allocator.kind=vade", "data.prompts_per_iteration=3"],
              "successive_elimination": ["allocator.kind=successive_elimination", "allocator.successive_elimination.round_size=2"],
              "dars_budget": ["allocator.kind=dars_budget"]}


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
def test_dgpo_trains_whole_groups_of_the_sizes_an_allocator_gives(tmp_path, tiny_sd3_dir, monkeypatch, allocator):
    import flowrl.train.objectives.implicit as implicit

    packs, group_batches = [], implicit.group_batches
    monkeypatch.setattr(implicit, "group_batches", lambda *a: packs.append(group_batches(*a)) or packs[-1])
    _, trained = record(monkeypatch, "dgpo")
    run = tmp_path / "run"
    # micro-batches of 4: a group of more is a micro-batch of its own
    args = [*TINY, *OBJECTIVES["dgpo"], f"model.path={tiny_sd3_dir}", "sampling.batch_size=4", *ALLOCATORS[allocator]]
    assert main(["train", "tiny_jpeg", *args, "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1] and len(packs) == 2
    for r, experience, batches in zip(rows, trained, packs):
        budget = 4 * (3 if allocator == "vade" else 2)
        assert r["sampled"] == budget and math.isfinite(r["loss"]) and r["optimizer_steps"] == 1
        sizes = torch.bincount(experience.prompt_ids)
        histogram = sorted(int(k) for k, n in r["group_size_histogram"].items() for _ in range(n))
        assert sorted(sizes[sizes > 0].tolist()) == histogram  # the groups the objective got are the ones sampled
        # every trained group whole in one micro-batch; a micro-batch over 4 samples holds one group
        seen = set()
        for b in batches:
            assert b.weight == 1.0
            for g in b.groups.unique().tolist():
                assert g not in seen and int((b.groups == g).sum()) == int(sizes[g])
                seen.add(g)
            assert len(b.groups) <= 4 or b.groups.unique().numel() == 1
        assert r["trained_groups"] == len(seen) >= 1
    if allocator == "vade":
        assert all(r["group_size_min"] == r["group_size_max"] == 4 for r in rows)
    else:
        assert any(r["group_size_min"] < r["group_size_max"] for r in rows), [r["group_size_histogram"] for r in rows]
    assert lora_moved(run)


def test_dgpo_under_prompt_gdro_writes_its_checkpoint(tmp_path, tiny_sd3_dir):
    args = [*TINY, *OBJECTIVES["dgpo"], f"model.path={tiny_sd3_dir}", "allocator.kind=prompt_gdro", "trainer.iterations=1"]
    assert main(["train", "tiny_jpeg", *args, "--run-dir", str(tmp_path / "run")]) == 0


def test_dgpo_under_dars_budget_on_two_processes_trains_the_groups_one_process_trains(tmp_path, tiny_sd3_dir):
    # dars_budget's top-ups are a second stage split evenly over the processes, which cuts the hard
    # prompts' groups in two: the group objective brings each group whole to one process
    args = [*TINY, *OBJECTIVES["dgpo"], f"model.path={tiny_sd3_dir}", "sampling.batch_size=4", *ALLOCATORS["dars_budget"],
            "trainer.iterations=1"]
    rows = {}
    for processes in (1, 2):
        run = tmp_path / f"p{processes}"
        assert main(["train", "tiny_jpeg", *args, f"run.cpu_processes={processes}", "--run-dir", str(run)]) == 0
        rows[processes] = run_metrics(run)[0]
    assert rows[2]["group_size_min"] < rows[2]["group_size_max"]  # groups of different sizes, so one was split
    for key in ("group_size_histogram", "trained_groups", "sampled"):
        assert rows[2][key] == rows[1][key], key
    assert rows[2]["trained_groups"] >= 1 and math.isfinite(rows[2]["loss"])
