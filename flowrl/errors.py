"""User-facing errors: one sentence naming the field and what is allowed. The CLI prints
them without a traceback and exits 2."""

import dataclasses
import math
import re


class UserError(Exception):
    """A mistake in what the user gave us (config, prompt file, checkpoint, reward output)."""


class ConfigError(UserError):
    """A config key with an unknown name, a wrong type or an impossible value."""


def check_choice(key: str, value, allowed) -> None:
    """`value` of config key `key` must be one of `allowed` (a sequence or a registry)."""
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got '{value}'")


_BOUND = re.compile(r"^(>=|>)\s*(-?[\d.]+)$")
_INTERVAL = re.compile(r"^([\[(])\s*(-?[\d.]+),\s*(-?[\d.]+)\s*([\])])$")


def in_range(value: float, spec: str) -> bool:
    """Whether `value` lies in `spec` ("> 0", ">= 2", "[0, 1)", ...); NaN and inf never do."""
    if not math.isfinite(value):
        return False
    if m := _BOUND.match(spec):
        return value >= float(m[2]) if m[1] == ">=" else value > float(m[2])
    m = _INTERVAL.match(spec)
    if m is None:
        raise ValueError(f"not a range: {spec!r}")
    lo, hi = float(m[2]), float(m[3])
    return (lo <= value if m[1] == "[" else lo < value) and (value <= hi if m[4] == "]" else value < hi)


def check_range(key: str, value, spec: str, why: str = "") -> None:
    """`value` of config key `key` must lie in `spec` (see in_range), finite."""
    if not in_range(value, spec):
        shown = f"a finite number {spec}" if spec[0] == ">" else f"in {spec}"
        raise ConfigError(f"{key} must be {shown}" + (f" ({why})" if why else "") + f"; got {value}")


def check_fields(node, key: str = "") -> None:
    """Every field of the dataclass `node` (a config or one of its sections, `key` its dotted name) and of its
    sub-sections, checked against what the dataclasses declare beside their fields: `RANGES` (field -> "> 0",
    "[0, 1)", ..., or (range, why)) and `CHOICES` (field -> the allowed values). One sentence for the first
    field that is outside them. This is the one place ranges and choices are checked."""
    for cls in type(node).__mro__:  # a section that extends another (the runtime's trainer options) declares its own
        for name, spec in vars(cls).get("RANGES", {}).items():
            spec, why = (spec, "") if isinstance(spec, str) else spec
            check_range(f"{key}.{name}" if key else name, getattr(node, name), spec, why)
        for name, allowed in vars(cls).get("CHOICES", {}).items():
            check_choice(f"{key}.{name}" if key else name, getattr(node, name), allowed)
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{key}.{f.name}" if key else f.name)


def check_positive(key: str, value, strict: bool = True) -> None:
    check_range(key, value, "> 0" if strict else ">= 0")


def check_producers(run, allocator_kind: str) -> None:
    """run.producers, run.producer_devices and run.ray.rollout_workers (both trainers' run sections)."""
    check_range("run.producers", run.producers, ">= 1")
    if run.producers > 1 and not run.async_rollouts:
        raise ConfigError(f"run.producers {run.producers} starts producers of asynchronous rollouts; set run.async_rollouts: true")
    producers, key = (run.ray.rollout_workers, "run.ray.rollout_workers") if run.cluster == "ray" else (run.producers, "run.producers")
    if producers > 1 and allocator_kind != "uniform":
        # each producer's allocator sees only its own batches; the uniform one draws by iteration alone
        raise ConfigError(f"{key} {producers} splits the batches between producers, each with its own allocator, "
                          f"which only allocator.kind uniform allows; got '{allocator_kind}'")
    devices = list(run.producer_devices)
    if devices and len(devices) != run.producers:
        raise ConfigError(f"run.producer_devices must name one device per producer (run.producers {run.producers}); got {devices}")
    for device in devices:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
            raise ConfigError(f"run.producer_devices entries must be cpu, cuda or cuda:N; got '{device}'")
