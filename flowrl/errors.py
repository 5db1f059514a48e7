"""User-facing errors: one sentence naming the field and what is allowed. The CLI prints
them without a traceback and exits 2."""

import math


class UserError(Exception):
    """A mistake in what the user gave us (config, prompt file, checkpoint, reward output)."""


class ConfigError(UserError):
    """A config key with an unknown name, a wrong type or an impossible value."""


def check_choice(key: str, value, allowed) -> None:
    """`value` of config key `key` must be one of `allowed` (a sequence or a registry)."""
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got '{value}'")


def check_positive(key: str, value, strict: bool = True) -> None:
    # NaN fails every comparison and inf passes `> 0`: both are refused by name
    if not (math.isfinite(value) and ((value > 0) if strict else (value >= 0))):
        raise ConfigError(f"{key} must be a finite number {'> 0' if strict else '>= 0'}; got {value}")
