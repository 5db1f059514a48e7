"""Where the presets live: configs/NAME.yaml, named on the command line by NAME. Light to import,
so that `flowrl --help` can list them without loading the config machinery."""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "default"


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def preset_description(name: str) -> str:
    """The first sentence of the preset's header comment (each preset opens with one saying what it runs)."""
    comment = []
    for line in (CONFIG_DIR / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#") or line.strip() == "#" or line.startswith("#  "):
            break  # the header's first paragraph ends at a blank comment line or an indented command
        comment.append(line.lstrip("#").strip())
    text = " ".join(comment)
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", text, maxsplit=1)[0]
