"""Image grids for sample sheets and `flowrl sample`, each image captioned with its prompt; for videos,
an animated grid (WebP) and a frame strip."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from tqdm.auto import tqdm

from flowrl.sampling.rollout import SamplerSpec, rollout
from rewards.simple import to_uint8


def image_grid(images: torch.Tensor, columns: int | None = None, pad: int = 2, captions: list[str] | None = None) -> Image.Image:
    """[N, 3, H, W] in [0, 1] -> one PIL image, row-major, `columns` per row; with `captions`
    (one per image), each image's caption is written under it, wrapped to the image's width."""
    n, _, h, w = images.shape
    if captions is not None and len(captions) != n:
        raise ValueError(f"image_grid: {len(captions)} captions for {n} images")
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    font = ImageFont.load_default()
    left, top, right, bottom = font.getbbox("Mg")
    char_w, line_h = max(1, (right - left) // 2), bottom - top + 2
    wrapped = [textwrap.wrap(c, max(1, w // char_w)) or [""] for c in captions] if captions is not None else []
    text_h = max(len(lines) for lines in wrapped) * line_h + 2 if wrapped else 0
    canvas = np.full((rows * (h + text_h + pad) + pad, columns * (w + pad) + pad, 3), 255, dtype=np.uint8)
    arr = to_uint8(images)
    for i in range(n):
        r, c = divmod(i, columns)
        y, x = pad + r * (h + text_h + pad), pad + c * (w + pad)
        canvas[y : y + h, x : x + w] = arr[i]
    grid = Image.fromarray(canvas)
    draw = ImageDraw.Draw(grid)
    for i, lines in enumerate(wrapped):
        r, c = divmod(i, columns)
        draw.multiline_text((pad + c * (w + pad), pad + r * (h + text_h + pad) + h + 1), "\n".join(lines), fill=(0, 0, 0),
                            font=font, spacing=2)
    return grid


def _enlarged(images: torch.Tensor, min_side: int) -> tuple[torch.Tensor, int]:
    """Images smaller than `min_side` enlarged by an integer factor (nearest neighbour, so pixels stay
    pixels) to be visible at all; the factor."""
    factor = math.ceil(min_side / min(images.shape[-2:]))
    if factor > 1:
        images = images.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
    return images, factor


def save_grid(images: torch.Tensor, path: str | Path, columns: int | None = None, min_side: int = 128,
              captions: list[str] | None = None) -> Path:
    """Write the grid as PNG, small images enlarged (`_enlarged`) before the captions are written at
    their normal size. Videos [N, 3, F, H, W] go to `save_video_grid`."""
    if images.dim() == 5:
        return save_video_grid(images, path, columns, min_side, captions)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images, factor = _enlarged(images, min_side)
    image_grid(images, columns, pad=2 * factor, captions=captions).save(path)
    return path


def with_sources(images: torch.Tensor, prompts: list, captions: list[str], per_prompt: int) -> tuple[torch.Tensor, list[str]]:
    """Edits' samples [N, 3, H, W] (`per_prompt` in a row per prompt) with each prompt's source before its
    samples, at their size: the images and captions of a grid of rows `source | edits`."""
    from rewards.registry import source_images

    sources = source_images("the sample grid", prompts, images)
    tiles, labels = [], []
    for i in range(0, len(prompts), per_prompt):
        tiles += [sources[i], *images[i : i + per_prompt]]
        labels += [f"source: {prompts[i].source_name}", *captions[i : i + per_prompt]]
    return torch.stack(tiles), labels


def log_grid(accelerator, tracker: str, path: Path, step: int, tag: str = "samples") -> None:
    """The sample grid at `path` (a video grid's PNG frame strip) to run.tracker `tracker` at `step`, beside the
    curves: tensorboard takes an [N, H, W, C] array, wandb a list of images (accelerate's trackers)."""
    if tracker == "none":
        return
    image = Image.open(path).convert("RGB")
    if tracker == "tensorboard":
        accelerator.get_tracker(tracker, unwrap=False).log_images({tag: np.asarray(image)[None]}, step=step, dataformats="NHWC")
    else:
        accelerator.get_tracker(tracker, unwrap=False).log_images({tag: [image]}, step=step)


STRIP_FRAMES = 8  # frames per video in a frame strip, evenly spaced from the first to the last
FPS = 16  # Wan2.1's frame rate


def save_animation(frames: list[Image.Image], path: str | Path, fps: int = FPS) -> None:
    """Frames as one looping, lossless animated WebP at `fps` frames per second."""
    frames[0].save(path, format="WEBP", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0,
                   lossless=True)


def strip_frame_indices(frames: int, most: int = STRIP_FRAMES) -> list[int]:
    return sorted({round(i * (frames - 1) / max(1, most - 1)) for i in range(min(most, frames))})


def save_video_grid(videos: torch.Tensor, path: str | Path, columns: int | None = None, min_side: int = 128,
                    captions: list[str] | None = None, fps: int = FPS) -> Path:
    """Videos [N, 3, F, H, W] in [0, 1]: an animated WebP beside `path` (the grid of `columns` videos
    per row, frame by frame, looping) and at `path` a PNG frame strip, one row per video of up to
    STRIP_FRAMES frames evenly spaced, its caption under the first. Returns the PNG's path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    videos, factor = _enlarged(videos, min_side)
    n, _, f = videos.shape[:3]
    grids = [image_grid(videos[:, :, t], columns, pad=2 * factor, captions=captions) for t in range(f)]
    save_animation(grids, path.with_suffix(".webp"), fps)
    picked = strip_frame_indices(f)
    strip = videos[:, :, picked].transpose(1, 2).reshape(n * len(picked), 3, *videos.shape[-2:])
    labels = None if captions is None else [c if k == 0 else f"frame {t}" for c in captions for k, t in enumerate(picked)]
    image_grid(strip, len(picked), pad=2 * factor, captions=labels).save(path)
    return path


def ode_images(policy, prompts: list[str], seeds: list[int], sigmas: torch.Tensor, batch_size: int,
               progress: bool = False, desc: str = "eval sampling") -> torch.Tensor:
    """Deterministic (ODE) samples on `sigmas` decoded to images [N, 3, H, W] in [0, 1] (evaluation, the
    monitor and `flowrl sample` draw them; flowrl.train.evaluate re-exports it)."""
    spec = SamplerSpec.ode(sigmas)
    images = []
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress, leave=False, unit="batch"):
        traj = rollout(policy, prompts[i : i + batch_size], seeds[i : i + batch_size], spec, batch_size, progress=False)
        images.append(policy.decode(traj.final))
    return torch.cat(images)
