"""BranchGRPO trees: the modality-free core on hand-built trees, the tree sampler on the tiny
SD3 (NFE, shared prefixes, reproducibility, exact log-probs), gradient-only pruning, and the
trainer's tree path end to end (metrics, ratio 1, resume, Mix, two processes). The reference
code's defaults, each against its formula, are in test_tree_reference.py."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.core.tree import (depthwise_advantages, edge_depths, fuse_rewards, level_counts, step_depths, trained_depths, tree_nfe,
                              width_prune)
from flowrl.errors import ConfigError
from flowrl.sampling.noise import seeded_noise
from flowrl.sampling.rollout import SamplerSpec, rollout, transition
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.sampling.steps import gaussian_log_prob
from flowrl.sampling.tree import path_seed, tree_rollout, tree_spec
from flowrl.schema import ModelConfig
from flowrl.train.experience import Experience
from flowrl.train.loop import Trainer
from run_checks import assert_resume_repeats, run_metrics, trainable

EPS = 1e-4

# ---- the core on hand-built trees ------------------------------------------------------------
# two trees; tree 0 is unbalanced (a has 3 leaves, b has 1), tree 1 has equal leaves
#   level 0: r0 r1            level 1: a b | c d          level 2: a1 a2 a3 b1 | c1 d1
PARENTS = [torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 1, 2, 3])]
TREE_IDS = [torch.tensor([0, 1]), torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1])]
LEAF_REWARDS = torch.tensor([1.0, 2.0, 3.0, 10.0, 5.0, 5.0])


def test_mean_fusion_averages_the_leaves_below_each_node():
    values = fuse_rewards(PARENTS, LEAF_REWARDS, "mean")
    assert values[2].tolist() == LEAF_REWARDS.tolist()
    assert values[1].tolist() == [2.0, 10.0, 5.0, 5.0]
    # the mean of the 4 leaves (16 / 4), not the mean of the two children ((2 + 10) / 2 = 6)
    assert values[0].tolist() == [4.0, 5.0]


def test_probability_fusion_weights_children_by_softmax_of_sibling_log_probs():
    # a constant -1000 would underflow a naive exp: the softmax must be shifted
    edge_lp = [torch.tensor([-1000.0, -1000.0 + math.log(3), 0.0, 0.0], dtype=torch.float64),
               torch.tensor([-1000.0 + math.log(2), -1000.0, -1000.0, 7.0, 1.0, 2.0], dtype=torch.float64)]
    values = fuse_rewards(PARENTS, LEAF_REWARDS, "prob", edge_lp)
    a = (2 * 1.0 + 1 * 2.0 + 1 * 3.0) / 4  # weights 2/4, 1/4, 1/4
    assert values[1].tolist() == pytest.approx([a, 10.0, 5.0, 5.0])
    assert values[0].tolist() == pytest.approx([0.25 * a + 0.75 * 10.0, 5.0])  # weights 1/4, 3/4
    with pytest.raises(ValueError):
        fuse_rewards(PARENTS, LEAF_REWARDS, "prob")


def test_depthwise_advantages_normalise_within_each_level_of_each_tree():
    adv = depthwise_advantages(fuse_rewards(PARENTS, LEAF_REWARDS, "mean"), TREE_IDS, EPS)
    assert adv[0].tolist() == [0.0, 0.0]  # one node per tree
    # level 1, tree 0: values 2, 10 -> mean 6, population std 4; tree 1: equal values -> 0
    assert adv[1].tolist() == pytest.approx([-4 / (4 + EPS), 4 / (4 + EPS), 0.0, 0.0])
    # level 2, tree 0: 1, 2, 3, 10 -> mean 4, std sqrt((9 + 4 + 1 + 36) / 4)
    std = math.sqrt(12.5)
    assert adv[2].tolist() == pytest.approx([-3 / (std + EPS), -2 / (std + EPS), -1 / (std + EPS), 6 / (std + EPS), 0.0, 0.0])


def test_width_prune_keeps_the_largest_abs_advantages_per_tree():
    adv = torch.tensor([0.1, -2.0, 1.5, 0.3, 1.0, -1.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    assert width_prune(adv, ids, 0.5).tolist() == [False, True, True, False, True, False]  # tie: lower index
    assert width_prune(adv, ids, 1.0).all()
    assert int(width_prune(torch.arange(10.0), torch.zeros(10), 0.3).sum()) == 3  # 0.3 x 10 is 3.0000000000000004


def test_depths_and_depth_pruning_masks():
    assert step_depths(10, [0, 3, 6, 9]).tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert step_depths(5, [2]).tolist() == [0, 0, 1, 1, 1]
    assert torch.equal(edge_depths(10, [0, 3, 6, 9], "split"), step_depths(10, [0, 3, 6, 9]))
    assert edge_depths(5, [2], "step").tolist() == [1, 2, 3, 4, 5]  # the reference code's: one depth per step
    assert trained_depths(4, [2]).tolist() == [False, True, False, True, True]
    window = [trained_depths(4, [], 2, 10, it).nonzero().squeeze(1).tolist() for it in (0, 9, 10, 25, 100)]
    assert window == [[1, 2], [1, 2], [2, 3], [3, 4], [3, 4]]
    assert trained_depths(4, [3], 2, 10, 10).nonzero().squeeze(1).tolist() == [2]


def test_closed_form_nfe():
    assert level_counts(4, {0: 2, 2: 3}) == [1, 2, 2, 6, 6]
    assert tree_nfe(20, {0: 2, 3: 2, 6: 2, 9: 2}) == 1 + 3 * 2 + 3 * 4 + 3 * 8 + 10 * 16  # 203: 12.7 per leaf, not 20
    assert tree_nfe(4, {0: 2, 2: 3}, roots=2) == 2 * (1 + 2 + 2 + 6)


# ---- the sampler on the tiny SD3 -------------------------------------------------------------
T = 4
SPLITS = {0: 2, 2: 3}
PROMPTS = ["a red circle", "two green triangles"]
SEEDS = [11, 12345]


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir):
    from flowrl.models import load_policy

    return load_policy(ModelConfig(kind="sd3", path=tiny_sd3_dir, guidance_scale=4.5), device="cpu")


def _spec(kind="flow_grpo", noise=0.7, sde=None):
    sde = torch.ones(T, dtype=torch.bool) if sde is None else sde
    return SamplerSpec(shifted_sigmas(T, 3.0), sde, kind, noise, "mean")


def test_nfe_equals_closed_form_and_counted_forwards(policy, monkeypatch):
    rows = []
    velocity = policy.velocity
    monkeypatch.setattr(policy, "velocity", lambda x, s, c: (rows.append(x.shape[0]), velocity(x, s, c))[1])
    tree = tree_rollout(policy, PROMPTS, SEEDS, _spec(), SPLITS, batch_size=3)
    assert sum(rows) == tree.nfe == tree_nfe(T, SPLITS, roots=2) == 22
    # every level goes through the network in batches: ceil(n_t / 3) forwards of at most 3 nodes
    assert len(rows) == sum(math.ceil(n / 3) for n in level_counts(T, SPLITS, 2)[:T]) and max(rows) == 3
    assert [len(x) for x in tree.levels] == level_counts(T, SPLITS, 2)


def test_leaves_share_bit_identical_prefixes_and_differ_after_their_split(policy):
    tree = tree_rollout(policy, PROMPTS, SEEDS, _spec(), SPLITS, batch_size=3)
    chains = tree.leaf_trajectory()
    anc = tree.ancestors(T)
    leaves = len(tree.leaves)
    checked = 0
    for i in range(leaves):
        for j in range(i + 1, leaves):
            if tree.tree_ids[-1][i] != tree.tree_ids[-1][j]:
                assert not torch.equal(chains.latents[i, 0], chains.latents[j, 0])  # different trees, different roots
                continue
            split = int((anc[:, i] != anc[:, j]).nonzero()[0])  # first level where the paths part
            assert split - 1 in SPLITS  # they can only part at a split step
            assert torch.equal(chains.latents[i, :split], chains.latents[j, :split])
            for t in range(split, T + 1):
                assert (chains.latents[i, t] != chains.latents[j, t]).float().mean() > 0.99
            checked += 1
    assert checked == 2 * 15  # 6 leaves per tree: 15 pairs each


def test_a_leaf_is_reproducible_from_seed_and_path_alone(policy):
    both = tree_rollout(policy, PROMPTS, SEEDS, _spec(), SPLITS, batch_size=4)
    alone = tree_rollout(policy, PROMPTS[1:], SEEDS[1:], _spec(), SPLITS, batch_size=1)
    second = both.tree_ids[-1] == 1
    assert torch.equal(both.paths[-1][second], alone.paths[-1])
    # other trees in the batch and another batch size change nothing but float rounding
    torch.testing.assert_close(both.leaves[second], alone.leaves, rtol=1e-5, atol=1e-5)


def test_leftmost_path_is_the_flat_rollout_of_the_tree_seed(policy):
    spec = _spec()
    flat = rollout(policy, PROMPTS[:1], SEEDS[:1], tree_spec(spec, SPLITS), batch_size=1)
    tree = tree_rollout(policy, PROMPTS[:1], SEEDS[:1], spec, SPLITS, batch_size=1)
    chains = tree.leaf_trajectory()
    assert chains.extras["paths"][0] == 0
    assert torch.equal(chains.latents[0], flat.latents[0])
    assert torch.equal(chains.log_probs[0], flat.log_probs[0])


@pytest.mark.parametrize("kind,noise", [("flow_grpo", 0.7), ("dance_grpo", 0.5), ("cps", 0.5)])
def test_every_edge_log_prob_equals_the_flat_step_log_prob(policy, kind, noise):
    # between splits: SDE at step 1, ODE at step 3 (cps is deterministic at the last step anyway)
    spec = tree_spec(_spec(kind, noise, torch.tensor([False, True, False, False])), SPLITS)
    tree = tree_rollout(policy, PROMPTS, SEEDS, spec, SPLITS, batch_size=3)
    assert tree.stochastic.tolist() == [True, True, True, False]
    chains = tree.leaf_trajectory()
    anc = tree.ancestors(T)
    for t in range(T):
        flat = transition(policy, chains, spec, slice(None), t, policy.encode(chains.prompts))
        torch.testing.assert_close(tree.log_probs[t][anc[t + 1]], flat.log_prob, rtol=1e-5, atol=1e-5)
        if not spec.is_stochastic(t):
            assert torch.equal(tree.log_probs[t], torch.zeros(len(tree.levels[t + 1])))
            torch.testing.assert_close(chains.latents[:, t + 1], flat.mean, rtol=1e-5, atol=1e-5)  # an exact ODE edge
            continue
        # one std for the noise and the log-prob: x' = mean + std eps with the node's own (seed, path) noise
        seeds = [path_seed(int(chains.seeds[k]), int(p)) for k, p in enumerate(tree.paths[t + 1][anc[t + 1]].tolist())]
        eps = seeded_noise(seeds, t, policy.latent_shape())
        torch.testing.assert_close(chains.latents[:, t + 1], flat.mean + flat.std * eps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flat.log_prob, gaussian_log_prob(flat.mean + flat.std * eps, flat.mean, flat.std), rtol=1e-5, atol=1e-5)
        assert abs(float(flat.std) - spec.std(t)) < 1e-6


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_re_evaluated_edges_reproduce_the_behaviour_log_probs_exactly(kind, tiny_sd3_dir, tiny_flux_dir):
    from flowrl.models import load_policy
    from flowrl.sampling.tree import parent_batches, tree_edges

    path = tiny_sd3_dir if kind == "sd3" else tiny_flux_dir
    pol = load_policy(ModelConfig(kind=kind, path=path, guidance_scale=3.5), device="cpu")
    spec = _spec()
    tree = tree_rollout(pol, PROMPTS, SEEDS, spec, SPLITS, batch_size=3)
    seen = torch.zeros(len(tree.leaves), dtype=torch.long)
    with torch.no_grad():
        for t in range(T):
            for parents in parent_batches(len(tree.levels[t]), 3):
                out, children = tree_edges(pol, tree, spec, t, parents)
                assert torch.equal(out.log_prob, tree.log_probs[t][children])  # ratio exactly 1
                assert torch.equal(out.next_x, tree.levels[t + 1][children])
                if t == T - 1:
                    seen[children] += 1
    assert seen.tolist() == [1] * len(tree.leaves)  # the batches cover every edge once


# ---- the trainer's tree path -----------------------------------------------------------------
TREE = [
    "sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
    "sampling.batch_size=3", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8", "run.sample_every=0",
    "rollout.kind=tree", "rollout.tree.split_steps=[0,2]", "rollout.tree.branching=[2]",
]


# flowrl's variant of every option whose default is the reference code's: the split's own transition, the leaf
# scored, depths counted in splits, and one micro-batch per (step, sampling batch of parents), which repeats the
# sampling forward, so the first ratio is exactly 1 (test_tree_reference.py tests the defaults)
FLOWRL = ["rollout.tree.split_noise_scale=1", "rollout.tree.leaf_reward=final_latent", "rollout.tree.depth_unit=split",
          "rollout.tree.edge_order=by_step"]


def _trainer(tmp_path, model_dir, name, *extra) -> Trainer:
    return Trainer(load_config("tiny_jpeg", [*TREE, f"model.path={model_dir}", *extra]), run_dir=tmp_path / name)


def experience(groups) -> Experience:
    """An experience of these micro-batches alone, weighed per transition as trees are."""
    return Experience(0, torch.zeros(0, 1), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), torch.zeros(0),
                      "float32", transitions=groups, weigh_by_transition=True)


def test_pruning_leaves_the_rollout_unchanged_and_pruned_edges_without_gradient(tmp_path, tiny_sd3_dir):
    full = _trainer(tmp_path, tiny_sd3_dir, "full", *FLOWRL)
    pruned = _trainer(tmp_path, tiny_sd3_dir, "pruned", *FLOWRL, "rollout.tree.width_keep=0.5", "rollout.tree.prune_depths=[1]",
                      "trainer.weight_decay=0")
    spec = pruned.rollout.spec(0)
    a, b = full.rollout.sample(0), pruned.rollout.sample(0)
    assert all(torch.equal(x, y) for x, y in zip(a.tree.levels, b.tree.levels))  # same images
    assert torch.equal(a.scores.rewards, b.scores.rewards)

    keep = pruned.rollout.keep(b.tree, pruned.rollout.edge_masks(b.tree, b.advantages, 0), b.real)
    depth = b.tree.depth_of_step.tolist()  # [1, 1, 2, 2]
    assert [k is None for k in keep] == [d == 1 for d in depth]
    for t in (2, 3):  # the last depth: 2 of each tree's 4 leaves, the largest |A|
        assert int(keep[t].sum()) == 2 * 2
        for tree_id in (0, 1):
            mine = b.tree.tree_ids[t + 1] == tree_id
            top = b.advantages[t + 1][mine].abs()
            assert top[keep[t][mine]].min() >= top[~keep[t][mine]].max()
    groups = pruned.rollout.micro_batches(b.tree, spec, b.advantages, keep)
    # step 2 (split): parents [0:3], [3:4] -> children [0:6], [6:8]; step 3: parents = children [0:3], [3:6], [6:8];
    # a batch whose edges are all pruned is not even evaluated
    batches = [(2, 0, 6), (2, 6, 8), (3, 0, 3), (3, 3, 6), (3, 6, 8)]
    assert len(groups) == sum(bool(keep[t][lo:hi].any()) for t, lo, hi in batches) >= 3
    assert all(g[0].keep.any() for g in groups)
    mixed = next(g[0] for g in groups if not g[0].keep.all())

    def grads(mb):
        pruned.optimizer.zero_grad(set_to_none=True)
        loss, _, _ = pruned.objective.micro_batch_loss(mb)
        loss.backward()
        return {n: p.grad.clone() for n, p in pruned.params.items()}

    # the pruned edges' advantages and old log-probs do not reach the gradient at all
    g1 = grads(mixed)
    noisy = mixed._replace(advantages=mixed.advantages + 100.0 * ~mixed.keep, old_log_prob=mixed.old_log_prob - 3.0 * ~mixed.keep)
    g2 = grads(noisy)
    assert any(g.abs().sum() > 0 for g in g1.values())
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    # a micro-batch of pruned edges only: zero gradient, so AdamW (no weight decay) leaves every weight as it was
    pruned.optimizer.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in pruned.params.items()}
    stats = pruned.objective.update(experience([[mixed._replace(keep=torch.zeros_like(mixed.keep))]]))
    assert stats["grad_norm"] == 0.0 and stats["optimizer_steps"] == 1
    assert all(torch.equal(before[n], p) for n, p in pruned.params.items())
    stats = pruned.objective.update(experience([[mixed]]))
    assert stats["grad_norm"] > 0 and any(not torch.equal(before[n], p) for n, p in pruned.params.items())


def test_tree_training_end_to_end_and_exact_resume(tmp_path, tiny_sd3_dir):
    # the reference code's defaults: the edges shuffled, an optimizer step every 12 of them
    common = [*TREE, f"model.path={tiny_sd3_dir}", "run.checkpoint_every=2", "trainer.kl_beta=0.01", "rollout.tree.fusion=prob"]
    straight = tmp_path / "straight"
    assert main(["train", "tiny_jpeg", *common, "trainer.iterations=4", "--run-dir", str(straight)]) == 0
    rows = run_metrics(straight)
    assert len(rows) == 4
    splits = {0: 2, 2: 2}
    for row in rows:
        assert row["nfe_per_leaf"] == tree_nfe(4, splits) / 4  # 9 forwards for 4 leaves
        assert row["samples"] == 8 and row["trees"] == 2
        assert row["trained_steps"] == 4 and row["trained_transitions"] == 2 * (2 + 2 + 4 + 4)
        # 24 edges: 2 optimizer steps of 12, each in forwards of at most sampling.batch_size (3) rows
        assert row["optimizer_steps"] == 2 and row["training_forwards"] == 2 * 4
        assert row["kl"] >= 0 and math.isfinite(row["loss"])
        for d in (1, 2):
            assert 0 < row[f"adv_abs_mean/depth{d}"] <= 5 and 0 < row[f"adv_std/depth{d}"] <= 5
    # fresh samples: the first importance ratio is 1 up to float rounding (rows batched otherwise than in sampling
    # move the log-prob in its last bits, about 1e-6 here; exactly 1 with edge_order by_step, test_ode_between_...)
    assert rows[0]["first_ratio_deviation"] < 1e-5
    assert rows[0]["reward_std"] > 0

    assert_resume_repeats(["tiny_jpeg", *common], straight, tmp_path / "stopped")
    a, first = trainable(straight, 4), trainable(straight, 2)
    assert any(not torch.equal(a[k], first[k]) for k in a if "lora_B" in k)


def test_mix_trains_only_sde_edges_inside_the_sliding_window(tmp_path, tiny_sd3_dir):
    trainer = _trainer(tmp_path, tiny_sd3_dir, "mix", *FLOWRL, "sampling.num_steps=6", "rollout.tree.split_steps=[1,4]",
                       "rollout.tree.between=window", "sampling.window.strategy=progressive", "sampling.window.size=2",
                       "sampling.window.start=0", "sampling.window.shift_every=1", "trainer.iterations=2")
    # iteration 0: window [0, 1] + splits {1, 4}; iteration 1: window [1, 2] + splits
    assert trainer.rollout.spec(0).sde_steps.tolist() == [True, True, False, False, True, False]
    assert trainer.rollout.spec(1).sde_steps.tolist() == [False, True, True, False, True, False]
    seen, keep_edges = [], trainer.rollout.keep  # one call per iteration, in order
    trainer.rollout.keep = lambda tree, edges, real: seen.append((tree, keep_edges(tree, edges, real))) or seen[-1][1]
    rows = trainer.train()
    tree, keep = seen[0]
    assert [k is not None for k in keep] == [False, True, False, False, True, False]  # step 0 is SDE but at depth 0
    for t in (2, 3, 5):  # ODE edges: no density, and the child is the mean
        assert torch.equal(tree.log_probs[t], torch.zeros_like(tree.log_probs[t]))
    assert [r["trained_steps"] for r in rows] == [2, 3]
    assert rows[0]["first_ratio_deviation"] < 1e-6
    assert rows[0]["nfe_per_leaf"] == tree_nfe(6, {1: 2, 4: 2}) / 4


def test_ode_between_splits_trains_the_split_edges_only(tmp_path, tiny_sd3_dir):
    trainer = _trainer(tmp_path, tiny_sd3_dir, "ode", *FLOWRL, "rollout.tree.between=ode", "trainer.iterations=1")
    assert trainer.rollout.spec(0).sde_steps.tolist() == [True, False, True, False]
    row = trainer.train()[0]
    assert row["trained_steps"] == 2 and row["trained_transitions"] == 2 * (2 + 4)
    assert row["training_forwards"] == 1 + 2  # edge_order by_step: the sampling batches of 3 parents again (2, then 4)
    assert row["first_ratio_deviation"] < 1e-6  # ... so the first ratio is exactly 1


def test_depth_window_slides_over_iterations(tmp_path, tiny_sd3_dir):
    trainer = _trainer(tmp_path, tiny_sd3_dir, "window", *FLOWRL, "rollout.tree.between=ode", "rollout.tree.depth_window=1",
                       "rollout.tree.depth_window_shift_every=1", "trainer.iterations=3")
    rows = trainer.train()
    # depth 1 (the split at step 0: 2 edges per tree), then depth 2 (step 2: 4 per tree), then it stays there
    assert [r["trained_transitions"] for r in rows] == [2 * 2, 2 * 4, 2 * 4]
    assert [r["trained_steps"] for r in rows] == [1, 1, 1]


def test_depth_window_in_step_depths_slides_one_step_at_a_time(tmp_path, tiny_sd3_dir):
    # depth_unit step (the default): a window of 2 step-depths over steps 0-3 (SDE everywhere, splits at 0 and 2)
    trainer = _trainer(tmp_path, tiny_sd3_dir, "window_steps", "rollout.tree.depth_window=2", "rollout.tree.depth_window_shift_every=1")
    batch = trainer.rollout.sample(0)
    r = trainer.rollout
    trained = [[t for t, k in enumerate(r.keep(batch.tree, r.edge_masks(batch.tree, batch.advantages, it), batch.real)) if k is not None]
               for it in range(4)]
    # depths {1, 2} = steps {0, 1}, then {2, 3} = steps {1, 2}, then {3, 4} = steps {2, 3}, where it stays
    assert trained == [[0, 1], [1, 2], [2, 3], [2, 3]]


BAD_TREES = [
    (["rollout.kind=forest"], "rollout.kind"),
    (["rollout.tree.split_steps=[0,4]"], "rollout.tree.split_steps"),
    (["rollout.tree.split_steps=[2,1]"], "rollout.tree.split_steps"),
    (["rollout.tree.branching=[1]"], "rollout.tree.branching"),
    (["rollout.tree.branching=[2,2,2]"], "rollout.tree.branching"),
    (["data.group_size=8"], "data.group_size"),
    (["rollout.tree.between=euler"], "rollout.tree.between"),
    (["rollout.tree.between=window"], "rollout.tree.between"),
    (["sampling.window.strategy=fixed", "sampling.window.size=2"], "sampling.window.strategy"),
    (["rollout.tree.fusion=max"], "rollout.tree.fusion"),
    (["rollout.tree.width_keep=0"], "rollout.tree.width_keep"),
    (["rollout.tree.prune_depths=[5]"], "rollout.tree.prune_depths"),  # step depths: 1..sampling.num_steps (4)
    (["rollout.tree.prune_depths=[1,2,3,4]"], "rollout.tree.prune_depths"),
    (["rollout.tree.depth_unit=split", "rollout.tree.prune_depths=[3]"], "rollout.tree.prune_depths"),
    (["rollout.tree.depth_unit=split", "rollout.tree.prune_depths=[1,2]"], "rollout.tree.prune_depths"),
    (["rollout.tree.depth_window=5"], "rollout.tree.depth_window"),
    (["rollout.tree.depth_unit=split", "rollout.tree.depth_window=3"], "rollout.tree.depth_window"),
    (["rollout.tree.depth_unit=splits"], "rollout.tree.depth_unit"),
    (["rollout.tree.split_noise_scale=0"], "rollout.tree.split_noise_scale"),
    (["rollout.tree.split_logprob_std=both"], "rollout.tree.split_logprob_std"),
    (["rollout.tree.leaf_reward=decoded"], "rollout.tree.leaf_reward"),
    (["rollout.tree.edge_order=random"], "rollout.tree.edge_order"),
    (["rollout.tree.edges_per_step=0"], "rollout.tree.edges_per_step"),
    (["trainer.gradient_accumulation_steps=2"], "trainer.gradient_accumulation_steps"),  # shuffled: edges_per_step sets the step
    (["rollout.tree.depth_window_shift_every=0"], "rollout.tree.depth_window_shift_every"),
    (["allocator.kind=vade"], "allocator.kind"),
    (["advantage.kind=rank"], "advantage.kind"),
    (["sampling.sampler=cps", "rollout.tree.split_steps=[0,3]"], "rollout.tree.split_steps"),  # cps: no noise at the last step
]


@pytest.mark.parametrize("overrides,key", BAD_TREES)
def test_bad_tree_config_is_one_sentence_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_jpeg", [*TREE, *overrides], validate_paths=False)
    message = str(info.value)
    assert key in message and "\n" not in message


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo launch is tested on Linux")
def test_two_processes_share_the_trees_and_end_with_identical_weights(tmp_path, tiny_sd3_dir):
    # 3 trees on 2 processes: the second process samples one real tree and one padding copy
    from safetensors.torch import save_file

    from flowrl.runtime.processes import run_cpu_processes

    def train_and_write() -> int:  # in each of 2 processes forked from this one
        cfg = load_config("tiny_jpeg", [*TREE, f"model.path={tiny_sd3_dir}", "data.prompts_per_iteration=3", "trainer.iterations=2",
                                        "run.checkpoint_every=0", "trainer.kl_beta=0.01", "rollout.tree.width_keep=0.5"])
        trainer = Trainer(cfg, run_dir=tmp_path / "run")
        history = trainer.train()
        rank = trainer.accelerator.process_index
        save_file({n: p.detach().contiguous() for n, p in trainer.params.items()}, str(tmp_path / f"rank{rank}.safetensors"))
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"world": trainer.accelerator.num_processes, "history": history}))
        return 0

    assert run_cpu_processes(2, train_and_write) == 0
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert any(r0[k].abs().sum() > 0 for k in r0 if "lora_B" in k)
    m0, m1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert m0["world"] == 2
    for a, b in zip(m0["history"], m1["history"]):
        assert a["reward_mean"] == b["reward_mean"] and a["samples"] == 12 and a["trees"] == 3
        # every process counts every real tree's kept edges: 3 trees x (2 + 2 + 2 + 2 kept of 2 + 2 + 4 + 4)
        assert a["trained_transitions"] == b["trained_transitions"] == 3 * 8
        assert a["adv_abs_mean/depth2"] == b["adv_abs_mean/depth2"]
        assert a["optimizer_steps"] == b["optimizer_steps"] == 2  # 2 trees' 16 edges a process (padding too): steps of 12 and 4
    assert m0["history"][0]["first_ratio_deviation"] < 1e-5  # shuffled edges: 1 up to float rounding


def test_invalid_leaves_are_dropped_from_fusion_and_advantages(tmp_path, tiny_sd3_dir):
    """reward.on_invalid=drop works for trees (they score through the same reward path as flat
    rollouts): a NaN leaf takes no part in its ancestors' values or its level's statistics, gets
    advantage 0, and the run goes on."""
    from rewards import register

    @register("test_tree_flaky", "mean pixel value, NaN for the first leaf of every call")
    def flaky(images, prompts, metadata=None):
        scores = images.mean(dim=(1, 2, 3))
        scores[0] = float("nan")
        return scores

    trainer = _trainer(tmp_path, tiny_sd3_dir, "drop", "reward.weights={test_tree_flaky: 1.0}", "reward.on_invalid=drop",
                       "trainer.iterations=1", "sampling.batch_size=8")
    batch = trainer.rollout.sample(0)
    valid = batch.scores.valid
    assert valid.tolist() == [False] + [True] * 7  # one call of 8 leaves: the first is NaN
    leaf_adv = batch.advantages[-1]
    assert leaf_adv[0] == 0 and torch.isfinite(leaf_adv).all()
    # tree 0's other three leaves are normalised among themselves (zero mean), not with the dropped one
    assert abs(float(leaf_adv[1:4].sum())) < 1e-4 and leaf_adv[1:4].abs().sum() > 0
    # the node above the last split (level 2) that holds leaves 0 and 1 is worth leaf 1's reward alone
    rewards = batch.scores.local_rewards.float() @ trainer.reward_fn.channel_weights
    values = fuse_rewards(batch.tree.parents, rewards, "mean", leaf_valid=valid)
    node = int(batch.tree.ancestors(batch.tree.num_steps)[2][0])
    assert int(batch.tree.ancestors(batch.tree.num_steps)[2][1]) == node
    assert values[2][node] == pytest.approx(float(rewards[1]))
    row = trainer.train()[0]
    assert row["dropped_samples"] == 1 and math.isfinite(row["loss"]) and math.isfinite(row["reward_mean"])
