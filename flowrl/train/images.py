"""Image grids for sample sheets and `flowrl sample`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rewards.simple import to_uint8


def image_grid(images: torch.Tensor, columns: int | None = None, pad: int = 2) -> Image.Image:
    """[N, 3, H, W] in [0, 1] -> one PIL image, row-major, `columns` per row."""
    n, _, h, w = images.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    canvas = np.full((rows * (h + pad) + pad, columns * (w + pad) + pad, 3), 255, dtype=np.uint8)
    arr = to_uint8(images)
    for i in range(n):
        r, c = divmod(i, columns)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        canvas[y : y + h, x : x + w] = arr[i]
    return Image.fromarray(canvas)


def save_grid(images: torch.Tensor, path: str | Path, columns: int | None = None, min_side: int = 128) -> Path:
    """Write the grid as PNG; images smaller than `min_side` are enlarged by an integer factor
    (nearest neighbour, so pixels stay pixels) to be visible at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid = image_grid(images, columns)
    factor = math.ceil(min_side / min(images.shape[-2:]))
    if factor > 1:
        grid = grid.resize((grid.width * factor, grid.height * factor), Image.NEAREST)
    grid.save(path)
    return path
