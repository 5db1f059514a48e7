"""Prompt sources: inline lists or a text file with one prompt per line."""

from __future__ import annotations

from pathlib import Path

from flowrl.config import DataConfig
from flowrl.errors import UserError


def read_prompt_file(path: str | Path, field: str = "data.prompt_file") -> list[str]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{field} '{path}' does not exist; give a text file with one prompt per line")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{field} '{path}' is not UTF-8 text; give a text file with one prompt per line") from None
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise UserError(f"{field} '{path}' holds no prompts; give one prompt per line")
    return prompts


def load_prompts(data: DataConfig) -> list[str]:
    return list(data.prompts) if data.prompts else read_prompt_file(data.prompt_file)
