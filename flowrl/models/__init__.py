"""Policy adapters over diffusers pipelines: one module per model family.

Each family is a `FlowPolicy` subclass that carries its own facts as class attributes (see
flowrl/models/base.py) and registers itself with `@register_family` under its `kind` (model.kind).
Importing this package imports each of its modules, so a new family is one new file here (and its
tiny pipeline in tiny.py); no table names it. The modules import no diffusers pipeline until one is
loaded, so importing them all stays cheap.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module

from flowrl.models.base import FlowPolicy
from flowrl.registry import Registry
from flowrl.schema import ModelConfig

FAMILIES = Registry("model.kind", "Model families")  # model.kind -> the family's FlowPolicy subclass


def register_family(cls: type[FlowPolicy]) -> type[FlowPolicy]:
    """Class decorator: register a family under its `kind`. Its kind and pipeline are its own, never
    inherited from the family it extends."""
    for attribute in ("kind", "pipeline_name"):
        if not vars(cls).get(attribute):
            raise TypeError(f"{cls.__name__} must set its own `{attribute}` to be registered as a model family")
    return FAMILIES.register(cls, name=cls.kind)


for _module in pkgutil.iter_modules(__path__):
    import_module(f"{__name__}.{_module.name}")


def policy_class(kind: str) -> type[FlowPolicy]:
    return FAMILIES.get(kind)


def pipeline_kinds() -> dict[str, str]:
    """The registered families' diffusers pipeline class names -> their model.kind (model_index.json's
    _class_name tells a pipeline directory's family)."""
    return {family.pipeline_name: kind for kind, family in FAMILIES.items()}


def load_policy(cfg: ModelConfig, device=None, prompts: list[str] | None = None) -> FlowPolicy:
    """`prompts`: the run's prompt set, which model.text_encoders cached encodes once (flowrl/models/text_cache.py)."""
    return policy_class(cfg.kind).from_config(cfg, device, prompts)


__all__ = ["FAMILIES", "FlowPolicy", "load_policy", "pipeline_kinds", "policy_class", "register_family"]
