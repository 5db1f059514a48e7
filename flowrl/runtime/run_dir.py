"""A run directory: resolved config, metrics.jsonl, sample grids, reward curve, checkpoints."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from flowrl.errors import UserError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"


def default_run_dir(cfg, prefix: str = "") -> Path:
    """run.output_dir/run.name, or `prefix` and a timestamp where run.name is empty."""
    from datetime import datetime

    return Path(cfg.run.output_dir) / (cfg.run.name or prefix + datetime.now().strftime("%Y%m%d-%H%M%S"))


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.path / "samples"

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    def create(self, cfg) -> None:
        """The directory, with the config in force (`cfg.to_yaml()`) as config.yaml."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{CONFIG_FILE}.tmp"
        tmp.write_text(cfg.to_yaml())
        os.replace(tmp, self.path / CONFIG_FILE)

    def append_metrics(self, row: dict) -> None:
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def read_metrics(self) -> list[dict]:
        """The rows of metrics.jsonl. A last row cut short by a crash is left out (a resume
        writes it again); a bad row before the last is an error naming its line."""
        rows, cut = read_json_lines(self.metrics_file)
        if cut:
            print(f"flowrl: the last row of {self.metrics_file} was cut short (a crash while writing it); left out",
                  file=sys.stderr)
        return rows

    def truncate_metrics(self, before_iteration: int) -> list[dict]:
        """Drop rows logged after the checkpoint we resume from (they will be logged again)."""
        rows = [r for r in self.read_metrics() if r["iteration"] < before_iteration]
        write_json_lines(self.metrics_file, rows)
        return rows

    def plot_reward_curve(self, rows: list[dict], out: Path | None = None) -> Path | None:
        """reward_curve.png (or `out`): the mean reward per iteration, every channel (each raw faint
        under its trailing mean, held-out evaluations as points where the rows hold heldout/ keys,
        points for a run of under 10 iterations), with the shapes reward the training strict
        accuracy per category, and where the rollouts went per
        kind of prompt (share of the rollouts and zero-variance groups) when the rows say. None
        for a run without online rewards."""
        if not rows or "reward_mean" not in rows[0]:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        its = [r["iteration"] for r in rows]
        categories = sorted({k for r in rows for k in r if k.startswith("strict/")})
        buckets = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("rollouts/")})
        panels = 1 + bool(categories) + bool(buckets)
        fig, axes = plt.subplots(panels, 1, figsize=(6, 3.5 * panels), dpi=100, squeeze=False)
        window = max(1, min(20, len(rows) // 5))  # a few prompts per kind per iteration: smooth over a trailing window
        draw_rewards(axes[0, 0], rows, window)
        if categories:
            ax = axes[1, 0]
            for key in categories:
                ax.plot(its, trailing_mean([r.get(key) for r in rows], window), label=key)
            ax.set_xlabel("iteration")
            ax.set_ylabel(f"training strict, mean of {window} iterations")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        if buckets:  # the allocator's spending: solid, share of the rollouts; dashed, groups with no signal
            ax = axes[-1, 0]
            for i, b in enumerate(buckets):
                share = [r[f"rollouts/{b}"] / r["samples"] if f"rollouts/{b}" in r and r.get("samples") else None for r in rows]
                ax.plot(its, trailing_mean(share, window), color=f"C{i}", label=f"{b}: share of rollouts")
                ax.plot(its, trailing_mean([r.get(f"zero_variance/{b}") for r in rows], window), color=f"C{i}", ls="--",
                        label=f"{b}: zero-variance groups")
            ax.set_xlabel("iteration")
            ax.set_ylabel(f"fraction, mean of {window} iterations")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        out = out or self.path / "reward_curve.png"
        fig.savefig(out)
        plt.close(fig)
        return out


def draw_rewards(ax, rows: list[dict], window: int) -> None:
    """The reward panel: each channel's raw iterations faint, their trailing mean over `window` drawn
    over them, held-out evaluations (heldout/ keys) as points where the run made them, and a run of
    under 10 iterations as points."""
    its = [r["iteration"] for r in rows]
    marker = "o" if len(rows) < 10 else None
    series = [("reward_mean", "reward (weighted sum)")] + [(k, k) for k in sorted(k for k in rows[-1] if k.startswith("reward/"))]
    for i, (key, label) in enumerate(series):
        raw = [r.get(key) for r in rows]
        ax.plot(its, [float("nan") if v is None else v for v in raw], color=f"C{i}", alpha=0.25, lw=0.8, marker=marker, ms=3)
        smoothed = f"{label}, mean of {window} iterations" if window > 1 else label
        ax.plot(its, trailing_mean(raw, window), color=f"C{i}", label=smoothed, marker=marker, ms=3)
    held_out = sorted({k for r in rows for k in r if k.startswith("heldout/")})
    for i, key in enumerate(held_out):
        points = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot(*zip(*points), ls="none", marker="D", ms=5, color=f"C{len(series) + i}", label=f"{key} (held-out)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def trailing_mean(values: list[float | None], window: int) -> list[float]:
    """Mean of the last `window` values that are present (None where an iteration drew no
    prompt of that kind); NaN until one is."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i + 1 - window) : i + 1] if v is not None]
        out.append(sum(seen) / len(seen) if seen else float("nan"))
    return out


def read_json_lines(path: Path) -> tuple[list[dict], bool]:
    """The rows of a JSON-lines file (none when it does not exist) and whether its last row was
    cut short, as an interruption while writing it leaves it; a bad row before the last is an
    error naming its line."""
    if not path.is_file():
        return [], False
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise UserError(f"{path} line {number} is not a JSON row; fix or remove that line") from None
            return rows, True
    return rows, False


def write_json_lines(path: Path, rows: list[dict]) -> None:
    """Replace `path` with `rows`, one JSON row per line, whole or not at all (a temporary file renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
