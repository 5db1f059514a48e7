"""Reproducible noise: every draw comes from a generator keyed by (sample seed, step),
never from global RNG state, so any sample can be regenerated exactly from its seed (the seeds
themselves: flowrl/core/seeds.py)."""

from __future__ import annotations

from typing import Sequence

import torch

INITIAL = -1  # the `step` key of the initial latent noise
INITIAL_NOISES = ("per_sample", "per_group")  # sampling.initial_noise: whose seed keys a chain's initial noise
# the `step` key of flow-matching objectives' forward-process noise (DiffusionNFT): below every
# sampling key (steps >= 0, INITIAL), so it never repeats a chain's noise; epoch e and training
# sigma k of K use FORWARD_NOISING - e x K - k
FORWARD_NOISING = -1_000
# the `step` key of implicit-reward objectives' group-shared forward noise (DGPO, GDRO): keyed by a
# group's seed, far below FORWARD_NOISING's range; epoch e and training sigma k of K use
# GROUP_NOISING - e x K - k
GROUP_NOISING = -2_000_000


def _key(seed: int, step: int) -> int:
    # a fixed odd multiplier spreads (seed, step) pairs; the modulus keeps it a valid seed
    return (int(seed) * 0x9E3779B1 + (step + 2) * 0x85EBCA77) % (2**63 - 1)


def initial_noise_seed(seed: int) -> int:
    """The torch.Generator seed of sample `seed`'s initial noise: torch.randn((1, *latent_shape),
    generator=torch.Generator().manual_seed(initial_noise_seed(seed))) is its row of seeded_noise."""
    return _key(seed, INITIAL)


def seeded_noise(seeds: Sequence[int], step: int, shape: Sequence[int], device=None) -> torch.Tensor:
    """Standard normal noise [len(seeds), *shape] in fp32; row i depends only on (seeds[i], step)."""
    rows = []
    for seed in seeds:
        g = torch.Generator(device="cpu").manual_seed(_key(seed, step))
        rows.append(torch.randn(tuple(shape), generator=g, dtype=torch.float32))
    return torch.stack(rows).to(device) if rows else torch.empty((0, *shape), device=device)
