"""The layers of docs/architecture.md, enforced: import-linter's contracts in pyproject.toml
(flowrl.core imports no diffusion, text, training or reward code; sampling, models and rewards
never import the loop or the CLI; no import cycles; each layer imports only the layers below it),
type-only imports counted, and flowrl.core's one third-party import."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_import_linter_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)
    # import-linter's CLI configures logging with dictConfig, which disables every logger that exists
    # already: in a test worker, flowrl's own loggers would then be silent for the tests that follow
    loggers = [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = [lg.disabled for lg in loggers]
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0
    finally:
        for lg, was in zip(loggers, disabled):
            lg.disabled = was


def test_core_imports_only_torch_and_the_standard_library():
    graph = grimp.build_graph("flowrl", include_external_packages=True, exclude_type_checking_imports=False, cache_dir=None)
    core = {"flowrl.core", *graph.find_descendants("flowrl.core")}
    imported = {m for module in core for m in graph.find_modules_directly_imported_by(module)}
    # the house's registry (core's estimators, selections and allocators register as every part does) and its
    # error type: two plain modules of the standard library's imports alone
    shared = {"flowrl.registry", "flowrl.errors"}
    outside = {m.split(".")[0] for m in imported if not m.startswith("flowrl.core") and m not in shared}
    assert outside - set(sys.stdlib_module_names) <= {"torch"}, outside
    below = {m for module in shared for m in graph.find_modules_directly_imported_by(module)} - shared
    assert {m.split(".")[0] for m in below} <= set(sys.stdlib_module_names), below
