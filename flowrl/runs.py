"""A run's pieces that the CLI, the Python API and the scripts share: the config argument split from
its overrides, an image run trained in this process, a run's checkpoint loaded as a policy (or a
base model's), its ODE samples as `flowrl sample` draws them, and the check that an output path can
be made. flowrl/cli.py parses the command line and calls these; flowrl/api.py and scripts/ call them
directly."""

from __future__ import annotations

import sys
from pathlib import Path

from flowrl.errors import UserError


def split_config_and_overrides(config, overrides):
    """(config, overrides) with a leading key=value taken as an override: `flowrl train trainer.lr=1e-5`
    (no config, only overrides) is allowed too."""
    if config is not None and "=" in config:
        return None, [config, *overrides]
    return config, overrides


def train_images(cfg, run_dir: Path, resume: bool) -> int:
    """`flowrl train` of an image config in this process: the trainer, its run directory and closing line."""
    from flowrl.train.loop import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, resume=resume)
    if trainer.accelerator.is_main_process:
        print(f"run directory: {trainer.run.path}", file=sys.stderr)
        if cfg.trainer.mixed_precision == "auto":
            print(f"trainer.mixed_precision auto: {trainer.mixed_precision} on this device", file=sys.stderr)
    history = trainer.train()
    if history and trainer.accelerator.is_main_process:
        print(trainer.closing_line())
    return 0


def load_run_policy(run: Path, overrides=(), iteration: int | str | None = None, weights: str = "ema"):
    """The policy of a run's checkpoint: the latest, `best` (the monitor's best by gold reward) or an iteration's;
    its EMA weights where the run kept an EMA (`weights="live"`: the trained weights themselves)."""
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.runtime.checkpoint import find_checkpoint
    from flowrl.runtime.run_dir import CONFIG_FILE, RunDir
    from flowrl.train.registry import add_adapter

    if weights not in ("ema", "live"):
        raise ValueError(f"weights must be 'ema' or 'live', not {weights!r}")
    if not (run / CONFIG_FILE).is_file():
        raise UserError(f"--run '{run}' is not a run directory (no {CONFIG_FILE})")
    cfg = load_config(run / CONFIG_FILE, list(overrides))
    ckpt = find_checkpoint(RunDir(run).checkpoints, iteration, run)
    policy = load_policy(cfg.model)
    if cfg.lora.enabled:
        add_adapter(policy, cfg)
        policy.load_lora(ckpt / ("ema_lora" if weights == "ema" and (ckpt / "ema_lora").is_dir() else "lora"))
    else:
        names = ("ema_transformer", "transformer") if weights == "ema" else ("transformer",)
        export = next((ckpt / name for name in names if (ckpt / name).is_dir()), None)
        if export is not None:  # the diffusers-format export (the only whole copy of a sharded checkpoint's weights)
            policy.load_transformer(export)
        else:  # a checkpoint from before the exports
            from safetensors.torch import load_file

            saved = load_file(str(ckpt / "trainable.safetensors"))
            policy.transformer.load_state_dict(saved, strict=False)
    return cfg, policy, ckpt


def ode_samples(cfg, policy, prompts, seeds, steps=None):
    """What `flowrl sample` draws: images of `prompts` from `seeds` on the ODE of sampling.eval_num_steps (or `steps`)."""
    from flowrl.train.images import ode_images

    s = cfg.sampling
    return ode_images(policy, prompts, seeds, policy.sigmas(s.eval_num_steps if steps is None else steps, s.schedule, s.shift),
                      s.batch_size)


def no_file_on_the_way(path: Path, what: str) -> None:
    """Refuse a path that cannot be made because a folder on the way (or the path itself) is a file."""
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{what} '{path}' cannot be made: '{folder}' is a file, not a folder")


def policy_for(run, checkpoint, config, overrides):
    """The policy of `run`'s checkpoint (`checkpoint`: None for the latest) or of `config`'s base model, with its
    config, a description and the checkpoint's name ("base model" for a config)."""
    from flowrl.config import load_config
    from flowrl.models import load_policy

    if run:
        cfg, policy, ckpt = load_run_policy(Path(run), overrides, checkpoint)
        return cfg, policy, f"{run} ({ckpt.name})", ckpt.name
    if checkpoint is not None:
        raise UserError("--checkpoint picks a checkpoint of --run; with --config there is none")
    cfg = load_config(config, overrides)
    return cfg, load_policy(cfg.model), f"base model {cfg.model.path}", "base model"
