"""The documentation site (mkdocs.yml, `make docs`) builds with `mkdocs build --strict`: no broken link or
anchor, no page missing from the nav or the docs; its API page documents every public name of flowrl.api,
its parts page every registered part and its presets page every preset. A control build with one broken
link fails, so strict is strict."""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[2]


def _build(site_dir: Path, **options) -> None:
    build(load_config(config_file=str(ROOT / "mkdocs.yml"), site_dir=str(site_dir), strict=True, **options))


def test_the_site_builds_strict_with_the_api_parts_and_presets(tmp_path):
    import flowrl.config  # noqa: F401  (every image part registered)
    import flowrl.text.config  # noqa: F401  (the text objectives)
    from flowrl import api
    from flowrl.presets import preset_description, preset_names
    from flowrl.registry import Registry

    _build(tmp_path)  # raises Abort on any warning

    home = (tmp_path / "index.html").read_text()
    assert "What the default run shows" in home and 'href="usage/"' in home  # README.md, its docs/ links rewritten
    assert (tmp_path / "BENCHMARKS" / "index.html").exists()

    page = (tmp_path / "reference" / "api" / "index.html").read_text()
    public = [name for name, obj in vars(api).items()
              if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == api.__name__]
    assert {"train", "sample", "evaluate", "export", "config", "Run"} <= set(public)
    missing = [name for name in public if f'id="flowrl.api.{name}"' not in page]
    assert not missing, f"the API page does not document flowrl.api's {missing}"

    page = (tmp_path / "reference" / "parts" / "index.html").read_text()
    kinds = {registry.what: registry.names() for registry in Registry.all()}
    assert {"Rollouts", "Objectives", "Model families", "Rewards", "Allocators", "Advantage estimators", "Selections",
            "Text objectives"} <= set(kinds)
    for label, names in kinds.items():
        assert names and f">{label}<" in page, f"the parts page has no section {label}"
        section = page.split(f">{label}<", 1)[1].split("<h2", 1)[0]
        missing = [name for name in names if f"<code>{name}</code>" not in section]
        assert not missing, f"the parts page's {label} lacks {missing}"

    page = (tmp_path / "reference" / "presets" / "index.html").read_text()
    missing = [name for name in preset_names() if f"<code>{name}</code>" not in page]
    assert not missing, f"the presets page lacks {missing}"
    # each row's description is its preset's header sentence: a preset that opens without one has none
    undescribed = [name for name in preset_names() if not preset_description(name).endswith(".")]
    assert not undescribed, f"presets whose YAML does not open with a comment saying what they run: {undescribed}"


def test_a_broken_link_fails_the_build(tmp_path, caplog):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    with (docs / "search.md").open("a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort):
        _build(tmp_path / "site", docs_dir=str(docs))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no-such-page.md" in warnings[0], warnings
