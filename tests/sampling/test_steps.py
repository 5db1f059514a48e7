"""Tests for flowrl.sampling: step functions (steps.py), sigma schedules and SDE windows
(schedules.py) and reproducible noise (noise.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.schedules import shifted_sigmas, stratified_sigma, time_shift, window_mask, window_start, window_steps
from flowrl.sampling.steps import (
    STEP_FUNCTIONS,
    cps_step,
    dance_grpo_step,
    flow_grpo_step,
    ode_step,
    transition_std,
)

FAST = settings(max_examples=50, deadline=None)

STOCHASTIC = ("flow_grpo", "dance_grpo", "cps")
NOISE_LEVELS = {"flow_grpo": 0.7, "dance_grpo": 0.3, "cps": 0.5}

SIGMAS10 = shifted_sigmas(10)  # SD3's default shift 3
SIGMA_MAX10 = float(SIGMAS10[1])
# (sigma, sigma_next) index pairs: the first step (sigma = 1, needs sigma_max), middle
# steps, and the last step (sigma_next = 0).
STEP_IDX = (0, 1, 4, 8, 9)


def _pair(i: int, sigmas: torch.Tensor = SIGMAS10) -> tuple[float, float]:
    return float(sigmas[i]), float(sigmas[i + 1])


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


# --------------------------------------------------------------------------------------
# Deterministic limit: noise_level 0 is the ODE
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("i", STEP_IDX)
@pytest.mark.parametrize("step_fn", [flow_grpo_step, dance_grpo_step], ids=["flow_grpo", "dance_grpo"])
def test_noise_level_zero_is_exactly_ode(step_fn, i):
    sigma, sigma_next = _pair(i)
    x, v, noise = _rand((4, 3, 5, 5), 10 + i), _rand((4, 3, 5, 5), 20 + i), _rand((4, 3, 5, 5), 30 + i)
    ode = ode_step(x, v, sigma, sigma_next)
    out = step_fn(x, v, sigma, sigma_next, noise=noise, noise_level=0.0, sigma_max=SIGMA_MAX10)
    assert torch.equal(out.next_x, ode.next_x)
    assert torch.equal(out.mean, ode.next_x)
    assert float(out.std) == 0.0
    # a deterministic transition has no density: log_prob is reported as 0
    assert torch.equal(out.log_prob, torch.zeros(4))


@pytest.mark.parametrize("i", STEP_IDX)
def test_cps_noise_level_zero_matches_ode(i):
    # CPS's mean (1 - s') (x - s v) + s' (x + (1 - s) v) equals x + (s' - s) v only in exact
    # arithmetic: the fp32 roundings of the two formulas differ, hence a tolerance.
    sigma, sigma_next = _pair(i)
    x, v, noise = _rand((4, 3, 5, 5), 10 + i), _rand((4, 3, 5, 5), 20 + i), _rand((4, 3, 5, 5), 30 + i)
    ode = ode_step(x, v, sigma, sigma_next)
    out = cps_step(x, v, sigma, sigma_next, noise=noise, noise_level=0.0, sigma_max=SIGMA_MAX10)
    torch.testing.assert_close(out.next_x, ode.next_x, rtol=0, atol=1e-6)
    assert float(out.std) == 0.0


def test_ode_step_is_euler():
    x, v = _rand((2, 7), 0), _rand((2, 7), 1)
    out = ode_step(x, v, 0.8, 0.6)
    torch.testing.assert_close(out.next_x, x - 0.2 * v)
    assert float(out.std) == 0.0
    assert torch.equal(out.log_prob, torch.zeros(2))


# --------------------------------------------------------------------------------------
# Log-probabilities
# --------------------------------------------------------------------------------------


def _stochastic_cases():
    for kind in STOCHASTIC:
        for i in STEP_IDX:
            if kind == "cps" and i == len(SIGMAS10) - 2:
                continue  # CPS's last step (sigma' = 0) is deterministic: tested separately
            yield kind, i


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind,i", list(_stochastic_cases()))
def test_log_prob_matches_torch_normal(kind, i, reduction):
    sigma, sigma_next = _pair(i)
    shape = (3, 2, 4, 4)
    x, v, noise = _rand(shape, 100 + i), _rand(shape, 200 + i), _rand(shape, 300 + i)
    fn = STEP_FUNCTIONS[kind]
    out = fn(x, v, sigma, sigma_next, noise=noise, noise_level=NOISE_LEVELS[kind], reduction=reduction, sigma_max=SIGMA_MAX10)
    assert float(out.std) > 0
    assert out.log_prob.shape == (3,)
    assert out.log_prob.dtype == torch.float32
    torch.testing.assert_close(out.next_x, out.mean + out.std * noise)

    per_dim = torch.distributions.Normal(out.mean.double(), out.std.double()).log_prob(out.next_x.double())
    expected = per_dim.sum((1, 2, 3)) if reduction == "sum" else per_dim.mean((1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-4)

    # training path: the stored next_x with no noise gives the identical behaviour log-prob
    again = fn(x, v, sigma, sigma_next, x_next=out.next_x, noise_level=NOISE_LEVELS[kind], reduction=reduction, sigma_max=SIGMA_MAX10)
    assert torch.equal(again.log_prob, out.log_prob)
    assert torch.equal(again.mean, out.mean)
    assert torch.equal(again.next_x, out.next_x)


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_log_prob_is_differentiable_wrt_velocity(kind):
    sigma, sigma_next = _pair(4)
    x, noise = _rand((2, 8), 1), _rand((2, 8), 2)
    v = _rand((2, 8), 3).requires_grad_(True)
    fn = STEP_FUNCTIONS[kind]
    with torch.no_grad():
        sampled = fn(x, v, sigma, sigma_next, noise=noise, noise_level=NOISE_LEVELS[kind], sigma_max=SIGMA_MAX10)
    out = fn(x, v, sigma, sigma_next, x_next=sampled.next_x, noise_level=NOISE_LEVELS[kind], sigma_max=SIGMA_MAX10)
    out.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


def test_stochastic_step_needs_noise_or_x_next():
    x, v = _rand((2, 3), 0), _rand((2, 3), 1)
    with pytest.raises(ValueError):
        flow_grpo_step(x, v, 0.5, 0.4)


def test_cps_last_step_is_deterministic():
    sigma, sigma_next = _pair(9)
    assert sigma_next == 0.0
    x, v, noise = _rand((2, 3), 0), _rand((2, 3), 1), _rand((2, 3), 2)
    out = cps_step(x, v, sigma, sigma_next, noise=noise, noise_level=0.5)
    assert float(out.std) == 0.0
    torch.testing.assert_close(out.next_x, x - sigma * v)  # x0_hat
    assert torch.equal(out.log_prob, torch.zeros(2))


# --------------------------------------------------------------------------------------
# transition_std
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("noise_level", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("kind", ["ode", *STOCHASTIC])
def test_transition_std_matches_step_std(kind, noise_level):
    x, v, noise = _rand((2, 3), 0), _rand((2, 3), 1), _rand((2, 3), 2)
    for sigmas in (SIGMAS10, shifted_sigmas(7, shift=1.0)):
        sigma_max = float(sigmas[1])
        for i in range(len(sigmas) - 1):
            sigma, sigma_next = _pair(i, sigmas)
            out = STEP_FUNCTIONS[kind](x, v, sigma, sigma_next, noise=noise, noise_level=noise_level, sigma_max=sigma_max)
            expected = transition_std(kind, sigma, sigma_next, noise_level, sigma_max)
            assert math.isclose(float(out.std), expected, rel_tol=1e-6, abs_tol=1e-7), (kind, i)


def test_transition_std_rejects_unknown_sampler():
    with pytest.raises(ValueError):
        transition_std("euler_ancestral", 0.5, 0.4, 0.7, None)


def test_flow_grpo_std_at_sigma_one_uses_sigma_max():
    # at sigma = 1 the Flow-GRPO coefficient a sqrt(sigma / (1 - sigma)) would divide by 0;
    # the reference substitutes sigma_max = sigmas[1] in the denominator.
    sigma, sigma_next = _pair(0)
    dt = sigma_next - sigma
    expected = 0.7 * math.sqrt(1.0 / (1.0 - SIGMA_MAX10)) * math.sqrt(-dt)
    assert math.isclose(transition_std("flow_grpo", sigma, sigma_next, 0.7, SIGMA_MAX10), expected, rel_tol=1e-9)
    x, v, noise = _rand((2, 3), 0), _rand((2, 3), 1), _rand((2, 3), 2)
    out = flow_grpo_step(x, v, sigma, sigma_next, noise=noise, noise_level=0.7, sigma_max=SIGMA_MAX10)
    assert math.isclose(float(out.std), expected, rel_tol=1e-6)
    assert torch.isfinite(out.next_x).all() and torch.isfinite(out.log_prob).all()


# --------------------------------------------------------------------------------------
# 1-D Gaussian toy: every sampler must transport N(0, 1) to the data distribution
# --------------------------------------------------------------------------------------

MU, S = 1.5, 0.5


def _exact_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """v(x, sigma) = E[eps - x0 | x_sigma = x] for x0 ~ N(MU, S^2), eps ~ N(0, 1)."""
    var = (1 - sigma) ** 2 * S**2 + sigma**2
    m = (1 - sigma) * MU
    e_x0 = MU + (1 - sigma) * S**2 / var * (x - m)
    e_eps = sigma / var * (x - m)
    return e_eps - e_x0


def _run_toy(kind: str, noise_level: float, num_steps: int, n: int = 20000, seed: int = 0) -> torch.Tensor:
    sigmas = shifted_sigmas(num_steps, shift=1.0)
    sigma_max = float(sigmas[1])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, generator=g)
    for i in range(num_steps):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        noise = torch.randn(x.shape, generator=g)
        x = STEP_FUNCTIONS[kind](
            x, _exact_velocity(x, sigma), sigma, sigma_next, noise=noise, noise_level=noise_level, sigma_max=sigma_max
        ).next_x
        assert torch.isfinite(x).all(), (kind, i)
    return x


def test_gaussian_toy_ode_is_accurate():
    x = _run_toy("ode", 0.0, 100)
    assert abs(x.mean().item() - MU) < 0.02
    assert abs(x.std().item() - S) < 0.02


# Measured with this seed at 100 steps (final mean - MU, final std - S):
#   ode              (-0.006, -0.005)
#   flow_grpo  0.7   (-0.005, +0.001)
#   dance_grpo 0.3   (-0.007, -0.001)
#   cps        0.5   (-0.001, -0.044)
# CPS keeps a systematic std deficit that does NOT shrink with more steps (exact moment
# propagation through this linear-Gaussian toy: -0.047 at 100 steps, -0.040 at 1000; -0.12
# at noise 0.9). Its std = sigma' sin(a pi / 2) does not vanish as dt -> 0, and the step uses
# only the posterior mean x0_hat, so the marginals are not preserved. The formula is the
# published one (Flow-GRPO reference code, sde_type="cps"), i.e. this is a property of the
# algorithm, not of this implementation; the 0.05 tolerance below holds, with a thin margin.
@pytest.mark.parametrize(
    "kind,noise_level",
    [("ode", 0.0), ("flow_grpo", 0.7), ("dance_grpo", 0.3), ("dance_grpo", 1.0), ("cps", 0.5)],
)
def test_gaussian_toy_reaches_data_distribution(kind, noise_level):
    x = _run_toy(kind, noise_level, 100)
    assert abs(x.mean().item() - MU) < 0.05, x.mean().item()
    assert abs(x.std().item() - S) < 0.05, x.std().item()


# --------------------------------------------------------------------------------------
# Schedules and windows
# --------------------------------------------------------------------------------------


@FAST
@given(num_steps=st.integers(1, 60), shift=st.floats(0.5, 6.0))
def test_shifted_sigmas_endpoints_and_monotone(num_steps, shift):
    sig = shifted_sigmas(num_steps, shift=shift)
    assert sig.shape == (num_steps + 1,)
    assert sig.dtype == torch.float32
    assert sig[0].item() == 1.0
    assert sig[-1].item() == 0.0
    assert (sig[1:] < sig[:-1]).all()


def test_shifted_sigmas_shift_one_is_linear_and_shift_raises_sigmas():
    torch.testing.assert_close(shifted_sigmas(8, shift=1.0), torch.linspace(1, 0, 9))
    assert (shifted_sigmas(8, shift=3.0)[1:-1] > shifted_sigmas(8, shift=1.0)[1:-1]).all()


@FAST
@given(num=st.integers(1, 6), low=st.floats(0.0, 0.5), seed=st.integers(0, 2**31))
def test_stratified_sigmas_fall_in_their_shifted_strata(num, low, seed):
    # NFT's training sigmas: the k-th lies in the k-th of num equal strata of (low, 1], counted
    # from the noisy end, after the time shift moves the strata's edges toward 1
    high = 1.0
    for shift in (1.0, 3.0):
        gen = torch.Generator().manual_seed(seed)
        for k in range(num):
            sigma = stratified_sigma(k, num, low, high, shift, gen)
            top = low + (high - low) * time_shift(1.0 - k / num, shift)
            bottom = low + (high - low) * time_shift(1.0 - (k + 1) / num, shift)
            assert bottom - 1e-9 <= sigma <= top + 1e-9
            assert sigma > low


def test_sigma_shift_moves_training_sigmas_to_the_noisy_end():
    def draws(shift: float) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return torch.tensor([stratified_sigma(k % 3, 3, 0.0, 1.0, shift, gen) for k in range(300)])

    uniform, shifted = draws(1.0), draws(3.0)
    assert abs(uniform.mean().item() - 0.5) < 0.05
    # shift 3 maps the strata (2/3, 1], (1/3, 2/3], (0, 1/3] to (6/7, 1], (3/5, 6/7], (0, 3/5]
    assert (shifted > 0.6).float().mean().item() == pytest.approx(2 / 3, abs=1e-6)
    assert (uniform > 0.6).float().mean().item() < 0.5


def _window(mask: torch.Tensor) -> tuple[int, int]:
    idx = mask.nonzero().flatten()
    start, count = int(idx[0]), int(idx.numel())
    assert torch.equal(idx, torch.arange(start, start + count)), "window is not contiguous"
    return start, count


@FAST
@given(num_steps=st.integers(1, 40), data=st.data())
def test_window_all_and_fixed(num_steps, data):
    size = data.draw(st.integers(1, num_steps))
    start = data.draw(st.integers(0, num_steps - size))
    iteration, seed = data.draw(st.integers(0, 1000)), data.draw(st.integers(0, 2**31))
    all_mask = window_mask("all", num_steps, size, start, iteration, seed)
    assert all_mask.dtype == torch.bool and all_mask.shape == (num_steps,) and all_mask.all()
    fixed = window_mask("fixed", num_steps, size, start, iteration, seed)
    assert fixed.shape == (num_steps,)
    assert _window(fixed) == (start, size)


@FAST
@given(num_steps=st.integers(1, 40), data=st.data())
def test_window_random(num_steps, data):
    size = data.draw(st.integers(1, num_steps))
    seed, iteration = data.draw(st.integers(0, 2**31)), data.draw(st.integers(0, 10**6))
    m1 = window_mask("random", num_steps, size, 0, iteration, seed)
    m2 = window_mask("random", num_steps, size, 0, iteration, seed)
    assert torch.equal(m1, m2)  # deterministic in (seed, iteration)
    start, count = _window(m1)
    assert count == size  # fits: never truncated by the end of the schedule
    assert start + size <= num_steps
    assert start <= max(0, num_steps // 2 - 1)  # within the first half
    assert start == window_start("random", num_steps, size, 0, iteration, seed)


def test_window_random_over_choices_draws_every_choice_and_nothing_else():
    # Flow-Factory's sde_steps [1, 2, 3] with one SDE step: each iteration one of them, uniformly
    firsts = [window_steps("random", 10, 1, 0, it, seed=3, choices=[3, 1, 2]) for it in range(300)]
    assert all(len(f) == 1 for f in firsts)
    counts = {c: sum(f[0] == c for f in firsts) for c in (1, 2, 3)}
    assert sum(counts.values()) == 300 and min(counts.values()) > 70
    assert window_steps("random", 10, 1, 0, 5, seed=3, choices=[1, 2, 3]) == firsts[5]  # keyed by (seed, iteration)


def test_window_choices_are_checked():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sampling.window.choices needs sampling.window.strategy random"):
        load_config("tiny_jpeg", ["sampling.window.strategy=fixed", "sampling.window.choices=[1]"])
    with pytest.raises(ConfigError, match=r"steps between 0 and 3 \(sampling.num_steps - size\), or strategy scattered; got \[1, 9\]"):
        load_config("tiny_jpeg", ["sampling.num_steps=4", "sampling.window.strategy=random", "sampling.window.size=1",
                                  "sampling.window.choices=[1, 9]"])


def test_window_scattered_draws_distinct_steps_from_its_pool():
    # Flow-DPPO's references: 3 distinct steps, not necessarily consecutive, from the first half of 10 (UniRL's
    # {0..4}) or from Flow-Factory's sde_steps [0..5]; each subset of the pool about equally often
    draws = [tuple(window_steps("scattered", 10, 3, 0, it, seed=3)) for it in range(1000)]
    assert all(len(set(d)) == 3 and list(d) == sorted(d) and set(d) <= set(range(5)) for d in draws)
    counts = {d: draws.count(d) for d in set(draws)}
    assert len(counts) == 10 and min(counts.values()) > 60  # C(5, 3) = 10 subsets, 100 each on average
    assert any(d[2] - d[0] > 2 for d in draws)  # not consecutive
    assert {s for d in (window_steps("scattered", 10, 3, 0, it, seed=3, choices=range(6)) for it in range(300)) for s in d} == set(range(6))
    assert window_steps("scattered", 10, 3, 0, 17, seed=3) == list(draws[17])  # keyed by (seed, iteration)


def test_window_scattered_needs_enough_steps_in_its_pool():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^sampling.window.strategy scattered draws sampling.window.size \(3\) distinct steps"):
        load_config("tiny_jpeg", ["sampling.num_steps=4", "sampling.window.strategy=scattered", "sampling.window.size=3"])
    with pytest.raises(ConfigError, match=r"each between 0 and 9; got \[1, 2, 10\]"):
        load_config("tiny_jpeg", ["sampling.num_steps=10", "sampling.window.strategy=scattered", "sampling.window.size=2",
                                  "sampling.window.choices=[1, 2, 10]"])
    cfg = load_config("tiny_jpeg", ["sampling.num_steps=10", "sampling.window.strategy=scattered", "sampling.window.size=3"])
    assert cfg.sampling.window.strategy == "scattered"


def test_window_random_varies_with_iteration_and_seed():
    starts = {window_start("random", 20, 4, 0, it, seed=7) for it in range(50)}
    assert len(starts) > 3
    assert starts <= set(range(0, 9 + 1))
    by_seed = [[window_start("random", 20, 4, 0, it, seed=s) for it in range(20)] for s in (1, 2)]
    assert by_seed[0] != by_seed[1]


@FAST
@given(num_steps=st.integers(1, 40), shift_every=st.integers(1, 7), data=st.data())
def test_window_progressive(num_steps, shift_every, data):
    size = data.draw(st.integers(1, num_steps))
    start = data.draw(st.integers(0, num_steps - size))
    prev = None
    for iteration in range(0, (num_steps + 2) * shift_every + 1):
        s, count = _window(window_mask("progressive", num_steps, size, start, iteration, 0, shift_every, at_end="clamp"))
        assert count == size and s + size <= num_steps  # never overflows
        assert s == min(start + iteration // shift_every, num_steps - size)
        if prev is not None:
            assert s >= prev  # moves later, never earlier
        prev = s
    assert prev == num_steps - size  # eventually touches the end


def test_window_unknown_strategy():
    with pytest.raises(ValueError):
        window_mask("sliding", 10, 2, 0, 0, 0)


@pytest.mark.parametrize("overrides, fragment", [
    (["sampling.window.at_end=wrap"], "sampling.window.at_end must be one of roll_back, clamp"),
    (["sampling.window.stride=-1"], "sampling.window.stride"),
    (["sampling.window.start=2"], "sampling.window.start must be between 0 and 1 with sampling.window.at_end roll_back"),
    (["sampling.window.at_end=clamp", "sampling.window.size=3", "sampling.window.start=2"], "sampling.window.start must be "
     "between 0 and 1 so the window of 3 steps fits"),
])
def test_progressive_window_settings_are_checked(overrides, fragment):
    """MixGRPO's window (tests/train/test_reference_fidelity.py checks it against the reference) on 4 steps."""
    from flowrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config("tiny_jpeg", ["sampling.window.strategy=progressive", "sampling.window.size=2", *overrides])
    assert fragment in str(err.value)


# --------------------------------------------------------------------------------------
# Seeded noise
# --------------------------------------------------------------------------------------


def test_seeded_noise_rows_depend_only_on_seed_and_step():
    shape = (2, 3, 3)
    a = seeded_noise([5, 9, 11], step=3, shape=shape)
    b = seeded_noise([11, 42, 5], step=3, shape=shape)
    c = seeded_noise([9], step=3, shape=shape)
    assert a.shape == (3, *shape) and a.dtype == torch.float32
    assert torch.equal(a[0], b[2])  # seed 5 at positions 0 and 2
    assert torch.equal(a[2], b[0])  # seed 11
    assert torch.equal(a[1], c[0])  # seed 9, batch of one
    assert torch.equal(a, seeded_noise([5, 9, 11], step=3, shape=shape))  # reproducible
    # independent of the global RNG state
    torch.manual_seed(123)
    d = seeded_noise([5], step=3, shape=shape)
    torch.manual_seed(456)
    assert torch.equal(d, seeded_noise([5], step=3, shape=shape))
    assert torch.equal(d[0], a[0])


def test_seeded_noise_differs_across_steps_and_seeds():
    shape = (16,)
    rows = {}
    for seed in (0, 1, 2, 12345):
        for step in (INITIAL, 0, 1, 2, 27):
            rows[(seed, step)] = seeded_noise([seed], step=step, shape=shape)[0]
    keys = list(rows)
    for i, k1 in enumerate(keys):
        for k2 in keys[i + 1 :]:
            assert not torch.equal(rows[k1], rows[k2]), (k1, k2)
    # same seed repeated in one batch gives identical rows
    dup = seeded_noise([3, 3], step=0, shape=shape)
    assert torch.equal(dup[0], dup[1])


def test_seeded_noise_is_standard_normal():
    z = seeded_noise(list(range(8)), step=4, shape=(4096,))
    assert abs(z.mean().item()) < 0.03
    assert abs(z.std().item() - 1) < 0.03


def test_seeded_noise_empty():
    z = seeded_noise([], step=0, shape=(2, 3))
    assert z.shape == (0, 2, 3)
