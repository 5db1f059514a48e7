"""Sigma schedules and SDE windows (which steps are stochastic and trained)."""

from __future__ import annotations

import random

import torch

WINDOW_STRATEGIES = ("all", "fixed", "random", "progressive", "scattered")


def time_shift(t, shift: float):
    """SD3's time shift sigma' = s t / (1 + (s - 1) t) (Esser et al., "Scaling Rectified Flow
    Transformers", eq. 23): s > 1 moves every t in (0, 1) toward 1, the noisier end."""
    return shift * t / (1 + (shift - 1) * t)


def shifted_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """num_steps + 1 sigmas from 1 to 0, time-shifted (`time_shift`). fp32, on CPU."""
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return time_shift(t, shift).float()


def stratified_sigma(k: int, num: int, low: float, high: float, shift: float, generator: torch.Generator) -> float:
    """The k-th of `num` training sigmas: one uniform draw in the k-th of `num` equal strata of
    (low, high], counted from the noisy end, then time-shifted inside the range. With shift > 1 the
    strata crowd toward `high`: DiffusionNFT-style training on clean samples then spends more of
    its steps at the noise levels where a sample's layout is decided. Never `low` itself (the
    adapter's edge), which float rounding could otherwise reach."""
    u = (k + float(torch.rand((), generator=generator))) / num
    # distance from the noisy end after the shift: 1 - time_shift(1 - u, shift), written so that it
    # is exactly u at shift 1 (runs from before the shift existed repeat bit for bit)
    w = u / (1 + (shift - 1) * (1 - u))
    return max(high - (high - low) * w, low + 1e-6)


WINDOW_ENDS = ("roll_back", "clamp")


def window_steps(strategy: str, num_steps: int, size: int, start: int, iteration: int, seed: int, shift_every: int = 25,
                 schedule_step: int | None = None, stride: int = 1, at_end: str = "roll_back", choices=()) -> list[int]:
    """The SDE (and trained) steps of this iteration (MixGRPO, arXiv 2507.21802; Flow-GRPO-Fast;
    docs/algorithms.md section 1).

    all: every step. fixed: [start, start + size). random: the start uniform in
    [0, num_steps // 2 - 1], clipped so the window fits, or uniform over `choices` where given
    (Flow-Factory's sde_steps), keyed by (seed, iteration).
    scattered (Flow-DPPO's references): `size` distinct steps, not necessarily consecutive, drawn
    without replacement from `choices` (Flow-Factory's sde_steps) or from the first half of the
    steps, [0, num_steps // 2) (UniRL's timestep_fraction [0, 0.5]), keyed by (seed, iteration).
    progressive (MixGRPO's sliding window): on the schedule's clock c (`schedule_step`, by default
    the iteration itself; a wall-clock budget maps it onto trainer.iterations) the start is
    l = start + stride * (c // shift_every), and at the end of the schedule:
    - roll_back (MixGRPO's code): windows hold only steps below num_steps - 2 (the reference never
      trains the last two steps) and are cut short there, W(l) = [l, min(l + size, num_steps - 2));
      once l passes num_steps - 2 it rolls back to `start`, so l cycles through start, start +
      stride, ... <= num_steps - 2. Where the reference's window is empty (l = num_steps - 2, for
      shift_every iterations of each cycle) flowrl keeps the one-step window [num_steps - 3].
    - clamp (flowrl's earlier rule): l stops at num_steps - size and the window, always `size`
      steps, stays on the schedule's last steps.
    stride 0 freezes the window at `start` (MixGRPO-Flash*)."""
    if strategy == "all":
        return list(range(num_steps))
    if strategy == "fixed":
        return list(range(start, start + size))
    if strategy == "random":
        rng = random.Random(seed * 1_000_003 + iteration)
        first = rng.choice(sorted(choices)) if choices else rng.randint(0, max(0, min(num_steps // 2 - 1, num_steps - size)))
        return list(range(first, first + size))
    if strategy == "scattered":
        rng = random.Random(seed * 1_000_003 + iteration)
        return sorted(rng.sample(sorted(set(choices)) if choices else range(num_steps // 2), size))
    if strategy != "progressive":
        raise ValueError(f"sampling.window.strategy must be one of {WINDOW_STRATEGIES}, got {strategy!r}")
    shifts = (iteration if schedule_step is None else schedule_step) // max(shift_every, 1)
    if at_end == "clamp":
        first = min(start + stride * shifts, num_steps - size)
        return list(range(first, first + size))
    if at_end != "roll_back":
        raise ValueError(f"sampling.window.at_end must be one of {WINDOW_ENDS}, got {at_end!r}")
    limit = num_steps - 2  # MixGRPO's max_timesteps: no window reaches it
    positions = (limit - start) // stride + 1 if stride > 0 else 1  # the starts start + stride j <= limit
    first = min(start + stride * (shifts % positions), limit - 1)
    return list(range(first, min(first + size, limit)))


def window_start(strategy: str, num_steps: int, size: int, start: int, iteration: int, seed: int, shift_every: int = 25,
                 schedule_step: int | None = None, stride: int = 1, at_end: str = "roll_back", choices=()) -> int:
    """First step of this iteration's SDE window (`window_steps`)."""
    return window_steps(strategy, num_steps, size, start, iteration, seed, shift_every, schedule_step, stride, at_end, choices)[0]


def window_mask(strategy: str, num_steps: int, size: int, start: int, iteration: int, seed: int, shift_every: int = 25,
                schedule_step: int | None = None, stride: int = 1, at_end: str = "roll_back", choices=()) -> torch.Tensor:
    """Boolean [num_steps]: True where the step is an SDE step (and so trainable); `window_steps`."""
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[window_steps(strategy, num_steps, size, start, iteration, seed, shift_every, schedule_step, stride, at_end, choices)] = True
    return mask
