"""Prompt sources: inline lists, a text file with one prompt per line, or an edit dataset (edit_data.py)."""

from __future__ import annotations

from pathlib import Path

from flowrl.errors import UserError
from flowrl.schema import DataConfig



BUILTIN_PROMPT_SETS = ("builtin:shapes-train", "builtin:shapes-heldout", "builtin:ocr")
SHIPPED_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "prompts"


def builtin_prompts(name: str, field: str, per_category: int | None = None) -> list[str]:
    """The shapes world's fixed prompt splits, category-balanced: each category's prompts
    cycled to `per_category` entries (default: the largest category's size, so every prompt
    appears). Balance matters because the grammar has 18 single-object prompts and over a
    thousand position prompts, while the evaluation weighs the four categories equally.
    builtin:ocr: 120 text-rendering prompts for the ocr reward, shipped as a text file."""
    from rewards.shapes_world import CATEGORIES, eval_set, prompt_split

    if name not in BUILTIN_PROMPT_SETS:
        raise UserError(f"{field} '{name}' names no built-in prompt set; built-ins: {', '.join(BUILTIN_PROMPT_SETS)}")
    if name == "builtin:ocr":
        return read_prompt_file(SHIPPED_PROMPTS / "ocr.txt", field)
    split = name.removeprefix("builtin:shapes-")
    per_category = per_category or max(len(prompt_split(split, c)) for c in CATEGORIES)
    return eval_set(per_category, split=split)


def read_prompt_file(path: str | Path, field: str = "data.prompt_file", per_category: int | None = None) -> list[str]:
    """One prompt per line (blank lines and # comments skipped), or a built-in set (builtin:NAME)."""
    if str(path).startswith("builtin:"):
        return builtin_prompts(str(path), field, per_category)
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
    """The training prompts: data.edits' edits (EditPrompts), else data.prompts, else data.prompt_file's."""
    if data.edits:
        from flowrl.train.edit_data import read_edits

        return read_edits(data.edits)
    return list(data.prompts) if data.prompts else read_prompt_file(data.prompt_file)


def eval_prompts(data: DataConfig, prompts: list[str]) -> list[str]:
    """The prompts of sample grids: data.eval_prompts, else the first four training prompts."""
    return list(data.eval_prompts) or prompts[:4]


def prompt_set(data: DataConfig, prompts: list[str], held_out: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every prompt a run conditions on, once each in order: the training prompts, the eval prompts and `held_out`
    (the monitor's). What model.text_encoders cached encodes ahead; the trainer and an async producer name the same
    set, so they share one cache file."""
    return list(dict.fromkeys([*prompts, *eval_prompts(data, prompts), *held_out]))


def snippet_prompt(data: DataConfig) -> str:
    """The prompt `flowrl export`'s printed code draws: the run's first held-out prompt (data.eval_prompts); an
    editing run's first edit (an EditPrompt: its instruction and source)."""
    if data.edits:
        return load_prompts(data)[0]
    return (data.eval_prompts or ["a photo of a cat"])[0]
