"""G2RPO: the multi-granularity advantage, the granular rollout's counts and structure on the
shapes model, and a short training run through the loop."""

import json

import pytest
import torch

from flowrl.core.advantages import grpo_advantages, multi_granularity_advantages
from flowrl.sampling.granular import (branch_edges, granular_nfe, granular_rollout, sequential_calls, tail_indices)
from flowrl.sampling.rollout import SamplerSpec
from flowrl.sampling.steps import ode_step

T = 6
BRANCH, GRANULARITIES, G = [0, 1, 2], [1, 2], 3


# ---- the core estimator ---------------------------------------------------------------------------
def test_a_single_granularity_is_plain_group_normalisation():
    r = torch.tensor([1.0, 2.0, 4.0, 0.5, 0.5, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    out = multi_granularity_advantages(r[:, None, None], groups, clip=None)
    expected = torch.cat([(x - x.mean()) / (x.std(unbiased=True) + 1e-8) for x in (r[:3], r[3:])])
    assert torch.allclose(out.advantages, expected, atol=1e-6)
    # the same ordering and zero sums as GRPO's (population std, its own eps)
    plain = grpo_advantages(r, groups).advantages
    assert torch.allclose(out.advantages / out.advantages.norm(), plain / plain.norm(), atol=1e-4)


def test_granularities_and_channels_sum_in_advantage_space_and_clip_after():
    g1 = torch.tensor([0.0, 1.0, 2.0])
    g2 = torch.tensor([10.0, 30.0, 20.0])  # a different scale: it weighs the same after normalisation
    r = torch.stack([g1, g2], 1)[:, :, None]  # [N, L, K=1]
    out = multi_granularity_advantages(r, torch.zeros(3, dtype=torch.long), clip=None)
    each = [(x - x.mean()) / (x.std() + 1e-8) for x in (g1, g2)]
    assert torch.allclose(out.advantages, each[0] + each[1], atol=1e-6)
    clipped = multi_granularity_advantages(r * torch.tensor([1.0, 1.0])[None, :, None], torch.zeros(3, dtype=torch.long), clip=1.5)
    assert torch.allclose(clipped.advantages, (each[0] + each[1]).clamp(-1.5, 1.5), atol=1e-6)
    # a flat granularity adds nothing; a group flat everywhere is degenerate with zero advantage
    flat = torch.stack([g1, torch.full((3,), 7.0)], 1)[:, :, None]
    assert torch.allclose(multi_granularity_advantages(flat, torch.zeros(3, dtype=torch.long), clip=None).advantages, each[0], atol=1e-6)
    dead = multi_granularity_advantages(torch.full((3, 2, 2), 0.4), torch.zeros(3, dtype=torch.long))
    assert bool(dead.degenerate.all()) and not dead.mask.any() and bool((dead.advantages == 0).all())


# ---- the rollout on the shapes model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def policy():
    from flowrl.config import load_config
    from flowrl.models import load_policy

    return load_policy(load_config("default").model)


def branch_spec(policy, noise_level=0.7) -> SamplerSpec:
    sigmas = policy.sigmas(T, "shifted_linear", 1.0)
    sde = torch.zeros(T, dtype=torch.bool)
    sde[BRANCH] = True
    return SamplerSpec(sigmas, sde, "flow_grpo", noise_level)


def test_counts_match_their_closed_forms(policy, monkeypatch):
    rows = []
    original = policy.velocity
    monkeypatch.setattr(policy, "velocity", lambda x, s, c: rows.append(len(x)) or original(x, s, c))
    prompts = ["a red circle", "a blue square"]
    batch = granular_rollout(policy, prompts, [11, 12], branch_spec(policy), BRANCH, GRANULARITIES, G, batch_size=64)
    per_prompt = granular_nfe(T, BRANCH, GRANULARITIES, G)
    # anchor T; tails from steps 1, 2, 3: g=1 takes 5 + 4 + 3 steps, g=2 (one step, then strides of 2: 1 2 4 6,
    # 2 3 5 6, 3 4 6) 3 + 3 + 2
    assert per_prompt == T + G * (5 + 4 + 3 + 3 + 3 + 2)
    assert sum(rows) == batch.nfe == len(prompts) * per_prompt
    # one batched call per sigma index: the anchor's T, then indices 1..5 for the tails
    assert len(rows) == batch.calls == sequential_calls(T, BRANCH, GRANULARITIES) == T + 5
    assert sequential_calls(16, range(8), [1, 2]) <= 2 * 16 + 2  # the reference: 1,792 calls at batch 1


def test_tails_end_at_sigma_zero_and_branches_share_the_anchor(policy):
    for k in range(T):
        for g in (1, 2, 3, 7):
            idx = tail_indices(k, g, T)
            assert idx[-1] == T and all(b - a <= g for a, b in zip(idx, idx[1:]))
    spec = branch_spec(policy)
    batch = granular_rollout(policy, ["a green triangle"], [5], spec, BRANCH, GRANULARITIES, G, batch_size=64)
    sig, cond = spec.sigmas, policy.encode(["a green triangle"])
    for m, k in enumerate(BRANCH):
        # the samples of a branch step share the anchor up to it, and differ after
        nxt = batch.branch_next[0, m]
        assert not torch.allclose(nxt[0], nxt[1]) and not torch.allclose(nxt[1], nxt[2])
        for l_, g in enumerate(GRANULARITIES):
            x = nxt[1:2]
            idx = tail_indices(k, g, T)
            for a, b in zip(idx, idx[1:]):  # the tail, one sample alone, by hand
                x = ode_step(x, policy.velocity(x, float(sig[a]), cond), float(sig[a]), float(sig[b])).next_x
            assert torch.allclose(batch.finals[0, m, l_, 1], x[0], atol=5e-4)  # batches of 1 vs 64 differ by ~1e-4


def test_no_branch_noise_makes_identical_tails_and_a_degenerate_group(policy):
    batch = granular_rollout(policy, ["a red circle"], [3], branch_spec(policy, noise_level=0.0), BRANCH, GRANULARITIES, G,
                             batch_size=64)
    finals = batch.finals[0]  # [M, L, G, ...]
    assert torch.equal(finals[:, :, 0], finals[:, :, 1]) and torch.equal(finals[:, :, 0], finals[:, :, 2])
    rewards = policy.decode(finals.reshape(-1, *finals.shape[3:])).mean((1, 2, 3)).view(len(BRANCH), len(GRANULARITIES), G)
    samples = rewards.permute(0, 2, 1).reshape(-1, len(GRANULARITIES), 1)
    out = multi_granularity_advantages(samples, torch.arange(len(BRANCH)).repeat_interleave(G))
    assert bool(out.degenerate.all()) and bool((out.advantages == 0).all())


def test_the_first_ratio_is_one_in_fp32(policy):
    spec = branch_spec(policy)
    prompts = ["a red circle", "a blue square", "a yellow star"]
    batch = granular_rollout(policy, prompts, [1, 2, 3], spec, BRANCH, GRANULARITIES, G, batch_size=2)
    for m in range(len(BRANCH)):
        for b in (slice(0, 2), slice(2, 3)):  # the anchor's sampling batches
            out = branch_edges(policy, batch, spec, m, b)
            assert torch.equal(out.log_prob, batch.log_probs[b, m].reshape(-1))


# ---- through the loop ---------------------------------------------------------------------------------
def test_granular_training_runs_and_logs_its_counts(tmp_path):
    from flowrl.cli import main

    run = tmp_path / "run"
    args = ["default", "rollout.kind=granular", "objective.kind=grpo", "sampling.sampler=flow_grpo", "run.cpu_processes=1", "trainer.budget_minutes=0",
            "trainer.iterations=2", "sampling.num_steps=4", "rollout.granular.branch_steps=[0,1]", "data.prompts_per_iteration=2",
            "data.group_size=2", "sampling.batch_size=4", "run.sample_every=0", "run.checkpoint_every=0", "trainer.max_minutes=0",
            "run.progress=false", "model.compile=none", "--run-dir", str(run)]  # eager: the default's compile is tested apart
    assert main(["train", *args]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    first = rows[0]
    assert first["first_ratio_deviation"] == 0.0
    assert first["nfe_per_prompt"] == granular_nfe(4, [0, 1], [1, 2], 2)
    assert first["sequential_calls_per_prompt"] == sequential_calls(4, [0, 1], [1, 2])
    assert first["decodes"] == 2 * 2 * 2 * 2
    assert first["optimizer_steps"] == 2  # one per branch step
    assert "adv_abs_mean/step0" in first and "adv_abs_mean/step1" in first


@pytest.mark.parametrize("override, fragment", [
    ("rollout.granular.branch_steps=[2,1]", "rollout.granular.branch_steps must be strictly increasing"),
    ("rollout.granular.branch_steps=[12]", "rollout.granular.branch_steps must be strictly increasing steps in [0, 9]"),
    ("rollout.granular.granularities=[0]", "rollout.granular.granularities must be strictly increasing strides >= 1"),
    ("rollout.granular.tail_grid=strided", "rollout.granular.tail_grid must be one of reference, from_branch"),
    ("rollout.granular.tail_end=last", "rollout.granular.tail_end must be one of zero, x0_prediction"),
    ("rollout.granular.step_order=random", "rollout.granular.step_order must be one of increasing, shuffled"),
    ("objective.kind=nft", "granular"),
    ("advantage.kind=rank", "advantage.kind must be grpo when rollout.kind is granular"),
])
def test_granular_settings_are_checked(override, fragment):
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    extra = [] if override.startswith("objective") else ["objective.kind=grpo"]
    with pytest.raises(ConfigError, match=None) as err:
        load_config("default", ["rollout.kind=granular", "sampling.sampler=flow_grpo", *extra, override])
    assert fragment in str(err.value)
