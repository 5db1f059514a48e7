"""Tests for flowrl.core.selection: choosing k of M candidates by their rewards."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import ConfigError
from flowrl.core.selection import SELECTIONS, best_worst, max_variance, mean_deviation, random_subset, select

FAST = settings(max_examples=50, deadline=None)


@st.composite
def pool_and_k(draw, max_m=10, integers=False):
    m = draw(st.integers(1, max_m))
    if integers:  # many ties
        values = draw(st.lists(st.integers(-3, 3), min_size=m, max_size=m))
    else:
        values = draw(st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=m, max_size=m))
    k = draw(st.integers(1, m))
    return torch.tensor(values, dtype=torch.float32), k


def population_var(values) -> float:
    v = torch.as_tensor(values, dtype=torch.float64)
    return v.var(unbiased=False).item() if v.numel() > 1 else 0.0


def assert_valid_subset(idx: torch.Tensor, m: int, k: int):
    assert idx.dtype == torch.long and idx.shape == (k,)
    assert len(set(idx.tolist())) == k
    assert ((idx >= 0) & (idx < m)).all()


@FAST
@given(pool=st.one_of(pool_and_k(), pool_and_k(integers=True)))
def test_max_variance_equals_brute_force(pool):
    r, k = pool
    idx = max_variance(r, k)
    assert_valid_subset(idx, r.numel(), k)
    r64 = r.double()
    best = max(population_var(r64[list(c)]) for c in itertools.combinations(range(r.numel()), k))
    got = population_var(r64[idx])
    assert got == pytest.approx(best, rel=1e-5, abs=1e-6)


def test_max_variance_all_k_exhaustive_small_pools():
    # every k for a few fixed pools up to M = 10 (the hypothesis test samples k)
    g = torch.Generator().manual_seed(0)
    for m in (2, 5, 8, 10):
        for trial in range(3):
            r = torch.randn(m, generator=g) * (1 + trial)
            if trial == 2:
                r[: m // 2] = r[0]  # a block of ties
            for k in range(1, m + 1):
                best = max(population_var(r.double()[list(c)]) for c in itertools.combinations(range(m), k))
                assert population_var(r.double()[max_variance(r, k)]) == pytest.approx(best, rel=1e-5, abs=1e-6)


@FAST
@given(pool=st.one_of(pool_and_k(), pool_and_k(integers=True)))
def test_best_worst_takes_top_ceil_and_bottom_floor(pool):
    r, k = pool
    idx = best_worst(r, k)
    assert_valid_subset(idx, r.numel(), k)
    ordered = torch.sort(r, descending=True).values
    n_top, n_bottom = (k + 1) // 2, k // 2
    want = torch.cat([ordered[:n_top], ordered[r.numel() - n_bottom :] if n_bottom else ordered[:0]])
    assert torch.equal(torch.sort(r[idx]).values, torch.sort(want).values)
    # the first ceil(k/2) indices are the top ones
    assert torch.equal(torch.sort(r[idx[:n_top]], descending=True).values, ordered[:n_top])
    if k >= 2:  # the subset spans the whole pool
        assert (r[idx].max() - r[idx].min()).item() == (r.max() - r.min()).item()


def test_best_worst_reference():
    r = torch.tensor([0.5, 0.9, 0.1, 0.7, 0.3])
    assert best_worst(r, 3).tolist() == [1, 3, 2]  # 0.9, 0.7 and 0.1
    assert best_worst(r, 2).tolist() == [1, 2]
    assert best_worst(r, 1).tolist() == [1]


@FAST
@given(pool=st.one_of(pool_and_k(), pool_and_k(integers=True)))
def test_mean_deviation_picks_farthest_from_mean(pool):
    r, k = pool
    idx = mean_deviation(r, k)
    assert_valid_subset(idx, r.numel(), k)
    dev = (r - r.mean()).abs()
    rest = torch.ones(r.numel(), dtype=torch.bool)
    rest[idx] = False
    if rest.any():
        assert dev[idx].min() >= dev[rest].max()


@FAST
@given(pool=pool_and_k(), seed=st.integers(0, 2**31))
def test_random_subset_valid_and_reproducible(pool, seed):
    r, k = pool
    a = random_subset(r, k, torch.Generator().manual_seed(seed))
    b = select("random", r, k, torch.Generator().manual_seed(seed))
    assert_valid_subset(a, r.numel(), k)
    assert torch.equal(a, b)


def test_random_subset_varies_with_seed():
    r = torch.arange(20.0)
    draws = {tuple(random_subset(r, 5, torch.Generator().manual_seed(s)).tolist()) for s in range(10)}
    assert len(draws) > 1


@pytest.mark.parametrize("kind", SELECTIONS)
@pytest.mark.parametrize("k", [0, -1, 6])
def test_bad_k_raises(kind, k):
    with pytest.raises(ValueError, match="selection size"):
        select(kind, torch.arange(5.0), k, torch.Generator().manual_seed(0))


def test_unknown_kind_raises():
    with pytest.raises(ConfigError, match="selection.kind"):
        select("top", torch.arange(5.0), 2)


@pytest.mark.parametrize("kind", SELECTIONS)
def test_select_dispatches(kind):
    r = torch.tensor([3.0, -1.0, 2.0, 8.0, 0.0, 5.0])
    fns = {"best_worst": best_worst, "max_variance": max_variance, "mean_deviation": mean_deviation}
    got = select(kind, r, 4, torch.Generator().manual_seed(1))
    assert_valid_subset(got, 6, 4)
    if kind in fns:
        assert torch.equal(got, fns[kind](r, 4))
