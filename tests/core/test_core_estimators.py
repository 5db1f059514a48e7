"""Property tests for every advantage estimator in flowrl.core.advantages (docs/algorithms.md section 6):
grpo, mc_grpo, gdpo, rank, reinforce_ada through estimate_advantages."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flowrl.errors import ConfigError
from flowrl.core.advantages import ADVANTAGES, estimate_advantages

FAST = settings(max_examples=50, deadline=None)
TINY_EPS = 1e-9  # the estimators' eps, where a test checks exact math rather than the eps guard


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------


@st.composite
def batches(draw, channels=1, min_size=1, max_size=8, max_groups=5, live_only=False, distinct=False, lo=-20, hi=20):
    """Rewards ([N] for one channel, else [N, channels]) of integers (exact in fp32) and group ids
    [N], groups of varying sizes interleaved in a random order. `live_only`: every group has at
    least two distinct values in channel 0. `distinct`: no two rewards in a group are equal."""
    n_groups = draw(st.integers(1, max_groups))
    rows, gids = [], []
    ids = draw(st.lists(st.integers(0, 10**6), min_size=n_groups, max_size=n_groups, unique=True))
    for gid in ids:
        size = draw(st.integers(max(min_size, 2 if (live_only or distinct) else 1), max_size))
        if distinct:
            first = draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size, unique=True))
        else:
            first = draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size).filter(
                lambda g: not live_only or len(set(g)) > 1))
        cols = [first] + [draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size)) for _ in range(channels - 1)]
        rows += [list(r) for r in zip(*cols)]
        gids += [gid] * size
    perm = list(draw(st.permutations(range(len(rows)))))
    r = torch.tensor(rows, dtype=torch.float32)[perm]
    g = torch.tensor(gids, dtype=torch.long)[perm]
    return (r[:, 0] if channels == 1 else r), g


def kind_channels(kind: str) -> int:
    return 2 if kind == "gdpo" else 1


def groups(group_ids: torch.Tensor):
    for gid in torch.unique(group_ids):
        yield group_ids == gid


def is_flat(rewards: torch.Tensor, sel: torch.Tensor) -> bool:
    v = rewards[sel]
    return bool((v == v[0]).all())


# --------------------------------------------------------------------------------------
# Invariants shared by all kinds
# --------------------------------------------------------------------------------------


@FAST
@pytest.mark.parametrize("kind", ["grpo", "reinforce_ada"])
@given(data=st.data())
def test_zero_mean_per_live_group(kind, data):
    # both centre on the group mean (reinforce_ada does not scale)
    r, g = data.draw(batches())
    out = estimate_advantages(kind, r, g)
    scale = max(1.0, out.advantages.abs().max().item())
    for sel in groups(g):
        if not is_flat(r, sel):
            assert abs(out.advantages[sel].mean().item()) < 1e-5 * scale


@FAST
@pytest.mark.parametrize("kind", ADVANTAGES)
@given(data=st.data())
def test_permutation_equivariant(kind, data):
    r, g = data.draw(batches(channels=kind_channels(kind)))
    perm = torch.tensor(data.draw(st.permutations(range(len(g)))))
    a, b = estimate_advantages(kind, r, g), estimate_advantages(kind, r[perm], g[perm])
    torch.testing.assert_close(b.advantages, a.advantages[perm], atol=1e-5, rtol=1e-5)
    assert torch.equal(b.degenerate, a.degenerate) and torch.equal(b.group_ids, a.group_ids)
    if kind != "mc_grpo":
        assert torch.equal(b.mask, a.mask[perm])
    else:
        # which of several tied median rewards is the pivot depends on the order: only the
        # number of gradient-free samples per group, and the values, are equivariant
        for sel in groups(g):
            assert int((~a.mask[sel]).sum()) == int((~b.mask[sel[perm]]).sum())


@FAST
@given(data=st.data())
def test_mc_grpo_permutation_equivariant_without_ties(data):
    r, g = data.draw(batches(distinct=True))
    perm = torch.tensor(data.draw(st.permutations(range(len(g)))))
    a, b = estimate_advantages("mc_grpo", r, g), estimate_advantages("mc_grpo", r[perm], g[perm])
    torch.testing.assert_close(b.advantages, a.advantages[perm], atol=1e-5, rtol=1e-5)
    assert torch.equal(b.mask, a.mask[perm])


def gdpo_total_reference(r: torch.Tensor, g: torch.Tensor, std: str = "group") -> torch.Tensor:
    """GDPO's weighted sum of per-channel normalised rewards before the batch rescale, in float64
    with plain loops (unit weights; channels flat within a group contribute 0)."""
    r = r.double()
    total = torch.zeros(len(g), dtype=torch.float64)
    for k in range(r.shape[1]):
        col = r[:, k]
        for sel in groups(g):
            v = col[sel]
            if (v == v[0]).all():
                continue
            scale = v.std(unbiased=False) if std == "group" else col.std(unbiased=False)
            total[sel] += (v - v.mean()) / scale
    return total


@FAST
@given(data=st.data(), std=st.sampled_from(["group", "global"]))
def test_gdpo_matches_float64_reference(data, std):
    r, g = data.draw(batches(channels=2))
    total = gdpo_total_reference(r, g, std)
    out = estimate_advantages("gdpo", r, g, std=std, eps=TINY_EPS)
    live = out.mask
    spread = total[live].std(unbiased=False).item() if live.sum() > 1 else 0.0
    # when every live group's channel z-scores cancel, the rescale only amplifies rounding noise
    assume(spread > 1e-3)
    torch.testing.assert_close(out.advantages.double(), total / spread, atol=1e-4, rtol=1e-4)


@FAST
@pytest.mark.parametrize("kind", ["grpo", "mc_grpo", "gdpo", "rank"])  # reinforce_ada: A is in reward units
@given(data=st.data(), scale=st.floats(0.01, 100.0), std=st.sampled_from(["group", "global"]))
def test_positive_scale_invariant(kind, data, scale, std):
    r, g = data.draw(batches(channels=kind_channels(kind)))
    if kind == "gdpo":  # see test_gdpo_matches_float64_reference
        live = ~estimate_advantages(kind, r, g).degenerate[torch.unique(g, return_inverse=True)[1]]
        assume(live.sum() > 1 and gdpo_total_reference(r, g, std)[live].std(unbiased=False) > 1e-3)
    a = estimate_advantages(kind, r, g, std=std, eps=TINY_EPS)
    b = estimate_advantages(kind, r * scale, g, std=std, eps=TINY_EPS)
    torch.testing.assert_close(b.advantages, a.advantages, atol=1e-4, rtol=1e-4)
    assert torch.equal(b.mask, a.mask)


_INCREASING = {
    "affine": lambda x: 3 * x + 7,
    "cube": lambda x: x**3,
    "exp": lambda x: torch.exp(x / 5),
    "atan": torch.atan,
    "shifted_log": lambda x: torch.log(x + 21),
}


@FAST
@given(data=st.data())
def test_rank_invariant_to_increasing_transforms(data):
    r, g = data.draw(batches())
    a = estimate_advantages("rank", r, g)
    for name, f in _INCREASING.items():
        b = estimate_advantages("rank", f(r), g)
        assert torch.equal(a.advantages, b.advantages) and torch.equal(a.mask, b.mask), name


@FAST
@pytest.mark.parametrize("kind", ADVANTAGES)
@given(data=st.data())
def test_degenerate_groups_zero_and_masked(kind, data):
    live_r, live_g = data.draw(batches(channels=kind_channels(kind), live_only=True, max_groups=3))
    n_flat = data.draw(st.integers(1, 3))
    flat_r, flat_g = [], []
    for j in range(n_flat):
        size = data.draw(st.integers(1, 6))
        value = data.draw(st.lists(st.integers(-20, 20), min_size=kind_channels(kind), max_size=kind_channels(kind)))
        flat_r += [value] * size
        flat_g += [-1 - j] * size  # ids disjoint from the live groups' (>= 0)
    fr = torch.tensor(flat_r, dtype=torch.float32)
    fr = fr[:, 0] if kind_channels(kind) == 1 else fr
    r, g = torch.cat([live_r, fr]), torch.cat([live_g, torch.tensor(flat_g)])
    out = estimate_advantages(kind, r, g)
    dead = g < 0
    assert (out.advantages[dead] == 0).all() and not out.mask[dead].any()
    assert torch.equal(out.degenerate, out.group_ids < 0)  # live groups have channel 0 spread
    assert out.mask[~dead].any()
    assert torch.isfinite(out.advantages).all()


@FAST
@pytest.mark.parametrize("kind", ADVANTAGES)
@given(data=st.data(), clip=st.floats(0.05, 3.0))
def test_clip_bounds_advantages(kind, data, clip):
    r, g = data.draw(batches(channels=kind_channels(kind)))
    free = estimate_advantages(kind, r, g)
    out = estimate_advantages(kind, r, g, clip=clip)
    assert (out.advantages.abs() <= clip + 1e-6).all()
    torch.testing.assert_close(out.advantages, free.advantages.clamp(-clip, clip))
    assert torch.equal(out.mask, free.mask)


@FAST
@pytest.mark.parametrize("kind", ADVANTAGES)
@given(data=st.data())
def test_variable_group_sizes(kind, data):
    r, g = data.draw(batches(channels=kind_channels(kind), min_size=1, max_size=9, max_groups=6))
    out = estimate_advantages(kind, r, g)
    assert out.advantages.shape == g.shape and out.mask.shape == g.shape and out.mask.dtype == torch.bool
    assert torch.isfinite(out.advantages).all()
    assert torch.equal(out.group_ids, torch.unique(g))
    for k, gid in enumerate(out.group_ids):
        sel = g == gid
        flat = bool((r[sel] == r[sel][0]).all())
        assert bool(out.degenerate[k]) == flat
        if int(sel.sum()) == 1:  # a group of one has no baseline
            assert flat and out.advantages[sel].item() == 0 and not out.mask[sel].any()


def test_unknown_kind_raises():
    with pytest.raises(ConfigError, match="advantage.kind"):
        estimate_advantages("ppo", torch.tensor([0.0, 1.0]), torch.tensor([0, 0]))


# --------------------------------------------------------------------------------------
# MC-GRPO: median baseline and its pivot
# --------------------------------------------------------------------------------------


@FAST
@given(data=st.data())
def test_mc_grpo_one_pivot_per_odd_group(data):
    r, g = data.draw(batches(live_only=True, min_size=2, max_size=9))
    out = estimate_advantages("mc_grpo", r, g)
    for sel in groups(g):
        n = int(sel.sum())
        dropped = ~out.mask[sel]
        if n % 2:
            assert int(dropped.sum()) == 1
            assert out.advantages[sel][dropped].item() == 0
            assert r[sel][dropped].item() == r[sel].sort().values[n // 2].item()  # the pivot is the median
        else:
            assert not dropped.any()  # no pivot: every sample carries gradient


def test_mc_grpo_odd_group_g_plus_one():
    # G + 1 = 5 samples, G = 4 carry gradient; the median sample is the pivot
    r = torch.tensor([0.2, 0.9, 0.5, 0.1, 0.7])
    out = estimate_advantages("mc_grpo", r, torch.zeros(5, dtype=torch.long))
    assert out.mask.tolist() == [True, True, False, True, True]
    assert out.advantages[2] == 0
    assert torch.equal(torch.sign(out.advantages), torch.sign(r - 0.5))


def test_mc_grpo_median_resists_outlier():
    r = torch.tensor([0.40, 0.45, 0.50, 0.55, 0.60, 0.65, 5.0])
    g = torch.zeros(7, dtype=torch.long)
    want = torch.sign(r - r.median())  # the clean ordering around the median

    def flips(adv):
        decided = want != 0
        return int((torch.sign(adv[decided]) != want[decided]).sum())

    grpo = estimate_advantages("grpo", r, g).advantages
    mc = estimate_advantages("mc_grpo", r, g).advantages
    # the outlier drags the mean above every clean sample: 0.60 and 0.65 get pushed down
    assert (grpo[:6] < 0).all()
    assert flips(grpo) == 2
    assert flips(mc) == 0 and flips(mc) < flips(grpo)
    assert mc[3] == 0 and (mc[4:] > 0).all() and (mc[:3] < 0).all()


# --------------------------------------------------------------------------------------
# GDPO vs GRPO on summed rewards
# --------------------------------------------------------------------------------------


def test_gdpo_symmetric_channels_tie_like_grpo():
    # symmetric channels with equal spreads: per-channel normalisation maps (1, 0) and (0, 1) to
    # the same total, so here decoupling changes nothing
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    g = torch.zeros(4, dtype=torch.long)
    grpo, gdpo = estimate_advantages("grpo", r, g).advantages, estimate_advantages("gdpo", r, g).advantages
    assert grpo[0] == grpo[1] and gdpo[0] == gdpo[1]


@pytest.mark.parametrize(
    "rewards, tied",
    [
        # a sparse channel: (1, 0) and (0, 1) both sum to 1, but channel 2 is rarer (spread 0.43
        # vs 0.5), so its success is worth more after per-channel normalisation
        ([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]], (0, 1)),
        # channels with different within-group spreads: (1, 0) vs (0.75, 0.25) both sum to 1;
        # channel 2 spans only 0.25, so its 0.25 gain outweighs channel 1's 0.25 loss
        ([[0.0, 0.0], [1.0, 0.0], [0.75, 0.25], [0.0, 0.25]], (1, 2)),
    ],
)
def test_gdpo_separates_equal_sums_grpo_ties(rewards, tied):
    r = torch.tensor(rewards)
    g = torch.zeros(len(rewards), dtype=torch.long)
    i, j = tied
    assert r[i].sum() == r[j].sum()
    grpo = estimate_advantages("grpo", r, g).advantages
    gdpo = estimate_advantages("gdpo", r, g).advantages
    assert grpo[i] == grpo[j]
    assert abs(gdpo[i] - gdpo[j]) > 0.1
    assert gdpo[j] > gdpo[i]  # the gain in the narrow (rarer) channel counts for more


def test_gdpo_distinct_combinations_hand_computed():
    # second case above by hand: channel z-scores, summed, then divided by the batch std of the sum
    r = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.75, 0.25], [0.0, 0.25]], dtype=torch.float64)
    z = (r - r.mean(0)) / r.std(0, unbiased=False)
    total = z.sum(1)
    want = total / total.std(unbiased=False)
    out = estimate_advantages("gdpo", r.float(), torch.zeros(4, dtype=torch.long), eps=TINY_EPS)
    torch.testing.assert_close(out.advantages.double(), want, atol=1e-5, rtol=1e-5)


def test_gdpo_group_is_live_if_any_channel_varies():
    # summed rewards are equal (GRPO: degenerate), but the combinations differ (GDPO: live)
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    g = torch.zeros(2, dtype=torch.long)
    assert estimate_advantages("grpo", r, g).degenerate.all()
    out = estimate_advantages("gdpo", r, g)
    assert not out.degenerate.any() and out.mask.all()


# --------------------------------------------------------------------------------------
# Rank advantages
# --------------------------------------------------------------------------------------


@FAST
@given(data=st.data())
def test_rank_range_ties_and_monotone(data):
    r, g = data.draw(batches(lo=0, hi=5))  # a narrow range: many ties
    out = estimate_advantages("rank", r, g)
    a = out.advantages
    assert ((a >= -1) & (a <= 1)).all()
    for sel in groups(g):
        v, av = r[sel], a[sel]
        if is_flat(r, sel):
            continue
        same = v[:, None] == v[None, :]
        assert (av[:, None] == av[None, :])[same].all()  # ties share an advantage
        below = v[:, None] < v[None, :]
        assert (av[:, None] < av[None, :])[below].all()  # strictly monotone in reward
        assert abs(av.sum().item()) < 1e-5  # centred
        if len(set(v.tolist())) == len(v):  # no ties: the extremes reach -1 and 1
            assert math.isclose(av.max().item(), 1.0) and math.isclose(av.min().item(), -1.0)


def test_rank_reference_values():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0, 10.0])
    out = estimate_advantages("rank", r, torch.zeros(5, dtype=torch.long))
    # 0-based average ranks [3, 0, 1.5, 1.5, 4], centred on 2 and scaled by 2
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -1.0, -0.25, -0.25, 1.0]))


def test_reinforce_ada_is_the_authors_global_statistics_baseline():
    # the reference: p = positives / (positives + negatives) over every sample of the prompt, from
    # all rounds; A_i = r_i - p, not divided by a std (norm_adv_by_std_in_grpo off)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    prompts = torch.tensor([7, 7, 7, 7, 7, 3, 3, 3, 9, 9, 9])
    expected = []
    for r, p in zip(rewards.tolist(), prompts.tolist()):
        mine = rewards[prompts == p]
        positives, negatives = int((mine > 0.5).sum()), int((mine <= 0.5).sum())
        expected.append(r - positives / (positives + negatives))
    out = estimate_advantages("reinforce_ada", rewards, prompts, std="group")
    torch.testing.assert_close(out.advantages, torch.tensor(expected), atol=1e-6, rtol=0)
    assert out.mask.all()
    flat = estimate_advantages("reinforce_ada", torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert flat.advantages[:2].eq(0).all() and not flat.mask[:2].any() and flat.mask[2:].all()
