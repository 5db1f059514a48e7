"""GDRO's listwise group losses and DGPO's group loss (flowrl/core/group_losses.py) on plain tensors."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.core.advantages import estimate_advantages
from flowrl.core.group_losses import dgpo_group_loss, dgpo_weighted_error_loss, listwise_group_loss


@pytest.mark.parametrize("form", ["top1", "plackett_luce"])
def test_pair_at_zero_temperature_is_diffusion_dpo(form):
    beta = 5.0
    delta = torch.tensor([0.03, -0.02, 0.01, 0.04], dtype=torch.float64)  # err_theta - err_ref
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.9], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    loss = listwise_group_loss(-beta * delta, rewards, ids, tau=1e-4, form=form)
    # Diffusion-DPO (Wallace et al. 2023): -log sigmoid(-beta (delta_w - delta_l))
    dpo = torch.stack([-torch.nn.functional.logsigmoid(-beta * (delta[0] - delta[1])),
                       -torch.nn.functional.logsigmoid(-beta * (delta[3] - delta[2]))])
    torch.testing.assert_close(loss, dpo)


@pytest.mark.parametrize("form", ["top1", "plackett_luce"])
def test_constant_shift_of_implicit_rewards_leaves_the_loss_unchanged(form):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(12, generator=g, dtype=torch.float64)
    r = torch.rand(12, generator=g, dtype=torch.float64)
    ids = torch.arange(12) // 6
    shifted = s + torch.where(ids == 0, 3.7, -1.2)
    torch.testing.assert_close(listwise_group_loss(s, r, ids, 0.05, form), listwise_group_loss(shifted, r, ids, 0.05, form))


def test_top1_at_zero_implicit_reward_is_log_k():
    r = torch.tensor([0.1, 0.5, 0.9, 0.3, 1.0, 0.0])
    loss = listwise_group_loss(torch.zeros(6), r, torch.zeros(6, dtype=torch.long), tau=0.05)
    assert loss.item() == pytest.approx(math.log(6), rel=1e-6)


def test_top1_gradient_raises_the_best_and_lowers_the_worst():
    s = torch.zeros(4, requires_grad=True)
    listwise_group_loss(s, torch.tensor([0.0, 1.0, 0.5, 0.2]), torch.zeros(4, dtype=torch.long), tau=0.05).sum().backward()
    assert s.grad[1] < 0 < s.grad[0]  # descent raises s of the best, lowers the worst's


def test_plackett_luce_ties_follow_the_keys():
    s = torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64)
    r = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    ids = torch.zeros(3, dtype=torch.long)
    first = listwise_group_loss(s, r, ids, 1e-4, "plackett_luce", tie_keys=torch.tensor([0.0, 1.0, 2.0]))
    swapped = listwise_group_loss(s, r, ids, 1e-4, "plackett_luce", tie_keys=torch.tensor([1.0, 0.0, 2.0]))
    # tau -> 0: position 1 splits q over the tied pair either way, position 2 holds whichever tie came second
    lse = lambda *x: torch.logsumexp(torch.tensor(x, dtype=torch.float64), 0)
    torch.testing.assert_close(first[0], (lse(0.5, -0.5, 0.0) - 0.0) + (lse(-0.5, 0.0) + 0.5))
    torch.testing.assert_close(swapped[0], (lse(0.5, -0.5, 0.0) - 0.0) + (lse(0.5, 0.0) - 0.5))
    assert not torch.equal(first, swapped)


def test_dgpo_partition_function_cancels_and_sides_balance():
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    delta = torch.tensor([0.1, -0.2, 0.05, 0.3, -0.1, 0.2], dtype=torch.float64)
    base = dgpo_group_loss(delta, adv, ids, beta=100.0)
    # a constant per group (the part of delta shared by every sample: the partition function) cancels
    torch.testing.assert_close(dgpo_group_loss(delta + torch.where(ids == 0, 0.7, -0.4), adv, ids, 100.0), base)
    # the sides balance in what is trained: flowrl's group-normalised advantages sum to 0 in each group,
    # so raising every error of a group equally leaves the code's loss (the default loss_form) unchanged
    rewards = torch.tensor([0.9, 0.1, 0.4, 0.2, 0.7, 0.3], dtype=torch.float64)
    a = estimate_advantages("grpo", rewards, ids).advantages.double()
    assert all(abs(a[ids == g].sum().item()) < 1e-6 for g in (0, 1)) and (a > 0).any() and (a < 0).any()
    err = torch.tensor([0.5, 0.2, 0.9, 0.4, 0.3, 0.6], dtype=torch.float64)
    shifted = err + torch.where(ids == 0, 0.3, -0.2)
    torch.testing.assert_close(dgpo_weighted_error_loss(shifted, delta, a, ids, 100.0).sum(),
                               dgpo_weighted_error_loss(err, delta, a, ids, 100.0).sum())


def test_dgpo_gradient_lowers_the_error_of_the_better_samples():
    delta = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    loss = dgpo_group_loss(delta, adv, torch.zeros(4, dtype=torch.long), beta=8.0)
    assert loss.item() == pytest.approx(math.log(2))
    loss.sum().backward()
    # d/d delta_i = sigmoid(0) * (beta / G) * A_i
    torch.testing.assert_close(delta.grad, 0.5 * (8.0 / 4) * adv)


def test_dgpo_group_sizes_override_the_counts():
    delta, adv = torch.tensor([0.1, -0.1]), torch.tensor([1.0, -1.0])
    ids = torch.zeros(2, dtype=torch.long)
    full = dgpo_group_loss(delta, adv, ids, 10.0, group_sizes=torch.tensor([4.0]))
    assert full.item() == pytest.approx(-math.log(1 / (1 + math.exp(10.0 / 4 * 0.2))), rel=1e-5)
