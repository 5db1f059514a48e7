"""Edit datasets (data.edits): the prompts of an editing run, each a source image and an instruction
(optionally a reference target), as EditPrompts (flowrl/models/edit_prompt.py).

A dataset is a JSONL file (one object per line), a parquet file, a hub dataset id (read with
`datasets`, its train split), or one of the editing world's built-in sets (BUILTIN_EDIT_SETS). Each row has an `instruction` (text), a `source` (a path, relative to
the file's folder where it is not absolute, or an image's bytes, or a `datasets` Image) and may have a
`reference` (the same kinds). Every row is checked when the dataset is read: a row without an
instruction, or whose image is missing or cannot be read, is one sentence naming the row. Images are
decoded when an edit is first encoded, not here: a dataset's images need not fit in memory."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from flowrl.errors import UserError
from flowrl.models.edit_prompt import EditPrompt

COLUMNS = ("instruction", "source", "reference")  # the last may be absent
# the editing world's fixed sets (rewards/shapes_edit_world.py `edit_set`, layouts drawn with seed 0): name ->
# (split, edits per edit type); the training set's 1,000 sources are rendered once, the held-out set is what
# `flowrl eval --edits` and the edit_shapes preset's monitor score
BUILTIN_EDIT_SETS = {"builtin:shapes-edit-train": ("train", 200), "builtin:shapes-edit-heldout": ("heldout", 100)}


def read_edits(spec: str, field: str = "data.edits") -> list[EditPrompt]:
    """The edits of a JSONL or parquet file or a hub dataset, in order; one sentence for the first bad row. A file
    is read once while it is unchanged (validation reads it, then the trainer's prompts: one pass over its images)."""
    path = Path(spec).expanduser()
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if path.is_file() else None
    return list(_read_edits(spec, field, stamp))


@functools.lru_cache(maxsize=4)
def _read_edits(spec: str, field: str, stamp) -> tuple[EditPrompt, ...]:
    if spec.startswith("builtin:"):
        return _builtin_edits(spec, field)
    path = Path(spec).expanduser()
    if path.suffix in (".jsonl", ".parquet"):
        if not path.is_file():
            raise UserError(f"{field} '{spec}' does not exist; give a .jsonl or .parquet file of edits, or a hub dataset id")
        rows, folder = (_jsonl_rows(path, field) if path.suffix == ".jsonl" else _parquet_rows(path, field)), path.parent
    elif re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) and not path.exists():  # org/name
        rows, folder = _hub_rows(spec, field), None
    else:
        raise UserError(f"{field} '{spec}' must be a .jsonl or .parquet file of edits, or a hub dataset id (org/name)")
    edits = tuple(_edit(row, i, folder, spec, field) for i, row in enumerate(rows))
    if not edits:
        raise UserError(f"{field} '{spec}' holds no edits; give rows with {', '.join(COLUMNS[:2])}")
    return edits


def _builtin_edits(spec: str, field: str) -> tuple[EditPrompt, ...]:
    from rewards.shapes_edit_world import edit_prompts, edit_set

    if spec not in BUILTIN_EDIT_SETS:
        raise UserError(f"{field} '{spec}' names no built-in edit set; built-ins: {', '.join(BUILTIN_EDIT_SETS)}")
    split, per_type = BUILTIN_EDIT_SETS[spec]
    return tuple(edit_prompts(edit_set(per_type, split=split, seed=0), name=spec.removeprefix("builtin:")))


def _jsonl_rows(path: Path, field: str) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{field} '{path}' line {i + 1} is not JSON ({exc.msg}); give one object per line") from None
        if not isinstance(row, dict):
            raise UserError(f"{field} '{path}' line {i + 1} is not an object; give one object per line, with "
                            f"{', '.join(COLUMNS[:2])}")
        rows.append(row)
    return rows


def _parquet_rows(path: Path, field: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:
        raise UserError(f"{field} '{path}' cannot be read as parquet ({type(exc).__name__}: {exc})") from None


def _hub_rows(spec: str, field: str) -> list[dict]:
    from datasets import load_dataset

    try:
        return list(load_dataset(spec, split="train"))
    except Exception as exc:
        raise UserError(f"{field} '{spec}' cannot be loaded as a hub dataset ({type(exc).__name__}: {exc})") from None


def _image(value: Any, folder: Path | None, where: str, column: str) -> tuple[Any, str, tuple[int, int]]:
    """A row's image as an EditPrompt source, its name and its (width, height); the file checked to exist and to
    be an image."""
    if isinstance(value, dict):  # a `datasets` Image as stored: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str) and value:
        file = Path(value).expanduser()
        file = file if file.is_absolute() or folder is None else folder / file
        if not file.is_file():
            raise UserError(f"{where} names a {column} image '{value}' that does not exist")
        return str(file), file.name, _check_readable(file, where, column)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), "image", _check_readable(bytes(value), where, column)
    if type(value).__module__.startswith("PIL."):
        return value, "image", value.size
    raise UserError(f"{where} has no {column} image (a path, the image's bytes, or an image); got {type(value).__name__}")


def _check_readable(source: Path | bytes, where: str, column: str) -> tuple[int, int]:
    """The image's (width, height), read from its header; one sentence where it is not an image."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
            im.verify()  # the header and structure, without decoding the pixels
            return im.size
    except Exception as exc:
        raise UserError(f"{where}'s {column} image cannot be read as an image ({type(exc).__name__}: {exc})") from None


def _edit(row: dict, i: int, folder: Path | None, spec: str, field: str) -> EditPrompt:
    where = f"{field} '{spec}' row {i + 1}"
    instruction = row.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise UserError(f"{where} has no instruction (a non-empty string); its columns: {', '.join(map(str, row)) or 'none'}")
    if row.get("source") is None:
        raise UserError(f"{where} has no source image; its columns: {', '.join(map(str, row))}")
    source, name, size = _image(row["source"], folder, where, "source")
    reference = None
    if row.get("reference") is not None:  # the target of the same scene: compared with the source pixel by pixel
        reference, _, reference_size = _image(row["reference"], folder, where, "reference")
        if reference_size != size:
            raise UserError(f"{where}'s reference image is {reference_size[0]}x{reference_size[1]} but its source is "
                            f"{size[0]}x{size[1]}; give a reference of the source's size")
    return EditPrompt(instruction.strip(), source, name=f"row {i + 1}: {name}", reference=reference)
