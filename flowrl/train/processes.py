"""What every trainer does first when it may run as several processes (accelerate's launcher,
`run.cpu_processes`, or one process alone): start the process group and agree on rank 0's values."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def start_processes(device: str, run_dir: str | Path) -> tuple[bool, Path]:
    """Start accelerate's process group (gloo between CPU processes) and return whether this is a
    CPU run and rank 0's run directory (a default directory carries a timestamp, which the
    processes would otherwise each draw for themselves)."""
    from accelerate import PartialState

    from flowrl.models.base import pick_device

    cpu = pick_device(device).type == "cpu"  # refuses a device that is not there
    PartialState(cpu=cpu)
    return cpu, Path(rank0(run_dir if isinstance(run_dir, str) else str(run_dir)))


def rank0(value: Any) -> Any:
    """Rank 0's `value` on every process (a picklable object); the value itself when alone."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return value
    return broadcast_object_list([value])[0]
