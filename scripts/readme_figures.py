#!/usr/bin/env python3
"""The README's pictures of a finished run: the sample grid before RL beside the last one, and the
reward curve.

    .venv/bin/flowrl train --run-dir runs/readme-default            # the default preset, ~270 iterations
    .venv/bin/python scripts/readme_figures.py runs/readme-default  # -> docs/images/default_*.png
    .venv/bin/python scripts/readme_figures.py --smoke               # the code path on a one-iteration tiny_jpeg run

Writes OUT/default_before_after.png (the run's samples/iter_000000_before.png and its last
samples/iter_NNNNNN.png side by side, titled with the iterations, the eval prompts below; for an
editing run, the first held-out edit of each type instead: its source, two seeds of the base model and the
same two of the trained one, each marked right or wrong by the shapes_edit verifier) and
OUT/default_reward_curve.png (the run directory's reward curve, redrawn from metrics.jsonl). Prints
the first and last iteration's training reward.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, nargs="?", help="a finished run directory")
    p.add_argument("--out", type=Path, default=None, help="default docs/images (with --smoke a temporary directory)")
    p.add_argument("--name", default="default", help="file name prefix")
    p.add_argument("--smoke", action="store_true", help="the code path in seconds: the figures of a one-iteration tiny_jpeg run "
                   "with sample grids, trained first (in a temporary directory unless RUN is given)")
    args = p.parse_args(argv)
    if args.run is None and not args.smoke:
        p.error("the run directory is required")
    with contextlib.ExitStack() as stack:
        if args.smoke:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="readme_figures-smoke-")))
            args.run, args.out = args.run or tmp / "run", args.out or tmp / "images"
            from flowrl.cli import main as flowrl

            if flowrl(["train", "tiny_jpeg", "trainer.iterations=1", "run.sample_every=1", "data.group_size=2", "sampling.batch_size=4",
                       "sampling.eval_num_steps=2", "run.tracker=none", "run.progress=false", "--run-dir", str(args.run)]) != 0:
                return 1
        return figures(args)


def figures(args) -> int:
    args.out = args.out or ROOT / "docs" / "images"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from flowrl.config import load_config
    from flowrl.runtime.run_dir import CONFIG_FILE, RunDir

    run = RunDir(args.run)
    before = run.samples / "iter_000000_before.png"
    grids = sorted(run.samples.glob("iter_[0-9]*[0-9].png"))
    rows = run.read_metrics()
    if not before.is_file() or not grids or not rows:
        print(f"error: {args.run} needs samples/iter_000000_before.png, a later sample grid and metrics.jsonl "
              "(a run with run.sample_every > 0)", file=sys.stderr)
        return 2
    after = grids[-1]
    cfg = load_config(args.run / CONFIG_FILE, validate_paths=False)
    args.out.mkdir(parents=True, exist_ok=True)
    if cfg.data.edits:  # an editing run: held-out edits of every type, the base model beside the trained one
        return edit_figures(args, run, rows)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=150)
    for ax, path, title in ((axes[0], before, "before RL"), (axes[1], after, f"after {int(after.stem.split('_')[1])} iterations")):
        ax.imshow(Image.open(path), interpolation="nearest")
        ax.set_title(f"{title} (EMA weights, same seeds)", fontsize=9)
        ax.axis("off")
    prompts = list(cfg.data.eval_prompts) or list(cfg.data.prompts)[:4]  # what the loop samples its grids with
    fig.text(0.5, 0.02, "in reading order, two seeds each: " + " | ".join(prompts), ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    grid_png = args.out / f"{args.name}_before_after.png"
    fig.savefig(grid_png)
    plt.close(fig)

    curve_png = run.plot_reward_curve(rows, out=args.out / f"{args.name}_reward_curve.png")
    print(f"wrote {grid_png} and {curve_png}")
    print(f"training reward: iteration {rows[0]['iteration']} {rows[0]['reward_mean']:.4f}, "
          f"iteration {rows[-1]['iteration']} {rows[-1]['reward_mean']:.4f}")
    return 0


EDIT_SEEDS = (10_000, 10_001)  # bench_shapes' first eval set's first seeds


def edit_figures(args, run, rows) -> int:
    """OUT/NAME_before_after.png for an editing run: the first held-out edit of each type (builtin:shapes-edit-heldout),
    one row each: the source, two seeds of the base model (the adapter off), the same two seeds of the trained one
    (the latest checkpoint's EMA weights), each sample captioned with the shapes_edit verifier's strict score."""
    import torch

    from flowrl.runs import load_run_policy, ode_samples
    from flowrl.train.edit_data import read_edits
    from flowrl.train.images import save_grid
    from rewards.shapes_edit import edit_type_of, score_edits
    from rewards.shapes_edit_world import EDIT_TYPES

    held = read_edits("builtin:shapes-edit-heldout")
    edits = [next(p for p in held if edit_type_of(p) == t) for t in EDIT_TYPES]
    cfg, policy, ckpt = load_run_policy(args.run)
    prompts = [p for p in edits for _ in EDIT_SEEDS]
    seeds = list(EDIT_SEEDS) * len(edits)
    sources = torch.stack([p.image() for p in prompts])
    with policy.reference():
        base = ode_samples(cfg, policy, prompts, seeds)
    trained = ode_samples(cfg, policy, prompts, seeds)
    k = len(EDIT_SEEDS)
    tiles, captions = [], []
    for i, edit in enumerate(edits):
        tiles.append(edit.image())
        captions.append(edit.instruction)
        for label, images in (("base", base), ("trained", trained)):
            strict = score_edits(images[i * k:(i + 1) * k], prompts[i * k:(i + 1) * k], sources[i * k:(i + 1) * k])[:, 0]
            tiles += list(images[i * k:(i + 1) * k])
            captions += [f"{label}: {'right' if s == 1 else 'wrong'}" for s in strict.tolist()]
    grid_png = save_grid(torch.stack(tiles), args.out / f"{args.name}_before_after.png", columns=1 + 2 * k, captions=captions)
    curve_png = run.plot_reward_curve(rows, out=args.out / f"{args.name}_reward_curve.png")
    print(f"wrote {grid_png} and {curve_png}: held-out edits, source | base x{k} | trained ({ckpt.name}) x{k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
