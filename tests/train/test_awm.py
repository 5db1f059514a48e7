"""AWM (objective.kind awm) against the authors' code, written out here (scxue/advantage_weighted_matching,
scripts/train_sd3_awm.py: `compute_log_prob_awm`, the timestep draw, the PPO-clipped loss, the two
KL terms), never imported from flowrl; and one iteration of it through the trainer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.train.experience import Experience
from flowrl.train.objectives.awm import AWM, AWMOptions, awm_indices, awm_policy_loss, awm_weighting, trained_timesteps
from run_checks import assert_close_relative, lora_grads, record_decays



def _awm(tiny_sd3_dir, policy, overrides=()):
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8", "objective.kind=awm", *overrides])
    obj = AWM.__new__(AWM)  # the loss alone: no optimizer, no accelerator
    obj.ctx = SimpleNamespace(cfg=cfg, policy=policy, params=policy.named_trainable_parameters())
    obj.opts, obj.ema = cfg.objective.awm, object()
    return obj


def test_the_weightings_are_the_reference_codes():
    m, t = torch.tensor([0.04], dtype=torch.float64), 0.5
    assert awm_weighting(m, t, "ghuber", 0.25).item() == pytest.approx(2 * ((0.04 + 1e-10) ** 0.25 - 1e-10**0.25), rel=1e-12)
    assert awm_weighting(m, t, "ghuber", 0.25).item() == pytest.approx(0.8881026, abs=1e-7)
    assert awm_weighting(m, t, "uniform").item() == pytest.approx(0.04)
    assert awm_weighting(m, t, "t").item() == pytest.approx(0.02)
    assert awm_weighting(m, t, "t2").item() == pytest.approx(0.01)
    assert awm_weighting(m, t, "huber").item() == pytest.approx(0.5 * (math.sqrt(0.04 + 1e-10) - 1e-5))


def test_the_timestep_draw_takes_one_index_per_stratum():
    gen = torch.Generator().manual_seed(0)
    bounds = [math.floor(b) for b in torch.linspace(1, 12, 7).tolist()]  # 14 steps x 0.9: indices 1..12
    seen = set()
    for _ in range(200):
        idx = awm_indices(14, 6, 0.9, "discrete_wo_init", gen).tolist()
        assert len(idx) == 6 and all(bounds[j] <= i < max(bounds[j + 1], bounds[j] + 1) for j, i in enumerate(idx))
        seen.update(idx)
    assert 0 not in seen and min(seen) == 1 and max(seen) <= 12
    assert awm_indices(14, 6, 0.9, "discrete_with_init", gen)[0] == 0
    assert 0 in {i for _ in range(50) for i in awm_indices(14, 6, 0.9, "discrete", gen).tolist()}


def _reference_loss(v, v_ref, v_ema, x0, eps, t, adv, p, clip, beta, beta_ema):
    """train_sd3_awm.py: m in float64, l = (t / p)((m + 1e-10)^p - (1e-10)^p), log-prob -l against its
    detached self (on-policy), PPO clip, the mean over rows, then beta KL_ref and, inside `if beta > 0`,
    beta_ema KL_ema, both mean squared velocity gaps."""
    m = ((v.double() - (eps - x0).double()) ** 2).mean(dim=(1, 2, 3))
    l = (t / p) * ((m + 1e-10) ** p - (1e-10) ** p)
    log_prob = -l
    ratio = torch.exp(log_prob - log_prob.detach())
    unclipped = -adv.double() * ratio
    clipped = -adv.double() * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = torch.mean(torch.maximum(unclipped, clipped))
    if beta > 0:
        loss = loss + beta * ((v - v_ref) ** 2).mean()
        if beta_ema > 0:
            loss = loss + beta_ema * ((v - v_ema) ** 2).mean()
    return loss


@pytest.mark.parametrize("beta", [0.001, 0.0])
def test_awm_loss_and_gradient_are_the_reference_codes(tiny_sd3_dir, policy, beta):
    obj = _awm(tiny_sd3_dir, policy, [f"objective.awm.beta={beta}"])
    g = torch.Generator().manual_seed(3)
    x0, eps = (torch.randn(4, *policy.latent_shape(), generator=g) for _ in range(2))
    sigma, adv = 0.62, torch.tensor([0.8, -0.3, 0.0, -1.0])
    cond = policy.encode(["a red circle", "a red circle", "two blue squares", "two blue squares"])
    x_t = (1 - sigma) * x0 + sigma * eps
    with policy.guidance(1.0):
        v = policy.velocity(x_t, sigma, cond)
        with torch.no_grad(), policy.reference():
            v_ref = policy.velocity(x_t, sigma, cond)
    v_ema = v.detach() + 0.05 * torch.randn(v.shape, generator=g)
    ours, logged = obj.step_loss(v, v_ref, v_ema, x0, eps, sigma, adv)
    ref = _reference_loss(v, v_ref, v_ema, x0, eps, sigma, adv, 0.25, 1.0, beta, 1.0)
    assert_close_relative(ours.detach(), ref.detach())
    assert_close_relative(lora_grads(ours, policy), lora_grads(ref, policy))
    assert ("kl_ema" in logged) == (beta > 0)  # nested: the EMA term only beside the reference's
    # on-policy the ratio is 1, so the gradient is that of mean_i A_i l_i (the whole algorithm)
    m = ((v.double() - (eps - x0).double()) ** 2).mean(dim=(1, 2, 3))
    plain = (adv.double() * awm_weighting(m, sigma, "ghuber", 0.25)).mean()
    if beta == 0:
        assert_close_relative(lora_grads(ours, policy), lora_grads(plain, policy))


def test_the_clip_stops_a_ratio_past_it_in_the_advantages_direction():
    l = torch.tensor([0.5, 0.5], dtype=torch.float64, requires_grad=True)
    l_old = l.detach() + math.log(1.001)  # r = exp(l_old - l) = 1.001
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, ratio = awm_policy_loss(l, l_old, adv, 1e-4)
    assert torch.allclose(ratio, torch.full((2,), 1.001, dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), l)
    assert grad[0] == 0 and grad[1] != 0  # A > 0 past 1 + c: clipped; A < 0: still pulled back
    loss, _ = awm_policy_loss(l, l_old, adv, 1.0)  # clip 1: r in (0, 2) is never clipped, the loss is -A r
    assert torch.allclose(loss, -adv * 1.001)


def test_advantages_are_scaled_as_the_reference_or_flow_factory(tiny_sd3_dir, policy):
    adv = torch.tensor([4.0, 7.0, -6.0, 0.5])
    exp = Experience(0, torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), adv, "float32")
    assert torch.allclose(_awm(tiny_sd3_dir, policy).scaled_advantages(exp), torch.tensor([0.8, 1.0, -1.0, 0.1]))
    clip = _awm(tiny_sd3_dir, policy, ["objective.awm.advantage_scale=clip"]).scaled_advantages(exp)
    assert torch.allclose(clip, torch.tensor([1.0, 1.0, -1.0, 0.5]))


def test_one_iteration_takes_one_optimizer_step_over_every_micro_batch_and_sigma(tmp_path, tiny_sd3_dir):
    from flowrl.train.loop import Trainer

    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "objective.kind=awm", "sampling.sampler=ode", "sampling.num_steps=6",
                                    "objective.awm.timesteps=3", "data.prompts_per_iteration=2", "data.group_size=4",
                                    "sampling.batch_size=4", "trainer.iterations=2", "lora.rank=4", "lora.alpha=8",
                                    "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    first = {k: v.detach().clone() for k, v in trainer.params.items()}
    rows = trainer.train()
    assert [r["optimizer_steps"] for r in rows] == [1, 1] and [r["trained_transitions"] for r in rows] == [2 * 3] * 2
    assert rows[0]["kl"] == 0.0 and rows[0]["kl_ema"] == 0.0  # the adapter starts at zero and the EMA at the policy
    assert rows[1]["kl"] > 0 and rows[0]["ratio_mean"] == 1.0  # on-policy
    assert any(not torch.equal(first[k], v) for k, v in trainer.params.items())
    ema = trainer.objective.ema.shadow  # d = min(0.3, 0.001 x 2) after the second iteration: almost the weights
    assert any(not torch.equal(first[k], v) for k, v in ema.items())


def test_the_ema_decay_reads_the_optimizer_steps_after_the_epochs_step(tmp_path, tiny_sd3_dir):
    """train_sd3_awm.py: global_step starts at 0 and grows by 1 after each optimizer step; at the end of
    the epoch the KL's EMA decays with d = min(kl_ema_decay, 0.001 x global_step). With one step per epoch
    the first three epochs read 1, 2, 3: at rate 0.1 and cap 0.25, d = 0.1, 0.2, 0.25 (counting from 0
    gave 0, 0.1, 0.2)."""
    from flowrl.train.loop import Trainer

    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "objective.kind=awm", "sampling.sampler=ode", "sampling.num_steps=4",
                                    "sampling.eval_num_steps=4", "objective.awm.timesteps=1", "data.prompts_per_iteration=2",
                                    "data.group_size=2", "sampling.batch_size=4", "trainer.iterations=3", "lora.rank=2", "lora.alpha=4",
                                    "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0",
                                    "objective.awm.ema_decay_rate=0.1", "objective.awm.ema_decay_max=0.25"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    decays = record_decays(trainer.objective.ema)
    rows = trainer.train()
    assert [r["optimizer_steps"] for r in rows] == [1, 1, 1]
    assert decays == pytest.approx([min(0.25, 0.1 * step) for step in (1, 2, 3)])
    assert decays == pytest.approx([0.1, 0.2, 0.25])


def test_bad_awm_settings_are_one_sentence(tiny_sd3_dir):
    base = [f"model.path={tiny_sd3_dir}", "objective.kind=awm", "sampling.sampler=ode"]
    with pytest.raises(ConfigError, match="^objective.awm.weighting must be one of"):
        load_config("tiny_jpeg", [*base, "objective.awm.weighting=cubic"])
    with pytest.raises(ConfigError, match=r"^objective.awm.timesteps \(9\) needs that many grid indices in \[1, 9\]"):
        load_config("tiny_jpeg", [*base, "sampling.num_steps=10", "objective.awm.timesteps=9"])
    assert [trained_timesteps(AWMOptions(), n) for n in (14, 10, 4)] == [6, 4, 2]  # the reference's 6 of 14, scaled


def test_the_sd35_preset_holds_the_reference_settings():
    cfg = load_config("sd35_medium_awm_1gpu", validate_paths=False)
    o = cfg.objective.awm
    assert (cfg.objective.kind, o.timesteps, o.timestep_fraction, o.time_type, o.weighting, o.ghuber_power) == (
        "awm", 6, 0.9, "discrete_wo_init", "ghuber", 0.25)
    assert (o.clip_range, o.advantage_scale, o.beta, o.beta_ema, o.kl_terms, o.guidance_scale) == (1.0, "reference", 0.001, 1.0,
                                                                                                 "nested", 1.0)
    assert (cfg.model.guidance_scale, cfg.sampling.num_steps, cfg.data.group_size, cfg.advantage.std, cfg.advantage.clip) == (
        1.0, 14, 24, "global", 5.0)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.trainer.lr, cfg.trainer.inner_epochs) == (32, 64, 3e-4, 1)
    assert cfg.data.prompts_per_iteration * cfg.data.group_size % cfg.sampling.batch_size == 0
