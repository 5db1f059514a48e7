"""A tree's leaves as groups of clean samples: every clean-sample objective (DGPO, AWM, DPO, NFT)
trains on them, each leaf carrying the reward it was scored with, a flat group's advantage from
the same rewards and a flat group's seed; the groups' reward spread is reported for trees and
flat groups alike."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.core.seeds import sample_seed
from flowrl.train.loop import Trainer
from flowrl.train.rollouts.common import spread
from run_checks import run_metrics, trainable

TREE = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=3", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
        "rollout.kind=tree", "rollout.tree.split_steps=[0,2]", "rollout.tree.branching=[2]", "run.cpu_processes=1"]
OBJECTIVES = {
    "dgpo": ["objective.dgpo.timesteps=2", "objective.dgpo.grid_points=3", "objective.dgpo.stepping=micro_batch"],
    "awm": ["objective.awm.timesteps=2"],
    "dpo": ["trainer.kl_beta=0", "objective.dpo.timesteps=2"],
    "nft": [],
}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_each_clean_sample_objective_trains_on_the_leaves(tmp_path, tiny_sd3_dir, objective):
    run = tmp_path / objective
    args = ["train", "tiny_jpeg", *TREE, f"model.path={tiny_sd3_dir}", f"objective.kind={objective}", *OBJECTIVES[objective],
            "trainer.iterations=2", "run.checkpoint_every=2", "--run-dir", str(run)]
    assert main(args) == 0
    rows = run_metrics(run)
    assert len(rows) == 2
    for row in rows:
        assert row["trees"] == 2 and row["sampled"] == 8 and row["samples"] == 8
        assert math.isfinite(row["loss"]) and row["group_reward_std"] > 0
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)


def _leaf_experience(tmp_path, model_dir, *extra):
    cfg = load_config("tiny_jpeg", [*TREE, f"model.path={model_dir}", "objective.kind=awm", "objective.awm.timesteps=2", *extra])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    batch = trainer.rollout.sample(0)
    return cfg, trainer, batch, trainer.rollout.experience(batch)


def test_leaves_are_the_scored_samples_with_flat_group_advantages_and_seeds(tmp_path, tiny_sd3_dir):
    cfg, trainer, batch, exp = _leaf_experience(tmp_path, tiny_sd3_dir)
    tree, g = batch.tree, cfg.data.group_size
    assert exp.transitions is None
    x0 = torch.cat([b.x0 for b in exp.samples])
    # leaf_reward clean_prediction (the reference's): the sample a leaf's reward scored is its last step's clean prediction
    assert torch.equal(x0, tree.clean.float()) and not torch.equal(x0, tree.leaves.float())
    assert torch.cat([b.index for b in exp.samples]).tolist() == list(range(2 * g))
    assert [p for b in exp.samples for p in b.prompts] == [tree.prompts[i] for i in tree.tree_ids[-1].tolist()]
    # tree k's leaf j carries the seed of a flat group's sample k x G + j
    assert torch.cat([b.seeds for b in exp.samples]).tolist() == [sample_seed(cfg.trainer.seed, 0, k) for k in range(2 * g)]
    # a flat group's advantages from the same rewards (advantage.std group): (r - mean) / (population std + eps) per prompt
    assert cfg.advantage.std == "group" and len(set(batch.prompt_ids.tolist())) == 2
    totals = batch.scores.rewards.float() @ trainer.reward_fn.channel_weights
    by_tree = totals.view(2, g)
    expected = ((by_tree - by_tree.mean(1, keepdim=True)) / (by_tree.std(1, unbiased=False, keepdim=True) + cfg.advantage.eps))
    expected = expected.flatten()
    assert torch.allclose(exp.advantages, expected.clamp(-cfg.advantage.clip, cfg.advantage.clip), atol=1e-5)
    std, width = spread(totals, batch.prompt_ids)
    assert exp.metrics["group_reward_std"] == pytest.approx(std) and exp.metrics["group_reward_range"] == pytest.approx(width)


def test_final_latent_leaves_train_on_the_leaves_themselves(tmp_path, tiny_sd3_dir):
    _, _, batch, exp = _leaf_experience(tmp_path, tiny_sd3_dir, "rollout.tree.leaf_reward=final_latent")
    assert torch.equal(torch.cat([b.x0 for b in exp.samples]), batch.tree.leaves.float())


def test_flat_groups_report_their_reward_spread(tmp_path, tiny_sd3_dir):
    run = tmp_path / "flat"
    args = ["train", "tiny_jpeg", *[a for a in TREE if not a.startswith("rollout.tree")], "rollout.kind=flat",
            f"model.path={tiny_sd3_dir}", "objective.kind=awm", "objective.awm.timesteps=2", "sampling.sampler=ode",
            "trainer.iterations=1", "--run-dir", str(run)]
    assert main(args) == 0
    row = run_metrics(run)[0]
    assert row["group_reward_std"] > 0 and row["group_reward_range"] >= 2 * row["group_reward_std"] - 1e-9
