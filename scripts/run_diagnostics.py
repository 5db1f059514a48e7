#!/usr/bin/env python3
"""Why does a run (not) move? Per run directory, the training signals an arena cell is diagnosed by,
read from what every run already writes: metrics.jsonl and the checkpoints' trained weights.

    .venv/bin/python scripts/run_diagnostics.py runs/arena/dgpo-s0-*            # a markdown table
    .venv/bin/python scripts/run_diagnostics.py runs/arena/* --image docs/images/diagnostics.png

Columns, each the mean over the first and the last tenth of the run's iterations ("first -> last"):
the training reward and its within-batch std; the share of groups whose rewards all tie (no
advantage, no gradient: `degenerate_groups`); the gradient norm before clipping; the clipped or
masked share (`clipfrac`, `clip_fraction`); the KL or velocity gap to the base network (`kl`); and,
from the checkpoints, the norm of the LoRA update (sum over adapted layers of ||(alpha / r) B A||_F^2,
square-rooted) at the run's first and last checkpoints. A signal a run does not log shows as "-".
With --image, the same signals against the iteration, one panel each, one line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

SIGNALS = {  # column: the metrics keys that carry it, the first present wins
    "reward": ("reward_mean",), "reward std": ("reward_std",), "tied groups": ("degenerate_groups",),
    "grad norm": ("grad_norm",), "clipped": ("clipfrac", "clip_fraction"), "KL to base": ("kl",),
}


def rows_of(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"run_diagnostics: {run} has no metrics.jsonl (give run directories of `flowrl train`)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], keys: tuple[str, ...]) -> list[float] | None:
    for key in keys:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            return [float(v) for v in values]
    return None


def ends(values: list[float]) -> tuple[float, float]:
    """The means of the first and the last tenth (at least one value each)."""
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def lora_update_norm(checkpoint: Path, scale: float) -> float:
    """sqrt(sum over adapted layers of ||scale B A||_F^2) of a checkpoint's trained LoRA weights."""
    weights = load_file(str(checkpoint / "trainable.safetensors"))
    total = 0.0
    for name, a in weights.items():
        if ".lora_A." in name:
            b = weights[name.replace(".lora_A.", ".lora_B.")]
            total += float((scale * b.float() @ a.float()).square().sum())
    return total ** 0.5


def checkpoints(run: Path) -> list[Path]:
    found = sorted(p for p in (run / "checkpoints").glob("iter_*") if (p / "trainable.safetensors").is_file())
    return found


def lora_scale(run: Path) -> float:
    config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    lora = (config or {}).get("lora") or {}
    return float(lora.get("alpha", 1)) / float(lora.get("rank", 1))


def diagnose(run: Path) -> dict:
    rows = rows_of(run)
    out = {"run": run.name, "iterations": len(rows)}
    for column, keys in SIGNALS.items():
        values = series(rows, keys)
        out[column] = None if values is None else ends(values)
    ckpts = checkpoints(run)
    scale = lora_scale(run)
    out["LoRA update"] = (lora_update_norm(ckpts[0], scale), lora_update_norm(ckpts[-1], scale)) if ckpts else None
    return out


def cell(value) -> str:
    if value is None:
        return "-"
    first, last = value
    return f"{first:.3g} -> {last:.3g}"


def table(diagnoses: list[dict]) -> str:
    columns = ["run", "iterations", *SIGNALS, "LoRA update"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for d in diagnoses:
        lines.append("| " + " | ".join(str(d[c]) if c in ("run", "iterations") else cell(d[c]) for c in columns) + " |")
    return "\n".join(lines)


def plot(runs: list[Path], image: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (column, keys) in zip(axes.flat, SIGNALS.items()):
        for run in runs:
            values = series(rows_of(run), keys)
            if values is not None:
                ax.plot(values, label=run.name, linewidth=1)
        ax.set_title(column)
        ax.set_xlabel("iteration")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    image.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(image, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    ap.add_argument("--image", type=Path, help="also draw the signals against the iteration into this PNG")
    args = ap.parse_args(argv)
    runs = [r for r in args.runs if r.is_dir()]
    if not runs:
        raise SystemExit("run_diagnostics: none of the given paths is a directory")
    print(table([diagnose(r) for r in runs]))
    if args.image:
        plot(runs, args.image)
        print(f"wrote {args.image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
