"""Tests for flowrl.core.allocation (docs/algorithms.md section 7): the budget and group-size contract
of every allocator, the VADE posteriors and Thompson draws, largest_remainder, and the
behaviour each allocator promises (sqrt rule, DARS top-ups, successive elimination)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.core.allocation import (
    ALLOCATORS,
    PromptStats,
    _gamma,
    largest_remainder,
    make_allocator,
    run_stages,
)
from flowrl.errors import ConfigError

FAST = settings(max_examples=50, deadline=None)


def bernoulli_outcome(p: torch.Tensor, seed: int):
    """outcome(prompt_ids) -> success, seeded; also records what it returned."""
    g = torch.Generator().manual_seed(seed)
    log = []

    def outcome(ids):
        s = torch.rand(ids.numel(), generator=g, dtype=torch.float64) < p[ids]
        log.append((ids, s))
        return s

    return outcome, log


def run_iterations(alloc, p, iterations, seed):
    """Drive `iterations` iterations with observe; returns each iteration's counts and stages."""
    history = []
    outcome, log = bernoulli_outcome(p, seed)
    for it in range(iterations):
        log.clear()
        counts, stages = run_stages(alloc, it, outcome)
        alloc.observe(torch.cat([i for i, _ in log]), torch.cat([s for _, s in log]))
        history.append((counts, stages))
    return history


# --------------------------------------------------------------------------------------
# The contract, for every allocator
# --------------------------------------------------------------------------------------


@st.composite
def pools(draw):
    num_prompts = draw(st.integers(1, 40))
    per_iteration = draw(st.integers(1, 12))
    budget = draw(st.integers(2 * per_iteration, 6 * per_iteration + 8))
    p = draw(st.lists(st.sampled_from([0.0, 0.05, 0.3, 0.5, 0.7, 0.95, 1.0]), min_size=num_prompts, max_size=num_prompts))
    return num_prompts, per_iteration, budget, torch.tensor(p, dtype=torch.float64)


@FAST
@pytest.mark.parametrize("kind", ALLOCATORS)
@given(pool=pools(), seed=st.integers(0, 1000))
def test_budget_exact_groups_at_least_min_and_deterministic(kind, pool, seed):
    num_prompts, per_iteration, budget, p = pool
    kw = dict(num_prompts=num_prompts, budget=budget, prompts_per_iteration=per_iteration, seed=seed)
    a, b = make_allocator(kind, **kw), make_allocator(kind, **kw)
    ha, hb = run_iterations(a, p, 3, seed), run_iterations(b, p, 3, seed)
    for (counts, stages), (counts_b, stages_b) in zip(ha, hb):
        if a.exact_budget:
            assert int(counts.sum()) == budget  # exactly, every iteration
        else:  # reinforce_ada samples until it has signal, at most its rounds' worth
            assert 0 < int(counts.sum()) <= a.budget
        assert (counts >= 0).all()
        assert (counts[counts > 0] >= 2).all()  # min_group
        assert int(sum(s.numel() for s in stages)) == int(counts.sum())
        assert counts.shape == (num_prompts,) and counts.dtype == torch.long
        assert torch.equal(counts, counts_b) and all(torch.equal(x, y) for x, y in zip(stages, stages_b))


def test_budget_too_small_for_min_group_raises():
    for kind in ALLOCATORS:
        with pytest.raises(ValueError, match="budget"):
            make_allocator(kind, num_prompts=10, budget=7, prompts_per_iteration=4)
    with pytest.raises(ConfigError, match="allocator.kind"):
        make_allocator("greedy", num_prompts=10, budget=8, prompts_per_iteration=4)


def test_different_seeds_choose_different_prompts():
    p = torch.full((200,), 0.5, dtype=torch.float64)
    picks = []
    for seed in (0, 1):
        alloc = make_allocator("uniform", num_prompts=200, budget=32, prompts_per_iteration=8, seed=seed)
        picks.append(run_iterations(alloc, p, 1, 0)[0][0] > 0)
    assert not torch.equal(*picks)


# --------------------------------------------------------------------------------------
# PromptStats: VADE's two-scale posteriors
# --------------------------------------------------------------------------------------


def test_prompt_stats_hand_computed_updates():
    st_ = PromptStats(3, prior_a=1.0, prior_b=1.0, fast_decay=0.5, slow_decay=0.9)
    st_.update(torch.tensor([0, 0, 0, 0]), torch.tensor([True, True, True, False]))
    # nothing to decay yet: both scales hold the raw counts
    assert st_.s_fast[0] == 3 and st_.s_slow[0] == 3 and st_.f_fast[0] == 1 and st_.f_slow[0] == 1
    assert st_.alpha[0] == pytest.approx(1 + 0.5 * (3 + 3)) == 4
    assert st_.beta[0] == pytest.approx(1 + 0.5 * (1 + 1)) == 2
    assert st_.mean()[0] == pytest.approx(4 / 6)

    st_.update(torch.tensor([0, 0, 1, 1]), torch.tensor([False, False, True, False]))
    # prompt 0: decay, then add 0 successes, 2 failures
    assert st_.s_fast[0] == pytest.approx(1.5) and st_.s_slow[0] == pytest.approx(2.7)
    assert st_.f_fast[0] == pytest.approx(0.5 + 2) and st_.f_slow[0] == pytest.approx(0.9 + 2)
    assert st_.alpha[0] == pytest.approx(1 + 0.5 * (1.5 + 2.7)) == pytest.approx(3.1)
    assert st_.beta[0] == pytest.approx(1 + 0.5 * (2.5 + 2.9)) == pytest.approx(3.7)
    # prompt 1, first seen now: 1 success, 1 failure
    assert st_.alpha[1] == pytest.approx(2.0) and st_.beta[1] == pytest.approx(2.0)
    # prompt 2 never sampled: the prior
    assert st_.alpha[2] == 1 and st_.beta[2] == 1
    assert st_.seen.tolist() == [2, 1, 0]

    # a third update that only touches prompt 1: prompt 0 is not decayed
    before = {k: v.clone() for k, v in st_.state_dict().items()}
    st_.update(torch.tensor([1, 1]), torch.tensor([True, True]))
    for k in ("s_fast", "f_fast", "s_slow", "f_slow"):
        assert getattr(st_, k)[0] == before[k][0]
    assert st_.s_fast[1] == pytest.approx(0.5 * 1 + 2) and st_.f_fast[1] == pytest.approx(0.5 * 1)
    assert st_.s_slow[1] == pytest.approx(0.9 * 1 + 2) and st_.f_slow[1] == pytest.approx(0.9 * 1)


def test_prompt_stats_decay_forgets_old_outcomes():
    # a prompt that always failed, then always succeeds: the posterior mean follows the change
    st_ = PromptStats(1, fast_decay=0.5, slow_decay=0.9)
    for _ in range(20):
        st_.update(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.bool))
    assert st_.mean()[0] < 0.1
    for _ in range(20):
        st_.update(torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool))
    assert st_.mean()[0] > 0.85


def test_prompt_stats_state_dict_round_trip():
    a = PromptStats(5)
    a.update(torch.tensor([0, 1, 1, 4]), torch.tensor([True, False, True, True]))
    b = PromptStats(5)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert torch.equal(a.alpha, b.alpha) and torch.equal(a.beta, b.beta) and torch.equal(a.seen, b.seen)


def test_vade_prefers_prompts_near_one_half():
    n, informative = 10, torch.arange(5)
    alloc = make_allocator("vade", num_prompts=n, budget=20, prompts_per_iteration=5, seed=0)
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5] * 5 + [0.0, 1.0, 0.0, 1.0, 0.02], dtype=torch.float64)
    for _ in range(10):  # many outcomes at fixed p: sharp posteriors
        ids = torch.arange(n).repeat_interleave(16)
        alloc.observe(ids, torch.rand(ids.numel(), generator=g, dtype=torch.float64) < p[ids])
    freq = torch.zeros(n)
    for it in range(200):  # posteriors held fixed (no observe): only the Thompson draws vary
        freq += (alloc.first_stage(it) > 0).float()
    freq /= 200
    assert freq[informative].min() > freq[5:].max()
    assert freq[informative].mean() > 0.9


def test_coverage_counts_the_prompts_observed_and_the_iterations_they_were_in():
    alloc = make_allocator("uniform", num_prompts=10, budget=6, prompts_per_iteration=3, seed=0)
    assert alloc.coverage() == {"pool_covered": 0.0, "pool_revisits": 0.0}
    history = run_iterations(alloc, torch.full((10,), 0.5, dtype=torch.float64), 5, seed=0)
    iterations_in = sum((counts > 0).long() for counts, _ in history)  # per prompt
    drawn = iterations_in > 0
    assert alloc.coverage() == pytest.approx({"pool_covered": drawn.double().mean().item(),
                                              "pool_revisits": iterations_in[drawn].double().mean().item()})
    assert 0.3 <= alloc.coverage()["pool_covered"] < 1.0 and alloc.coverage()["pool_revisits"] > 1.0


# --------------------------------------------------------------------------------------
# Thompson draws (hand-written Gamma sampler)
# --------------------------------------------------------------------------------------


def _stats_with(alpha: float, beta: float, n: int, prior: float = 1.0) -> PromptStats:
    s = PromptStats(n, prior_a=prior, prior_b=prior)
    # alpha = prior + (s_fast + s_slow) / 2
    s.s_fast.fill_(alpha - prior)
    s.s_slow.fill_(alpha - prior)
    s.f_fast.fill_(beta - prior)
    s.f_slow.fill_(beta - prior)
    return s


@pytest.mark.parametrize("alpha, beta, prior", [(3.0, 7.0, 1.0), (0.5, 0.5, 0.5), (0.3, 2.0, 0.3), (20.0, 5.0, 1.0)])
def test_thompson_matches_beta_moments(alpha, beta, prior):
    n = 200_000
    s = _stats_with(alpha, beta, n, prior)
    assert torch.allclose(s.alpha, torch.tensor(alpha, dtype=torch.float64))
    draws = s.thompson(torch.Generator().manual_seed(0))
    mean = alpha / (alpha + beta)
    var = alpha * beta / ((alpha + beta) ** 2 * (alpha + beta + 1))
    se_mean = math.sqrt(var / n)
    assert ((draws >= 0) & (draws <= 1)).all()
    assert abs(draws.mean().item() - mean) < 5 * se_mean
    assert draws.var().item() == pytest.approx(var, rel=0.03)
    # a quantile check beyond two moments: the fraction below the mean
    if (alpha, beta) == (0.5, 0.5):  # arcsine law: P(p < 1/4) = 1/3
        assert (draws < 0.25).double().mean().item() == pytest.approx(1 / 3, abs=0.005)


@pytest.mark.parametrize("shape", [0.2, 0.7, 1.0, 2.5, 30.0])
def test_gamma_sampler_moments(shape):
    n = 200_000
    x = _gamma(torch.full((n,), shape, dtype=torch.float64), torch.Generator().manual_seed(1))
    assert (x > 0).all() and torch.isfinite(x).all()
    assert x.mean().item() == pytest.approx(shape, abs=5 * math.sqrt(shape / n))  # Gamma(k, 1): mean k, var k
    assert x.var().item() == pytest.approx(shape, rel=0.04)


def test_thompson_reproducible_from_generator():
    s = _stats_with(3.0, 7.0, 50)
    a = s.thompson(torch.Generator().manual_seed(5))
    b = s.thompson(torch.Generator().manual_seed(5))
    c = s.thompson(torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------------------
# largest_remainder
# --------------------------------------------------------------------------------------


@FAST
@given(
    weights=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=20),
    minimum=st.integers(0, 4),
    extra=st.integers(0, 200),
)
def test_largest_remainder(weights, minimum, extra):
    w = torch.tensor(weights, dtype=torch.float64)
    total = minimum * len(weights) + extra
    counts = largest_remainder(w, total, minimum)
    assert counts.dtype == torch.long and int(counts.sum()) == total
    assert (counts >= minimum).all()
    share = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1 / len(weights))
    assert ((counts - minimum - share * extra).abs() < 1 + 1e-9).all()  # proportional within one


def test_largest_remainder_exact_and_raises():
    assert largest_remainder(torch.tensor([1.0, 1.0, 2.0]), 8).tolist() == [2, 2, 4]
    # 2 each, then the free 6 split 1.5 / 4.5: floors 1 and 4, the tied remainder goes to the first
    assert largest_remainder(torch.tensor([1.0, 3.0]), 10, minimum=2).tolist() == [4, 6]
    assert largest_remainder(torch.tensor([1.0, 2.0, 7.0]), 13, minimum=1).tolist() == [2, 3, 8]
    assert largest_remainder(torch.zeros(4), 6, minimum=1).sum() == 6
    with pytest.raises(ValueError):
        largest_remainder(torch.ones(3), 5, minimum=2)


# --------------------------------------------------------------------------------------
# sqrt (Rollout-GDRO)
# --------------------------------------------------------------------------------------


def test_sqrt_allocation_follows_square_root_rule():
    means = torch.tensor([0.5, 0.1, 0.9, 0.02, 0.3, 0.7], dtype=torch.float64)
    n, budget, min_group = len(means), 96, 2
    alloc = make_allocator("sqrt", num_prompts=n, budget=budget, prompts_per_iteration=n, seed=0, min_group=min_group)
    # posterior means set by hand: alpha = 1 + m * 100, beta = 1 + (1 - m) * 100 (fast = slow counts)
    strength = 100.0
    alloc.load_state_dict({"s_fast": means * strength, "s_slow": means * strength,
                           "f_fast": (1 - means) * strength, "f_slow": (1 - means) * strength})
    m = alloc.stats.mean()
    counts = alloc.first_stage(0)
    assert int(counts.sum()) == budget and (counts >= min_group).all()
    w = (m * (1 - m)).sqrt()
    ideal = min_group + w / w.sum() * (budget - n * min_group)
    assert ((counts - ideal).abs() < 1).all()
    chosen = alloc.choose_prompts(0)  # the order largest_remainder saw the prompts in
    assert torch.equal(counts[chosen], min_group + largest_remainder(w[chosen], budget - n * min_group))
    # square root, not linear in the variance: the linear rule would allocate differently
    v = m * (1 - m)
    linear = min_group + v / v.sum() * (budget - n * min_group)
    assert ((counts - linear).abs() >= 1).any()
    assert int(counts[0]) == int(counts.max()) and int(counts[3]) == int(counts.min())


# --------------------------------------------------------------------------------------
# DARS
# --------------------------------------------------------------------------------------


def test_dars_follows_the_authors_schedule_and_trains_on_mixed_groups():
    # the reference (ray_dars_trainer.py): a group of 8, then totals by accuracy; resample_func1 (equal
    # treatment) 0 -> 32, 1/8 -> 18, 2/8 -> 11, 3/8 -> 9, above -> 8; resample_func2 48, 24, 12, 9, 8
    def resample_func1(acc):
        return 32 if acc <= 1e-6 else 18 if acc <= 1 / 8 + 1e-6 else 11 if acc <= 2 / 8 + 1e-6 else 9 if acc <= 3 / 8 + 1e-6 else 8

    def resample_func2(acc):
        return 48 if acc <= 1e-6 else 24 if acc <= 1 / 8 + 1e-6 else 12 if acc <= 2 / 8 + 1e-6 else 9 if acc <= 3 / 8 + 1e-6 else 8

    from flowrl.core.allocation import dars_total

    for k in range(9):
        assert dars_total(k / 8, 8, "equal") == resample_func1(k / 8)
        assert dars_total(k / 8, 8, "hardness") == resample_func2(k / 8)
    assert dars_total(0.0, 16, "equal") == 64 and dars_total(0.5, 16) == 16  # groups of 16: the totals doubled

    # 5 prompts with 0..4 successes of their first 8 (the pool is the iteration): one second stage
    alloc = make_allocator("dars", num_prompts=5, budget=40, prompts_per_iteration=5, seed=0)
    first = alloc.first_stage(0)
    assert first.tolist() == [8] * 5
    wins = torch.tensor([0, 1, 2, 3, 4])
    extra = alloc.next_stage(first, wins, first - wins)
    assert extra.tolist() == [24, 10, 3, 1, 0]
    assert int(alloc.next_stage(first + extra, wins, first + extra - wins).sum()) == 0  # one second stage only
    # the loss sees the prompts whose samples are neither all failures nor all successes
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    won = torch.tensor([False, False, True, False, True, True])
    assert alloc.keep(ids, won).tolist() == [False, False, True, True, False, False]


@FAST
@given(pool=pools(), seed=st.integers(0, 1000), hard_accuracy=st.sampled_from([0.3, 0.5, 0.8]))
def test_dars_budget_tops_up_only_hard_prompts(pool, seed, hard_accuracy):
    num_prompts, per_iteration, budget, p = pool
    alloc = make_allocator("dars_budget", num_prompts=num_prompts, budget=budget, prompts_per_iteration=per_iteration,
                           seed=seed, hard_accuracy=hard_accuracy, target_positives=2)
    outcome, _ = bernoulli_outcome(p, seed)
    stage = alloc.first_stage(0)
    first = stage > 0
    total = torch.zeros(num_prompts, dtype=torch.long)
    succ = torch.zeros(num_prompts, dtype=torch.long)
    while int(stage.sum()) > 0:
        ids = torch.repeat_interleave(torch.arange(num_prompts), stage)
        succ += torch.bincount(ids, weights=outcome(ids).double(), minlength=num_prompts).long()
        total += stage
        rate = succ.double() / total.clamp_min(1).double()
        hard = (total > 0) & (rate < hard_accuracy) & (succ < 2)
        stage = alloc.next_stage(total, succ, total - succ)
        assert (stage[total == 0] == 0).all()  # top-ups never open new prompts
        if hard.any():
            assert (stage[~hard] == 0).all()  # while hard prompts exist, only they get more
    assert int(total.sum()) == budget and torch.equal(total > 0, first)


# --------------------------------------------------------------------------------------
# Successive elimination (Reinforce-Ada)
# --------------------------------------------------------------------------------------


def drive_recording(alloc, p, iteration, outcome):
    """run_stages by hand, recording the state each next_stage saw and what it returned."""
    n = alloc.num_prompts
    stage = alloc.first_stage(iteration)
    first = stage.clone()
    total = torch.zeros(n, dtype=torch.long)
    succ = torch.zeros(n, dtype=torch.long)
    steps = []
    while int(stage.sum()) > 0:
        ids = torch.repeat_interleave(torch.arange(n), stage)
        succ += torch.bincount(ids, weights=outcome(ids).double(), minlength=n).long()
        total += stage
        stage = alloc.next_stage(total, succ, total - succ)
        steps.append((total.clone(), succ.clone(), stage.clone()))
    return first, total, succ, steps


@FAST
@given(pool=pools(), seed=st.integers(0, 1000), round_size=st.integers(2, 5), cap=st.integers(0, 12))
def test_successive_elimination_respects_cap(pool, seed, round_size, cap):
    num_prompts, per_iteration, budget, p = pool
    kw = dict(round_size=round_size) | (dict(cap=cap) if cap else {})
    alloc = make_allocator("successive_elimination", num_prompts=num_prompts, budget=budget,
                           prompts_per_iteration=per_iteration, seed=seed, **kw)
    cap = cap or 2 * max(1, budget // per_iteration)
    per = max(2, round_size)
    outcome, _ = bernoulli_outcome(p, seed)
    first, total, succ, steps = drive_recording(alloc, p, 0, outcome)
    assert int(total.sum()) == budget
    topped_up = torch.zeros(num_prompts, dtype=torch.bool)
    for counts, s, extra in steps:
        signal = (s > 0) & (s < counts)
        active = (counts > 0) & ~signal & (counts < cap)
        if active.any():
            # a round: only active prompts get more, never beyond the cap
            assert (extra[~active] == 0).all()
            assert (counts + extra)[active].le(cap).all()
        elif int(extra.sum()):
            joiners = (counts == 0) & (extra > 0)
            assert (extra[joiners] == per).all()  # a fresh prompt joins with one round
            if joiners.any():
                # the budget left must afford the joiners more rounds: nothing else gets any
                assert (extra[~joiners] == 0).all()
            else:
                # the final leftover: only to prompts with signal (to every sampled one if none has)
                receivers = signal if signal.any() else counts > 0
                assert (extra[~receivers] == 0).all()
                assert int(extra.max()) - int(extra[receivers].min()) <= 1  # round-robin
                topped_up |= extra > 0
    # nothing passes the cap (or the first stage's / a joining round's size, where a tiny cap
    # is below those) except through the final top-up
    over = total > max(cap, int(first.max()), per)
    assert (topped_up | ~over).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_successive_elimination_few_degenerate_groups_when_signal_possible(seed):
    # p = 0.5 everywhere and an ample budget (16 rollouts per prompt): sampling each prompt until
    # it has a success and a failure leaves almost no degenerate group (uniform groups of 4
    # would be degenerate 1/8 of the time)
    n, per_iteration, budget = 200, 8, 8 * 16
    alloc = make_allocator("successive_elimination", num_prompts=n, budget=budget, prompts_per_iteration=per_iteration, seed=seed)
    p = torch.full((n,), 0.5, dtype=torch.float64)
    outcome, log = bernoulli_outcome(p, seed)
    groups = dead = 0
    for it in range(10):
        log.clear()
        counts, _ = run_stages(alloc, it, outcome)
        ids, s = torch.cat([i for i, _ in log]), torch.cat([x for _, x in log])
        alloc.observe(ids, s)
        succ = torch.bincount(ids, weights=s.double(), minlength=n).long()
        sampled = counts > 0
        groups += int(sampled.sum())
        dead += int((sampled & ((succ == 0) | (succ == counts))).sum())
    assert groups >= 10 * per_iteration
    assert dead / groups < 0.05


def test_successive_elimination_state_round_trip():
    n, p = 30, torch.linspace(0.0, 1.0, 30, dtype=torch.float64)
    kw = dict(num_prompts=n, budget=40, prompts_per_iteration=6, seed=3)
    a = make_allocator("successive_elimination", **kw)
    run_iterations(a, p, 4, seed=0)
    b = make_allocator("successive_elimination", **kw)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    outcome_a, log_a = bernoulli_outcome(p, 9)
    outcome_b, log_b = bernoulli_outcome(p, 9)
    for it in range(4, 8):
        log_a.clear()
        log_b.clear()
        ca, _ = run_stages(a, it, outcome_a)
        cb, _ = run_stages(b, it, outcome_b)
        assert torch.equal(ca, cb)
        a.observe(torch.cat([i for i, _ in log_a]), torch.cat([s for _, s in log_a]))
        b.observe(torch.cat([i for i, _ in log_b]), torch.cat([s for _, s in log_b]))
    # and a fresh allocator without the state allocates differently
    c = make_allocator("successive_elimination", **kw)
    assert not torch.equal(c.stats.alpha, a.stats.alpha)


# --------------------------------------------------------------------------------------
# Reinforce-Ada as its authors run it
# --------------------------------------------------------------------------------------


def reference_rounds(outcomes: list[bool], group: int, round_size: int, max_rounds: int, exit_rule: str) -> int:
    """The authors' sampling of one prompt, written out: rounds of `round_size` until the exit test
    holds after a round, or `max_rounds`; returns how many samples it drew."""
    pos = neg = 0
    for r in range(max_rounds):
        for won in outcomes[r * round_size : (r + 1) * round_size]:
            pos, neg = pos + won, neg + (not won)
        done = pos >= 1 if exit_rule == "positive" else pos >= group // 2 and neg >= group - group // 2
        if done:
            break
    return (r + 1) * round_size


def reference_downsample(successes: list[bool], group: int) -> list[int]:
    """The authors' `downsample_cache`: scan the samples in order into positive and negative
    caches; the first min(n/2, #pos) positives, then negatives up to n, a shortfall filled from
    the other cache. Returns the kept samples' positions."""
    pos = [i for i, won in enumerate(successes) if won]
    neg = [i for i, won in enumerate(successes) if not won]
    take = pos[: min(group // 2, len(pos))]
    take += neg[: min(group - len(take), len(neg))]
    for cache in (pos, neg):  # the shortfall, from whichever cache has samples left
        take += [i for i in cache if i not in take][: group - len(take)]
    return sorted(take)


@pytest.mark.parametrize("exit_rule", ["balanced", "positive"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_ada_samples_and_downsamples_as_the_reference(exit_rule, seed):
    n, group, per_iteration, round_size, max_rounds = 40, 6, 10, 4, 3
    p = torch.tensor([0.0, 0.02, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0] * 5, dtype=torch.float64)
    alloc = make_allocator("reinforce_ada", num_prompts=n, budget=per_iteration * group, prompts_per_iteration=per_iteration,
                           seed=seed, round_size=round_size, max_rounds=max_rounds, exit=exit_rule)
    assert alloc.budget == per_iteration * round_size * max_rounds and not alloc.exact_budget
    outcome, log = bernoulli_outcome(p, seed)
    for it in range(3):
        log.clear()
        counts, stages = run_stages(alloc, it, outcome)
        ids, won = torch.cat([i for i, _ in log]), torch.cat([x for _, x in log])
        assert int((counts > 0).sum()) == per_iteration
        kept = alloc.keep(ids, won)
        for prompt in (counts > 0).nonzero().squeeze(1).tolist():
            mine = (ids == prompt).nonzero().squeeze(1)
            history = won[mine].tolist()
            assert int(counts[prompt]) == reference_rounds(history, group, round_size, max_rounds, exit_rule)
            assert kept[mine].nonzero().squeeze(1).tolist() == reference_downsample(history, group)
            assert int(kept[mine].sum()) == min(group, len(mine))  # a prompt that stopped early trains on fewer
        alloc.observe(ids, won)


def test_reinforce_ada_trains_on_far_fewer_degenerate_groups_than_uniform():
    # p = 0.15 everywhere: a uniform group of 8 is all failures 27% of the time; Reinforce-Ada
    # samples up to 32 and keeps a balanced 8 whenever it found successes (all fail: 0.55%)
    n, per_iteration, group = 100, 16, 8
    p = torch.full((n,), 0.15, dtype=torch.float64)
    dead = {}
    for kind in ("uniform", "reinforce_ada"):
        alloc = make_allocator(kind, num_prompts=n, budget=per_iteration * group, prompts_per_iteration=per_iteration, seed=0)
        outcome, log = bernoulli_outcome(p, 0)
        groups = degenerate = 0
        for it in range(20):
            log.clear()
            run_stages(alloc, it, outcome)
            ids, won = torch.cat([i for i, _ in log]), torch.cat([x for _, x in log])
            kept = alloc.keep(ids, won)
            for prompt in torch.unique(ids[kept]).tolist():
                trained = won[kept & (ids == prompt)]
                groups += 1
                degenerate += int(trained.all() or not trained.any())
            alloc.observe(ids, won)
        dead[kind] = degenerate / groups
    assert dead["uniform"] > 0.15 and dead["reinforce_ada"] < 0.03, dead


def test_reinforce_ada_refuses_rounds_that_cannot_fill_a_group():
    with pytest.raises(ValueError, match="cannot fill groups of 16"):
        make_allocator("reinforce_ada", num_prompts=10, budget=64, prompts_per_iteration=4, round_size=2, max_rounds=4)
    with pytest.raises(ValueError, match="exit"):
        make_allocator("reinforce_ada", num_prompts=10, budget=16, prompts_per_iteration=4, exit="both")


# --------------------------------------------------------------------------------------
# Prompt-GDRO: the data adversary over difficulty bins
# --------------------------------------------------------------------------------------


def test_prompt_gdro_draws_each_bin_by_its_weight_not_its_size():
    # 90 prompts in an easy bin, 10 in a hard one, equal q: each bin gets half the draws (sampling
    # in proportion to size would give the easy bin 90%)
    alloc = make_allocator("prompt_gdro", num_prompts=100, budget=8, prompts_per_iteration=4, seed=0, bins=4)
    alloc.bins = torch.tensor([3] * 90 + [0] * 10)
    alloc.q = torch.tensor([0.25, 0.0, 0.0, 0.25, 0.0], dtype=torch.float64)  # nothing else weighted
    w = alloc.prompt_weights()
    assert w[:90].sum().item() == pytest.approx(0.5) and w[90:].sum().item() == pytest.approx(0.5)
    hard = sum(int((alloc.choose_prompts(it) >= 90).sum()) for it in range(200))
    assert 0.4 < hard / 800 < 0.6


def test_prompt_gdro_adversary_update_by_hand():
    alloc = make_allocator("prompt_gdro", num_prompts=6, budget=4, prompts_per_iteration=2, seed=0, bins=2,
                           step=2.0, ema=0.5, uniform_mix=0.3)
    b = 3  # two bins and the unseen one
    # first visit of bins 0 and 1: no history, so no score; q stays uniform and the EMA starts
    alloc.update_adversary(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(alloc.q, torch.full((b,), 1 / b, dtype=torch.float64))
    assert alloc.error_ema[:2].tolist() == [0.5, 0.0] and alloc.error_ema[2].isnan()
    # bin 0's error rises to 1 (score 0.5), bin 1's stays 0 (score 0), bin 2 unsampled (score 0)
    alloc.update_adversary(torch.tensor([0, 1]), torch.tensor([1.0, 0.0]))
    q = torch.tensor([math.exp(2.0 * 0.5), 1.0, 1.0], dtype=torch.float64) / b
    torch.testing.assert_close(alloc.q, 0.7 * q / q.sum() + 0.3 / b)
    assert alloc.error_ema[:2].tolist() == [0.75, 0.0]


def test_prompt_gdro_bins_follow_pass_at_k_with_hysteresis():
    alloc = make_allocator("prompt_gdro", num_prompts=3, budget=4, prompts_per_iteration=2, seed=0, bins=4, window=4)
    assert alloc.bins.tolist() == [4, 4, 4]  # unseen
    visit = lambda prompt, won: alloc.update_bins(torch.tensor([prompt, prompt]), torch.tensor([won, False]))  # noqa: E731
    visit(0, True)  # pass@k 1: the top bin
    visit(1, False)  # pass@k 0: the bottom bin
    assert alloc.bins.tolist() == [3, 0, 4]
    visit(0, True), visit(0, True), visit(0, False)  # 3/4 = 0.75: on bin 3's lower edge, still inside
    assert alloc.bins[0] == 3
    visit(0, False)  # the window keeps the last four: 1, 1, 0, 0 -> 0.5, past bin 3's edge by more than the margin
    assert alloc.bins[0] == 2
    visit(0, True), visit(0, True), visit(0, True)  # 0, 1, 1, 1 -> 0.75: bin 3's edge, within bin 2's margin
    assert alloc.bins[0] == 2
    visit(0, True)  # 1, 1, 1, 1
    assert alloc.bins[0] == 3


def test_prompt_gdro_shifts_weight_toward_a_bin_whose_error_rises():
    # an easy and a hard class of prompts settle in different bins; then the policy forgets the
    # easy ones (success 0.9 -> 0.3): the adversary moves weight to their bin
    n = 40
    p = torch.tensor([0.9] * 20 + [0.05] * 20, dtype=torch.float64)
    alloc = make_allocator("prompt_gdro", num_prompts=n, budget=32, prompts_per_iteration=8, seed=0, bins=2)
    run_iterations(alloc, p, 30, seed=0)
    easy_bin, hard_bin = int(torch.mode(alloc.bins[:20]).values), int(torch.mode(alloc.bins[20:]).values)
    assert (easy_bin, hard_bin) == (1, 0)
    before = alloc.q[easy_bin].item()
    p[:20] = 0.3
    run_iterations(alloc, p, 3, seed=1)
    assert alloc.q[easy_bin].item() > before + 0.1, (before, alloc.q)


def test_prompt_gdro_state_round_trip():
    p = torch.linspace(0.0, 1.0, 30, dtype=torch.float64)
    kw = dict(num_prompts=30, budget=24, prompts_per_iteration=6, seed=3)
    a = make_allocator("prompt_gdro", **kw)
    run_iterations(a, p, 5, seed=0)
    b = make_allocator("prompt_gdro", **kw)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for x, y in ((a.q, b.q), (a.bins, b.bins), (a.passes, b.passes), (a.visits, b.visits)):
        assert torch.equal(x, y)
    assert torch.equal(a.error_ema.nan_to_num(-1), b.error_ema.nan_to_num(-1))
    assert all(torch.equal(a.choose_prompts(it), b.choose_prompts(it)) for it in range(5, 9))


def test_prompt_gdro_state_is_finite_and_restores_its_no_history_marks():
    alloc = make_allocator("prompt_gdro", num_prompts=6, budget=4, prompts_per_iteration=2, seed=0, bins=2)
    alloc.observe(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert alloc.error_ema.isnan().any() and not alloc.error_ema.isnan().all()  # some bins seen, some not
    state = alloc.state_dict()
    assert all(torch.isfinite(v.float()).all() for v in state.values())  # a checkpoint refuses non-finite tensors
    fresh = make_allocator("prompt_gdro", num_prompts=6, budget=4, prompts_per_iteration=2, seed=0, bins=2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.error_ema.isnan(), alloc.error_ema.isnan())
    assert torch.equal(fresh.error_ema.nan_to_num(), alloc.error_ema.nan_to_num())
