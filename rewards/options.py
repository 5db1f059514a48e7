"""Per-reward options (`reward.options.NAME` in the config): checked against the reward
factory's own keyword arguments, so a reward declares its options once, in its signature.

Two options belong to every reward and are consumed here, not by the factory:
  kind        the registered reward to build; lets one reward appear under several names
              (two remote servers, two PickScore checkpoints): weights {hps_a: 1, hps_b: 1}
  batch_size  images per call of this reward (default: reward.batch_size)
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flowrl.errors import ConfigError
from flowrl.devices import DTYPES
from rewards.hub import looks_local
from rewards.registry import REQUIRED, RewardSpec, as_reward, available_rewards, get_reward

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
        fn = as_reward(self.name, self.spec.factory(**self.factory_options))  # a factory may build an (images, prompts) one too
        return fn, tuple(getattr(fn, "channel_names", None) or self.spec.channels)


def plan_reward(name: str, options: dict[str, Any] | None = None) -> RewardPlan:
    options = dict(options or {})
    kind = options.pop("kind", name)
    batch_size = options.pop("batch_size", None)
    spec = get_reward(kind)
    missing = [key for key, default in spec.options().items() if default is REQUIRED and key not in options]
    if missing:  # the config catches this too; callers that build rewards directly land here
        raise ConfigError(f"reward '{name}' needs the option {missing[0]} (reward.options.{name}.{missing[0]})")
    return RewardPlan(name, spec, options, batch_size)


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _expected_types(spec: RewardSpec) -> dict[str, type]:
    """Option -> bool / int / float / str, from the factory's annotation (`str | None` counts
    as str), else from its default; options of other types are not checked here."""
    try:
        params = inspect.signature(spec.factory, eval_str=True).parameters
    except Exception:  # an annotation that does not evaluate at run time
        params = inspect.signature(spec.factory).parameters
    expected = {}
    for key, p in params.items():
        hint = p.annotation
        if typing.get_args(hint):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = args[0] if len(args) == 1 else None
        if hint not in _TYPE_WORDS and p.default is not inspect.Parameter.empty and p.default is not None:
            hint = type(p.default)
        if hint in _TYPE_WORDS:
            expected[key] = hint
    return expected


def _has_type(value, expected: type) -> bool:
    if expected in (int, float) and isinstance(value, bool):  # True is an int to Python, not to a config
        return False
    return isinstance(value, (int, float)) if expected is float else isinstance(value, expected)


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
    types = _expected_types(get_reward(kind))
    for key, value in options.items():
        if key in SHARED_OPTIONS:
            continue
        if key not in allowed:
            takes = ", ".join([*allowed, *SHARED_OPTIONS])
            raise ConfigError(f"{where(key)} is not an option of reward '{kind}'; it takes: {takes}")
        none_ok = value is None and allowed[key] is None  # None is the default's own value
        if key in types and not none_ok and not _has_type(value, types[key]):
            raise ConfigError(f"{where(key)} must be {_TYPE_WORDS[types[key]]}; got {value!r}")
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
