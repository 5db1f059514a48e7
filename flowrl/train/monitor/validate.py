"""The config's monitor section checked (flowrl/config.py calls `validate_monitor`): one sentence for the first mistake."""

from __future__ import annotations

from flowrl.errors import ConfigError, check_choice, check_range
from flowrl.train.monitor.image_stats import ARTEFACT_STATISTICS, STATISTICS
from flowrl.train.monitor.rules import ACTIONS
from flowrl.train.prompts import BUILTIN_PROMPT_SETS
from rewards import check_reward_config, get_reward

# frame_change: videos only; patch_energy: every image model; background_impurity, fill_nonuniformity: shapes-world prompts only
DRIFT_STATISTICS = (*STATISTICS, "frame_change", *ARTEFACT_STATISTICS)


def gold_reward(channel: str) -> str:
    """The reward a gold channel (REWARD or REWARD/CHANNEL) belongs to."""
    return channel.split("/")[0]


def validate_monitor(cfg, validate_paths: bool = True) -> None:
    m = cfg.monitor
    for key, spec in (("every", ">= 1"), ("num_prompts", ">= 1"), ("seeds", ">= 1"), ("divergence_evals", ">= 1"),
                      ("divergence_min_drop", ">= 0"), ("diversity_floor", "[0, 1]"), ("max_rollbacks", ">= 0")):
        check_range(f"monitor.{key}", getattr(m, key), spec)
    for key in ("on_gold_divergence", "on_drift", "on_diversity"):
        check_choice(f"monitor.{key}", getattr(m, key), ACTIONS)
    for name, limit in m.drift.items():
        check_choice("monitor.drift's statistics", name, DRIFT_STATISTICS)
        check_range(f"monitor.drift.{name}", limit, "> 0")
    if m.prompt_file and m.prompt_file.startswith("builtin:"):
        check_choice("monitor.prompt_file", m.prompt_file, BUILTIN_PROMPT_SETS)
    if not m.enabled:
        return
    if m.seeds < 2 and m.on_diversity != "warn":
        raise ConfigError(f"monitor.seeds must be at least 2 for the diversity within a group that monitor.on_diversity "
                          f"{m.on_diversity} acts on; got {m.seeds}")
    rewards = sorted({gold_reward(c) for c in m.gold})
    # the gold rewards' own options only: reward.validate checks those of the trained rewards
    check_reward_config({r: 0.0 for r in rewards}, {k: v for k, v in cfg.reward.options.items() if k in rewards},
                        validate_paths=validate_paths)
    for c in m.gold:
        channels = get_reward(gold_reward(c)).channels
        named = [gold_reward(c)] if len(channels) == 1 else [f"{gold_reward(c)}/{k}" for k in channels]
        if c not in named:
            raise ConfigError(f"monitor.gold '{c}' names no channel of reward '{gold_reward(c)}'; its channels: {', '.join(named)}")
    if not m.gold and "rollback" in (m.on_gold_divergence, m.on_drift, m.on_diversity):
        raise ConfigError("a monitor rule's action rollback restores the `best` checkpoint, which monitor.gold decides; "
                          "name a gold reward in monitor.gold, or choose warn or stop")
