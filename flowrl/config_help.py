"""`flowrl config show`: a resolved config as YAML, each key with its description.

The descriptions are the comments written beside (or just above) each field of a section's
dataclass, read from the source of the module that defines it (flowrl/schema.py, or a part's own
file for its rollout.<name> or objective.<name> section), so the help cannot drift from the code."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import tokenize
from functools import lru_cache

from omegaconf import OmegaConf

from flowrl.errors import UserError


@lru_cache(maxsize=None)
def field_comments(module_name: str) -> dict[tuple[str, str], str]:
    """(dataclass name, field name) -> the comment on the field's line, or the comment lines
    directly above it, in the module `module_name`."""
    import sys

    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):  # a class made at run time, or a module without source
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                text = comments.get(item.end_lineno)
                if text is None:  # a comment block right above the field
                    above, row = [], item.lineno - 1
                    while row in comments and lines[row - 1].lstrip().startswith("#"):
                        above.insert(0, comments[row])
                        row -= 1
                    text = " ".join(above) or None
                if text:
                    out[(node.name, item.target.id)] = text
    return out


def _value_yaml(value) -> str:
    """One line of YAML: lists and mappings in flow style (JSON is YAML), scalars as OmegaConf writes them."""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return OmegaConf.to_yaml({"v": value}).strip().removeprefix("v:").strip()


def describe(cfg, keys: list[str] | tuple[str, ...] = ()) -> str:
    """The config as YAML with each field's description as a comment; only the `keys` (dotted, such as
    model.quantize, or a section such as model) and the sections above them when any are given."""
    out, matched = [], set()

    def shown(path: str) -> bool:
        if not keys:
            return True
        hit = [k for k in keys if path == k or path.startswith(k + ".")]
        matched.update(k for k in hit if path == k)
        return bool(hit) or any(k.startswith(path + ".") for k in keys)

    def note_of(cls: type, name: str) -> str | None:
        for klass in cls.__mro__:  # a field inherited from a schema section is described there
            found = field_comments(klass.__module__).get((klass.__name__, name))
            if found:
                return found
        return None

    def walk(obj, indent: str, prefix: str = "") -> None:
        for f in dataclasses.fields(obj):
            if not shown(prefix + f.name):
                continue
            value = getattr(obj, f.name)
            note = note_of(type(obj), f.name)
            if dataclasses.is_dataclass(value):
                doc = (inspect.getdoc(type(value)) or "").split("\n\n")[0].replace("\n", " ")
                if doc.startswith(f"{type(value).__name__}("):  # the signature dataclass writes where there is no docstring
                    doc = ""
                out.append(f"{indent}{f.name}:" + (f"  # {doc}" if doc and not indent else ""))
                walk(value, indent + "  ", f"{prefix}{f.name}.")
                continue
            out.append(f"{indent}{f.name}: {_value_yaml(value)}" + (f"  # {note}" if note else ""))

    walk(cfg, "")
    unknown = [k for k in keys if k not in matched]
    if unknown:
        raise UserError(f"config show: '{unknown[0]}' is no key of this config; give a dotted key such as model.quantize "
                        "or a section such as model")
    return "\n".join(out) + "\n"
