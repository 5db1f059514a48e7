"""Seeds of a run's random draws, shared by every trainer: a sample's seed is keyed by (run seed,
iteration, index), and the loops' own random streams (orders, selections, training sigmas) take
indices far above any batch, so a resumed or multi-process run draws exactly what one
uninterrupted process would."""

from __future__ import annotations


class Stream:
    """The `index` keys of `sample_seed` for the training loop's own random streams. Sample
    indices are 0, 1, 2, ... within an iteration; these sit far above any batch, so no stream
    shares a seed with a sample."""

    NFT_ORDER = 999_979  # DiffusionNFT: order of the sample batches, and its training sigmas
    UPDATE_ORDER = 999_983  # the policy-gradient update: order of the micro-batch groups
    EDGE_ORDER = 999_931  # BranchGRPO's shuffled edges (rollout.tree.edge_order shuffled): their order and grouping
    SELECTION = 777_767  # two-stage exploration: ties and the random selection
    GROUP_SIGMAS = 999_961  # group objectives (DGPO, GDRO): the training sigmas of an iteration
    TIE_BREAK = 999_953  # GDRO: the seeded order of tied rewards
    DGPO_ANCHOR = 999_917  # DGPO's anchor_beta: the anchored sigmas and their noise


def sample_seed(base: int, iteration: int, index: int) -> int:
    """The seed of sample `index` of `iteration` in a run seeded `base`: every rollout is
    reproducible from (run seed, iteration, index), whichever process draws it. Iteration -1
    is the sample grids'."""
    return (base * 1_000_003 + iteration) * 100_003 + index
