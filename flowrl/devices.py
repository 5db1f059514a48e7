"""Device and dtype names, one place for every part: model.dtype, reward options' dtype, the
exploration copy's plain precisions, and model.device / text model.device as torch devices."""

from __future__ import annotations

import torch

from flowrl.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # config name -> torch dtype


def pick_device(name: str) -> torch.device:
    """model.device as a torch device: auto is CUDA where there is one, else the CPU. A device
    that torch cannot name, or CUDA on a machine without it, is refused rather than replaced."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"model.device must be auto, cpu, cuda or cuda:N; got '{name}'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"model.device is '{name}' but torch sees no CUDA device here; use model.device=cpu or auto")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"model.device must be auto, cpu, cuda or cuda:N; got '{name}'")
    return device
