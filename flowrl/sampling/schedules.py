"""Sigma schedules and SDE windows (which steps are stochastic and trained)."""

from __future__ import annotations

import random

import torch

WINDOW_STRATEGIES = ("all", "fixed", "random", "progressive")


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


def window_start(strategy: str, num_steps: int, size: int, start: int, iteration: int, seed: int, shift_every: int = 10,
                 schedule_step: int | None = None) -> int:
    """First step of the SDE window for this iteration (MixGRPO / Flow-GRPO-Fast).

    fixed: always `start`. random: uniform in [0, num_steps // 2 - 1] clipped so the window
    fits, keyed by (seed, iteration). progressive: `start` moved one step later every
    `shift_every` iterations of the schedule's clock (`schedule_step`, by default the iteration
    itself; a wall-clock budget maps it onto trainer.iterations), until the window touches the end
    of the schedule.
    """
    last = num_steps - size
    if strategy == "all":
        return 0
    if strategy == "fixed":
        return start
    if strategy == "random":
        hi = max(0, min(num_steps // 2 - 1, last))
        return random.Random(seed * 1_000_003 + iteration).randint(0, hi)
    if strategy == "progressive":
        return min(start + (iteration if schedule_step is None else schedule_step) // max(shift_every, 1), last)
    raise ValueError(f"sampling.window.strategy must be one of {WINDOW_STRATEGIES}, got {strategy!r}")


def window_mask(strategy: str, num_steps: int, size: int, start: int, iteration: int, seed: int, shift_every: int = 10,
                schedule_step: int | None = None) -> torch.Tensor:
    """Boolean [num_steps]: True where the step is an SDE step (and so trainable)."""
    if strategy == "all":
        return torch.ones(num_steps, dtype=torch.bool)
    s = window_start(strategy, num_steps, size, start, iteration, seed, shift_every, schedule_step)
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[s : s + size] = True
    return mask
