"""Model-backed rewards (PickScore, CLIP score, HPSv2): registered by name, not implemented yet.

The presets in configs/ name these rewards, and config validation only checks that a reward
name is registered; it never builds the reward. Registering placeholders here lets those
presets validate (and lets `flowrl rewards` list the names honestly) while the reward models
themselves are added by the rewards library issue. A placeholder's factory raises `UserError`
when a run actually builds its rewards (trainer start, `flowrl eval`), before any sampling.
"""

from __future__ import annotations

from flowrl.errors import UserError
from rewards.registry import register

# name -> (what the reward is, for the error message; the description `flowrl rewards` prints)
PENDING_MODEL_REWARDS: dict[str, tuple[str, str]] = {
    "pickscore": (
        "PickScore, a CLIP-H preference model trained on Pick-a-Pic",
        "PickScore (not yet available: needs the rewards library)",
    ),
    "clip_score": (
        "CLIP score, the image-text cosine similarity of a CLIP model",
        "CLIP image-text similarity (not yet available: needs the rewards library)",
    ),
    "hpsv2": (
        "HPSv2, the Human Preference Score v2 model",
        "HPSv2 human preference score (not yet available: needs the rewards library)",
    ),
}


def _placeholder_factory(name: str, what: str):
    def factory(**_options):
        raise UserError(
            f"reward '{name}' ({what}) is a model-backed reward that is not implemented yet in this version of flowrl; "
            f"the rewards library issue will add it, so until then choose a reward listed by `flowrl rewards` without 'not yet available'"
        )

    factory.__name__ = f"{name}_not_implemented"
    return factory


for _name, (_what, _description) in PENDING_MODEL_REWARDS.items():
    register(_name, _description, factory=True)(_placeholder_factory(_name, _what))
