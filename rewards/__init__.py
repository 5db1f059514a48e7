"""Reward functions for flowrl.

A reward is any callable `fn(images, prompts, metadata) -> scores` where `images` is a float
tensor [N, 3, H, W] in [0, 1] (videos [N, 3, F, H, W] are scored frame by frame, rewards/video.py), `prompts` a list of N strings, `metadata` a list of N dicts
(or None), and `scores` a float tensor [N] (one channel) or [N, K] (K named channels). A plain
function is a reward, of `(images, prompts)` too; `register` puts it in the registry by name, from
flowrl's own modules, a module named in a config's `plugins`, or one an installed package declares
under the `flowrl.parts` entry point group (rewards/registry.py). Model-backed rewards are
registered as factories whose keyword arguments are their options (reward.options.NAME); they
import their heavy packages only when built.
"""

from __future__ import annotations

from rewards.registry import REWARDS, RewardSpec, available_rewards, describe_rewards, get_reward, register
from rewards.multi import MultiReward, check_scores
from rewards.options import check_reward_config
from rewards.runner import AsyncRewardRunner

# Built-in rewards register themselves on import.
from rewards import simple as _simple  # noqa: F401,E402
from rewards import models as _models  # noqa: F401,E402  (pickscore, clip_score)
from rewards import aesthetic as _aesthetic  # noqa: F401,E402
from rewards import hps as _hps  # noqa: F401,E402  (hpsv2; open-clip-torch, extra hps)
from rewards import textsim as _textsim  # noqa: F401,E402  (text_similarity; extra textsim)
from rewards import remote as _remote  # noqa: F401,E402  (remote: a reward server's client)
from rewards import vlm_judge as _vlm_judge  # noqa: F401,E402  (vlm_judge: a VLM behind an OpenAI-compatible endpoint)
from rewards import ocr as _ocr  # noqa: F401,E402  (ocr: Flow-GRPO's OCR reward; extra ocr)
from rewards import imagereward as _imagereward  # noqa: F401,E402  (imagereward: BLIP + MLP, weights converted once)
from rewards import shapes as _shapes  # noqa: F401,E402  (shapes: the verifiable reward of the embedded default)
from rewards import shapes_edit as _shapes_edit  # noqa: F401,E402  (shapes_edit: the shapes editing world's verifier)
from rewards import preservation as _preservation  # noqa: F401,E402  (image_similarity, pixel_preservation: edits against their sources)
from rewards import video as _video  # noqa: F401,E402  (temporal_consistency; image rewards score videos by frame)

__all__ = [
    "REWARDS",
    "RewardSpec",
    "available_rewards",
    "describe_rewards",
    "get_reward",
    "register",
    "MultiReward",
    "check_scores",
    "check_reward_config",
    "AsyncRewardRunner",
]
