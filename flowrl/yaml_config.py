"""Reading a config file: a preset name or YAML path, the YAML mapping, merged over a dataclass
schema's defaults with `key=value` overrides. Shared by the image config (flowrl/config.py) and
the text config (flowrl/text/config.py); every mistake is one sentence naming the key.
"""

from __future__ import annotations

import difflib
import io
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from flowrl.errors import ConfigError
from flowrl.presets import CONFIG_DIR, DEFAULT_PRESET, preset_names


def preset_path(name_or_path: str | None) -> Path:
    """A config argument is a YAML path or the name of a preset in configs/."""
    if name_or_path is None:
        name_or_path = DEFAULT_PRESET
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"config file '{name_or_path}' does not exist; give a YAML path or a preset name from {CONFIG_DIR}")
        return p
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        names = ", ".join(preset_names())
        raise ConfigError(f"config '{name_or_path}' is neither a YAML file nor a preset{did_you_mean(name_or_path, preset_names())}; "
                          f"presets: {names}")
    return candidate


def read_yaml(src: Path) -> DictConfig:
    """The file's mapping, parsed once per text (a preset is read by every config load, and the YAML
    parser is pure Python; a file rewritten in place is parsed again). Shared between the calls, so
    callers only read it (OmegaConf's read-only flag would pass on to every config merged from it)."""
    raw = Path(src).read_bytes()
    if raw not in _PARSED:
        try:
            loaded = OmegaConf.load(io.BytesIO(raw))  # the bytes already read, not the file a second time
        except Exception as exc:  # YAML syntax errors
            raise ConfigError(f"config file '{src}' is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file '{src}' must hold a mapping of sections (model:, trainer:, ...) at its top level, "
                              f"not a {type(loaded).__name__.removesuffix('Config').lower() or 'value'}")
        if len(_PARSED) >= 64:  # a long process that writes many configs (a study's trials) starts it over
            _PARSED.clear()
        _PARSED[raw] = loaded
    return _PARSED[raw]


_PARSED: dict[bytes, DictConfig] = {}


def without_retired_defaults(loaded: DictConfig, retired: dict[str, Any]) -> DictConfig:
    """`loaded` less the retired keys (`retired`: dotted key -> its last default) that hold their default, as
    every run directory's config written before they retired does; `loaded` itself when none does (it is shared)."""
    found = [k for k, default in retired.items() if OmegaConf.select(loaded, k, default=None) == default]
    if not found:
        return loaded
    copy = OmegaConf.create(OmegaConf.to_container(loaded))
    for key in found:
        section, _, name = key.rpartition(".")
        del (OmegaConf.select(copy, section) if section else copy)[name]
    return copy


def refuse_moved_keys(loaded: DictConfig, overrides: list[str], moved: dict[str, str], source: str) -> None:
    """A key that has moved (`moved`: old name -> new name), in the file or an override, is refused
    with one sentence naming its new name."""
    for key in [k for k in moved if OmegaConf.select(loaded, k, default=None) is not None]:
        raise ConfigError(f"config key '{key}' in {source} has moved to '{moved[key]}'; rename it")
    for key in [item.partition("=")[0] for item in overrides]:
        if key in moved:
            raise ConfigError(f"config key '{key}' in the command line has moved to '{moved[key]}'; rename it")


def merge_config(schema: type, loaded: DictConfig, source: str, overrides: list[str] | None, replaced_mappings=(),
                 moved: dict[str, str] | None = None, defaults: dict[str, Any] | None = None,
                 retired: dict[str, Any] | None = None) -> Any:
    """`loaded` (a YAML file's mapping) over the dataclass `schema`'s defaults (with `defaults`,
    {dotted key: value}, in place of the schema's own), then `key=value` overrides; a key of `moved`
    is refused naming its new name, unless it is a `retired` key at its last default (left out); any
    mistake is one sentence naming the key."""
    loaded = without_retired_defaults(loaded, retired or {})
    refuse_moved_keys(loaded, overrides or [], moved or {}, source)
    try:
        merged = merge_replacing(schema_config(schema, defaults), loaded, replaced_mappings)
    except OmegaConfBaseException as exc:
        raise ConfigError(one_sentence(exc, source, schema)) from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must have the form key=value, for example trainer.lr=1e-5")
        key, _, raw = item.partition("=")
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
            # an override replaces the value, mappings included (reward.weights={brightness: 1.0})
            OmegaConf.update(merged, key, value, merge=False, force_add=False)
        except OmegaConfBaseException as exc:
            raise ConfigError(one_sentence(exc, "the command line", schema)) from None
    return OmegaConf.to_object(merged)


def merge_replacing(base: DictConfig, loaded: DictConfig, replaced_mappings) -> DictConfig:
    """`loaded` merged onto `base`, except that a mapping of `replaced_mappings` given in `loaded` replaces the
    base's instead of adding to it (one left out keeps the base's)."""
    merged = OmegaConf.merge(base, loaded)
    for key in replaced_mappings:
        given = OmegaConf.select(loaded, key, default=None)
        if given is not None:
            OmegaConf.update(merged, key, given, merge=False)
    return merged


_SCHEMA_CONFIGS: dict[tuple, DictConfig] = {}


def schema_config(schema: type, defaults: dict[str, Any] | None = None) -> DictConfig:
    """`structured_with(schema, defaults)`, built once per schema and defaults and only read (OmegaConf.merge copies
    its first config): OmegaConf.structured walks the whole dataclass tree, most of a config load's time (45 ms)."""
    key = (schema, repr(sorted((defaults or {}).items())))
    if key not in _SCHEMA_CONFIGS:
        _SCHEMA_CONFIGS[key] = structured_with(schema, defaults)
    return _SCHEMA_CONFIGS[key]


def structured_with(schema: type, defaults: dict[str, Any] | None = None) -> DictConfig:
    """The dataclass `schema`'s defaults as a config, with `defaults` ({dotted key: value}) in place of its own."""
    base = OmegaConf.structured(schema)
    for key, value in (defaults or {}).items():
        OmegaConf.update(base, key, value, merge=False)
    return base


def one_sentence(exc: OmegaConfBaseException, source: str, schema: type) -> str:
    """OmegaConf's complaint about `source` against the dataclass `schema` as one sentence naming the key."""
    key = getattr(exc, "full_key", None) or "?"
    msg = str(getattr(exc, "msg", exc)).splitlines()[0].strip()
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        node = OmegaConf.structured(schema)
        allowed = OmegaConf.select(node, parent) if parent else node
        keys = list(allowed.keys()) if hasattr(allowed, "keys") else []
        hint = did_you_mean(key.rsplit(".", 1)[-1], keys, prefix=parent + "." if parent else "")
        return (f"unknown config key '{key}' in {source}{hint}; allowed keys{' under ' + repr(parent) if parent else ''}: "
                f"{', '.join(keys) or '?'}")
    if isinstance(exc, ValidationError):
        expected = type_name_of(key, schema)
        if "is not Optional" in msg:  # null given to a key that needs a value: OmegaConf's message quotes the key
            return f"config key '{key}' in {source} must be {expected}, got null"
        value = msg.split("'", 2)[1] if msg.count("'") >= 2 else msg
        return f"config key '{key}' in {source} must be {expected}, got {value!r}"
    return f"invalid config in {source}: {key}: {msg}"


def did_you_mean(word: str, options, prefix: str = "") -> str:
    """ " (did you mean 'x'?)" for the closest of `options` to a mistyped `word` (the standard
    library's close matches), or "" when none is close."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def type_name_of(key: str, schema: type) -> str:
    node: Any = schema()
    for part in key.split("."):
        if not hasattr(node, part):
            return "a valid value"
        node = getattr(node, part)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    return names.get(type(node), "a valid value")
