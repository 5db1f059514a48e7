"""Name -> reward factory. Factories are called lazily, so heavy models load only when used."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from flowrl.errors import UserError


@dataclass(frozen=True)
class RewardSpec:
    name: str
    description: str
    factory: Callable[..., Callable]  # (**options) -> reward callable
    channels: tuple[str, ...] = ()  # channel names if the reward returns [N, K]; default (name,)
    # (prompts, this reward's scores [N, K]) -> {prompt kind: {column: mean}} with an "overall" row: a
    # breakdown that metrics rows and `flowrl eval` show (the shapes reward: GenEval's categories)
    breakdown: Callable[..., dict] | None = None
    bucket: Callable[[str], str] | None = None  # prompt -> its kind (the same kinds): where the rollouts went, per kind
    video: bool = False  # scores videos [N, 3, F, H, W] itself; otherwise a video is scored by its frames (rewards/video.py)

    def options(self) -> dict[str, object]:
        """The factory's keyword options and their defaults (`REQUIRED` where it has none)."""
        params = inspect.signature(self.factory).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {p.name: (REQUIRED if p.default is inspect.Parameter.empty else p.default) for p in params if p.kind in kinds}


REQUIRED = object()  # marks a factory option without a default


_REGISTRY: dict[str, RewardSpec] = {}


def register(name: str, description: str, channels: tuple[str, ...] = (), factory: bool = False,
             breakdown: Callable[..., dict] | None = None, bucket: Callable[[str], str] | None = None, video: bool = False):
    """Decorator: register a reward under `name`. A plain function is the reward itself; a
    class, or a function registered with factory=True, builds the reward when first used; its
    keyword arguments are the reward's options (reward.options.NAME in the config). `breakdown`
    (prompts, scores [N, K]) -> {prompt kind: {column: mean}} splits its scores by kind of prompt,
    `bucket` (prompt) -> kind names one prompt's kind; `video`: it scores videos [N, 3, F, H, W] itself
    (any other reward scores a video's frames)."""

    def wrap(obj):
        make = obj if factory or isinstance(obj, type) else (lambda: obj)
        _REGISTRY[name] = RewardSpec(name, description, make, channels or (name,), breakdown, bucket, video)
        return obj

    return wrap


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def describe_rewards() -> list[tuple[str, str]]:
    return [(n, _REGISTRY[n].description) for n in available_rewards()]


def get_reward(name: str) -> RewardSpec:
    if name not in _REGISTRY:
        raise UserError(f"unknown reward '{name}'; available: {', '.join(available_rewards())}")
    return _REGISTRY[name]
