"""Looking up registered rollouts and objectives by name, and checking a config against their
declarations (flowrl/train/parts.py). Importing this module registers the built-in parts."""

from __future__ import annotations

import flowrl.train.objectives  # noqa: F401  (registers the built-in objectives)
import flowrl.train.rollouts  # noqa: F401  (registers the built-in rollouts)
from flowrl.errors import ConfigError
from flowrl.schema import Config
from flowrl.train.experience import DATA_KINDS
from flowrl.train.parts import OBJECTIVES, ROLLOUTS, Objective, Rollout


def rollout_class(kind: str) -> type[Rollout]:
    return ROLLOUTS.get(kind)


def objective_class(kind: str) -> type[Objective]:
    return OBJECTIVES.get(kind)


def add_adapter(policy, cfg: "Config") -> None:
    """The run's LoRA (cfg.lora) on `policy`, acting where lora.sigma_range says or, with lora.acts_at trained, at the
    sigmas the objective trains on the loaded model's own sampling grid (a pipeline's grid is known only here)."""
    policy.add_lora(cfg.lora, seed=cfg.trainer.seed)
    if cfg.lora.acts_at == "trained":
        s = cfg.sampling
        grid = policy.sigmas(s.num_steps, s.schedule, s.shift).tolist()[: s.num_steps]
        trained = objective_class(cfg.objective.kind).trained_sigma_range(cfg, grid)
        policy.lora_sigma_range = None if trained is None else (float(trained[0]), float(trained[1]))


def check_async_processes(cfg: "Config", processes: int) -> None:
    """run.async_rollouts beside `processes` trainer processes (run.cpu_processes when the config is
    read, the launch's count when the trainer starts): more than one needs a rollout that splits."""
    rollout = rollout_class(cfg.rollout.kind)
    if cfg.run.async_rollouts and processes > 1 and not rollout.splits_batches:
        able = ", ".join(sorted(n for n, c in ROLLOUTS.items() if c.splits_batches))
        raise ConfigError(f"run.async_rollouts with {processes} trainer processes splits each batch between them, which "
                          f"rollout.kind {able} can do, not '{rollout.name}'; run one trainer process (run.cpu_processes: 1)")


def check_compatible(cfg: "Config") -> None:
    """Both parts exist, each accepts the config, and the rollout provides what the objective needs."""
    rollout, objective = rollout_class(cfg.rollout.kind), objective_class(cfg.objective.kind)
    rollout.validate(cfg)
    objective.validate(cfg)
    if cfg.run.distributed == "fsdp2":
        for key, part, registry in (("rollout.kind", rollout, ROLLOUTS), ("objective.kind", objective, OBJECTIVES)):
            if not part.shards:
                able = ", ".join(sorted(n for n, c in registry.items() if c.shards))
                raise ConfigError(f"run.distributed fsdp2 runs {key} {able}, not '{part.name}'; use run.distributed=ddp for it")
    if cfg.run.async_rollouts and not rollout.runs_ahead:
        ahead = ", ".join(sorted(n for n, c in ROLLOUTS.items() if c.runs_ahead))
        raise ConfigError(f"run.async_rollouts needs a rollout that a producer process samples ahead of the trainer: rollout.kind "
                          f"{ahead}, not '{rollout.name}'")
    check_async_processes(cfg, cfg.run.cpu_processes)
    provided = rollout.provides(cfg)
    for data, option in objective.requires(cfg).items():
        if data not in provided:
            able = ", ".join(ROLLOUTS.where(lambda r: data in r.provides(cfg)))
            raise ConfigError(f"{option} needs {DATA_KINDS[data]}, which rollout.kind '{rollout.name}' does not provide under "
                              f"this config; rollout.kind {able or 'none of the registered rollouts'} does")
    if objective.needs not in provided:
        able = sorted(name for name, o in OBJECTIVES.items() if o.needs in provided)
        reason = rollout.missing_reason(cfg, objective.needs)
        raise ConfigError(f"objective.kind '{objective.name}' trains on {DATA_KINDS[objective.needs]}, which rollout.kind "
                          f"'{rollout.name}' does not provide{' ' + reason if reason else ''}; objective.kind may be "
                          f"{', '.join(able) or 'none of the registered objectives'} with it")
