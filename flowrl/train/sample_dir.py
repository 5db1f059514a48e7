"""`flowrl sample --out-dir DIR`: one PNG per image (an animated WebP per video) at the model's resolution and a manifest,
`samples.jsonl`, one row per image (its file, prompt, seed, ODE steps, what sampled it, and its
rewards when scored). Images are written batch by batch, each PNG before its row, so an
interrupted call keeps what it wrote, and the same call again samples only what is missing.
A directory that holds another request's samples is refused rather than mixed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from PIL import Image

from flowrl.errors import UserError
from flowrl.runtime.run_dir import read_json_lines, write_json_lines
from flowrl.train.images import save_animation
from rewards.simple import to_uint8

MANIFEST = "samples.jsonl"
SAME_REQUEST = ("prompt", "seed", "steps", "source")  # what a row must repeat to count as already sampled


def image_file(index: int, video: bool = False) -> str:
    return f"{index:06d}.{'webp' if video else 'png'}"


def write_sample(pixels: torch.Tensor, path: Path) -> None:
    """One image [3, H, W] as PNG, or one video [3, F, H, W] as an animated WebP (`save_animation`),
    written whole under a temporary name, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    if pixels.dim() == 4:
        save_animation([Image.fromarray(a) for a in to_uint8(pixels.transpose(0, 1))], tmp)
    else:
        Image.fromarray(to_uint8(pixels[None])[0]).save(tmp, format="PNG")
    os.replace(tmp, path)


class SampleDir:
    def __init__(self, path: str | Path, jobs: list[dict]):
        """`jobs`: one dict per image, in order, with at least the keys of SAME_REQUEST."""
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.manifest = self.path / MANIFEST
        self.jobs = jobs
        self.done = self._check(self._read())

    def _read(self) -> list[dict]:
        """The manifest's rows; a last row cut short by an interruption is dropped from the file."""
        rows, cut = read_json_lines(self.manifest)
        if cut:  # the cut row would otherwise run into the next one written
            write_json_lines(self.manifest, rows)
        return rows

    def _check(self, rows: list[dict]) -> set[int]:
        """The indices already sampled for this request (a row whose PNG is missing is sampled again)."""
        done = set()
        for row in rows:
            index = row.get("index")
            job = self.jobs[index] if isinstance(index, int) and 0 <= index < len(self.jobs) else None
            differs = [k for k in SAME_REQUEST if job is None or row.get(k) != job[k]]
            if differs:
                raise UserError(f"--out-dir '{self.path}' holds samples of another request (image {index}: its "
                                f"{differs[0]} differs); choose another directory or remove {MANIFEST}")
            if (self.path / row["file"]).is_file():
                done.add(index)
        return done

    def todo(self) -> list[int]:
        return [i for i in range(len(self.jobs)) if i not in self.done]

    def write(self, indices: list[int], images: torch.Tensor, rewards: dict[str, torch.Tensor] | None = None) -> None:
        """Each image's PNG (each video's animated WebP), written whole, then its manifest row."""
        rows = []
        for k, (index, pixels) in enumerate(zip(indices, images)):
            name = image_file(index, video=pixels.dim() == 4)
            write_sample(pixels, self.path / name)
            row = {"index": index, "file": name, **self.jobs[index]}
            if rewards:
                row["rewards"] = {channel: float(scores[k]) for channel, scores in rewards.items()}
            rows.append(row)
        with self.manifest.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
        self.done.update(indices)
