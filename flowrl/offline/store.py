"""A group store: a directory with `index.json` and safetensors shards of clean samples.

index.json (format "flowrl-group-store", version 1):
  complete        true once every group is written (a partial store is refused for training)
  data            "latents" (the model's latent space) or "images" ([3, H, W] in [0, 1], encoded
                  by the model's VAE when read)
  shape           the shape of one sample, e.g. [16, 64, 64]
  channel_names   the reward channels, in the order of every group's rewards rows
  source          free-form provenance (model, checkpoint, sampler, steps, guidance, seed)
  shards          [{"file", "rows", "sha256"}]: each file holds one tensor "x0" [rows, *shape]
  groups          [{"prompt", "shard", "start", "size", "seeds", "rewards", "valid"}]: the group's
                  rows are x0[start : start + size] of shard number `shard`; rewards [size][K]
                  finite numbers; valid [size] booleans (false: the reward was invalid)
Shards are written whole (to a temporary name, then renamed) before the index names them, so a
crash leaves at most an orphan file, and a resumed build starts after the last indexed shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flowrl.errors import UserError

FORMAT, VERSION, INDEX = "flowrl-group-store", 1, "index.json"
DATA_KINDS = ("latents", "images")


@dataclass
class StoredGroup:
    prompt: str
    shard: int
    start: int
    size: int
    seeds: list[int]
    rewards: list[list[float]]
    valid: list[bool]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


class GroupStore:
    """A validated group store, read-only. `open` refuses a missing, partial or corrupted one with
    one sentence naming what is wrong."""

    def __init__(self, path: Path, index: dict):
        self.path, self.index = path, index
        self.data: str = index["data"]
        self.shape: list[int] = list(index["shape"])
        self.channel_names: list[str] = list(index["channel_names"])
        self.source: dict = dict(index.get("source", {}))
        self.shards: list[dict] = list(index["shards"])
        self.groups = [StoredGroup(**g) for g in index["groups"]]

    @classmethod
    def open(cls, path, field: str = "data.offline", verify: bool = True, allow_partial: bool = False) -> "GroupStore":
        path = Path(path).expanduser()
        where = f"{field} '{path}'"
        if not (path / INDEX).is_file():
            raise UserError(f"{where} is not a group store (no {INDEX}); build one with `flowrl offline build CONFIG -o DIR`")
        try:
            index = json.loads((path / INDEX).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{where}: {INDEX} is not valid JSON; the store is corrupted, rebuild it") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
            raise UserError(f"{where}: {INDEX} is not a {FORMAT} version {VERSION} index")
        if not index.get("complete") and not allow_partial:
            raise UserError(f"{where} is a partial store ({len(index.get('groups', []))} groups written); finish it by running "
                            "the same `flowrl offline build` command again")
        try:
            store = cls(path, index)
        except (KeyError, TypeError) as exc:
            raise UserError(f"{where}: {INDEX} lacks or misnames the field {exc}; see docs/offline.md for the format") from None
        store._check(where, verify)
        return store

    def _check(self, where: str, verify: bool) -> None:
        if self.data not in DATA_KINDS:
            raise UserError(f"{where}: data must be one of {', '.join(DATA_KINDS)}; got '{self.data}'")
        k = len(self.channel_names)
        if k == 0:
            raise UserError(f"{where}: channel_names is empty; a store needs at least one reward channel")
        for i, s in enumerate(self.shards):
            file = self.path / s["file"]
            if not file.is_file():
                raise UserError(f"{where}: shard {s['file']} is missing; the store is corrupted, rebuild it")
            if verify and _sha256(file) != s["sha256"]:
                raise UserError(f"{where}: shard {s['file']} does not match its checksum; the store is corrupted, rebuild it")
            try:
                with safe_open(str(file), framework="pt") as f:
                    shape = list(f.get_slice("x0").get_shape())
            except Exception:
                raise UserError(f"{where}: shard {s['file']} is not a safetensors file with a tensor x0") from None
            if shape != [s["rows"], *self.shape]:
                raise UserError(f"{where}: shard {s['file']} holds x0 of shape {shape}, but the index says {[s['rows'], *self.shape]}")
        for j, g in enumerate(self.groups):
            if not (0 <= g.shard < len(self.shards)) or g.start < 0 or g.start + g.size > self.shards[g.shard]["rows"]:
                raise UserError(f"{where}: group {j} points outside its shard")
            if g.size < 2 or len(g.rewards) != g.size or len(g.valid) != g.size or len(g.seeds) != g.size:
                raise UserError(f"{where}: group {j} must have size >= 2 and one seed, rewards row and valid flag per sample")
            if any(len(row) != k or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in row) for row in g.rewards):
                raise UserError(f"{where}: group {j}'s rewards must be {k} finite numbers per sample ({', '.join(self.channel_names)})")

    def __len__(self) -> int:
        return len(self.groups)

    def x0(self, group_indices: list[int]) -> torch.Tensor:
        """The clean samples of these groups, concatenated in order, fp32 [sum sizes, *shape]."""
        rows = []
        for j in group_indices:
            g = self.groups[j]
            with safe_open(str(self.path / self.shards[g.shard]["file"]), framework="pt") as f:
                rows.append(f.get_slice("x0")[g.start : g.start + g.size].float())
        return torch.cat(rows)


class StoreWriter:
    """Writes a store shard by shard; `StoreWriter(path, meta)` resumes a partial store built with
    the same `meta` and refuses a complete one or one built with other settings."""

    def __init__(self, path, data: str, shape: list[int], channel_names: list[str], source: dict):
        self.path = Path(path).expanduser()
        header = {"format": FORMAT, "version": VERSION, "data": data, "shape": list(shape), "channel_names": list(channel_names),
                  "source": source}
        if (self.path / INDEX).is_file():
            existing = GroupStore.open(self.path, field="-o", allow_partial=True).index
            if existing.get("complete"):
                raise UserError(f"-o '{self.path}' already holds a complete group store; choose another directory")
            if {k: existing.get(k) for k in header} != header:
                raise UserError(f"-o '{self.path}' holds a partial store built with other settings; finish it with its own "
                                "command or choose another directory")
            self.index = existing
        elif self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise UserError(f"-o '{self.path}' exists and is not an empty directory or a partial group store; choose another directory")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self.index = {**header, "complete": False, "shards": [], "groups": []}
            _write_json_atomic(self.path / INDEX, self.index)

    @property
    def groups_done(self) -> int:
        return len(self.index["groups"])

    def add_shard(self, x0: torch.Tensor, groups: list[StoredGroup]) -> None:
        """Write one shard holding `groups` (their `start` counted within this shard), then index it."""
        number = len(self.index["shards"])
        name = f"shard-{number:05d}.safetensors"
        tmp = self.path / (name + ".tmp")
        save_file({"x0": x0.detach().cpu().contiguous()}, str(tmp))
        os.replace(tmp, self.path / name)
        self.index["shards"].append({"file": name, "rows": int(x0.shape[0]), "sha256": _sha256(self.path / name)})
        self.index["groups"] += [asdict(StoredGroup(g.prompt, number, g.start, g.size, g.seeds, g.rewards, g.valid)) for g in groups]
        _write_json_atomic(self.path / INDEX, self.index)

    def finish(self) -> GroupStore:
        self.index["complete"] = True
        _write_json_atomic(self.path / INDEX, self.index)
        return GroupStore.open(self.path, verify=False)
