"""Prompt datasets with columns: the built-in arithmetic worlds, JSONL or parquet files, or a hub
id, read through the `datasets` library. Rewards receive every column but the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flowrl.errors import UserError
from flowrl.text.arithmetic import BUCKETS, WIDE_BUCKETS, held_out, train_pool


@dataclass
class PromptSet:
    prompts: list[str]
    columns: dict[str, list]  # column -> one value per prompt

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, ids: list[int]) -> tuple[list[str], dict[str, list]]:
        return [self.prompts[i] for i in ids], {k: [v[i] for i in ids] for k, v in self.columns.items()}


# the built-in arithmetic worlds: data.source -> operand digit counts (flowrl/text/arithmetic.py)
BUILTIN_DATA = {"builtin:add": BUCKETS, "builtin:add_wide": WIDE_BUCKETS}


def load_prompt_set(cfg, split: str) -> PromptSet:
    """The text config's data (flowrl/text/config.py TextDataConfig) at `split`."""
    d = cfg.data
    return load_prompts(d.source, split, d.prompt_column, d.max_prompts if split == d.split else 0, d.subset, d.prompt_template)


def load_prompts(source: str, split: str, prompt_column: str = "prompt", max_prompts: int = 0, subset: str = "",
                 template: str = "{prompt}") -> PromptSet:
    """data.source at data.split: builtin:add or builtin:add_wide (train: its fixed pool; test: its
    held-out problems), a .jsonl or .parquet file (split ignored), or a hub dataset id (with its
    configuration `subset`). Each prompt is put into `template` at {prompt}."""
    if source in BUILTIN_DATA:
        if split not in ("train", "test"):
            raise UserError(f"data.split of {source} must be train or test; got '{split}'")
        buckets = BUILTIN_DATA[source]
        rows = [p.row() for p in (train_pool(buckets=buckets) if split == "train" else held_out(buckets))]
        table = {k: [r[k] for r in rows] for k in rows[0]}
    else:
        table = _read_table(source, split, subset)
    if prompt_column not in table:
        raise UserError(f"data.source '{source}' has no column '{prompt_column}' (data.prompt_column); "
                        f"its columns: {', '.join(table) or 'none'}")
    prompts = [template.replace("{prompt}", str(p)) for p in table.pop(prompt_column)]
    if not prompts:
        raise UserError(f"data.source '{source}' (split {split}) holds no rows")
    if max_prompts:
        prompts = prompts[:max_prompts]
        table = {k: v[:max_prompts] for k, v in table.items()}
    return PromptSet(prompts, table)


def _read_table(source: str, split: str, subset: str = "") -> dict[str, list]:
    import datasets

    datasets.utils.logging.disable_progress_bar()
    path = Path(source).expanduser()
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    try:
        if path.suffix in kinds:
            if not path.is_file():
                raise UserError(f"data.source '{source}' does not exist")
            ds = datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train")
        elif path.exists():
            raise UserError(f"data.source '{source}' must be a .jsonl or .parquet file, a hub dataset id, builtin:add or "
                            "builtin:add_wide")
        else:
            ds = datasets.load_dataset(source, subset or None, split=split)
    except UserError:
        raise
    except Exception as exc:  # malformed files, unknown ids, no network
        detail = str(exc).strip().splitlines()
        raise UserError(f"data.source '{source}' could not be read as a dataset ({type(exc).__name__}: "
                        f"{detail[0] if detail else 'no detail'})") from None
    return {k: list(v) for k, v in ds.to_dict().items()}
