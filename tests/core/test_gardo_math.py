"""GARDO's pieces (flowrl/core/gardo.py) against the worked numbers of GARDO's
specification (docs/monitor.md, "GARDO"), written out here."""

from __future__ import annotations

import pytest
import torch

from flowrl.core.gardo import (KappaController, descending_ranks, diversity_aware_advantages, gated_kl, nearest_neighbour_novelty,
                               reference_reset_due, uncertainty, uncertainty_gate)


def test_diversity_weights_and_advantages_of_the_worked_group():
    e = torch.tensor([[1.0, 0.0], [0.6, 0.8], [1.0, 0.0]])
    groups = torch.zeros(3, dtype=torch.long)
    novelty = nearest_neighbour_novelty(e * torch.tensor([[2.0], [1.0], [5.0]]), groups)  # scale does not matter
    assert novelty.tolist() == pytest.approx([0.0, 0.4, 0.0])
    # mean reward 2/3, mean novelty 0.1333: weights [0, 3, 1] (the below-mean sample keeps 1), no std division
    adv = diversity_aware_advantages(torch.tensor([1.0, 1.0, 0.0]), groups, novelty)
    assert adv.tolist() == pytest.approx([0.0, 1.0, -2 / 3], abs=1e-6)


def test_groups_are_separate_and_degenerate_ones_keep_plain_centred_advantages():
    e = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    groups = torch.tensor([0, 0, 1, 1])
    novelty = nearest_neighbour_novelty(e, groups)
    assert novelty.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0])  # group 1's pair is orthogonal
    adv = diversity_aware_advantages(torch.tensor([2.0, 0.0, 1.0, 3.0]), groups, novelty, clip=5.0)
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])  # group 0: identical features, w = 1
    assert diversity_aware_advantages(torch.tensor([20.0, 0.0]), torch.zeros(2), torch.ones(2), clip=5.0).tolist() == [5.0, -5.0]


def test_ranks_uncertainty_and_the_gate_under_both_signs():
    main, aux = torch.tensor([3.0, 2.0, 1.0]), torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    assert descending_ranks(main).tolist() == [1, 2, 3]
    u = uncertainty(main, aux, "reference_code")
    assert u.tolist() == [-2, 0, 2]
    # u >= 0: {0, 2}; the 90th percentile 1.8; only u = 2 above it: the sample the main reward ranks worst
    assert uncertainty_gate(u, 0.1).tolist() == [False, False, True]
    # the paper's reading gates the sample the main reward over-rates against the auxiliaries
    assert uncertainty_gate(uncertainty(main, aux, "paper"), 0.1).tolist() == [True, False, False]
    assert not uncertainty_gate(torch.tensor([-1.0, -2.0]), 0.1).any()


def test_kappa_grows_shrinks_and_clips_with_its_history():
    k = KappaController()
    assert k.update(0.5) == pytest.approx(0.1)  # the first: kappa0
    assert k.update(0.7) == pytest.approx(0.11)  # above every mean so far: x 1.1
    assert k.update(0.6) == pytest.approx(0.11)  # within [0.5, 0.7]: unchanged
    assert k.update(0.1) == pytest.approx(0.099)  # below every one: x 0.9
    for mu in range(2, 30):
        k.update(float(mu))  # ever larger: x 1.1 each time, up to the cap
    assert k.kappa == pytest.approx(0.2) and len(k.history) == 20
    low = KappaController(kappa0=0.021)
    low.update(1.0)
    assert low.update(0.5) == pytest.approx(0.02)  # 0.0189 clipped to the floor


def test_the_kl_is_averaged_over_gated_rows_only_and_is_zero_without_any():
    kl = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    assert gated_kl(kl, torch.tensor([False, True, True])).item() == pytest.approx(3.0)
    zero = gated_kl(kl, torch.zeros(3, dtype=torch.bool))
    assert zero.item() == 0.0 and zero.requires_grad  # the loss is then the policy term alone


def test_the_reference_resets_on_a_large_kl_or_after_its_period():
    assert reference_reset_due(True, 1, 15)
    assert not reference_reset_due(False, 15, 15)
    assert reference_reset_due(False, 16, 15)
