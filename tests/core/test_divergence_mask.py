"""Flow-DPPO's divergence mask (flowrl.core.losses.divergence_masked_policy_loss) against the
truth table and the scalar example its references imply (docs/algorithms.md section 15)."""

from __future__ import annotations

import itertools

import torch

from flowrl.core import gaussian_kl
from flowrl.core.losses import divergence_masked_policy_loss
from flowrl.sampling.steps import transition_std


def test_a_row_is_removed_only_past_the_threshold_when_the_move_pushes_further():
    rows = list(itertools.product((2e-6, 0.0), (1.1, 0.9, 1.0), (1.0, -1.0, 0.0)))  # D, r, A
    d = torch.tensor([r[0] for r in rows])
    log_ratio = torch.log(torch.tensor([r[1] for r in rows]))
    adv = torch.tensor([r[2] for r in rows])
    out = divergence_masked_policy_loss(log_ratio, torch.zeros_like(log_ratio), adv, d, 1e-6)
    expected = [D >= 1e-6 and ((r > 1 and a > 0) or (r < 1 and a < 0)) for D, r, a in rows]
    assert out.clipped.tolist() == expected
    assert sum(expected) == 2  # (violate, r > 1, A > 0) and (violate, r < 1, A < 0) alone


def test_the_flow_sde_example_reaches_the_threshold():
    # sigma 0.8 -> 0.7 at eta 0.7 on Flow-GRPO's SDE (sigma_max 1 excluded as the reference does):
    # s^2 = 0.196; a uniform mean shift of 1e-3 gives D = 1e-6 / 0.392 = 2.551e-6
    s = transition_std("flow_grpo", 0.8, 0.7, 0.7, 1.0)
    assert abs(float(s) ** 2 - 0.196) < 1e-6
    mean = torch.zeros(1, 4, 2, 2)
    d = gaussian_kl(mean + 1e-3, mean, torch.as_tensor(s), "mean")
    assert abs(float(d) - 2.551e-6) < 1e-9 and float(d) >= 1e-6


def test_masked_rows_get_no_gradient_and_an_overflowing_ratio_no_nan():
    log_prob = torch.tensor([80.0, 0.1, -0.1], requires_grad=True)  # r = e^80 in a masked row
    adv = torch.tensor([1.0, 1.0, 1.0])
    out = divergence_masked_policy_loss(log_prob, torch.zeros(3), adv, torch.tensor([1.0, 0.0, 1.0]), 1e-6)
    out.loss.backward()
    assert out.clipped.tolist() == [True, False, False] and torch.isfinite(out.loss)
    assert log_prob.grad[0] == 0 and log_prob.grad[1] != 0 and log_prob.grad[2] != 0  # row 2: corrective, kept
