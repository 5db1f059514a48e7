"""docs/architecture.md checked against the code, so it cannot go stale silently (issue 87): every module of
flowrl/ and rewards/ is named in it (in its room list, "## The rooms", by file name under its folder, or
anywhere by its path), and every kind of part (`Registry.all()`) by the config key that chooses it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("flowrl", "rewards")

_ENTRY = re.compile(r"^( *)(\w+)(/|\.py)(?=\s|$)")  # a room-list line's first word: a folder (name/) or a file
_MODULE = re.compile(r"[\w/]*\w\.py\b")


def modules(root: Path = ROOT) -> list[str]:
    """The modules the doc must name, as paths ("flowrl/core/advantages.py"): every .py file under the packages,
    a package's __init__.py as its folder ("flowrl/core/"), underscore-private files left out."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if path.name == "__init__.py":
                out.append(rel[: -len("__init__.py")])
            elif not path.name.startswith("_"):
                out.append(rel)
    return out


def room_block(text: str) -> str:
    """The fenced block under "## The rooms"."""
    section = text.split("\n## The rooms", 1)[1]
    return section.split("```", 2)[1]


def named(text: str) -> set[str]:
    """Every module path and folder the doc names: paths written out anywhere (flowrl/x/y.py), and in the room
    list each folder and each file name, resolved against the folders its line stands under. A line opening
    with "name/" or "name.py" at most two columns deeper than the folder above it is an entry (a folder, or a
    file in that folder); any other line continues the entry above."""
    found = {m for m in _MODULE.findall(text) if m.startswith(tuple(f"{p}/" for p in PACKAGES))}
    stack: list[tuple[int, str]] = []  # (indentation, folder)
    for line in room_block(text).splitlines():
        m = _ENTRY.match(line)
        indent = len(m[1]) if m else None
        if m and indent <= (stack[-1][0] + 2 if stack else 0):  # deeper lines continue the entry above
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if m[3] == "/":
                stack.append((indent, m[2]))
        folder = "/".join(name for _, name in stack)
        if folder:
            found.add(folder + "/")
        for name in _MODULE.findall(line):
            found.add(f"{folder}/{name}" if folder else name)
            if "/" in name and stack:  # a path relative to the top folder (runtime/options.py under flowrl/)
                found.add(f"{stack[0][1]}/{name}")
    return found


def missing_modules(text: str, mods: list[str]) -> list[str]:
    names = named(text)
    return [m for m in mods if m not in names]


def registry_keys() -> list[str]:
    """The config key of every kind of part, with the image and the text config's parts registered."""
    import flowrl.config  # noqa: F401  (every image part's registry)
    import flowrl.text.config  # noqa: F401  (the text objectives and rewards)
    from flowrl.registry import Registry

    return sorted({r.key for r in Registry.all()})


def missing_keys(text: str, keys: list[str]) -> list[str]:
    return [k for k in keys if f"`{k}`" not in text and not re.search(rf"\b{re.escape(k)}\b", text)]


def test_every_module_is_named():
    mods = modules()
    assert len(mods) > 100  # the walk found the packages
    missing = missing_modules(DOC.read_text(), mods)
    assert not missing, f"docs/architecture.md does not name these modules (add them to its room list): {missing}"


def test_a_module_left_out_is_reported():
    """The control: a module the doc does not name, a file name written under the wrong folder, and a folder
    left out are each reported."""
    text = DOC.read_text()
    mods = modules()
    assert missing_modules(text, mods + ["flowrl/core/made_up_toy.py"]) == ["flowrl/core/made_up_toy.py"]
    # `loop.py` is named under train/, not under core/
    assert missing_modules(text, ["flowrl/core/loop.py", "flowrl/train/loop.py"]) == ["flowrl/core/loop.py"]
    # the room list with one entry cut out
    cut = text.replace("    image_producer.py", "    (cut)")
    assert missing_modules(cut, mods) == ["flowrl/train/image_producer.py"]
    assert missing_modules(text, ["flowrl/nowhere/"]) == ["flowrl/nowhere/"]


def test_every_kind_of_part_is_named_by_its_key():
    keys = registry_keys()
    assert {"allocator.kind", "objective.kind", "rollout.kind", "reward.weights"} <= set(keys)
    text = DOC.read_text()
    assert not missing_keys(text, keys), f"docs/architecture.md does not name these config keys: {missing_keys(text, keys)}"
    assert missing_keys(text, keys + ["made_up.kind"]) == ["made_up.kind"]


def section_code(text: str, heading: str, lang: str = "python") -> str:
    """The first ```lang block under `## heading`."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def test_the_allocator_example_is_a_working_plugin(tmp_path, monkeypatch):
    """The toy of "Adding an allocator", loaded as the doc says (one module named in `plugins`): the config
    gets allocator.toy_retry, its RANGES and its validate are checked, and it allocates the whole budget."""
    import torch

    from flowrl.config import load_config
    from flowrl.core.allocation import ALLOCATORS, run_stages
    from flowrl.errors import ConfigError

    (tmp_path / "doc_toy_retry.py").write_text(section_code(DOC.read_text(), "Adding an allocator"))
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["plugins=[doc_toy_retry]", "allocator.kind=toy_retry", "data.prompts_per_iteration=4", "data.group_size=4"]
    try:
        cfg = load_config(None, [*base, "allocator.toy_retry.retry_share=0.5"], validate_paths=False)
        assert cfg.allocator.toy_retry.retry_share == 0.5
        import pytest

        with pytest.raises(ConfigError, match=r"^allocator\.toy_retry\.retry_share must be in \[0, 1\); got 1\.5"):
            load_config(None, [*base, "allocator.toy_retry.retry_share=1.5"], validate_paths=False)
        with pytest.raises(ConfigError, match=r"^allocator\.toy_retry\.retry_share x data\.group_size must be 0 or >= 1"):
            load_config(None, [*base, "allocator.toy_retry.retry_share=0.1"], validate_paths=False)
        alloc = cfg.allocator.build(num_prompts=10, prompts_per_iteration=4, group_size=4, seed=0)
        counts, stages = run_stages(alloc, 0, lambda ids: ids % 2 == 0)  # even prompts succeed
        assert int(counts.sum()) == 16 and len(stages) == 2  # half the budget, then the rest again
        retried = stages[1].unique()
        assert bool((retried % 2 == 1).all()) and len(retried) > 0  # only prompts without a success
        assert torch.equal(counts > 0, torch.bincount(stages[0], minlength=10) > 0)
    finally:
        ALLOCATORS.unregister("toy_retry")


def test_the_schema_holds_sections_only():
    """schema.py keeps the sections the parts do not own, under 250 lines, and no `kind` field's comment lists the
    parts it chooses among: the registry lists them (flowrl config show), a comment would go stale."""
    import flowrl.config  # noqa: F401  (every built-in part registered)
    from flowrl.registry import Registry

    text = (ROOT / "flowrl" / "schema.py").read_text()
    assert len(text.splitlines()) < 250
    names = {name for registry in Registry.all() for name in registry.names()}
    for line in text.splitlines():
        if re.match(r"\s+kind: str = ", line):
            listed = [n for n in re.split(r"[\s|,]+", line.partition("#")[2]) if n in names]
            assert len(listed) < 2, f"schema.py lists parts by hand: {line.strip()}"
