#!/usr/bin/env python3
"""Is there a signal in a policy-gradient update? The direction of the gradient an objective would
step on, measured over fresh iterations without stepping, against a control whose advantages carry
no information.

    .venv/bin/python scripts/gradient_signal.py configs/arena/flow_grpo.yaml --iterations 12
    .venv/bin/python scripts/gradient_signal.py configs/arena/flow_grpo.yaml model.guidance_scale=1 \
        --iterations 12 --json docs/experiments/gradient-signal/flow_grpo-g1.json

Builds the trainer of a config (one process, eager), then for each of K iterations collects a fresh
experience (the rollout's own sampling, rewards and advantages; the weights never move) and takes,
per denoising step, the gradient over the trainable weights of the objective's own loss summed over
the iteration's kept transitions (each micro-batch's loss times its kept count: at the base weights
the ratio is 1, so this is -sum A grad log p, with whatever per-step weighting the objective applies).
The control recomputes the same gradients with the advantages permuted within groups (flat rollouts:
one permutation of each prompt's samples, the same at every step; tree and granular micro-batches:
within consecutive blocks of data.group_size rows), so any agreement it shows is the noise floor.

Reported per trained step, for the early steps (0-2), for the total without the last step and for the
total: the mean pairwise cosine between the K iterations' gradients (a gradient that points the same
way each iteration has cosines well above 0; pure noise has about 0), its null standard deviation
(the pairwise cosines' std over sqrt(pairs): pairwise cosines of independent isotropic vectors are
uncorrelated), the share of the squared gradient norm, and ||mean g|| / mean ||g|| (pure noise of
equal norms: 1 / sqrt(K)). A variant's gradient "has signal" when a cosine clears its control's by
3 combined null standard deviations (`clears`).

Iterations draw different prompts, so a direction that is real for one iteration's prompts but not
shared with the next one's shows no cosine between iterations. The split-half cosine looks within an
iteration: each group's chains are split in two halves (even and odd samples), each half's gradient
taken from the same forward, and their cosine averaged over the iterations (standard error from its
spread): positive where the update has a direction for its own prompts at all. Both the real and the
control gradients come from one forward per micro-batch (at these weights every loss term is linear
in the advantages). The KL is off (`trainer.kl_beta=0` unless overridden): at the base weights the
adapter is zero and the KL's gradient exactly 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

EARLY = (0, 1, 2)


def permuted_within_groups(values, group_ids, generator):
    """`values` [N] with each group's entries shuffled among themselves."""
    import torch

    out = values.clone()
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero().squeeze(1)
        out[idx] = values[idx[torch.randperm(len(idx), generator=generator)]]
    return out


def permuted_in_blocks(values, block: int, generator):
    """`values` [n] shuffled within consecutive blocks of `block` entries."""
    import torch

    out = values.clone()
    for start in range(0, len(values), block):
        sl = slice(start, min(start + block, len(values)))
        out[sl] = values[sl][torch.randperm(sl.stop - sl.start, generator=generator)]
    return out


def halves_of(mb) -> "torch.Tensor":
    """[n] bool: the rows of `mb` in the first half of their group (flat rollouts: even sample index, so
    each group splits into two equal halves of independent chains; tree and granular rows: even row)."""
    import torch

    rows = mb.index if mb.index is not None else torch.arange(len(mb.advantages))
    return rows % 2 == 0


def control_advantages(experience, group_size: int, generator) -> list[list["torch.Tensor"]]:
    """Per micro-batch of the experience, advantages that carry no information about their samples."""
    from flowrl.train.experience import advantages_at

    permuted = permuted_within_groups(experience.advantages, experience.prompt_ids, generator)
    return [[advantages_at(permuted, mb.index) if mb.index is not None else permuted_in_blocks(mb.advantages, group_size, generator)
             for mb in group] for group in experience.transitions]


def _flat(grads, params) -> "torch.Tensor":
    import torch

    return torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1).detach().float().cpu() for x, p in zip(grads, params)])


def step_gradients(objective, params: list, groups, control: list | None = None) -> dict[int, tuple]:
    """Per step: the flattened gradients of the objective's loss summed over the kept transitions of
    `groups`, split into the two halves of each group (`halves_of`): {step: (half A, half B)}; their sum
    is the step's gradient. With `control` (advantages per micro-batch), the same for those advantages,
    from the same forward: (real, control)."""
    import torch

    real: dict[int, tuple] = {}
    ctrl: dict[int, tuple] = {}

    def add(out, key, a, b):
        out[key] = (out[key][0] + a, out[key][1] + b) if key in out else (a, b)

    for gi, group in enumerate(groups):
        for k, mb in enumerate(group):
            if mb.kept() == 0:
                continue
            out = mb.evaluate()  # one forward: every loss below is linear in the advantages at these weights
            cached = mb._replace(evaluate=lambda out=out: out)
            key = -1 if mb.step is None else int(mb.step)
            keep = mb.keep.bool() if mb.keep is not None else torch.ones(len(mb.advantages), dtype=torch.bool)
            half = halves_of(mb)
            jobs = [(real, mb.advantages)] + ([(ctrl, control[gi][k])] if control is not None else [])
            for target, adv in jobs:
                parts = []
                for side in (half, ~half):
                    rows = keep & side
                    if not bool(rows.any()):
                        parts.append(torch.zeros(sum(p.numel() for p in params)))
                        continue
                    loss, _, _ = objective.micro_batch_loss(cached._replace(advantages=adv, keep=rows))
                    parts.append(_flat(torch.autograd.grad(loss * int(rows.sum()), params, allow_unused=True, retain_graph=True),
                                       params))
                add(target, key, *parts)
    return (real, ctrl) if control is not None else real


def split_half_stats(pairs: list) -> dict:
    """Mean over iterations of the cosine between a gradient's two halves (independent chains of the
    same prompts: positive where the update has a direction for these prompts), and its standard error."""
    import torch

    cos = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in pairs if float(a.norm()) > 0 and float(b.norm()) > 0]
    if len(cos) < 2:
        return {"split_half": float("nan"), "split_half_se": float("nan")}
    t = torch.tensor(cos, dtype=torch.float64)
    return {"split_half": float(t.mean()), "split_half_se": float(t.std() / math.sqrt(len(cos)))}


def cosine_stats(vectors: list) -> dict:
    """Mean pairwise cosine, its null std, and ||mean|| / mean ||.|| of K vectors (zero vectors skipped)."""
    import torch

    vs = [v for v in vectors if float(v.norm()) > 0]
    k = len(vs)
    if k < 2:
        return {"cosine": float("nan"), "cosine_sd": float("nan"), "norm": float("nan"), "coherence": float("nan"), "k": k}
    m = torch.stack([v / v.norm() for v in vs]).double()
    gram = m @ m.T
    iu = torch.triu_indices(k, k, 1)
    pairs = gram[iu[0], iu[1]]
    norms = torch.stack([v.norm() for v in vs]).double()
    mean_vec = torch.stack(vs).double().mean(0)
    return {"cosine": float(pairs.mean()), "cosine_sd": float(pairs.std() / math.sqrt(len(pairs))),
            "norm": float(norms.mean()), "coherence": float(mean_vec.norm() / norms.mean()), "k": k}


def summarise(real: list[dict], control: list[dict], steps: list[int]) -> list[dict]:
    """One row per part (each step, early, total without the last step, total): real and control
    statistics. `real` and `control`: per iteration, {step: (half A, half B)}."""
    last = max(steps)
    parts = [(f"step {s}", [s]) for s in steps]
    early = [s for s in steps if s in EARLY]
    if early and len(early) < len(steps):
        parts.append(("early (0-2)", early))
    if len(steps) > 1:
        parts.append(("all but last", [s for s in steps if s != last]))
    parts.append(("total", steps))

    def halves(it, members):
        return sum(it[s][0] for s in members), sum(it[s][1] for s in members)

    def whole(it, members):
        a, b = halves(it, members)
        return a + b

    sq_steps = sum(sum(float(whole(it, [s]).norm() ** 2) for s in steps) for it in real) or 1.0
    rows = []
    for name, members in parts:
        r = cosine_stats([whole(it, members) for it in real])
        c = cosine_stats([whole(it, members) for it in control])
        rs = split_half_stats([halves(it, members) for it in real])
        cs = split_half_stats([halves(it, members) for it in control])
        share = sum(float(whole(it, [s]).norm() ** 2) for it in real for s in members) / sq_steps
        sd = math.sqrt(r["cosine_sd"] ** 2 + c["cosine_sd"] ** 2)
        sd_half = math.sqrt(rs["split_half_se"] ** 2 + cs["split_half_se"] ** 2)
        rows.append({"part": name, "steps": members, "cosine": r["cosine"], "control": c["cosine"], "sd": sd,
                     "z": (r["cosine"] - c["cosine"]) / sd if sd > 0 else float("nan"),
                     "clears": bool(r["cosine"] - c["cosine"] > 3 * sd), "norm_share": share,
                     "coherence": r["coherence"], "coherence_control": c["coherence"], "norm": r["norm"],
                     "split_half": rs["split_half"], "split_half_control": cs["split_half"], "split_half_sd": sd_half,
                     "split_half_z": (rs["split_half"] - cs["split_half"]) / sd_half if sd_half > 0 else float("nan")})
    return rows


def table(rows: list[dict], k: int) -> str:
    lines = [f"| part | cosine between iterations | control | null SD | z | clears 3 SD | split-half cosine | control | z | "
             f"share of squared norm | coherence (noise {1 / math.sqrt(k):.3f}) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['part']} | {r['cosine']:+.4f} | {r['control']:+.4f} | {r['sd']:.4f} | {r['z']:+.1f} | "
                     f"{'yes' if r['clears'] else 'no'} | {r['split_half']:+.4f} | {r['split_half_control']:+.4f} | "
                     f"{r['split_half_z']:+.1f} | {r['norm_share']:.3f} | {r['coherence']:.3f} ({r['coherence_control']:.3f}) |")
    return "\n".join(lines)


def measure(config: str, overrides: list[str], iterations: int, seed: int, run_dir: str, progress: bool = True) -> dict:
    import torch
    from tqdm.auto import tqdm

    from flowrl.config import load_config
    from flowrl.train.experience import TRANSITIONS
    from flowrl.train.loop import Trainer

    # no KL unless asked: at the base weights the adapter is zero, so the KL's gradient is exactly 0
    cfg = load_config(config, ["run.cpu_processes=1", "model.compile=none", "run.tracker=none", "run.sample_every=0",
                               "run.checkpoint_every=0", "trainer.budget_minutes=0", "trainer.kl_beta=0", f"trainer.seed={seed}",
                               *overrides])
    trainer = Trainer(cfg, run_dir=run_dir)
    if trainer.objective.needs != TRANSITIONS:
        raise SystemExit(f"gradient_signal: objective.kind {cfg.objective.kind} trains on clean samples, not transitions with "
                         "log-probs; this diagnostic measures policy-gradient objectives")
    objective, params = trainer.objective, list(trainer.params.values())
    gen = torch.Generator().manual_seed(seed + 7919)
    real, control, rewards = [], [], []
    for i in tqdm(range(iterations), desc="gradient signal", disable=not progress, unit="iter"):
        trainer.iteration = i
        trainer.policy.transformer.eval()
        experience, _ = trainer.next_experience()
        trainer.policy.transformer.train()
        r, c = step_gradients(objective, params, experience.transitions, control_advantages(experience, cfg.data.group_size, gen))
        real.append(r)
        control.append(c)
        totals = experience.reward_totals if experience.reward_totals is not None else experience.rewards.sum(1)
        rewards.append(float(totals.float().mean()))
    steps = sorted(set().union(*[set(r) for r in real]))
    zero = torch.zeros(sum(p.numel() for p in params))
    for it in real + control:  # a step absent from an iteration (a moving window) contributes nothing there
        for s in steps:
            it.setdefault(s, (zero, zero))
    rows = summarise(real, control, steps)
    return {"config": config, "overrides": overrides, "iterations": iterations, "seed": seed, "steps": steps,
            "trainable_parameters": int(zero.numel()), "reward_mean": sum(rewards) / len(rewards), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a preset or YAML file (an arena cell)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as flowrl train takes them")
    p.add_argument("--iterations", type=int, default=12, help="fresh iterations K (default 12)")
    p.add_argument("--seed", type=int, default=0, help="trainer.seed: which iterations are drawn")
    p.add_argument("--json", help="write the measurement here as well")
    p.add_argument("--run-dir", help="the trainer's run directory (default: a temporary one)")
    args = p.parse_args(argv)
    if args.iterations < 2:
        p.error("--iterations must be at least 2 (cosines are between iterations)")
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.config, args.overrides, args.iterations, args.seed, args.run_dir or tmp)
    print(f"{args.config} {' '.join(args.overrides)}: K = {args.iterations}, steps {result['steps']}, "
          f"{result['trainable_parameters']:,} trainable weights, mean reward {result['reward_mean']:.3f}")
    print(table(result["rows"], args.iterations))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
