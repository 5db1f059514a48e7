"""Reward functions for flowrl.

A reward is any callable `fn(images, prompts, metadata) -> scores` where `images` is a float
tensor [N, 3, H, W] in [0, 1], `prompts` a list of N strings, `metadata` a list of N dicts
(or None), and `scores` a float tensor [N] (one channel) or [N, K] (K named channels). A plain
function is a reward; `register` puts it in the registry by name.
"""

from __future__ import annotations

from rewards.registry import RewardSpec, available_rewards, describe_rewards, get_reward, register
from rewards.multi import MultiReward

# Built-in rewards register themselves on import.
from rewards import simple as _simple  # noqa: F401,E402
from rewards import models as _models  # noqa: F401,E402  (placeholders: pickscore, clip_score, hpsv2)

__all__ = ["RewardSpec", "available_rewards", "describe_rewards", "get_reward", "register", "MultiReward"]
