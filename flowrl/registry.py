"""One registry type for every kind of part a config chooses by name (objective.kind,
rollout.kind, allocator.kind, advantage.kind, selection.kind, the rewards of reward.weights, ...):
a decorator that registers a part under its name, lazy entries imported on first use (so `--help`
stays light), the choices that `config show` and the error sentence list, the config section of
the parts' options (`section`: a part whose `options` is a dataclass gets a sub-section under its
name), and parts from outside the package: a module named in the config's `plugins` list, or one
that an installed package declares under the `flowrl.parts` entry point group, registers its
parts when imported. `Registry.all()` lists every kind (the documentation's parts page).

    OBJECTIVES = Registry("objective.kind")

    @OBJECTIVES.register
    class MyObjective(Objective):
        name = "mine"
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from importlib import import_module
from typing import Any, Callable, ClassVar, Iterator

from flowrl.errors import ConfigError

ENTRY_POINT_GROUP = "flowrl.parts"  # installed packages' modules that register parts when imported
_ENTRY_POINTS_LOADED: list[bool] = []


class Registry:
    _ALL: ClassVar[list[weakref.ref]] = []  # weakly: a registry a test makes and drops leaves the list

    def __init__(self, key: str, what: str = ""):
        self.key = key  # the config field that chooses among the parts, for the error sentence
        self.what = what or key  # what the parts are, in a word or two (their heading in the documentation)
        self._parts: dict[str, Any] = {}
        self._lazy: dict[str, str] = {}  # name -> "module:attribute", imported on first lookup
        Registry._ALL.append(weakref.ref(self))

    @classmethod
    def all(cls) -> list["Registry"]:
        """Every registry alive (each module that defines one must have been imported), in the order they were made."""
        return [r for r in (ref() for ref in cls._ALL) if r is not None]

    def register(self, part: Any = None, *, name: str | None = None) -> Any:
        """Register `part` under `name` (default: its `name` attribute); usable as a decorator."""
        def add(obj):
            self._parts[name or obj.name] = obj
            self._lazy.pop(name or obj.name, None)
            return obj

        return add if part is None else add(part)

    def unregister(self, name: str) -> None:
        self._parts.pop(name, None)
        self._lazy.pop(name, None)

    def register_lazy(self, name: str, target: str) -> None:
        """`target` ("module:attribute") is imported when `name` is first looked up."""
        self._lazy[name] = target

    def names(self) -> tuple[str, ...]:
        return tuple(sorted({*self._parts, *self._lazy}))

    def __contains__(self, name: str) -> bool:
        return name in self._parts or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def get(self, name: str) -> Any:
        """The part registered as `name`; one sentence naming the field and the choices otherwise."""
        if name not in self:
            raise ConfigError(f"{self.key} must be one of {', '.join(self.names())}; got '{name}'")
        if name not in self._parts:
            module, attribute = self._lazy.pop(name).split(":")
            self._parts[name] = getattr(import_module(module), attribute)
        return self._parts[name]

    __getitem__ = get

    def items(self) -> list[tuple[str, Any]]:
        return [(n, self.get(n)) for n in self.names()]

    def where(self, test: Callable[[Any], bool]) -> list[str]:
        """The names of the parts for which `test(part)` holds (for 'X can do it' sentences)."""
        return [n for n, part in self.items() if test(part)]

    def section(self, name: str, base: type) -> type:
        """The config section `base` (a dataclass: the kind and the options every part shares) with a
        sub-section per registered part whose `options` is a dataclass, under the part's name and typed
        by it (objective.nft, allocator.vade, ...)."""
        parts = [(n, part.options, dataclasses.field(default_factory=part.options)) for n, part in self.items()
                 if getattr(part, "options", None)]
        return dataclasses.make_dataclass(name, parts, bases=(base,), namespace={
            "__doc__": base.__doc__, "__deepcopy__": deepcopy_fields, "__module__": base.__module__})


def deepcopy_fields(self, memo):
    """A dataclass's deep copy field by field (a made dataclass has no module attribute to pickle by)."""
    return type(self)(**{f.name: copy.deepcopy(getattr(self, f.name), memo) for f in dataclasses.fields(self)})


def load_plugins(modules: list[str] | tuple[str, ...] = (), entry_points: bool = True) -> None:
    """Import the modules that register parts: the config's `plugins` and, with `entry_points`,
    every module of the `flowrl.parts` entry point group. An import that fails is one sentence."""
    for i, module in enumerate(modules):
        try:
            import_module(module)
        except Exception as exc:  # a missing module, or the module's own error
            raise ConfigError(f"plugins[{i}] '{module}' does not import ({type(exc).__name__}: {exc}); give an importable "
                              "module that registers parts, such as my_package.my_objective") from None
    if entry_points and not _ENTRY_POINTS_LOADED:
        from importlib.metadata import entry_points as installed

        _ENTRY_POINTS_LOADED.append(True)  # once per process: reading every package's metadata is slow
        for ep in installed(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except Exception as exc:
                raise ConfigError(f"the '{ep.name}' entry point of group {ENTRY_POINT_GROUP} ({ep.value}) does not import "
                                  f"({type(exc).__name__}: {exc})") from None
