"""Shared plumbing for model-backed rewards: device and dtype names, `from_pretrained` with a
one-sentence error, the local file cache, and images as PIL for the reference processors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from flowrl.devices import DTYPES
from flowrl.errors import UserError



def resolve_device(device: str) -> torch.device:
    """'auto' is this process's current GPU (accelerate sets it per process), else the CPU."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserError(f"reward device '{device}' is not a device name; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"reward device '{device}' needs a CUDA GPU and this machine has none; use device auto or cpu")
    return resolved


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise UserError(f"reward dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def reward_cache_dir() -> Path:
    """Where converted reward weights live by default (next to flowrl's other cached files)."""
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "rewards"


def looks_local(path: str) -> bool:
    """A hub id is org/name; anything starting with '.', '/' or '~' is meant as a local path."""
    return path.startswith((".", "/", "~"))


def load_pretrained(load: Callable, path: str, *, reward: str, what: str, **kwargs):
    """`load(path, **kwargs)` (a `from_pretrained`), turning a missing directory or an
    unreachable hub id into one sentence that names the reward and the path."""
    local = Path(path).expanduser()
    if looks_local(path) and not local.exists():
        raise UserError(f"reward '{reward}': {what} directory '{path}' does not exist; give a directory saved with save_pretrained or a hub id")
    try:
        return load(str(local) if local.exists() else path, **kwargs)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0][:200].rstrip(".") if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"reward '{reward}' could not load {what} from '{path}' ({reason}); give a local directory saved with "
            "save_pretrained or a hub id this machine can download"
        ) from None


def to_pil(images: torch.Tensor) -> list:
    """[N, 3, H, W] floats in [0, 1] -> RGB PIL images, rounded to 8 bits as the reference
    reward code does with saved images."""
    from PIL import Image

    from rewards.simple import to_uint8

    return [Image.fromarray(a) for a in to_uint8(images)]


def pooled(features) -> torch.Tensor:
    """transformers 5 returns the projected CLIP features as `pooler_output` of an output object."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output
