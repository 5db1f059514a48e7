"""Learning-rate schedules as a factor of the base rate, from the iteration alone (so a resumed
run continues the same curve without a scheduler state to save)."""

import math

LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(schedule: str, iteration: float, total: int) -> float:
    """The factor on the base learning rate at `iteration` (0-based) of `total`: 1 for constant;
    cosine (0.5 (1 + cos(pi p))) or linear (1 - p) decay with p = iteration / total, so the last
    iteration still trains (p < 1). A fractional `iteration` is a point between two (a wall-clock
    budget's plan maps its iterations onto the nominal count)."""
    if schedule == "constant":
        return 1.0
    p = min(max(iteration / max(total, 1), 0.0), 1.0)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if schedule == "linear":
        return 1.0 - p
    raise ValueError(f"unknown learning-rate schedule '{schedule}' ({', '.join(LR_SCHEDULES)})")


def warmup_factor(iteration: int, warmup: int) -> float:
    """A linear warm-up over the first `warmup` iterations (0-based `iteration`): (iteration + 1) /
    warmup, then 1; no warm-up when `warmup` is 0."""
    return min(1.0, (iteration + 1) / warmup) if warmup else 1.0
