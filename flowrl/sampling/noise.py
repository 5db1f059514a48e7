"""Reproducible noise: every draw comes from a generator keyed by (sample seed, step),
never from global RNG state, so any sample can be regenerated exactly from its seed."""

from __future__ import annotations

from typing import Sequence

import torch

INITIAL = -1  # the `step` key of the initial latent noise


def _key(seed: int, step: int) -> int:
    # a fixed odd multiplier spreads (seed, step) pairs; the modulus keeps it a valid seed
    return (int(seed) * 0x9E3779B1 + (step + 2) * 0x85EBCA77) % (2**63 - 1)


def seeded_noise(seeds: Sequence[int], step: int, shape: Sequence[int], device=None) -> torch.Tensor:
    """Standard normal noise [len(seeds), *shape] in fp32; row i depends only on (seeds[i], step)."""
    rows = []
    for seed in seeds:
        g = torch.Generator(device="cpu").manual_seed(_key(seed, step))
        rows.append(torch.randn(tuple(shape), generator=g, dtype=torch.float32))
    return torch.stack(rows).to(device) if rows else torch.empty((0, *shape), device=device)
