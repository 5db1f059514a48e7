"""Reproducible noise: every draw comes from a generator keyed by (sample seed, step),
never from global RNG state, so any sample can be regenerated exactly from its seed."""

from __future__ import annotations

from typing import Sequence

import torch

INITIAL = -1  # the `step` key of the initial latent noise
# the `step` key of flow-matching objectives' forward-process noise (DiffusionNFT): below every
# sampling key (steps >= 0, INITIAL), so it never repeats a chain's noise; epoch e and training
# sigma k of K use FORWARD_NOISING - e x K - k
FORWARD_NOISING = -1_000
# the `step` key of implicit-reward objectives' group-shared forward noise (DGPO, GDRO): keyed by a
# group's seed, far below FORWARD_NOISING's range; epoch e and training sigma k of K use
# GROUP_NOISING - e x K - k
GROUP_NOISING = -2_000_000


class Stream:
    """The `index` keys of `sample_seed` for the training loop's own random streams. Sample
    indices are 0, 1, 2, ... within an iteration; these sit far above any batch, so no stream
    shares a seed with a sample."""

    NFT_ORDER = 999_979  # DiffusionNFT: order of the sample batches, and its training sigmas
    UPDATE_ORDER = 999_983  # the policy-gradient update: order of the micro-batch groups
    SELECTION = 777_767  # two-stage exploration: ties and the random selection
    GROUP_SIGMAS = 999_961  # group objectives (DGPO, GDRO): the training sigmas of an iteration
    TIE_BREAK = 999_953  # GDRO: the seeded order of tied rewards


def sample_seed(base: int, iteration: int, index: int) -> int:
    """The seed of sample `index` of `iteration` in a run seeded `base`: every rollout is
    reproducible from (run seed, iteration, index), whichever process draws it. Iteration -1
    is the sample grids'."""
    return (base * 1_000_003 + iteration) * 100_003 + index


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
