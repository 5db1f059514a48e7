"""The monitor's rules over its evaluations (docs/monitor.md): plain data in, the rules that fire out.

gold_divergence: the training reward rose while a gold reward fell, at each of the last K evaluations.
stat_drift: an image statistic is further than its threshold from the base model's on the same prompts and seeds.
diversity_collapse: the diversity within groups fell below a fraction of the base model's.
Each rule's action (warn | stop | rollback) is the config's; the trainer carries it out."""

from __future__ import annotations

from dataclasses import dataclass, field

RULES = ("gold_divergence", "stat_drift", "diversity_collapse")
ACTIONS = ("warn", "stop", "rollback")


@dataclass
class Evaluation:
    """One monitor evaluation: what the rules read."""

    iteration: int
    train_reward: float | None  # the mean training reward of the iterations since the previous evaluation
    gold: dict[str, float] = field(default_factory=dict)  # gold channel -> mean score on the monitor's prompts
    stats: dict[str, float] = field(default_factory=dict)  # image statistic -> value
    diversity: float | None = None  # within-group diversity relative to the base model's (1: as diverse)


@dataclass
class Firing:
    rule: str
    action: str
    message: str


def gold_divergence(evaluations: list[Evaluation], k: int, min_drop: float = 0.0) -> list[str]:
    """The gold channels that fell (by more than min_drop) from each evaluation to the next over the last
    k steps between evaluations, while the training reward rose at each of them. A single noisy step
    does not fire; a run that improves on both, or on neither, never does."""
    if len(evaluations) < k + 1:
        return []
    window = evaluations[-(k + 1):]
    pairs = list(zip(window, window[1:]))
    if any(a.train_reward is None or b.train_reward is None or b.train_reward <= a.train_reward for a, b in pairs):
        return []
    return [name for name in window[-1].gold
            if all(name in a.gold and name in b.gold and b.gold[name] < a.gold[name] - min_drop for a, b in pairs)]


def stat_drift(stats: dict[str, float], base: dict[str, float], thresholds: dict[str, float]) -> dict[str, float]:
    """statistic -> (value - base) for each statistic with a threshold that drifted beyond it."""
    return {name: stats[name] - base[name] for name, limit in thresholds.items()
            if name in stats and name in base and abs(stats[name] - base[name]) > limit}


def diversity_collapse(ratio: float | None, floor: float) -> bool:
    return ratio is not None and ratio < floor


def check_rules(evaluations: list[Evaluation], base_stats: dict[str, float], options) -> list[Firing]:
    """The rules that fire on the newest evaluation, with their configured actions (`options`: the
    config's monitor section)."""
    last, o = evaluations[-1], options
    fired = []
    falling = gold_divergence(evaluations, o.divergence_evals, o.divergence_min_drop)
    if falling:
        fired.append(Firing("gold_divergence", o.on_gold_divergence,
                            f"training reward rose while {', '.join(falling)} fell over the last {o.divergence_evals} evaluations"))
    drifted = stat_drift(last.stats, base_stats, dict(o.drift))
    if drifted:
        said = ", ".join(f"{n} {last.stats[n]:.4g} vs base {base_stats[n]:.4g}" for n in drifted)
        fired.append(Firing("stat_drift", o.on_drift, f"image statistics drifted from the base model's: {said}"))
    if diversity_collapse(last.diversity, o.diversity_floor):
        fired.append(Firing("diversity_collapse", o.on_diversity,
                            f"diversity within groups fell to {last.diversity:.3g} of the base model's (floor {o.diversity_floor})"))
    return fired
