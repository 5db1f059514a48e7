"""Checkpoints without pickles: safetensors for tensors, JSON for the rest, written atomically
(a temporary directory renamed into place, then the `latest` pointer replaced)."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flowrl.errors import UserError

LATEST = "latest"
BEST = "best"  # the pointer to the checkpoint with the best gold reward (the monitor's, docs/monitor.md)
# the files every checkpoint holds; any other NAME.safetensors is optional state (the EMA weights,
# the allocator's, an objective's such as DiffusionNFT's old policy), returned under its NAME
REQUIRED_TENSORS = ("trainable", "optimizer", "rng")
SHARDED_DIR = "sharded"  # run.distributed fsdp2: the shards of the sharded tensor groups (flowrl/train/sharding.py)


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor: one process's shard of a tensor split over processes."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def optimizer_to_flat(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's state dict as {"IDX.KEY": tensor} for safetensors and the rest for JSON."""
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}
    for idx, entry in state["state"].items():
        meta["state"][str(idx)] = _flatten_entry(entry, str(idx), tensors)
    return _unshared(tensors), meta


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of every tensor whose memory an earlier one holds: safetensors refuses shared memory, and
    bitsandbytes gives all its 8-bit tensors the same two quantisation maps."""
    seen = set()
    for name, t in tensors.items():
        if is_sharded(t):
            continue
        pointer = t.untyped_storage().data_ptr()
        if pointer in seen:
            tensors[name] = t.clone()
        seen.add(pointer)
    return tensors


def _flatten_entry(entry: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    """One parameter's state: each tensor into `tensors` under PREFIX.KEY, "tensor" in its place;
    a nested dict (bitsandbytes wraps its quantised moments, maps and absmax in one) as {"dict": ...}."""
    meta = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor):
            # a sharded moment stays where it is: its process writes its own shard (flowrl/train/sharding.py)
            tensors[f"{prefix}.{key}"] = value.detach() if is_sharded(value) else value.detach().cpu().contiguous()
            meta[key] = "tensor"
        elif isinstance(value, dict):
            meta[key] = {"dict": _flatten_entry(value, f"{prefix}.{key}", tensors)}
        else:
            meta[key] = value
    return meta


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {}
    for idx, entry in meta["state"].items():
        state[int(idx) if idx.isdigit() else idx] = _unflatten_entry(entry, idx, tensors)
    return {"state": state, "param_groups": meta["param_groups"]}


def _unflatten_entry(entry: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    out = {}
    for key, value in entry.items():
        if value == "tensor":
            out[key] = tensors[f"{prefix}.{key}"]
        elif isinstance(value, dict) and value.keys() == {"dict"}:
            out[key] = _unflatten_entry(value["dict"], f"{prefix}.{key}", tensors)
        else:
            out[key] = value
    return out


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def checkpoint_iterations(root: Path) -> list[int]:
    """The iterations that have a finished checkpoint under root, ascending."""
    return sorted(int(p.name.removeprefix("iter_")) for p in Path(root).glob("iter_*") if p.is_dir())


def save_checkpoint(root: Path, iteration: int, params: dict[str, torch.Tensor] | None, optimizer_state: dict | None,
                    ema_shadow: dict[str, torch.Tensor] | None, extra: dict, export=None, sharded: dict | None = None,
                    **state_tensors: dict[str, torch.Tensor] | None) -> Path:
    """Write checkpoints/iter_NNNNNN atomically. `export(dir)` may add user-facing files
    (the diffusers-format LoRA) inside the temporary directory before it is renamed.
    `state_tensors` (allocator=..., nft_old=...) go to NAME.safetensors when not None.
    `sharded` (run.distributed fsdp2): {"dir": the shards every process wrote, "groups": their
    names, "optimizer": the optimizer state's JSON part}; `params` and `optimizer_state` are then
    None, and the shards' directory moves in as SHARDED_DIR."""
    root = Path(root)
    name = checkpoint_name(iteration)
    opt_tensors, opt_meta = optimizer_to_flat(optimizer_state) if optimizer_state is not None else ({}, sharded["optimizer"])
    for key, tensors in {"trainable": params, "optimizer": opt_tensors, "ema": ema_shadow, **state_tensors}.items():
        bad = next((n for n, t in (tensors or {}).items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
        if bad is not None:  # checked before anything is written: the last checkpoint stays the newest
            raise UserError(f"checkpoint {name} was not written: {key} tensor '{bad}' holds NaN or inf; "
                            f"the last checkpoint is {latest_checkpoint(root) or 'none'}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if sharded is not None:
        os.replace(sharded["dir"], tmp / SHARDED_DIR)
    else:
        save_file({n: p.detach().cpu().contiguous() for n, p in params.items()}, str(tmp / "trainable.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    for key, tensors in {"ema": ema_shadow, **state_tensors}.items():
        if key in REQUIRED_TENSORS or not key.isidentifier():
            raise ValueError(f"checkpoint tensor file name '{key}' must be an identifier other than {', '.join(REQUIRED_TENSORS)}")
        if tensors is not None:
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / f"{key}.safetensors"))
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(tmp / "rng.safetensors"))
    py_state = random.getstate()
    state = {"iteration": iteration, "optimizer": opt_meta, "python_random": [py_state[0], list(py_state[1]), py_state[2]],
             "sharded": sharded["groups"] if sharded is not None else [], **extra}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    if export is not None:
        export(tmp)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    point_to(root, LATEST, name)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names; where that pointer is missing or names no checkpoint, the
    newest one there is (every iter_* directory is complete: each is renamed into place whole)."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if path.name.startswith("iter_") and path.is_dir():
            return path
    done = checkpoint_iterations(root) if root.is_dir() else []
    return root / checkpoint_name(done[-1]) if done else None


def point_to(root: Path, pointer: str, name: str) -> None:
    """Replace pointer file `pointer` (latest, best) under root with `name`, atomically."""
    tmp = Path(root) / f".{pointer}.tmp"
    tmp.write_text(name)
    os.replace(tmp, Path(root) / pointer)


def best_checkpoint(root: Path) -> Path | None:
    """The checkpoint `best` names, or None where the run keeps none (no monitor, or no gold reward)."""
    pointer = Path(root) / BEST
    path = Path(root) / pointer.read_text().strip() if pointer.is_file() else None
    return path if path is not None and path.name.startswith("iter_") and path.is_dir() else None


def parse_checkpoint_arg(text: str) -> int | str:
    """A --checkpoint value: an iteration (an integer >= 0) or `best`; ValueError otherwise."""
    if text == BEST:
        return BEST
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def find_checkpoint(root: Path, which: int | str | None, run) -> Path:
    """The checkpoint of --checkpoint `which` under root (None: the latest; `best`: the best by gold
    reward; an int: that iteration's), or UserError naming what the run (`run`, for the sentence) has."""
    root = Path(root)
    if which is None:
        ckpt = latest_checkpoint(root)
        if ckpt is None:
            raise UserError(f"--run '{run}' has no checkpoint yet")
        return ckpt
    have = ", ".join(map(str, checkpoint_iterations(root) if root.is_dir() else [])) or "none"
    if which == BEST:
        ckpt = best_checkpoint(root)
        if ckpt is None:
            raise UserError(f"--checkpoint best: '{run}' keeps no best checkpoint (only a run with monitor.enabled and "
                            f"monitor.gold keeps one); its checkpoints: {have}")
        return ckpt
    ckpt = root / checkpoint_name(which)
    if not ckpt.is_dir():
        raise UserError(f"--checkpoint {which}: '{run}' has no checkpoint of that iteration; it has {have}")
    return ckpt


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's tensors and state. A sharded one's (state "sharded") groups stay in its
    SHARDED_DIR, for every process to load its own shards of (flowrl/train/sharding.py); its
    "params" is then None and "optimizer" only the JSON part."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
        sharded = state.get("sharded") or []
        out = {
            "state": state,
            "params": None if sharded else load_file(str(path / "trainable.safetensors")),
            "optimizer": state["optimizer"] if sharded else optimizer_from_flat(load_file(str(path / "optimizer.safetensors")),
                                                                                state["optimizer"]),
            "rng": load_file(str(path / "rng.safetensors")),
            "ema": None,
            "allocator": None,
            **{f.stem: load_file(str(f)) for f in sorted(path.glob("*.safetensors")) if f.stem not in REQUIRED_TENSORS},
        }
        if sharded and not (path / SHARDED_DIR).is_dir():
            raise FileNotFoundError(f"no {SHARDED_DIR} folder")
    except Exception as exc:  # safetensors, JSON and missing files all mean the same to the user
        raise UserError(f"checkpoint '{path}' is incomplete or corrupt ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    return out


def restore_weights(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], ckpt: Path) -> None:
    """Copy a checkpoint's trainable weights into `params`, refusing (one sentence) a checkpoint
    whose weight names or shapes are not the configured model's."""
    mismatched = sorted(set(params) ^ set(saved))
    if mismatched:
        raise UserError(f"--resume: checkpoint '{ckpt}' does not match the configured model ({len(mismatched)} mismatched "
                        f"weights, e.g. '{mismatched[0]}')")
    for n, p in params.items():
        if tuple(saved[n].shape) != tuple(p.shape):
            raise UserError(f"--resume: checkpoint '{ckpt}' holds '{n}' of shape {tuple(saved[n].shape)} where the "
                            f"configured model has {tuple(p.shape)}; resume with the run's own lora settings")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])


def restore_rng(rng: dict[str, torch.Tensor], python_random) -> None:
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(k for k in rng if k.startswith("torch_cuda_"))]
        if states:
            torch.cuda.set_rng_state_all(states)
    random.setstate((python_random[0], tuple(python_random[1]), python_random[2]))
