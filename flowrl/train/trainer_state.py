"""The image Trainer's checkpoint: what it writes (`save_trainer`) and how `--resume` restores its
part (`restore_trainer`; the run manager restores the rest, flowrl/runtime/run_manager.py). A checkpoint holds everything a resume needs to repeat an uninterrupted run:
weights, optimizer, EMA, allocator and objective state, random generators, the budget's plans and
clock, plus the user-facing exports (the LoRA, or the fully fine-tuned transformer, each also with
EMA weights). Under fsdp2 every process writes and reads its own shards. `tr` is the image
Trainer (flowrl/train/loop.py), which imports this module.
"""

from __future__ import annotations

import shutil
from pathlib import Path
import torch

from flowrl.errors import UserError
from flowrl.runtime.checkpoint import SHARDED_DIR, checkpoint_name, is_sharded, latest_checkpoint, restore_weights, save_checkpoint


def save_trainer(tr) -> Path | None:
    """Write the trainer's checkpoint at its current iteration; rank 0 returns its path. Under
    fsdp2 every process writes its shards and helps gather the exports; rank 0 writes the rest."""
    acc, lay = tr.accelerator, tr.layout
    acc.wait_for_everyone()
    main, root = acc.is_main_process, tr.run.checkpoints
    ema = tr.ema.shadow if tr.ema is not None else None
    objective_state = tr.objective.state_dict()
    sharded = None
    if lay.sharded:
        opt_tensors, opt_meta = lay.optimizer_state(tr.policy.transformer, tr.optimizer)
        groups = {"trainable": tr.params, "optimizer": opt_tensors, **({"ema": ema} if ema is not None else {}),
                  **{k: v for k, v in objective_state.items() if v is not None and any(map(is_sharded, v.values()))}}
        bad = lay.non_finite(groups)  # asked of every process: one refusal, before anyone writes
        if bad is not None:
            raise UserError(f"checkpoint {checkpoint_name(tr.iteration)} was not written: {bad} holds NaN or inf; "
                            f"the last checkpoint is {latest_checkpoint(root) or 'none'}")
        shards = root / f".shards-{checkpoint_name(tr.iteration)}"
        if main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(shards, ignore_errors=True)
        acc.wait_for_everyone()
        lay.save(shards, groups)
        sharded = {"dir": shards, "groups": sorted(groups), "optimizer": opt_meta}
        objective_state = {k: v for k, v in objective_state.items() if k not in groups}
    exports = trainer_exports(tr) if (main or lay.sharded) else {}
    path = None
    if main:
        def export(tmp: Path):
            for name, state in exports.items():
                if tr.cfg.lora.enabled:
                    tr.policy.save_lora(tmp / name, state)
                else:
                    tr.policy.save_transformer(tmp / name, state)

        path = save_checkpoint(root, tr.iteration, None if sharded else tr.params,
                               None if sharded else tr.optimizer.state_dict(), None if sharded else ema,
                               {"policy_version": tr.iteration, "num_processes": acc.num_processes, "distributed": lay.name,
                                **tr.budget_state(), **({"monitor": tr.monitor.state_dict()} if getattr(tr, "monitor", None) else {})},
                               export=export, sharded=sharded, allocator=tr.allocator.state_dict(), **objective_state)
    acc.wait_for_everyone()
    return path


def trainer_exports(tr) -> dict[str, dict[str, torch.Tensor]]:
    """{folder: whole weights} for the checkpoint's user-facing exports, on rank 0: `lora` and
    `ema_lora`, or under full fine-tuning `transformer` and `ema_transformer` (diffusers'
    format). Collective under fsdp2."""
    lora = tr.cfg.lora.enabled
    prefix = "lora" if lora else "transformer"

    def whole() -> dict[str, torch.Tensor]:
        return tr.layout.full(tr.params if lora else tr.policy.transformer.state_dict())

    out = {prefix: whole()}
    if tr.ema is not None:
        with tr.ema.swapped_in(tr.params):
            out[f"ema_{prefix}"] = whole()
    return out


def restore_trainer(tr, ckpt: Path, data: dict) -> None:
    """The image trainer's part of checkpoint `ckpt` (the run manager restores the allocator, the
    random generators, the iteration, the metrics and the budget): weights, optimizer and EMA, whole
    or sharded; the objective's state."""
    if data["state"]["sharded"]:
        load_shards(tr, ckpt, data)
    else:
        load_whole(tr, ckpt, data)
    tr.objective.load_state_dict(data, str(ckpt))


def load_whole(tr, ckpt: Path, data: dict) -> None:
    """Weights, optimizer and EMA of a checkpoint written whole (run.distributed ddp)."""
    if tr.layout.sharded:
        raise UserError(f"--resume: checkpoint '{ckpt}' was written whole (run.distributed ddp); resume it with "
                        "run.distributed=ddp")
    restore_weights(tr.params, data["params"], ckpt)
    tr.optimizer.load_state_dict(data["optimizer"])
    if tr.ema is not None and data["ema"] is not None:
        tr.ema.shadow = {n: t.clone() for n, t in data["ema"].items()}


def load_shards(tr, ckpt: Path, data: dict) -> None:
    """Every process loads its own shards of a sharded checkpoint (onto any number of
    processes): the current tensors are the templates, filled in place."""
    if not tr.layout.sharded:
        raise UserError(f"--resume: checkpoint '{ckpt}' holds shards (run.distributed fsdp2); resume it with "
                        "run.distributed=fsdp2")
    names = set(data["state"]["sharded"])
    opt_tensors, _ = tr.layout.optimizer_state(tr.policy.transformer, tr.optimizer)
    templates = {"trainable": {n: p.detach() for n, p in tr.params.items()}, "optimizer": opt_tensors}
    if "ema" in names and tr.ema is not None:
        templates["ema"] = tr.ema.shadow
    templates.update({k: v for k, v in tr.objective.state_dict().items() if k in names and v is not None})
    tr.layout.load(ckpt / SHARDED_DIR, templates, str(ckpt))
    tr.layout.load_optimizer_state(tr.policy.transformer, tr.optimizer, templates["optimizer"], data["optimizer"])
    data.update({k: v for k, v in templates.items() if k not in ("trainable", "optimizer", "ema")})
