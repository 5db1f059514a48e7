"""BranchGRPO's defaults against the reference code (Li et al., arXiv:2509.06040; the authors'
fastvideo/train_branchgrpo_flux.py and its 8-GPU FLUX launch script), each formula or schedule
written out here by hand: the split's children drawn 4 stds from the mean but scored with the
unscaled std, the leaf reward on the last step's clean prediction, pruning by step depth, and the
shuffled edges with an optimizer step every 12. flowrl's variant of each is a named value
(docs/algorithms.md section 3); test_tree.py covers them."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.config import load_config
from flowrl.sampling.noise import seeded_noise
from flowrl.sampling.rollout import SamplerSpec
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.tree import SplitNoise, parent_batches, path_seed, tree_edge_rows, tree_edges, tree_rollout
from flowrl.schema import ModelConfig
from flowrl.train.loop import Trainer

T = 4
ETA = 0.3  # the reference's eta
SPLITS = {0: 2, 2: 2}
PROMPTS = ["a red circle", "two green triangles"]
SEEDS = [11, 12345]
TREE = [
    "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
    "sampling.batch_size=3", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
    "rollout.kind=tree", "rollout.tree.split_steps=[0,2]", "rollout.tree.branching=[2]", "sampling.sampler=dance_grpo",
    f"sampling.noise_level={ETA}",
]


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir):
    from flowrl.models import load_policy

    return load_policy(ModelConfig(kind="sd3", path=tiny_sd3_dir, guidance_scale=4.5), device="cpu")


def _trainer(tmp_path, model_dir, name, *extra) -> Trainer:
    return Trainer(load_config("tiny_jpeg", [*TREE, f"model.path={model_dir}", *extra]), run_dir=tmp_path / name)


def reference_mean(x, v, sigma, sigma_next, eta=ETA):
    """flux_step_with_split's mean as the reference code writes it: x + dsigma v + dsigma 0.5 eta^2 (x - (1 - sigma)
    x0_hat) / sigma^2, x0_hat = x - sigma v."""
    x0_hat = x - sigma * v
    dsigma = sigma_next - sigma
    return x + dsigma * v + dsigma * 0.5 * eta**2 * (x - (1 - sigma) * x0_hat) / sigma**2


def reference_log_prob(x_next, mean, std):
    """The reference's log-prob: the Gaussian density per dimension, averaged over the dimensions."""
    per_dim = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return per_dim.mean(dim=tuple(range(1, per_dim.ndim)))


@torch.no_grad()
def level_velocity(policy, tree, t):
    """v of every level-t node, one forward over the level."""
    return policy.velocity(tree.levels[t], float(tree.sigmas[t]), policy.encode([tree.prompts[i] for i in tree.tree_ids[t].tolist()]))


@pytest.mark.parametrize("logprob_std", ["unscaled", "scaled"])
def test_split_children_are_drawn_four_stds_out_and_scored_as_the_option_says(policy, logprob_std):
    spec = SamplerSpec(shifted_sigmas(T, 3.0), torch.ones(T, dtype=torch.bool), "dance_grpo", ETA, "mean")
    tree = tree_rollout(policy, PROMPTS, SEEDS, spec, SPLITS, batch_size=3, split_noise=SplitNoise(4.0, logprob_std))
    for t in range(T):
        sigma, sigma_next = float(spec.sigmas[t]), float(spec.sigmas[t + 1])
        parent = tree.parents[t]
        mean = reference_mean(tree.levels[t], level_velocity(policy, tree, t), sigma, sigma_next)[parent]
        std = ETA * math.sqrt(sigma - sigma_next)
        seeds = [path_seed(SEEDS[k], p) for k, p in zip(tree.tree_ids[t + 1].tolist(), tree.paths[t + 1].tolist())]
        eps = seeded_noise(seeds, t, policy.latent_shape())
        split = t in SPLITS
        # the reference: noise = randn * split_noise_scale; x' = mean + noise * std, on the children of a split only
        child = mean + (eps * (4.0 if split else 1.0)) * std
        torch.testing.assert_close(tree.levels[t + 1], child, rtol=1e-5, atol=1e-5)
        # its log-prob: the unscaled std (the reference's); "scaled": the std the children were drawn with
        lp_std = 4.0 * std if split and logprob_std == "scaled" else std
        torch.testing.assert_close(tree.log_probs[t], reference_log_prob(child, mean, lp_std), rtol=1e-5, atol=1e-5)


def test_unscaled_split_log_probs_re_evaluate_to_ratio_one(policy):
    """The behaviour/log-prob mismatch does not move the first ratio: sampling and training score
    the child with the same (unscaled) Gaussian."""
    spec = SamplerSpec(shifted_sigmas(T, 3.0), torch.ones(T, dtype=torch.bool), "dance_grpo", ETA, "mean")
    tree = tree_rollout(policy, PROMPTS, SEEDS, spec, SPLITS, batch_size=3, split_noise=SplitNoise(4.0, "unscaled"))
    with torch.no_grad():
        for t in range(T):
            for parents in parent_batches(len(tree.levels[t]), 3):
                out, children = tree_edges(policy, tree, spec, t, parents)
                assert torch.equal(out.log_prob, tree.log_probs[t][children])  # the sampling batches again: exactly 1
                # one edge a row, one sigma a row (edge_order shuffled): 1 up to the forward's float rounding
                rows = tree_edge_rows(policy, tree, spec, torch.full((len(children),), t), children)
                torch.testing.assert_close(rows.log_prob, tree.log_probs[t][children], rtol=0, atol=2e-6)
                assert float(rows.std.max()) == pytest.approx(spec.std(t))


def test_leaves_are_scored_on_the_last_steps_clean_prediction(tmp_path, tiny_sd3_dir):
    scored = {}
    for reward in ("clean_prediction", "final_latent"):
        trainer = _trainer(tmp_path, tiny_sd3_dir, reward, f"rollout.tree.leaf_reward={reward}")
        start = trainer.rollout.scoring.start

        def recording_start(prompts, start=start, seen=scored.setdefault(reward, [])):
            on_batch = start(prompts)
            return lambda batch, latents: (seen.append(latents.clone()), on_batch(batch, latents))[1]

        trainer.rollout.scoring.start = recording_start
        tree = trainer.rollout.sample(0).tree
        # the reference: x0_hat = x - sigma v of the last step, from the leaf's parent at sigma_{T-1}
        x, v = tree.levels[T - 1], level_velocity(trainer.policy, tree, T - 1)
        x0_hat = (x - float(tree.sigmas[T - 1]) * v)[tree.parents[T - 1]]
        images = torch.cat(scored[reward])
        if reward == "clean_prediction":
            torch.testing.assert_close(images, x0_hat, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(images, tree.leaves, atol=1e-3)  # the last step is an SDE step: the leaf is noisier
        else:
            assert torch.equal(images, tree.leaves)


def test_prune_depths_count_steps_by_default(tmp_path, tiny_sd3_dir):
    prune = [1, 3]
    trainer = _trainer(tmp_path, tiny_sd3_dir, "steps", f"rollout.tree.prune_depths={prune}")
    batch = trainer.rollout.sample(0)
    keep = trainer.rollout.keep(batch.tree, trainer.rollout.edge_masks(batch.tree, batch.advantages, 0), batch.real)
    # the reference: an edge is dropped when its child's depth, step + 1, is listed
    assert [k is None for k in keep] == [t + 1 in prune for t in range(T)]
    # flowrl's split depths: depth 1 is the segment after the first split, steps 0 and 1
    trainer = _trainer(tmp_path, tiny_sd3_dir, "splits", "rollout.tree.depth_unit=split", "rollout.tree.prune_depths=[1]")
    keep = trainer.rollout.keep(batch.tree, trainer.rollout.edge_masks(batch.tree, batch.advantages, 0), batch.real)
    assert [k is None for k in keep] == [True, True, False, False]


def edges_of(mb) -> list[tuple[int, int]]:
    """(step, child) of every row of a shuffled micro-batch (the arguments of its tree_edge_rows)."""
    steps, children = mb.evaluate.args[3], mb.evaluate.args[4]
    return list(zip(steps.tolist(), children.tolist()))


def test_shuffled_edges_step_every_edges_per_step_and_train_each_edge_once(tmp_path, tiny_sd3_dir):
    trainer = _trainer(tmp_path, tiny_sd3_dir, "shuffled", "rollout.tree.edges_per_step=5", "trainer.weight_decay=0")
    batch = trainer.rollout.sample(0)
    exp = trainer.rollout.experience(batch)
    keep = trainer.rollout.keep(batch.tree, trainer.rollout.edge_masks(batch.tree, batch.advantages, 0), batch.real)
    edges = sorted((t, c) for t, k in enumerate(keep) for c in k.nonzero().squeeze(1).tolist())
    assert len(edges) == 2 * (2 + 2 + 4 + 4)  # 24 edges, every one of them trained
    groups = exp.transitions
    # the reference: shuffle the edges, then an optimizer step after every 5 (here) and one for the rest
    assert [sum(len(mb.advantages) for mb in g) for g in groups] == [5, 5, 5, 5, 4]
    assert all(len(mb.advantages) <= 3 for g in groups for mb in g)  # forwards of at most sampling.batch_size rows
    order = [e for g in groups for mb in g for e in edges_of(mb)]
    assert sorted(order) == edges  # each edge once
    assert order != sorted(order, key=lambda e: e[0])  # not in step order: the steps are mixed
    for mb in (mb for g in groups for mb in g):  # each row keeps its own edge's behaviour log-prob and advantage
        for i, (t, c) in enumerate(edges_of(mb)):
            assert mb.old_log_prob[i] == batch.tree.log_probs[t][c] and mb.advantages[i] == batch.advantages[t + 1][c]
    # keyed by (trainer.seed, iteration): the same order again, another at the next iteration
    again = [e for g in trainer.rollout.experience(batch).transitions for mb in g for e in edges_of(mb)]
    later = [e for g in trainer.rollout.experience(batch._replace(iteration=1)).transitions for mb in g for e in edges_of(mb)]
    assert again == order and later != order
    stats = trainer.objective.update(exp)
    assert stats["optimizer_steps"] == math.ceil(24 / 5)
    assert stats["first_ratio_deviation"] < 1e-5  # 1 up to float rounding: the rows are batched otherwise than in sampling


def test_by_step_keeps_one_micro_batch_per_step_and_sampling_batch(tmp_path, tiny_sd3_dir):
    trainer = _trainer(tmp_path, tiny_sd3_dir, "by_step", "rollout.tree.edge_order=by_step")
    batch = trainer.rollout.sample(0)
    groups = trainer.rollout.experience(batch).transitions
    # parents 2, 4, 4, 8 at steps 0-3 (2 trees) in batches of 3: one group of one micro-batch each, in step order
    assert [g[0].step for g in groups] == [0, 1, 1, 2, 2, 3, 3, 3] and all(len(g) == 1 for g in groups)
    assert [len(g[0].advantages) for g in groups] == [4, 3, 1, 6, 2, 3, 3, 2]  # their children (steps 0 and 2 split)
