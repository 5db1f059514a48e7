"""mkdocs hooks (mkdocs.yml `hooks:`) for the documentation site (`make docs`).

The site is built from the repository as it stands, with no copies kept in docs/: README.md becomes
the home page and BENCHMARKS.md a page of its own, and the presets and parts pages are rendered from
the code at build time (`preset_names`/`preset_description`, the parts' registries). The markdown in
the repository is written for a reader of the repository (GitHub, an editor), so its links are
relative to each file's place there; `on_page_markdown` rewrites each link that points at an existing
file to where that file is in the site. A link to a missing file is left alone, so that
`mkdocs build --strict` fails on it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# repository files outside docs/ that are pages of the site: their path in the repository -> in the site
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "BENCHMARKS.md"}

LINK = re.compile(r"(!?\[(?P<text>[^\]]*)\]\()(?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)", re.M)


# ---- the generated pages ---------------------------------------------------------------------------
def presets_page() -> str:
    from flowrl.presets import preset_description, preset_names

    rows = "\n".join(f"| `{name}` | {preset_description(name).replace('|', '&#124;')} |" for name in preset_names())
    return ("# Presets\n\n"
            "A preset is a YAML file in `configs/`, named on the command line without its extension "
            "(`flowrl train sd35_medium_dgpo_1gpu`); `flowrl config show NAME` prints its resolved config, each key "
            "with its description ([usage](../usage.md#configuration-reference)). Each description below is the "
            "first sentence of the comment that the preset's YAML opens with.\n\n"
            "| preset | what it runs |\n|---|---|\n" + rows + "\n")


def part_kinds() -> list[tuple[str, Any]]:
    """Each kind of registered part as (label, registry): every flowrl.registry.Registry, once the two
    configs that validate against them (and so import every built-in part) are loaded."""
    import flowrl.config  # noqa: F401  (the image config: rollouts, objectives, allocators, estimators, rewards, ...)
    import flowrl.text.config  # noqa: F401  (the text config: the text objectives)
    from flowrl.registry import Registry

    return [(registry.what, registry) for registry in Registry.all()]


def describe_part(name: str, part: Any, key: str | None) -> str:
    """A part's one line: the description it carries (a reward's), else the first sentence of the module
    that defines it (a part is one file, whose docstring says what it is; a class's own docstring often
    describes one method's detail), less a leading "rollout.kind flat: "."""
    if isinstance(part, str):
        return part
    own_file = sum(getattr(other, "__module__", None) == part.__module__ for other in _REGISTERED.get(key, ())) <= 1
    text = getattr(part, "description", None) or (sys.modules[part.__module__].__doc__ if own_file else part.__doc__) or ""
    text = " ".join(text.strip().split("\n\n")[0].split())
    text = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text, maxsplit=1)[0]
    return re.sub(rf"^{re.escape(f'{key} {name}')}: ", "", text) if key else text


_REGISTERED: dict[str, list] = {}  # key -> the parts of its registry: several in one file are described each by its docstring


def parts_page(kinds: Iterable[tuple[str, Any]]) -> str:
    lines = ["# Parts", "",
             "Every registered part, by kind: the name a config chooses it by, and what it is. A part of your "
             "own registers the same way ([adding an objective](../architecture.md#adding-an-objective), "
             "[a rollout](../architecture.md#adding-a-rollout), [a model family](../architecture.md#adding-a-model-family), "
             "[a reward](../architecture.md#adding-a-reward)).", ""]
    for label, registry in kinds:
        key = getattr(registry, "key", None)
        lines += [f"## {label}", "", f"Chosen by `{key}`." if key else "", "", "| name | description |", "|---|---|"]
        _REGISTERED[key] = [part for _, part in registry.items()]
        lines += [f"| `{name}` | {describe_part(name, part, key).replace('|', '&#124;')} |" for name, part in registry.items()]
        lines.append("")
    return "\n".join(lines)


def on_config(config):
    # the pages describe this checkout's code, not another installed copy (mkdocs restores sys.path
    # after loading a hook, so this happens here rather than at import)
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    return config


def on_files(files, config):
    for src_uri, page in ROOT_PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / src_uri)))
    files.append(File.generated(config, "reference/presets.md", content=presets_page()))
    files.append(File.generated(config, "reference/parts.md", content=parts_page(part_kinds())))
    return files


# ---- links -------------------------------------------------------------------------------------------
def _source(page_uri: str) -> Path:
    """Where the page's markdown lives in the repository (a docs_dir of another place, such as the tests'
    copy of docs/, mirrors docs/: its links are read as docs/'s are)."""
    for repo_path, site_path in ROOT_PAGES.items():
        if page_uri == site_path:
            return ROOT / repo_path
    return DOCS / page_uri


def _rewrite(target: str, page_uri: str) -> str | None:
    """The link's target in the site, or None to keep it as written."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None  # a URL, an anchor of this page
    path, _, anchor = target.partition("#")
    real = (_source(page_uri).parent / path).resolve()
    if not real.exists() or ROOT not in real.parents:
        return None  # a broken link stays broken: --strict reports it
    rel = real.relative_to(ROOT).as_posix()
    if rel in ROOT_PAGES:
        site = ROOT_PAGES[rel]
    elif real.is_relative_to(DOCS):
        site = real.relative_to(DOCS).as_posix()
    else:
        return ""  # a file of the repository that is no page of the site: named, not linked
    new = os.path.relpath(site, os.path.dirname(page_uri) or ".").replace(os.sep, "/")
    return new + (f"#{anchor}" if anchor else "")


def _rewrite_links(markdown: str, page_uri: str) -> str:
    def one(match: re.Match) -> str:
        target = match.group("target")
        new = _rewrite(target, page_uri)
        if new is None:
            return match.group(0)
        if new == "":
            text = match.group("text")
            return f"`{target}`" if text.strip("`") == target else f"{text} (`{target}`)"
        return f"{match.group(1)}{new})"

    parts = FENCE.split(markdown)
    # FENCE.split keeps the fence markers: text, marker, code, marker, text, ...; rewrite text only
    out, inside = [], False
    for chunk in parts:
        if chunk in ("```", "~~~"):
            inside = not inside
            out.append(chunk)
        else:
            out.append(chunk if inside else LINK.sub(one, chunk))
    return "".join(out)


def on_page_markdown(markdown, page, config, files):
    return _rewrite_links(markdown, page.file.src_uri)
