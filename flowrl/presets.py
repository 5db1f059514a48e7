"""Where the presets live: configs/NAME.yaml, named on the command line by NAME. Light to import,
so that `flowrl --help` can list them without loading the config machinery."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "default"


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
