#!/usr/bin/env python3
"""The artefact curve of shapes-world runs: held-out strict accuracy and the three artefact measures
(docs/monitor.md, "Artefact measures") at every saved checkpoint, against the base model's spread.

    python scripts/artefact_curve.py runs/bench-fill-s0 runs/arena/dgpo_tuned-s0-*   # every checkpoint
    python scripts/artefact_curve.py RUN --every 2 --per-category 50 --seed 10000
    python scripts/artefact_curve.py RUN --gaps --per-category 4    # where the adapter acts: its velocity gap per sigma
    python scripts/artefact_curve.py --smoke          # the code path on a tiny run trained here

Each checkpoint's weights (EMA where the run kept one, as `flowrl eval` scores; --weights live: the
trained weights) draw one ODE sample per held-out prompt (--per-category per category, image j from
seed --seed + j, the run's eval steps and guidance); so do the base model's, on the same prompts and
seeds. Per image: strict accuracy, background impurity, fill nonuniformity and patch energy at the
policy's token side; per checkpoint their means and standard errors (std / sqrt(n) over the images
where each is defined). Every point is a JSON line of --out (a rerun skips the points there). The
table marks a measure outside the base's mean +- 2 standard errors, the band issue 88 asks a clean
gain to stay inside; the image draws each measure against the iteration with that band.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the arena's pieces
from arena_curve import checkpoint_minutes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "experiments" / "artefact-curve.jsonl"
MEASURES = ("strict", "background impurity", "fill nonuniformity", "patch energy")  # strict: higher is better; the rest lower


def per_image(policy, cfg, reward, prompts: list[str], seed: int) -> dict[str, list[float]]:
    """One ODE image per prompt (seed + j): each measure per image (NaN where it is undefined)."""
    from flowrl.runs import ode_samples
    from flowrl.train.monitor.image_stats import patch_energies
    from rewards.shapes import background_impurity_batch, fill_nonuniformity_batch

    images = ode_samples(cfg, policy, prompts, [seed + j for j in range(len(prompts))])
    strict = reward(images, prompts)[:, reward.channel_names.index("shapes/strict")]
    values = {"strict": strict, "background impurity": background_impurity_batch(images),
              "fill nonuniformity": fill_nonuniformity_batch(images), "patch energy": patch_energies(images, policy.pixel_patch)}
    return {name: [float(v) for v in values[name]] for name in MEASURES}


def mean_and_se(values: list[float]) -> tuple[float, float, int]:
    """The mean, its standard error (sample std / sqrt(n)) and n, over the finite values."""
    xs = [v for v in values if math.isfinite(v)]
    if not xs:
        return math.nan, math.nan, 0
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0) / math.sqrt(len(xs)), len(xs)


def point(run: str, iteration: int, key: dict, values: dict[str, list[float]], minutes: float | None) -> dict:
    line = {"run": run, "iteration": iteration, "minutes": minutes, **key, "date": time.strftime("%Y-%m-%d %H:%M")}
    for name in MEASURES:
        mean, se, n = mean_and_se(values[name])
        line[name] = {"mean": mean, "se": se, "n": n}
    return line


def read_points(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def score_runs(args) -> list[dict]:
    """Score every missing point (the base of each model once, every chosen checkpoint of every run)."""
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.runs import load_run_policy
    from flowrl.runtime.checkpoint import checkpoint_iterations
    from flowrl.runtime.run_dir import CONFIG_FILE, RunDir
    from flowrl.train.prompts import builtin_prompts
    from rewards import MultiReward

    out = Path(args.out)
    prompts = builtin_prompts("builtin:shapes-heldout", "--per-category", per_category=args.per_category)
    key = {"per_category": args.per_category, "seed": args.seed, "weights": args.weights}
    done = {(p["run"], p["iteration"]) for p in read_points(out) if all(p.get(k) == v for k, v in key.items())}
    lines = []
    for run in map(Path, args.runs):
        if not (run / CONFIG_FILE).is_file():
            raise SystemExit(f"artefact_curve: {run} is not a run directory (no {CONFIG_FILE})")
        cfg = load_config(run / CONFIG_FILE, ["run.progress=false", *args.overrides])
        reward = MultiReward({"shapes": 1.0})
        iterations = checkpoint_iterations(RunDir(run).checkpoints)[:: -1][:: args.every][::-1]  # the latest always
        minutes = checkpoint_minutes(run)
        base_name = f"base:{cfg.model.path}"
        todo = ([] if (base_name, 0) in done else [0]) + [i for i in iterations if (str(run), i) not in done]
        for iteration in todo:
            t0 = time.perf_counter()
            if iteration == 0:
                name, policy = base_name, load_policy(cfg.model)
            else:
                name = str(run)
                _, policy, _ = load_run_policy(run, ["run.progress=false", *args.overrides], iteration, weights=args.weights)
            line = point(name, iteration, key, per_image(policy, cfg, reward, prompts, args.seed), minutes.get(iteration))
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "a") as f:
                f.write(json.dumps(line) + "\n")
            done.add((name, iteration))
            lines.append(line)
            print(f"{name} iteration {iteration}: " + ", ".join(f"{m} {line[m]['mean']:.4f}" for m in MEASURES)
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    return lines


def curves(args) -> dict[str, tuple[dict, list[dict]]]:
    """Per run: (its base point, its points by iteration), from --out with this invocation's prompts and seeds."""
    from flowrl.config import load_config
    from flowrl.runtime.run_dir import CONFIG_FILE

    key = {"per_category": args.per_category, "seed": args.seed, "weights": args.weights}
    points = [p for p in read_points(Path(args.out)) if all(p.get(k) == v for k, v in key.items())]
    out = {}
    for run in args.runs:
        model = load_config(Path(run) / CONFIG_FILE, ["run.progress=false", *args.overrides]).model.path
        base = next(p for p in points if p["run"] == f"base:{model}")
        out[str(run)] = (base, sorted((p for p in points if p["run"] == str(run)), key=lambda p: p["iteration"]))
    return out


def outside(base: dict, line: dict, name: str) -> bool:
    """Whether a measure lies outside the base's mean +- 2 standard errors."""
    return abs(line[name]["mean"] - base[name]["mean"]) > 2 * base[name]["se"]


def table(runs: dict[str, tuple[dict, list[dict]]]) -> str:
    rows = ["| run | iteration | minutes | " + " | ".join(MEASURES) + " |", "|---|---|---|" + "---|" * len(MEASURES)]
    for run, (base, points) in runs.items():
        rows.append(f"| {Path(run).name} base | 0 | 0 | "
                    + " | ".join(f"{base[m]['mean']:.4f} ± {base[m]['se']:.4f}" for m in MEASURES) + " |")
        for p in points:
            minutes = "-" if p["minutes"] is None else f"{p['minutes']:.1f}"
            rows.append(f"| {Path(run).name} | {p['iteration']} | {minutes} | "
                        + " | ".join(f"{p[m]['mean']:.4f}{' *' if outside(base, p, m) else ''}" for m in MEASURES) + " |")
    rows.append("\n`*`: outside the base's mean ± 2 standard errors (over images, the same prompts and seeds).")
    return "\n".join(rows)


def plot(runs: dict[str, tuple[dict, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MEASURES), figsize=(4.2 * len(MEASURES), 3.8))
    for ax, name in zip(axes, MEASURES):
        banded = set()
        for k, (run, (base, points)) in enumerate(runs.items()):
            xs = [0] + [p["iteration"] for p in points]
            ys = [base[name]["mean"]] + [p[name]["mean"] for p in points]
            ax.plot(xs, ys, marker="o", ms=3, color=f"C{k}", label=Path(run).name)
            if base["run"] not in banded:  # runs of one base model share its band
                banded.add(base["run"])
                band = 2 * base[name]["se"]
                ax.axhspan(base[name]["mean"] - band, base[name]["mean"] + band, color="grey", alpha=0.2)
        ax.set_title(name + (" (higher is better)" if name == "strict" else " (lower is cleaner)"), fontsize=9)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Held-out strict and artefact measures per checkpoint; bands: the base's mean ± 2 standard errors", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def velocity_gaps(run: Path, overrides: list[str], per_category: int, seed: int) -> list[dict]:
    """Where a run's adapter acts: at each sigma of its sampling grid, the mean squared gap between the trained and
    the base network's velocity, conditional and guided (model.guidance_scale), against the base's own flow-matching
    error, on the base model's ODE images of the held-out prompts noised with fresh noise (the latest checkpoint's
    trained weights)."""
    import torch

    from flowrl.runs import load_run_policy, ode_samples
    from flowrl.train.objectives.implicit import flow_errors
    from flowrl.train.prompts import builtin_prompts

    cfg, policy, ckpt = load_run_policy(run, ["run.progress=false", *overrides], None, weights="live")
    s = cfg.sampling
    prompts = builtin_prompts("builtin:shapes-heldout", "--per-category", per_category=per_category)
    rows = []
    with torch.no_grad():
        with policy.reference():
            images = ode_samples(cfg, policy, prompts, [seed + j for j in range(len(prompts))])
        x0, cond = policy.encode_images(images), policy.encode(prompts)
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
        for sigma in policy.sigmas(s.num_steps, s.schedule, s.shift).tolist()[: s.num_steps]:
            row = {"sigma": sigma}
            for name, scale in (("conditional", 1.0), ("guided", None)):
                with policy.guidance(scale):
                    errors = flow_errors(policy, x0, eps, sigma, cond)
                row[f"{name} gap"] = ((errors.v - errors.v_ref) ** 2).mean().item()
                row[f"{name} base error"] = errors.err_ref.mean().item()
            rows.append(row)
    print(f"{run} ({ckpt.name}): mean squared velocity gap to the base network per sampling sigma")
    print("| sigma | conditional gap | base's error | guided gap | base's error |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sigma']:.2f} | {r['conditional gap']:.4f} | {r['conditional base error']:.4f} | "
              f"{r['guided gap']:.4f} | {r['guided base error']:.4f} |")
    return rows


def smoke_run(directory: Path) -> Path:
    """A tiny shapes run of two iterations with a checkpoint after each (scripts/smoke.py's model and overrides)."""
    from smoke import shapes_overrides, tiny_shapes_model

    from flowrl.cli import main as cli_main

    run = directory / "run"
    overrides = shapes_overrides(tiny_shapes_model(directory / "model")) + ["trainer.iterations=2", "run.checkpoint_every=1"]
    if cli_main(["train", *overrides, "--run-dir", str(run)]) != 0:
        raise SystemExit("artefact_curve --smoke: the tiny run failed")
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="run directories of shapes-world runs")
    ap.add_argument("--overrides", nargs="*", default=[], help="dot-list overrides when a run's config is loaded")
    ap.add_argument("--per-category", type=int, default=25, help="held-out images per category (default 25: 100 images)")
    ap.add_argument("--seed", type=int, default=10_000, help="image j is drawn from seed + j (training never uses these)")
    ap.add_argument("--every", type=int, default=1, help="every k-th checkpoint, counted back from the latest")
    ap.add_argument("--weights", choices=("ema", "live"), default="ema")
    ap.add_argument("--out", default=str(OUT), help="the points, one JSON line each")
    ap.add_argument("--image", default=None, help="draw the curves here (a .png)")
    ap.add_argument("--gaps", action="store_true", help="instead: each run's velocity gap to the base network per sampling "
                    "sigma (its latest checkpoint), on the base model's images of --per-category prompts per category")
    ap.add_argument("--smoke", action="store_true", help="a tiny run trained here, scored on one prompt per category")
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error(f"--every must be 1 or more; got {args.every}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flowrl.quiet import silence_known_messages

    silence_known_messages()
    with tempfile.TemporaryDirectory(prefix="artefact_curve-smoke-") as tmp:
        if args.smoke:
            args.runs, args.per_category = [str(smoke_run(Path(tmp)))], 1
            args.overrides = [*args.overrides, "model.compile=none"]
            if args.out == str(OUT):
                args.out = str(Path(tmp) / "points.jsonl")
        if not args.runs:
            ap.error("give run directories, or --smoke")
        if args.gaps:
            for run in args.runs:
                velocity_gaps(Path(run), args.overrides, args.per_category, args.seed)
            return 0
        score_runs(args)
        runs = curves(args)
        print(table(runs))
        if args.image:
            plot(runs, Path(args.image))
            print(f"wrote {args.image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
