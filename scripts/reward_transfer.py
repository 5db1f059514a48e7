#!/usr/bin/env python3
"""Where does a run's training reward go? Its rise is measured on training prompts, with the run's
own rollout sampler (an SDE for the policy-gradient cells) and the live weights; the arena scores
held-out prompts with a 20-step ODE (and the live weights too); `flowrl eval` the EMA weights. This scores the base model, the last
checkpoint's live weights and its EMA weights under each of those conditions on the same prompts and
seeds, so the gap splits into its parts: the prompts (training against held-out), the sampler (the
rollout's against the evaluation's ODE) and the weights (live against EMA).

    .venv/bin/python scripts/reward_transfer.py runs/arena/flow_grpo_tuned-s1-*          # a markdown table
    .venv/bin/python scripts/reward_transfer.py RUN --per-category 100 --seed 10000      # the arena's first eval set

Columns: strict accuracy (the shapes reward's GenEval-style overall, equal weight per category) and
the weighted reward sum (what the run logs as reward_mean), per condition. The rollout sampler is the
run's flat one (sampling.sampler, noise_level, num_steps and its SDE window at the last iteration); tree
and granular cells branch from chains on the same steps. With --per-category 100 and --seed 10000
the held-out ODE column of the live weights is the arena's end_eval1 for that run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def sample(policy, prompts: list[str], seed: int, spec, batch_size: int):
    """Images [N, 3, H, W] of prompts under `spec`, image j from seed + j (flowrl.train.evaluate's seeding)."""
    import torch

    from flowrl.sampling.rollout import rollout

    seeds = [seed + j for j in range(len(prompts))]
    images = []
    for i in range(0, len(prompts), batch_size):
        traj = rollout(policy, prompts[i : i + batch_size], seeds[i : i + batch_size], spec, batch_size)
        images.append(policy.decode(traj.final))
    return torch.cat(images)


def score(cfg, reward, images, prompts: list[str]) -> tuple[float, float]:
    """(strict, weighted reward sum) of images of prompts."""
    from flowrl.train.evaluate import score_images

    result = score_images(cfg, reward, images, prompts)
    table = result.category_table()
    return (table["overall"]["strict"] if table else float("nan")), result.means()["weighted sum"]


def prompt_sets(cfg, per_category: int) -> dict[str, list[str]]:
    from flowrl.train.prompts import read_prompt_file

    train = read_prompt_file(cfg.data.prompt_file, "data.prompt_file", per_category=per_category)
    if not str(cfg.data.prompt_file).startswith("builtin:"):
        train = train[: 4 * per_category]
    return {"held-out": read_prompt_file("builtin:shapes-heldout", "--per-category", per_category=per_category), "training": train}


def measure(run: Path, per_category: int, seed: int) -> list[dict]:
    import torch

    from safetensors.torch import load_file

    from flowrl.runs import load_run_policy
    from flowrl.sampling.rollout import SamplerSpec
    from flowrl.train.rollouts.common import training_spec
    from rewards import MultiReward

    cfg, policy, ckpt = load_run_policy(run, ["model.compile=none", "run.progress=false"])
    if not cfg.lora.enabled:
        raise SystemExit(f"reward_transfer: {run} trains without LoRA; this script compares adapters")
    iteration = int(ckpt.name.removeprefix("iter_"))  # the window of the last trained iteration
    s = cfg.sampling
    specs = {"ODE": SamplerSpec.ode(policy.sigmas(s.eval_num_steps, s.schedule, s.shift)),
             "rollout": training_spec(cfg, iteration, policy)}
    reward = MultiReward.from_config(cfg.reward)
    sets = prompt_sets(cfg, per_category)
    # the checkpoint's own tensors, not its exports: before 2026-11-30 a CPU run's `ema_lora` export held the live weights
    weights = {"live": ckpt / "trainable.safetensors", "EMA": ckpt / "ema.safetensors"}
    rows = []
    with torch.no_grad():
        for model in ("base", "live", "EMA"):
            if model != "base" and not weights[model].is_file():
                continue
            if model != "base":
                unexpected = policy.transformer.load_state_dict(load_file(str(weights[model])), strict=False).unexpected_keys
                if unexpected:
                    raise SystemExit(f"reward_transfer: {weights[model]} holds weights the run's model lacks: {unexpected[:3]}")
            row = {"run": run.name, "checkpoint": ckpt.name, "model": model}
            for set_name, prompts in sets.items():
                for sampler, spec in specs.items():
                    # the base: the same network with the adapter disabled, the model the run started from
                    with policy.reference() if model == "base" else contextlib.nullcontext():
                        images = sample(policy, prompts, seed, spec, s.batch_size)
                    row[f"{set_name} {sampler}"] = score(cfg, reward, images, prompts)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    columns = [k for k in rows[0] if k not in ("run", "checkpoint", "model")]
    out = ["| run | weights | " + " | ".join(f"{c} (strict / reward)" for c in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
    for r in rows:
        out.append(f"| {r['run']} | {r['model']} | " + " | ".join(f"{r[c][0]:.3f} / {r[c][1]:.3f}" for c in columns) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories of `flowrl train` (their last checkpoint)")
    ap.add_argument("--per-category", type=int, default=25, help="prompts per category in each prompt set (default 25)")
    ap.add_argument("--seed", type=int, default=30_000, help="image j of a set is drawn from seed + j (default 30000)")
    args = ap.parse_args(argv)
    rows = [row for run in args.runs for row in measure(run, args.per_category, args.seed)]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
