"""DGPO, GDRO and DiffusionNFT against their references' formulas, written out here from the
reference code (DGPO: Luo-Yihong/DGPO scripts/train_sd3_dgpo.py; DiffusionNFT: NVlabs/DiffusionNFT
scripts/train_nft_sd3.py) or the paper (GDRO, no public code), never imported from flowrl. Each
test runs the objective's own loss on a small batch of the tiny SD3 model's velocities and checks
the loss and its gradient (on the LoRA weights) to 1e-6 relative; docs/algorithms.md gives each
reference's settings and flowrl's named variants."""

from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from flowrl.config import load_config
from flowrl.train.experience import Experience
from flowrl.train.objectives.dgpo import DGPO
from flowrl.train.objectives.gdro import GDRO
from flowrl.train.objectives.implicit import FlowErrors, GroupBatch
from flowrl.train.objectives.nft import NFT, trained_timesteps
from run_checks import assert_close_relative, lora_grads, record_decays



def _objective(cls, tiny_sd3_dir, policy, overrides):
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8", "sampling.num_steps=10", *overrides])
    obj = cls.__new__(cls)  # the loss alone: no optimizer, no accelerator
    obj.ctx = SimpleNamespace(cfg=cfg, policy=policy, params=policy.named_trainable_parameters())
    if cls is NFT:  # NFT keeps its options; the group objectives read them from ctx
        obj.opts = cfg.objective.nft
    return obj


def _batch(policy, n=6, groups=(0, 0, 0, 1, 1, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, *policy.latent_shape(), generator=g)
    eps = torch.randn(n, *policy.latent_shape(), generator=g)
    prompts = ["a red circle"] * 3 + ["two blue squares"] * 3
    return x0, eps, torch.tensor(groups), prompts


def _velocities(policy, x0, eps, sigma, prompts):
    """The reference codes' training inputs: x_t = (1 - t) x0 + t eps, target u = eps - x0, the
    trained (conditional) velocity with grad and the adapter-disabled one without."""
    t = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, *[1] * (x0.ndim - 1))
    x_t, u = (1 - t) * x0 + t * eps, eps - x0
    cond = policy.encode(prompts)
    with policy.guidance(1.0):
        v = policy.velocity(x_t, sigma, cond)
        with torch.no_grad(), policy.reference():
            v_ref = policy.velocity(x_t, sigma, cond)
    return x_t, u, v, v_ref


# ---- DGPO -----------------------------------------------------------------------------------


def _dgpo_reference_loss(v, v_ref, u, adv, groups, beta, group_size, clip=None, v_old=None):
    """Luo-Yihong/DGPO `compute_group_dgpo_loss_allreduce` and its caller, on one process."""
    b = v.shape[0]
    dsm = (u - v).square().reshape(b, -1).mean(dim=1)
    ref_dsm = (u - v_ref).square().reshape(b, -1).mean(dim=1)
    if clip is not None:
        old_dsm = (u - v_old).square().reshape(b, -1).mean(dim=1)
        ratio = torch.exp(-dsm + old_dsm)
        should_clip = torch.where(adv > 0, ratio > 1.0 + clip, ratio < 1.0 - clip)
        dsm = torch.where(should_clip, dsm.detach(), dsm)
    per_sample = adv * beta * (dsm.detach() - ref_dsm.detach()) / group_size
    sums = torch.zeros(int(groups.max()) + 1).scatter_add(0, groups, per_sample)
    weights = torch.sigmoid(sums)[groups]
    return (weights.detach() * adv * dsm).mean()


def _experience(adv, rewards=None):
    n = len(adv)
    return Experience(iteration=0, rewards=torch.zeros(n, 1), prompt_ids=torch.arange(n) // 3, valid=torch.ones(n, dtype=torch.bool),
                      advantages=adv, precision="fp32", reward_totals=rewards)


@pytest.mark.parametrize("clip", [0.0, 0.01])
def test_dgpo_loss_and_gradient_are_the_reference_codes(tiny_sd3_dir, policy, clip):
    obj = _objective(DGPO, tiny_sd3_dir, policy, ["objective.kind=dgpo", f"objective.dgpo.clip_range={clip}"])
    x0, eps, groups, prompts = _batch(policy)
    adv = torch.tensor([1.2, -0.3, -0.9, 0.5, 0.7, -1.2])
    _, u, v, v_ref = _velocities(policy, x0, eps, 0.83, prompts)
    v_old = v.detach() + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(3))  # an older model's velocity
    errors = FlowErrors(((v - u) ** 2).mean((1, 2, 3)), ((v_ref - u) ** 2).mean((1, 2, 3)), v, v_ref)
    batch = GroupBatch(x0, prompts, groups, torch.arange(6), 1.0)
    err_old = ((v_old - u) ** 2).mean((1, 2, 3)) if clip else None
    ours, stats = obj.loss(_experience(adv), batch, errors, err_old)
    ref = _dgpo_reference_loss(v, v_ref, u, adv, groups, 100.0, 3, clip or None, v_old)
    assert_close_relative(ours.detach(), ref.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy))
    if clip:
        assert 0 < stats["clip_fraction"] < 1  # the clip acts on some samples, not all


def test_dgpo_trains_distinct_sigmas_from_the_head_of_its_sampling_grid(tiny_sd3_dir, policy):
    obj = _objective(DGPO, tiny_sd3_dir, policy, ["objective.kind=dgpo", "sampling.num_steps=10"])
    DGPO.__init__(obj, obj.ctx)  # the grid is read once, when the objective is built
    s = obj.ctx.cfg.sampling
    head = policy.sigmas(s.num_steps, s.schedule, s.shift)[:5].tolist()  # DGPO's trunc_steps 4: the first 5 points
    seen = set()
    for it in range(8):
        sigmas = obj.training_sigmas(it, 0)
        assert len(sigmas) == 4 == len(set(sigmas)) and all(any(abs(x - h) < 1e-7 for h in head) for x in sigmas)
        assert sigmas == obj.training_sigmas(it, 0)  # keyed by (seed, iteration, epoch): a resume draws the same
        seen.update(sigmas)
    assert len(seen) == 5


def test_dgpo_anchor_is_the_guided_velocity_gap_at_an_untrained_grid_sigma(tiny_sd3_dir, policy, monkeypatch):
    """objective.dgpo.anchor_beta (a flowrl variant): beta_a x mean((v_cfg - v_cfg_ref)^2) on the micro-batch's first
    anchor_samples samples, at one sigma of the sampling grid below the trained head, fresh noise; both drawn from
    the iteration's own stream, so a resumed run draws the same."""
    from flowrl.core.seeds import Stream, sample_seed

    obj = _objective(DGPO, tiny_sd3_dir, policy, ["objective.kind=dgpo", "objective.dgpo.anchor_beta=2.5",
                                                  "objective.dgpo.anchor_samples=4"])
    DGPO.__init__(obj, obj.ctx)
    monkeypatch.setattr(policy.cfg, "guidance_scale", 3.0)  # the sampled velocity: both branches
    s = obj.ctx.cfg.sampling
    tail = policy.sigmas(s.num_steps, s.schedule, s.shift)[5:-1].tolist()  # the steps below DGPO's first 5 (not the final 0)
    x0, _, groups, prompts = _batch(policy, seed=4)
    batch = GroupBatch(x0, prompts, groups, torch.arange(6), 1.0)
    for iteration in (3, 3, 7):  # the second call of iteration 3 draws the stream's next sigma and noise
        ours = obj.anchor(dataclasses.replace(_experience(torch.zeros(6)), iteration=iteration), batch, x0)
    gen = torch.Generator().manual_seed(sample_seed(obj.ctx.cfg.trainer.seed, 7, Stream.DGPO_ANCHOR))
    sigma = tail[int(torch.randint(len(tail), (), generator=gen))]
    eps = torch.randn(x0[:4].shape, generator=gen)
    t = torch.tensor(sigma)
    x_t, cond = (1 - t) * x0[:4] + t * eps, policy.encode(prompts[:4])
    with policy.guidance(3.0):
        v = policy.velocity(x_t, sigma, cond)
        with torch.no_grad(), policy.reference():
            v_ref = policy.velocity(x_t, sigma, cond)
    ref = 2.5 * ((v - v_ref) ** 2).mean()
    assert_close_relative(ours.detach(), ref.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy))
    assert obj.anchor_iteration == 7


@pytest.mark.parametrize("overrides, gate_below, message", [
    (["objective.dgpo.anchor_beta=1", "objective.dgpo.grid_points=10"], None, "grid_points trains all 10 of them"),
    (["objective.dgpo.anchor_beta=1", "objective.dgpo.sigma_draw=stratified"], None, "needs objective.dgpo.sigma_draw grid"),
    ([], 4, "trains (or anchors) the grid's sigmas {} outside lora.sigma_range"),  # the trained head's last point
    (["objective.dgpo.anchor_beta=1"], 8, "the grid's sigmas {} outside"),  # the anchored steps' last two
])
def test_dgpo_refuses_an_anchor_or_a_grid_it_cannot_train(tiny_sd3_dir, policy, monkeypatch, overrides, gate_below, message):
    from flowrl.errors import ConfigError

    if gate_below is None:  # the config's own check
        with pytest.raises(ConfigError, match=re.escape(message)):
            _objective(DGPO, tiny_sd3_dir, policy, ["objective.kind=dgpo", *overrides])
        return
    obj = _objective(DGPO, tiny_sd3_dir, policy, ["objective.kind=dgpo", *overrides])
    s = obj.ctx.cfg.sampling  # the adapter acts from between grid points gate_below - 1 and gate_below up
    grid = policy.sigmas(s.num_steps, s.schedule, s.shift).tolist()[: s.num_steps]
    monkeypatch.setattr(policy, "lora_sigma_range", ((grid[gate_below] + grid[gate_below - 1]) / 2, 1.0))
    message = message.format([round(x, 4) for x in grid[gate_below:(None if overrides else gate_below + 1)]])
    with pytest.raises(ConfigError, match=re.escape(message)):
        DGPO.__init__(obj, obj.ctx)


# ---- GDRO -----------------------------------------------------------------------------------


def _gdro_reference_loss(v, v_ref, u, rewards, groups, beta, tau, gamma):
    """GDRO (arXiv 2601.02036), top-1: s = -beta (||u - v||^2 - ||u - v_ref||^2) with squared
    norms summed over dimensions; per group logsumexp(s) - sum softmax(r / tau) s, averaged over
    groups; plus gamma times the flow-matching MSE of each group's best sample."""
    b = v.shape[0]
    s = -beta * ((u - v).square().reshape(b, -1).sum(1) - (u - v_ref).square().reshape(b, -1).sum(1))
    listwise, fm = [], []
    for g in groups.unique():
        idx = (groups == g).nonzero().flatten()
        q = torch.softmax(rewards[idx] / tau, 0)
        listwise.append(torch.logsumexp(s[idx], 0) - (q * s[idx]).sum())
        best = idx[rewards[idx].argmax()]
        fm.append((u[best] - v[best]).square().mean())
    return torch.stack(listwise).mean() + gamma * torch.stack(fm).mean()


def test_gdro_loss_and_gradient_are_the_papers(tiny_sd3_dir, policy):
    obj = _objective(GDRO, tiny_sd3_dir, policy, ["objective.kind=gdro", "objective.gdro.beta=6", "objective.gdro.gamma=1.0"])
    x0, eps, groups, prompts = _batch(policy, seed=1)
    rewards = torch.tensor([0.9, 0.1, 0.4, 0.3, 0.8, 0.2])
    _, u, v, v_ref = _velocities(policy, x0, eps, 0.6, prompts)
    errors = FlowErrors(((v - u) ** 2).mean((1, 2, 3)), ((v_ref - u) ** 2).mean((1, 2, 3)), v, v_ref)
    exp = _experience(torch.zeros(6), rewards)
    obj.tie_keys = torch.zeros(6)
    ours, _ = obj.loss(exp, GroupBatch(x0, prompts, groups, torch.arange(6), 1.0), errors, None)
    ref = _gdro_reference_loss(v, v_ref, u, rewards, groups, 6.0, 0.05, 1.0)
    assert_close_relative(ours.detach(), ref.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy))


# ---- DiffusionNFT ---------------------------------------------------------------------------


def _nft_reference_loss(v, v_old, v_ref, x0, x_t, t, adv, beta, adv_clip, kl_beta):
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py: the implicit velocities, x0 predictions with
    the adaptive (detached, per-sample) weight, r from the clipped advantage, the loss times
    A_max / beta, plus the KL weight times the mean squared gap to the base model."""
    b = v.shape[0]
    t = t.reshape(b, 1, 1, 1)
    adv = adv.clamp(-adv_clip, adv_clip)
    r = ((adv / adv_clip) / 2.0 + 0.5).clamp(0, 1).reshape(b)
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v
    x0_pos, x0_neg = x_t - t * v_pos, x_t - t * v_neg
    w_pos = (x0_pos - x0).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5).detach()
    w_neg = (x0_neg - x0).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5).detach()
    l_pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=(1, 2, 3))
    l_neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=(1, 2, 3))
    policy_loss = (adv_clip * (r * l_pos + (1 - r) * l_neg) / beta).mean()
    return policy_loss + kl_beta * ((v - v_ref) ** 2).mean(dim=(1, 2, 3)).mean()


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_and_gradient_are_the_reference_codes(tiny_sd3_dir, policy, beta):
    obj = _objective(NFT, tiny_sd3_dir, policy, ["objective.kind=nft", f"objective.nft.beta={beta}"])
    x0, eps, _, prompts = _batch(policy, seed=2)
    t = torch.tensor([0.95, 0.31, 0.62, 0.88, 0.12, 0.47])  # each sample at its own grid sigma
    adv = torch.tensor([4.0, -1.5, 0.2, 6.5, -7.0, 0.0])  # beyond +-5 the reference clips
    x_t, u, v, v_ref = _velocities(policy, x0, eps, t, prompts)
    v_old = v.detach() + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(5))
    exp = _experience(adv.clamp(-5, 5))  # flowrl's advantages arrive clipped to advantage.clip
    r = 0.5 + 0.5 * obj.optimality(exp).clamp(-1, 1)
    ours = obj.loss(v, v_old, u, r, t) + 0.01 * ((v - v_ref) ** 2).mean()
    ref = _nft_reference_loss(v, v_old, v_ref, x0, x_t, t, adv, beta, 5.0, 0.01)
    assert_close_relative(ours.detach(), ref.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy))


def test_nft_trains_each_sample_on_its_own_permutation_of_the_sampling_grid(tiny_sd3_dir, policy):
    obj = _objective(NFT, tiny_sd3_dir, policy, ["objective.kind=nft", "sampling.num_steps=10"])
    assert trained_timesteps(obj.opts, 10) == 9  # the reference's timestep_fraction 0.99
    grid = obj.grid()
    assert len(grid) == 10 and float(grid[0]) == 1.0 and float(grid[-1]) > 0  # the 10 step sigmas, not the final 0
    steps = obj.batch_sigmas(5, 9, torch.Generator().manual_seed(0))
    table = torch.stack(steps, 1)  # [sample, step]
    assert table.shape == (5, 9)
    assert all(len(set(row.tolist())) == 9 for row in table)  # distinct sigmas per sample
    assert len({tuple(row.tolist()) for row in table}) > 1  # each sample its own order


def _reference_return_decay(step, flat, uprate, uphold):
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py `return_decay`: 0 before `flat`, then a linear rise, capped."""
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def test_nft_old_policy_decay_reads_the_optimizer_steps_after_the_epochs_steps(tmp_path, tiny_sd3_dir):
    """The reference's global_step starts at 0 and grows by 1 after each optimizer step; after an epoch's
    steps the old adapter decays with return_decay(global_step): at one step per epoch the first three
    epochs read 1, 2, 3 (with uprate 0.2, uphold 0.5: 0.2, 0.4, 0.5; counting from 0 gave 0, 0.2, 0.4)."""
    from flowrl.train.loop import Trainer

    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "objective.kind=nft", "sampling.sampler=ode", "sampling.num_steps=4",
                                    "sampling.eval_num_steps=4", "objective.nft.timesteps=1", "data.prompts_per_iteration=2",
                                    "data.group_size=2", "sampling.batch_size=4", "trainer.iterations=3", "trainer.kl_beta=0",
                                    "lora.rank=2", "lora.alpha=4", "run.tracker=none", "run.progress=false", "run.sample_every=0",
                                    "run.checkpoint_every=0", "objective.nft.old_decay=0.5", "objective.nft.old_decay_rate=0.2"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    decays = record_decays(trainer.objective.old)
    rows = trainer.train()
    assert [r["optimizer_steps"] for r in rows] == [1, 1, 1]
    assert decays == pytest.approx([0.2, 0.4, 0.5])
    assert decays == pytest.approx([_reference_return_decay(step, 0, 0.2, 0.5) for step in (1, 2, 3)])


@pytest.mark.parametrize("overrides, steps, iterations, expected", [
    # decay type 1 (flat 0, uprate 1e-3, uphold 0.5): after the first three iterations' one step each, steps 1, 2, 3
    ([], 1, [0, 1, 2], [0.001, 0.002, 0.003]),
    ([], 2, [0, 1, 2], [0.002, 0.004, 0.006]),  # two optimizer steps an iteration: the count after them, 2, 4, 6
    ([], 1, [498, 499, 600], [0.499, 0.5, 0.5]),  # steps 499, 500, 601: capped at uphold 0.5
    # decay type 2 (the OCR config: flat 75, uprate 7.5e-3, uphold 0.999): steps 74, 75, 76, 77, 209
    (["objective.nft.old_decay=0.999", "objective.nft.old_decay_rate=0.0075", "objective.nft.old_decay_flat=75"], 1,
     [73, 74, 75, 76, 208], [0.0, 0.0, 0.0075, 0.015, 0.999]),
    # flowrl's earlier clock (the arena's nft and sol_rl cells): the iterations before this one, 0, 1, 2
    (["objective.nft.old_decay_clock=iterations"], 2, [0, 1, 2], [0.0, 0.001, 0.002]),
])
def test_nft_old_policy_decay_types_are_the_references_schedules(tiny_sd3_dir, policy, overrides, steps, iterations, expected):
    obj = _objective(NFT, tiny_sd3_dir, policy, ["objective.kind=nft", *overrides])
    obj.ctx.plan = SimpleNamespace(progress=float)  # no budget: the nominal iteration is the iteration
    assert [obj.old_decay_after(i, steps) for i in iterations] == pytest.approx(expected)


def test_nft_old_policy_decay_settings_are_one_sentence(tiny_sd3_dir):
    from flowrl.errors import ConfigError

    base = [f"model.path={tiny_sd3_dir}", "objective.kind=nft"]
    with pytest.raises(ConfigError, match="^objective.nft.old_decay_clock must be one of optimizer_steps, iterations"):
        load_config("tiny_jpeg", [*base, "objective.nft.old_decay_clock=epochs"])
    with pytest.raises(ConfigError, match="^objective.nft.old_decay_flat must be a finite number >= 0"):
        load_config("tiny_jpeg", [*base, "objective.nft.old_decay_flat=-1"])


def test_a_velocity_of_per_row_sigmas_equals_one_call_per_sigma(policy):
    x = torch.randn(3, *policy.latent_shape(), generator=torch.Generator().manual_seed(7))
    cond = policy.encode(["a red circle"] * 3)
    sig = torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        rows = policy.velocity(x, sig, cond)
        one = torch.cat([policy.velocity(x[i : i + 1], float(sig[i]), policy.encode(["a red circle"])) for i in range(3)])
    torch.testing.assert_close(rows, one, rtol=1e-4, atol=1e-5)  # batch 3 against batch 1: kernel rounding only


# ---- GRPO-Guard -----------------------------------------------------------------------------


def _guard_reference_loss(mean, mean_old, x_next, std, dt, adv, clip):
    """zhtmike/flow_grpo scripts/train_sd3_GRPO_Guard.py, its `rationorm` branch: dimension-averaged
    Gaussian log-probs of the stored next latent, the ratio exp((logp - logp_old) s + mean(d^2) / (2 s))
    with d = mu - mu_old (not detached), PPO's clip, and the step's loss divided by dt."""
    def logp(m):
        return (-((x_next - m) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(torch.tensor(2 * torch.pi)))).mean(
            dim=(1, 2, 3))

    d2 = ((mean - mean_old) ** 2).mean(dim=(1, 2, 3))
    ratio = torch.exp((logp(mean) - logp(mean_old)) * std + d2 / (2 * std))
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return torch.mean(torch.maximum(unclipped, clipped)) / dt


def test_grpo_guard_loss_and_gradient_are_the_reference_codes(tiny_sd3_dir, policy):
    from flowrl.sampling.steps import flow_grpo_step
    from flowrl.train.experience import TransitionBatch
    from flowrl.train.objectives.grpo import GRPO

    obj = _objective(GRPO, tiny_sd3_dir, policy, ["objective.kind=grpo", "sampling.sampler=flow_grpo", "objective.grpo.ratio_norm=true",
                                                  "objective.grpo.step_reweight=true", "objective.grpo.clip_range=2e-6",
                                                  "trainer.kl_beta=0"])
    obj.ctx.accelerator = SimpleNamespace(device=torch.device("cpu"))
    x0, eps, _, prompts = _batch(policy, seed=4)
    sigma, sigma_next = 0.7, 0.6
    x_t = (1 - sigma) * x0 + sigma * eps
    cond = policy.encode(prompts)
    with torch.no_grad():  # the sampling step: an older model's velocity, then x' = mu_old + s eps'
        v_old = policy.velocity(x_t, sigma, cond) + 0.05 * torch.randn(x_t.shape, generator=torch.Generator().manual_seed(6))
        noise = torch.randn(x_t.shape, generator=torch.Generator().manual_seed(7))
        behaviour = flow_grpo_step(x_t, v_old, sigma, sigma_next, noise=noise, sigma_max=0.9)
    adv = torch.tensor([1.2, -0.3, -0.9, 0.5, 0.7, -1.2])

    def evaluate():
        return flow_grpo_step(x_t, policy.velocity(x_t, sigma, cond), sigma, sigma_next, x_next=behaviour.next_x, sigma_max=0.9)

    mb = TransitionBatch(evaluate, behaviour.log_prob, adv, lambda *a: torch.zeros(()), None,
                         behaviour_mean=lambda: behaviour.mean, dt=sigma - sigma_next)
    ours, terms, _ = obj.micro_batch_loss(mb)
    out = evaluate()
    ref = _guard_reference_loss(out.mean, behaviour.mean, behaviour.next_x, out.std, sigma - sigma_next, adv, 2e-6)
    assert_close_relative(ours.detach(), ref.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy))
    plain = torch.exp(out.log_prob - behaviour.log_prob).detach()  # Flow-GRPO's ratio: biased below 1
    assert (terms.ratio - 1).abs().mean() < (plain - 1).abs().mean()


def test_grpo_guard_needs_flow_grpos_sde_on_flat_rollouts(tiny_sd3_dir):
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="GRPO-Guard"):
        load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "sampling.sampler=dance_grpo", "objective.grpo.ratio_norm=true"])


# ---- Flow-DPPO's trust region (objective.grpo.trust_region divergence_mask) ------------------


def _dppo_reference_loss(mean, mean_old, log_prob, log_prob_old, std, adv, tau):
    """Tencent-Hunyuan/UniRL `_flowdppo_kl_adv_loss` (x-based, with the variance scaling): the
    equal-covariance Gaussian KL per element, averaged; keep a row when it is below tau or when the
    move is corrective; the unclipped surrogate where kept, 0 elsewhere; a mean over the rows."""
    ratio = torch.exp(log_prob - log_prob_old)
    kl = ((mean.detach() - mean_old) ** 2 / (2 * std**2)).mean(dim=(1, 2, 3))
    corrective = ~(((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    keep = ((kl < tau) | corrective).detach()
    return torch.where(keep, -adv * ratio, torch.zeros_like(ratio)).mean(), kl, keep


class _SdeStep(NamedTuple):
    """What the GRPO loss reads of a step's evaluation: the transition's mean, std and log-prob."""

    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor
    next_x: torch.Tensor


def _flow_sde_step(x, v, sigma, sigma_next, eta, noise=None, x_next=None):
    """Flow-GRPO's SDE step as its sde_step_with_logprob writes it (Flow-DPPO trains on it in UniRL):
    s = eta sqrt(sigma / (1 - sigma)), mean = x (1 + s^2 dt / (2 sigma)) + v (1 + s^2 (1 - sigma) / (2 sigma)) dt,
    x' = mean + s sqrt(-dt) z, the log-prob the Gaussian log-density of x' under std s sqrt(-dt), averaged
    over elements."""
    dt = sigma_next - sigma
    s = eta * math.sqrt(sigma / (1 - sigma))
    mean = x * (1 + s**2 * dt / (2 * sigma)) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    std = torch.tensor(s * math.sqrt(-dt))
    x_next = mean + std * noise if x_next is None else x_next
    log_prob = (-((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    return _SdeStep(mean, std, log_prob, x_next)


def _dppo_micro_batch(policy, perturb: float):
    """One Flow-GRPO SDE step of the tiny model, written out above (not flowrl's step function): the
    behaviour step's velocity is the policy's plus `perturb` x noise (an older policy), and evaluate()
    recomputes the step under the current weights."""
    from flowrl.train.experience import TransitionBatch

    x0, eps, _, prompts = _batch(policy, seed=5)
    sigma, sigma_next, eta = 0.8, 0.7, 0.7
    x_t = (1 - sigma) * x0 + sigma * eps
    cond = policy.encode(prompts)
    with torch.no_grad():
        v_old = policy.velocity(x_t, sigma, cond).float() + perturb * torch.randn(x_t.shape, generator=torch.Generator().manual_seed(6))
        noise = torch.randn(x_t.shape, generator=torch.Generator().manual_seed(7))
        behaviour = _flow_sde_step(x_t, v_old, sigma, sigma_next, eta, noise=noise)
    assert float(behaviour.std) == pytest.approx(1.4 * math.sqrt(0.1))  # s = 0.7 sqrt(0.8 / 0.2) = 1.4; x sqrt(-dt): 0.4427
    adv = torch.tensor([1.2, -0.3, -0.9, 0.5, 0.7, -1.2])

    def evaluate():
        return _flow_sde_step(x_t, policy.velocity(x_t, sigma, cond).float(), sigma, sigma_next, eta, x_next=behaviour.next_x)

    mb = TransitionBatch(evaluate, behaviour.log_prob, adv, lambda *a: torch.zeros(()), None, behaviour_mean=lambda: behaviour.mean,
                         dt=sigma - sigma_next)
    return mb, behaviour, evaluate, adv


def test_dppo_divergence_mask_loss_and_gradient_are_the_reference_codes(tiny_sd3_dir, policy):
    from flowrl.train.objectives.grpo import GRPO

    mb, behaviour, evaluate, adv = _dppo_micro_batch(policy, perturb=0.05)
    out = evaluate()
    _, kl, _ = _dppo_reference_loss(out.mean, behaviour.mean, out.log_prob, behaviour.log_prob, out.std, adv, 0.0)
    tau = float(kl.median())  # half the rows past the threshold: both branches of the mask run
    obj = _objective(GRPO, tiny_sd3_dir, policy, ["objective.kind=grpo", "sampling.sampler=flow_grpo", "trainer.kl_beta=0",
                                                  "objective.grpo.trust_region=divergence_mask",
                                                  f"objective.grpo.divergence_threshold={tau}"])
    obj.ctx.accelerator = SimpleNamespace(device=torch.device("cpu"))
    ours, terms, _ = obj.micro_batch_loss(mb)
    out = evaluate()
    ref, _, keep = _dppo_reference_loss(out.mean, behaviour.mean, out.log_prob, behaviour.log_prob, out.std, adv, tau)
    assert 0 < int((~keep).sum()) < len(adv)  # some rows masked, some kept
    assert torch.equal(terms.clipped, ~keep)
    assert_close_relative(ours.detach(), ref.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy))


def test_dppo_on_policy_first_step_keeps_every_row_and_is_the_plain_surrogate(tiny_sd3_dir, policy):
    # the first micro-step: the current weights sampled the step, so mu = mu_old, D = 0 and nothing is
    # masked; the loss is mean(-A r) with r = 1, and its gradient that of the unclipped surrogate
    from flowrl.train.objectives.grpo import GRPO

    obj = _objective(GRPO, tiny_sd3_dir, policy, ["objective.kind=grpo", "sampling.sampler=flow_grpo", "trainer.kl_beta=0",
                                                  "objective.grpo.trust_region=divergence_mask"])
    obj.ctx.accelerator = SimpleNamespace(device=torch.device("cpu"))
    mb, behaviour, evaluate, adv = _dppo_micro_batch(policy, perturb=0.0)
    ours, terms, _ = obj.micro_batch_loss(mb)
    assert not terms.clipped.any() and torch.allclose(terms.ratio, torch.ones_like(terms.ratio))
    plain = (-adv * torch.exp(evaluate().log_prob - behaviour.log_prob)).mean()
    assert_close_relative(ours.detach(), plain.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(plain, policy))
