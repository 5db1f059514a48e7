"""Name -> reward factory. Factories are called lazily, so heavy models load only when used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flowrl.errors import UserError


@dataclass(frozen=True)
class RewardSpec:
    name: str
    description: str
    factory: Callable[..., Callable]  # (**options) -> reward callable
    channels: tuple[str, ...] = ()  # channel names if the reward returns [N, K]; default (name,)


_REGISTRY: dict[str, RewardSpec] = {}


def register(name: str, description: str, channels: tuple[str, ...] = ()):
    """Decorator: register a reward factory (or a plain reward function) under `name`."""

    def wrap(obj):
        factory = obj if isinstance(obj, type) or getattr(obj, "_is_factory", False) else (lambda **_: obj)
        _REGISTRY[name] = RewardSpec(name, description, factory, channels or (name,))
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
