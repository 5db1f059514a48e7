"""Off-policy losses (flowrl/core/off_policy.py) on hand-made batches: decoupled PPO equals the
synchronous clipped loss when nothing is stale, and AReaL's formula, written out here, when it
is; TIS's cap and rejection mask; M2PO's second-moment mask and objective."""

import math

import pytest
import torch

from flowrl.core.off_policy import behaviour_weights, decoupled_policy_loss, m2po_mask, m2po_policy_loss
from flowrl.core.token_losses import token_policy_loss


def batch(seed=0, n=4, t=5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, t, generator=g) * 3).requires_grad_()
    prox = logp.detach() + 0.1 * torch.randn(n, t, generator=g)
    behav = prox + 0.4 * torch.randn(n, t, generator=g)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3, 1:] = False
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    return logp, prox, behav, mask, adv


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_with_nothing_stale_it_is_the_synchronous_loss_exactly(aggregation):
    logp, prox, _, mask, adv = batch()
    ours = decoupled_policy_loss(logp, prox, prox, adv, mask, 0.2, 0.28, aggregation)
    sync = token_policy_loss(logp, prox, adv, mask, 0.2, 0.28, aggregation)
    assert torch.equal(ours.loss, sync.loss)
    g1, = torch.autograd.grad(ours.loss, logp)
    g2, = torch.autograd.grad(sync.loss, logp)
    assert torch.equal(g1, g2) and torch.equal(ours.clipped_high, sync.clipped_high)


def areal_reference(logp, prox, behav, adv, mask, eps, cap=None, reject=False):
    """AReaL's ppo_actor_loss_fn with decoupled loss, written out: the clip on exp(logp - prox), the
    detached weight exp(prox - behav), rejected tokens zeroed, the sum over the original mask count."""
    m = mask.float()
    ratio = torch.exp(logp - prox)
    pg1, pg2 = -adv[:, None] * ratio, -adv[:, None] * torch.clamp(ratio, 1 - eps, 1 + eps)
    w = torch.exp(prox - behav)
    keep = m
    if cap is not None and reject:
        keep = m * (w <= cap).float()
    elif cap is not None:
        w = torch.clamp(w, max=cap)
    return (torch.maximum(pg1, pg2) * w * keep).sum() / m.sum()


@pytest.mark.parametrize("mode, cap", [("none", None), ("truncate", 1.2), ("mask", 1.2)])
def test_stale_samples_follow_areals_decoupled_loss(mode, cap):
    logp, prox, behav, mask, adv = batch(seed=1)
    ours = decoupled_policy_loss(logp, prox, behav, adv, mask, 0.2, weight_mode=mode, weight_cap=cap)
    ref = areal_reference(logp, prox, behav, adv, mask, 0.2, cap, reject=mode == "mask")
    torch.testing.assert_close(ours.loss, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(ours.loss, logp)[0], torch.autograd.grad(ref, logp)[0], rtol=1e-6, atol=1e-7)
    w, keep = behaviour_weights(prox, behav, mask, mode, cap)
    if mode == "truncate":
        assert w.max() <= cap and (w[mask] == cap).any()
    if mode == "mask":
        assert (keep != mask).any() and not keep[~mask].any()  # some tokens rejected; never one outside the mask


def test_the_sequence_weight_is_the_geometric_mean_of_its_tokens():
    prox = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    behav = torch.tensor([[-0.3, -1.1, -2.2], [-1.0, -0.5, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w, keep = behaviour_weights(prox, behav, mask, level="sequence")
    assert torch.allclose(w[0], torch.full((3,), math.exp((0.3 + 0.1 + 0.2) / 3)))
    assert torch.allclose(w[1, :2], torch.full((2,), math.exp(-0.5 / 2)))  # the masked token's log-ratio is left out
    assert torch.equal(keep, mask)
    with pytest.raises(ValueError, match="needs a cap"):
        behaviour_weights(prox, behav, mask, mode="truncate")


def test_m2po_masks_the_largest_squared_log_ratios_until_their_mean_is_below_tau():
    behav = torch.zeros(1, 6)
    prox = torch.tensor([[0.5, 0.1, 0.05, 0.3, 0.0, 0.02]])  # squared: .25 .01 .0025 .09 0 .0004
    mask = torch.ones(1, 6, dtype=torch.bool)
    keep = m2po_mask(prox, behav, mask, tau=0.04)
    # all six: mean .059 >= .04; without .25: .0206 < .04, so only the 0.5 token is masked
    assert keep.tolist() == [[False, True, True, True, True, True]]
    assert m2po_mask(prox, behav, mask, tau=0.1).all()  # .059 < .1: nothing masked
    assert m2po_mask(prox, behav, mask, tau=0.0).sum() == 1  # no count reaches 0: all but the smallest
    padded = torch.tensor([[True, True, True, True, True, False]])
    assert not m2po_mask(prox, behav, padded, tau=0.04)[0, 5]  # a token outside the mask is never kept


def test_m2po_loss_is_the_papers_masked_ratio_times_advantage():
    logp, prox, behav, mask, adv = batch(seed=2)
    keep = m2po_mask(prox, behav, mask)
    ours = m2po_policy_loss(logp, behav, adv, mask, keep)
    ref = -(torch.exp(logp - behav) * adv[:, None] * keep.float()).sum() / mask.sum()
    torch.testing.assert_close(ours.loss, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(ours.loss, logp)[0], torch.autograd.grad(ref, logp)[0], rtol=1e-6, atol=1e-7)
