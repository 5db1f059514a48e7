"""Modality-free RL math: tensors in, tensors out. Imports torch only."""

from flowrl.core.advantages import AdvantageOutput, grpo_advantages
from flowrl.core.losses import clipped_policy_loss, gaussian_kl, nft_loss, optimality_probability

__all__ = ["AdvantageOutput", "grpo_advantages", "clipped_policy_loss", "gaussian_kl", "nft_loss", "optimality_probability"]
