"""Rewards that need no model: DDPO's JPEG (in)compressibility and mean brightness."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from rewards.registry import register


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[N, 3, H, W] floats in [0, 1] -> [N, H, W, 3] uint8."""
    return (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)


def jpeg_kilobytes(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    sizes = []
    for arr in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register("jpeg_compressibility", "minus the JPEG size in kB at quality 95 (DDPO's toy reward)")
def jpeg_compressibility(images, prompts=None, metadata=None):
    return -jpeg_kilobytes(images)


@register("jpeg_incompressibility", "the JPEG size in kB at quality 95 (DDPO's toy reward)")
def jpeg_incompressibility(images, prompts=None, metadata=None):
    return jpeg_kilobytes(images)


@register("brightness", "mean pixel value in [0, 1]")
def brightness(images, prompts=None, metadata=None):
    return images.detach().float().mean(dim=(1, 2, 3)).cpu()
