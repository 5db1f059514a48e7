"""Tests for flowrl.core: GRPO advantages (advantages.py) and policy losses (losses.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.core.advantages import combine_channels, grpo_advantages
from flowrl.core.losses import clipped_policy_loss, gaussian_kl, nft_loss, optimality_probability

FAST = settings(max_examples=50, deadline=None)

# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------

# a non-degenerate group: integer rewards (exact in fp32) with at least two distinct values
_group = st.lists(st.integers(-20, 20), min_size=2, max_size=8).filter(lambda g: len(set(g)) > 1)


@st.composite
def grouped_rewards(draw, max_groups=5):
    """Rewards [N] (fp32) and group ids [N], groups interleaved in a random order."""
    groups = draw(st.lists(_group, min_size=1, max_size=max_groups))
    ids = draw(st.lists(st.integers(0, 10**6), min_size=len(groups), max_size=len(groups), unique=True))
    rewards, group_ids = [], []
    for gid, g in zip(ids, groups):
        rewards += [float(r) for r in g]
        group_ids += [gid] * len(g)
    perm = draw(st.permutations(range(len(rewards))))
    r = torch.tensor(rewards, dtype=torch.float32)[list(perm)]
    gi = torch.tensor(group_ids, dtype=torch.long)[list(perm)]
    return r, gi


def _per_group(values: torch.Tensor, group_ids: torch.Tensor):
    for gid in torch.unique(group_ids):
        yield gid, values[group_ids == gid]


# --------------------------------------------------------------------------------------
# grpo_advantages
# --------------------------------------------------------------------------------------


@FAST
@given(grouped_rewards())
def test_advantages_zero_mean_unit_std_per_group(data):
    r, gi = data
    out = grpo_advantages(r, gi, eps=1e-6)
    assert out.advantages.shape == r.shape and out.advantages.dtype == torch.float32
    assert out.mask.all() and not out.degenerate.any()
    torch.testing.assert_close(out.group_ids, torch.unique(gi))
    for _, a in _per_group(out.advantages, gi):
        assert abs(a.mean().item()) < 1e-5
        assert abs(a.std(unbiased=False).item() - 1) < 1e-4  # population std, as the code documents


def test_advantages_reference_values():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 0.0, 0.0])
    gi = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    out = grpo_advantages(r, gi, eps=0.0)
    g0 = torch.tensor([1.0, 2.0, 3.0, 4.0])
    exp0 = (g0 - g0.mean()) / g0.std(unbiased=False)
    torch.testing.assert_close(out.advantages[:4], exp0)
    torch.testing.assert_close(out.advantages[4:], torch.tensor([1.0, 1.0, -1.0, -1.0]))


@FAST
@given(grouped_rewards(), st.randoms(use_true_random=False))
def test_advantages_permutation_equivariant(data, rnd):
    r, gi = data
    perm = list(range(r.numel()))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    a = grpo_advantages(r, gi).advantages
    b = grpo_advantages(r[perm], gi[perm]).advantages
    torch.testing.assert_close(b, a[perm], rtol=1e-5, atol=1e-6)


@FAST
@given(grouped_rewards(), st.floats(0.01, 100.0), st.floats(-50.0, 50.0))
def test_advantages_invariant_to_positive_affine_rewards(data, scale, rel_shift):
    r, gi = data
    # The shift is drawn relative to the scale so the fp32 rounding of the transformed rewards
    # stays small against the group spread (group std >= 0.33 * scale for distinct integers);
    # eps is tiny relative to that spread, so (r - m) / (std + eps) is affine-invariant up to
    # rounding.
    shift = rel_shift * scale
    a = grpo_advantages(r, gi, std="group", eps=1e-9).advantages
    b = grpo_advantages(r * scale + shift, gi, std="group", eps=1e-9).advantages
    torch.testing.assert_close(b, a, rtol=1e-3, atol=2e-3)


@FAST
@given(
    st.lists(st.tuples(st.integers(-64, 64), st.integers(1, 8)), min_size=1, max_size=4),
    grouped_rewards(max_groups=3),
)
def test_degenerate_groups_flagged_and_zeroed(constant_groups, live):
    # Constant groups use small integer rewards: their fp32 group mean is exact.
    r_live, gi_live = live
    r = [r_live]
    gi = [gi_live]
    deg_ids = []
    for k, (value, n) in enumerate(constant_groups):
        gid = -1 - k  # never collides with the live (non-negative) ids
        deg_ids.append(gid)
        r.append(torch.full((n,), float(value)))
        gi.append(torch.full((n,), gid, dtype=torch.long))
    r, gi = torch.cat(r), torch.cat(gi)
    out = grpo_advantages(r, gi)
    is_deg = (gi < 0)
    assert torch.equal(out.advantages[is_deg], torch.zeros(int(is_deg.sum())))
    assert torch.equal(out.mask, ~is_deg)
    expected_flags = torch.tensor([int(g) < 0 for g in out.group_ids])
    assert torch.equal(out.degenerate, expected_flags)
    assert sorted(int(g) for g in out.group_ids[out.degenerate]) == sorted(deg_ids)


# Regression: equal rewards whose fp32 group mean is inexact have a float std of ~1 ulp.
@pytest.mark.parametrize("value,n", [(0.3, 6), (0.7, 7), (123.456, 5), (1000.1, 3)])
def test_degenerate_group_with_inexact_mean(value, n):
    r = torch.full((n,), value)
    out = grpo_advantages(r, torch.zeros(n, dtype=torch.long))
    assert out.degenerate.all()
    assert not out.mask.any()
    assert torch.equal(out.advantages, torch.zeros(n))


@FAST
@given(grouped_rewards(), st.floats(0.1, 2.0))
def test_advantage_clip(data, clip):
    r, gi = data
    free = grpo_advantages(r, gi).advantages
    clipped = grpo_advantages(r, gi, clip=clip).advantages
    assert (clipped.abs() <= clip + 1e-7).all()
    torch.testing.assert_close(clipped, free.clamp(-clip, clip))


@FAST
@given(
    st.integers(1, 4).flatmap(
        lambda k: st.tuples(
            st.just(k),
            st.lists(st.floats(0.0, 3.0), min_size=k, max_size=k),
            st.integers(0, 2**31),
        )
    )
)
def test_channel_weights_weighted_sum(args):
    k, weights, seed = args
    g = torch.Generator().manual_seed(seed)
    n = 12
    rewards = torch.randn(n, k, generator=g)
    gi = torch.arange(n) // 4
    w = torch.tensor(weights)
    combined = (rewards * w).sum(1)
    torch.testing.assert_close(combine_channels(rewards, w), combined, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(combine_channels(rewards), rewards.sum(1), rtol=1e-5, atol=1e-6)
    out = grpo_advantages(rewards, gi, weights=w)
    ref = grpo_advantages(combined, gi)
    torch.testing.assert_close(out.advantages, ref.advantages, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.mask, ref.mask)


def test_channel_weights_select_a_channel():
    rewards = torch.tensor([[1.0, 50.0], [2.0, -7.0], [3.0, 0.5], [4.0, 3.0]])
    gi = torch.zeros(4, dtype=torch.long)
    only_first = grpo_advantages(rewards, gi, weights=torch.tensor([1.0, 0.0])).advantages
    torch.testing.assert_close(only_first, grpo_advantages(rewards[:, 0], gi).advantages)
    # a 1-D reward vector is its own combination
    torch.testing.assert_close(combine_channels(rewards[:, 1]), rewards[:, 1])


@FAST
@given(grouped_rewards())
def test_global_std_uses_batch_std(data):
    r, gi = data
    out = grpo_advantages(r, gi, std="global", eps=1e-4)
    batch_std = r.std(unbiased=False)  # population std over the whole batch
    for gid, a in _per_group(out.advantages, gi):
        rg = r[gi == gid]
        torch.testing.assert_close(a, (rg - rg.mean()) / (batch_std + 1e-4), rtol=1e-5, atol=1e-5)


def test_global_std_differs_from_group_std_and_zeroes_degenerate():
    r = torch.tensor([0.0, 1.0, 100.0, 300.0, 5.0, 5.0])
    gi = torch.tensor([0, 0, 1, 1, 2, 2])
    out = grpo_advantages(r, gi, std="global", eps=0.0)
    s = r.std(unbiased=False)
    torch.testing.assert_close(out.advantages, torch.stack([-0.5 / s, 0.5 / s, -100 / s, 100 / s, s * 0, s * 0]))
    assert torch.equal(out.mask, torch.tensor([True, True, True, True, False, False]))
    assert torch.equal(out.degenerate, torch.tensor([False, False, True]))


def test_unknown_std_kind():
    with pytest.raises(ValueError):
        grpo_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), std="batch")


# --------------------------------------------------------------------------------------
# clipped_policy_loss
# --------------------------------------------------------------------------------------


@FAST
@given(st.integers(1, 16), st.integers(0, 2**31), st.floats(0.05, 0.5))
def test_ratio_one_is_reinforce(b, seed, clip):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(b, generator=g)
    old = torch.randn(b, generator=g)
    lp = old.clone().requires_grad_(True)
    out = clipped_policy_loss(lp, old, adv, clip)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, -adv / b)
    torch.testing.assert_close(out.loss, -adv.mean())
    torch.testing.assert_close(out.ratio, torch.ones(b))
    assert not out.clipped.any()
    assert not out.ratio.requires_grad and not out.clipped.requires_grad


def test_clipped_ratio_has_zero_gradient_in_favoured_direction():
    eps_lo, eps_hi = 0.2, 0.28
    # element 0: A > 0, ratio 1.5 > 1 + eps_hi -> clipped, no gradient
    # element 1: A < 0, ratio 0.5 < 1 - eps_lo -> clipped, no gradient
    # element 2: A > 0, ratio 0.5 (below the range, against A) -> unclipped, gradient -A r / B
    # element 3: A < 0, ratio 1.5 (above the range, against A) -> unclipped, gradient -A r / B
    # element 4: A > 0, ratio 1.1 inside the range -> unclipped
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1])
    adv = torch.tensor([2.0, -1.0, 2.0, -1.0, 0.7])
    old = torch.tensor([-3.0, 0.2, 1.0, -0.5, 0.0])
    lp = (old + ratio.log()).requires_grad_(True)
    out = clipped_policy_loss(lp, old, adv, eps_lo, eps_hi)
    out.loss.backward()
    b = 5
    expected_grad = torch.tensor([0.0, 0.0, -2.0 * 0.5 / b, 1.0 * 1.5 / b, -0.7 * 1.1 / b])
    torch.testing.assert_close(lp.grad, expected_grad)
    assert torch.equal(out.clipped, torch.tensor([True, True, False, False, False]))
    torch.testing.assert_close(out.ratio, ratio)
    expected_loss = torch.tensor([-2.0 * 1.28, -1.0 * -0.8, -2.0 * 0.5, 1.0 * 1.5, -0.7 * 1.1]).mean()
    torch.testing.assert_close(out.loss, expected_loss)


def test_asymmetric_clip_bounds():
    # ratio 1.25 with A > 0: inside [1 - 0.2, 1 + 0.28] (DAPO's clip-higher) but outside the
    # symmetric [0.8, 1.2]
    old = torch.zeros(1)
    lp = torch.log(torch.tensor([1.25]))
    adv = torch.ones(1)
    assert not clipped_policy_loss(lp, old, adv, 0.2, 0.28).clipped.any()
    assert clipped_policy_loss(lp, old, adv, 0.2).clipped.all()


@FAST
@given(st.integers(0, 2**31), st.floats(0.05, 0.4))
def test_clipped_flags_match_definition(seed, clip):
    g = torch.Generator().manual_seed(seed)
    b = 32
    adv = torch.randn(b, generator=g)
    adv = torch.where(adv.abs() < 1e-3, torch.full_like(adv, 0.5), adv)
    old = torch.randn(b, generator=g)
    log_ratio = torch.randn(b, generator=g) * 0.5
    lp = (old + log_ratio).requires_grad_(True)
    out = clipped_policy_loss(lp, old, adv, clip)
    out.loss.backward()
    r = out.ratio
    favoured = ((adv > 0) & (r > 1 + clip)) | ((adv < 0) & (r < 1 - clip))
    # keep away from the exact clip boundaries, where the branch is a tie
    away = ((r - (1 + clip)).abs() > 1e-4) & ((r - (1 - clip)).abs() > 1e-4)
    assert torch.equal(out.clipped[away], favoured[away])
    assert (lp.grad[favoured & away] == 0).all()
    torch.testing.assert_close(lp.grad[~favoured & away], (-adv * r / b)[~favoured & away])


# --------------------------------------------------------------------------------------
# gaussian_kl
# --------------------------------------------------------------------------------------


def test_gaussian_kl_zero_for_equal_means():
    m = torch.randn(3, 4, 5)
    assert torch.equal(gaussian_kl(m, m.clone(), torch.tensor(0.3)), torch.zeros(3))
    assert torch.equal(gaussian_kl(m, m.clone(), torch.tensor(0.3), reduction="sum"), torch.zeros(3))


@FAST
@given(
    st.integers(0, 2**31),
    st.floats(0.01, 3.0),
    st.sampled_from([(2, 7), (3, 2, 4), (1, 3, 2, 2)]),
)
def test_gaussian_kl_matches_torch(seed, std, shape):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(shape, generator=g, dtype=torch.float64)
    ref = torch.randn(shape, generator=g, dtype=torch.float64)
    std_t = torch.tensor(std, dtype=torch.float64)
    per_dim = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, std_t), torch.distributions.Normal(ref, std_t)
    )
    dims = tuple(range(1, len(shape)))
    torch.testing.assert_close(gaussian_kl(mean, ref, std_t, reduction="sum"), per_dim.sum(dims))
    torch.testing.assert_close(gaussian_kl(mean, ref, std_t, reduction="mean"), per_dim.mean(dims))
    torch.testing.assert_close(gaussian_kl(mean, ref, std_t), per_dim.mean(dims))  # default: mean
    assert (gaussian_kl(mean, ref, std_t) >= 0).all()


def test_gaussian_kl_gradient_flows_to_mean_only():
    mean = torch.randn(2, 6, requires_grad=True)
    ref = torch.randn(2, 6)
    kl = gaussian_kl(mean, ref, torch.tensor(0.5), reduction="sum")
    kl.sum().backward()
    torch.testing.assert_close(mean.grad, (mean - ref).detach() / 0.25)


def test_optimality_probability_maps_advantages_into_zero_one():
    r = optimality_probability(torch.tensor([-3.0, -0.5, 0.0, 0.4, 2.0]))
    assert torch.allclose(r, torch.tensor([0.0, 0.25, 0.5, 0.7, 1.0]))
    assert torch.allclose(optimality_probability(torch.tensor([1.0]), scale=2.0), torch.tensor([0.75]))


@pytest.mark.parametrize("r,beta", [(1.0, 1.0), (0.0, 1.0), (0.8, 0.5), (0.3, 2.0), (0.5, 1.0)])
def test_nft_loss_minimiser_moves_from_the_old_policy_toward_or_away_from_the_target(r, beta):
    # DiffusionNFT: the loss is minimised at v_old + (2r - 1)(u - v_old) / beta
    g = torch.Generator().manual_seed(0)
    v_old, u = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    rr = torch.full((2,), r)
    best = v_old + (2 * r - 1) * (u - v_old) / beta
    v = best.clone().requires_grad_(True)
    nft_loss(v, v_old, u, rr, beta).sum().backward()
    assert v.grad.abs().max() < 1e-5
    off = (best + 0.1 * torch.randn(2, 3, 4, generator=g))
    assert (nft_loss(off, v_old, u, rr, beta) > nft_loss(best, v_old, u, rr, beta)).all()


def test_nft_gradient_at_the_old_policy_is_advantage_weighted_flow_matching():
    # with v_old = v (detached), the gradient is (2r - 1) beta times the flow-matching gradient:
    # better-than-group samples pull their velocity toward u, worse ones push it away
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 5, generator=g, requires_grad=True)
    x, u = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    r, beta = torch.tensor([1.0, 0.0, 0.75, 0.5]), 0.7
    v = x @ w
    nft_loss(v, v.detach(), u, r, beta).sum().backward()
    got = w.grad.clone()
    w.grad = None
    v = x @ w
    ((2 * r - 1) * beta * ((v - u) ** 2).mean(1)).sum().backward()
    assert torch.allclose(got, w.grad, atol=1e-6)


def test_nft_adaptive_weighting_equalises_the_step_per_sample():
    # DiffusionNFT's weighting divides each sample's x0 error by its own mean size: a sample ten
    # times further from its target gets the same gradient, where the plain loss gives it ten times more
    g = torch.Generator().manual_seed(2)
    u = torch.randn(2, 3, 4, generator=g)

    def grads(scale_second: float, **kw) -> torch.Tensor:
        v = torch.stack([u[0] + 0.3, u[1] + 0.3 * scale_second]).requires_grad_(True)
        nft_loss(v, v.detach(), u, torch.ones(2), 1.0, **kw).sum().backward()
        return v.grad

    plain, plain10 = grads(1.0), grads(10.0)
    assert torch.allclose(plain10[1], 10 * plain[1], atol=1e-6)
    weighted, weighted10 = grads(1.0, sigma=0.8), grads(10.0, sigma=0.8)
    assert torch.allclose(weighted10[1], weighted[1], atol=1e-6) and torch.allclose(weighted10[0], weighted[0])


def test_lr_schedules_start_at_the_base_rate_and_decay_to_zero():
    from flowrl.core.lr_schedule import lr_factor

    assert [lr_factor("constant", i, 4) for i in range(4)] == [1.0] * 4
    assert [lr_factor("linear", i, 4) for i in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [lr_factor("cosine", i, 4) for i in range(5)] == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466, 0.0])
    with pytest.raises(ValueError, match="cosine"):
        lr_factor("step", 0, 4)


def test_nft_loss_without_negatives_pulls_only_the_better_samples():
    # the positive half alone: max(2r - 1, 0) ||v+ - u||^2; below-average samples carry no gradient
    g = torch.Generator().manual_seed(1)
    v_old, u = torch.randn(4, 3, 4, generator=g), torch.randn(4, 3, 4, generator=g)
    v = v_old.clone().requires_grad_(True)
    r = torch.tensor([1.0, 0.75, 0.5, 0.1])
    nft_loss(v, v_old, u, r, negatives=False).sum().backward()
    assert v.grad[2:].abs().max() == 0  # r <= 0.5: no move, and no push away
    # r = 1 and 0.75 both pull toward u, with weight 1 and 0.5: grad = w * 2 (v - u) / numel
    per = 2 * (v_old - u) / v_old[0].numel()
    torch.testing.assert_close(v.grad[0], per[0])
    torch.testing.assert_close(v.grad[1], 0.5 * per[1])
    # with negatives the r = 0.1 sample is pushed away: its gradient points from u, not zero
    v2 = v_old.clone().requires_grad_(True)
    nft_loss(v2, v_old, u, r).sum().backward()
    assert (v2.grad[3] * (v_old[3] - u[3])).sum() < 0


def test_unit_scale_per_group_keeps_each_groups_sum_where_clipping_breaks_it():
    from flowrl.core.advantages import unit_scale_per_group

    # group 0: one success among seven failures (A = +2.65 and -0.38 x 7); group 1: all |A| <= 1
    rewards = torch.tensor([1.0] + [0.0] * 7 + [0.2, 0.4, 0.6, 0.8])
    ids = torch.tensor([0] * 8 + [1] * 4)
    a = grpo_advantages(rewards, ids).advantages
    assert a[:8].abs().max() > 2 and a[8:].abs().max() <= 1.35
    scaled = unit_scale_per_group(a, ids)
    for g in (0, 1):
        torch.testing.assert_close(scaled[ids == g].sum(), torch.tensor(0.0), atol=1e-5, rtol=0)
        torch.testing.assert_close(scaled[ids == g].abs().max(), torch.tensor(1.0))
    torch.testing.assert_close(scaled[:8], a[:8] / a[:8].abs().max())  # one factor per group: the ordering stays
    # clipping instead leaves group 0 a net push away from its own samples
    assert a[:8].clamp(-1, 1).sum() < -1.0
    small = torch.tensor([0.5, -0.5, 0.25, -0.25])
    torch.testing.assert_close(unit_scale_per_group(small, torch.tensor([0, 0, 1, 1])), small)  # within +-1: unchanged
