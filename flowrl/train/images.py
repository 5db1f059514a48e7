"""Image grids for sample sheets and `flowrl sample`, each image captioned with its prompt."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

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


def save_grid(images: torch.Tensor, path: str | Path, columns: int | None = None, min_side: int = 128,
              captions: list[str] | None = None) -> Path:
    """Write the grid as PNG; images smaller than `min_side` are enlarged by an integer factor
    (nearest neighbour, so pixels stay pixels) to be visible at all, before the captions are
    written at their normal size."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    factor = math.ceil(min_side / min(images.shape[-2:]))
    if factor > 1:
        images = images.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
    image_grid(images, columns, pad=2 * factor, captions=captions).save(path)
    return path
