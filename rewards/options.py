"""Per-reward options (`reward.options.NAME` in the config): checked against the reward
factory's own keyword arguments, so a reward declares its options once, in its signature.

Two options belong to every reward and are consumed here, not by the factory:
  kind        the registered reward to build; lets one reward appear under several names
              (two remote servers, two PickScore checkpoints): weights {hps_a: 1, hps_b: 1}
  batch_size  images per call of this reward (default: reward.batch_size)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flowrl.errors import ConfigError
from rewards.hub import DTYPES, looks_local
from rewards.registry import REQUIRED, RewardSpec, available_rewards, get_reward

SHARED_OPTIONS = ("kind", "batch_size")
PATH_OPTIONS = ("path", "processor", "head", "checkpoint")  # local paths are checked to exist
DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


@dataclass(frozen=True)
class RewardPlan:
    """What to build for one weights entry: `spec.factory(**factory_options)`."""

    name: str  # the weights key; channel names and messages use it
    spec: RewardSpec
    factory_options: dict[str, Any]
    batch_size: int | None  # None: the caller's default

    def build(self) -> tuple[Callable, tuple[str, ...]]:
        """The reward callable and its channel names (a reward may report them itself, as a
        remote reward does after asking its server)."""
        fn = self.spec.factory(**self.factory_options)
        return fn, tuple(getattr(fn, "channel_names", None) or self.spec.channels)


def plan_reward(name: str, options: dict[str, Any] | None = None) -> RewardPlan:
    options = dict(options or {})
    kind = options.pop("kind", name)
    batch_size = options.pop("batch_size", None)
    return RewardPlan(name, get_reward(kind), options, batch_size)


def _type_error(where: str, value, default) -> str | None:
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    for kind, words in expected.items():
        if isinstance(default, kind):  # bool first: True is an int too
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return None if ok else f"{where} must be {words}; got {value!r}"
    return None  # a None default takes any value


def check_options(name: str, options: dict[str, Any] | None, where: Callable[[str], str], validate_paths: bool = True) -> None:
    """Raise ConfigError (one sentence naming the option) for an unknown reward kind, an
    unknown option, a value of the wrong type, a missing required option or a missing path."""
    options = dict(options or {})
    kind = options.get("kind", name)
    if not isinstance(kind, str) or kind not in available_rewards():
        what = where("kind") if "kind" in options else "reward.weights"
        raise ConfigError(f"{what} names unknown reward '{kind}'; available: {', '.join(available_rewards())}")
    batch_size = options.get("batch_size", 1)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ConfigError(f"{where('batch_size')} must be an integer > 0; got {batch_size!r}")
    allowed = get_reward(kind).options()
    for key, value in options.items():
        if key in SHARED_OPTIONS:
            continue
        if key not in allowed:
            takes = ", ".join([*allowed, *SHARED_OPTIONS])
            raise ConfigError(f"{where(key)} is not an option of reward '{kind}'; it takes: {takes}")
        problem = _type_error(where(key), value, allowed[key])
        if problem:
            raise ConfigError(problem)
        if key == "dtype" and value not in DTYPES:
            raise ConfigError(f"{where(key)} must be one of {', '.join(DTYPES)}; got '{value}'")
        if key == "device" and not DEVICE.match(str(value)):
            raise ConfigError(f"{where(key)} must be auto, cpu, cuda or cuda:N; got '{value}'")
        if key in PATH_OPTIONS and validate_paths and isinstance(value, str) and looks_local(value):
            if not Path(value).expanduser().exists():
                raise ConfigError(f"{where(key)} '{value}' does not exist; give an existing local path or a hub id (org/name)")
    for key, default in allowed.items():
        if default is REQUIRED and key not in options:
            raise ConfigError(f"reward '{name}' needs {where(key)}; set it in the config")


def check_reward_config(weights: dict[str, float], options: dict[str, dict[str, Any]], validate_paths: bool = True) -> None:
    """The reward section's names and options, as `flowrl.config.validate` checks them."""
    for name in options:
        if name not in weights:
            raise ConfigError(f"reward.options names '{name}', which is not in reward.weights ({', '.join(weights)}); give it a weight or drop its options")
    for name in weights:
        check_options(name, options.get(name), lambda key, n=name: f"reward.options.{n}.{key}", validate_paths)
