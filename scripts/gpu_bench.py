"""What the GPU checks' scripts (scripts/gpu_checks.sh) share: whether to run at all, and appending a
reading to the results file."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def use_cuda(script: str, cpu_smoke: bool) -> bool | None:
    """True on a CUDA machine, False for --cpu-smoke (tiny models, the code path only), None (said
    in one line) when there is neither: nothing to measure."""
    if cpu_smoke:
        return False
    if torch.cuda.is_available():
        return True
    print(f"{script} needs a CUDA GPU (or --cpu-smoke for the code path); nothing measured")
    return None


def append_result(out: Path | None, row: dict) -> None:
    """One reading as a JSON line of `out` (--out; nothing when None)."""
    if out:
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
