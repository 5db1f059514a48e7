"""Evaluation: ODE samples of a policy on a prompt set, scored by the configured rewards, with the
rewards' breakdown by kind of prompt (GenEval's categories when the shapes reward is among them)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from flowrl.train.images import ode_images


class EvalResult(NamedTuple):
    prompts: list[str]
    scores: torch.Tensor  # [N, K]
    channel_names: list[str]
    channel_weights: torch.Tensor  # [K]
    judge: torch.Tensor | None = None  # [N] the auxiliary judge's scores on the same images (reward.judge)
    judge_range: tuple[float, float] = (0.0, 1.0)
    breakdown: dict[str, dict[str, float]] | None = None  # the reward's breakdown by kind of prompt (MultiReward.breakdown)
    artefacts: dict[str, float] | None = None  # the shapes world's artefact measures (`artefact_means`), lower is cleaner

    def means(self) -> dict[str, float]:
        out = {name: self.scores[:, k].mean().item() for k, name in enumerate(self.channel_names)}
        out["weighted sum"] = (self.scores @ self.channel_weights).mean().item()
        if self.judge is not None:
            out["judge"] = self.judge.mean().item()
            for k, name in enumerate(self.channel_names):
                out[f"corrected {name}"] = corrected_score(self.scores[:, k], self.judge, self.judge_range).mean().item()
        out.update(self.artefacts or {})
        return out

    def category_table(self) -> dict[str, dict[str, float]] | None:
        """Per-category strict/partial means when a shapes reward was scored (its breakdown), else None."""
        return self.breakdown


def corrected_score(reward: torch.Tensor, judge: torch.Tensor, judge_range=(0.0, 1.0)) -> torch.Tensor:
    """GDRO's corrected score (arXiv 2601.02036): r * (u - 3) + 0.2, with u the judge's score
    mapped linearly from judge_range onto the 1-5 scale of its judge (docs/algorithms.md section
    10). A reward gained with samples the judge scores low (below 3) counts against the model."""
    low, high = judge_range
    u = 1 + 4 * (judge.float() - low) / (high - low)
    return reward.float() * (u - 3) + 0.2


def evaluate(cfg, policy, reward, prompts: list[str], seed: int = 0, num_steps: int | None = None,
             progress: bool = False, judge=None, desc: str = "eval sampling") -> EvalResult:
    """Score one ODE sample per prompt (seed + index) with `reward` (a MultiReward), and with
    `judge` (a one-channel MultiReward) for the corrected score."""
    seeds = [seed + j for j in range(len(prompts))]
    s = cfg.sampling
    images = ode_images(policy, prompts, seeds, policy.sigmas(num_steps or s.eval_num_steps, s.schedule, s.shift), s.batch_size,
                        progress=progress, desc=desc)
    return score_images(cfg, reward, images, prompts, judge, patch=getattr(policy, "pixel_patch", None))


def score_images(cfg, reward, images: torch.Tensor, prompts: list[str], judge=None, patch: int | None = None) -> EvalResult:
    """Score images [N, 3, H, W] of `prompts` with `reward`, and with `judge` when given; the artefact
    measures of shapes-world prompts (`artefact_means`, patch energy where `patch`, the policy's pixel_patch, is given)."""
    judged = None if judge is None else judge(images, prompts)[:, 0]
    scores = reward(images, prompts)
    return EvalResult(list(prompts), scores, list(reward.channel_names), reward.channel_weights, judged,
                      tuple(cfg.reward.judge_range), reward.breakdown(prompts, scores), artefact_means(images, prompts, patch))


JUDGE_LEGEND = ("judge = the mean of {judge}, which the run did not train on; corrected CHANNEL = GDRO's corrected score, the "
                "channel x (u - 3) + 0.2 with u the judge mapped from reward.judge_range [{low}, {high}] onto 1-5: a score "
                "gained on images the judge rates below 3 counts against the model, so it can exceed 1 or fall while the channel rises")
ARTEFACT_LEGEND = ("artefacts, lower is cleaner: background impurity = mean RGB distance (0-255) of the background pixels "
                   "from white; fill nonuniformity = mean RGB distance of an object's pixels from its mean colour; patch "
                   "energy = share of the luminance spectrum's power on the transformer patch's lattice (white noise: "
                   "(p^2 - 1) / (H W - 1))")


def artefact_means(images: torch.Tensor, prompts: list[str], patch: int | None = None) -> dict[str, float] | None:
    """The shapes world's artefact measures of images whose prompts are all shapes-world prompts (else None),
    each the nanmean over the images where it is defined: background impurity and fill nonuniformity
    (rewards/shapes.py), and patch energy on the lattice of `patch` pixels (flowrl/train/monitor/image_stats.py)
    where it is given. docs/monitor.md, "Artefact measures"."""
    from flowrl.train.monitor.image_stats import artefact_statistics, patch_energy
    from rewards.shapes import prompt_category

    if not prompts or any(prompt_category(p) == "other" for p in prompts):
        return None
    stats = artefact_statistics(images)
    out = {"background impurity": stats.get("background_impurity", float("nan")),
           "fill nonuniformity": stats.get("fill_nonuniformity", float("nan"))}
    if patch:
        out["patch energy"] = patch_energy(images, patch)
    return out


def format_comparison(base: dict[str, float], run: dict[str, float], first: str = "channel") -> str:
    """One row per score: the base model's, the run's and the change, side by side."""
    width = max(len(first), *(len(name) for name in run))
    lines = [f"{first:<{width}}  {'base':>8}  {'run':>8}  {'change':>8}"]
    for name, value in run.items():
        lines.append(f"{name:<{width}}  {base[name]:>8.4f}  {value:>8.4f}  {value - base[name]:>+8.4f}")
    return "\n".join(lines)


def format_category_table(tables: dict[str, dict[str, dict[str, float]]]) -> str:
    """Rows: categories (then overall); one strict and one partial column per evaluated model."""
    names = list(tables)
    first = tables[names[0]]
    cats = [c for c in first if c != "overall"] + ["overall"]
    widths = [max(12, len(n) + 7) for n in names]  # the whole model name, then " strict"
    head = f"{'category':<12} {'n':>5}" + "".join(f" {n + ' strict':>{w}} {'partial':>8}" for n, w in zip(names, widths))
    lines = [head]
    for c in cats:
        row = f"{c:<12} {int(first[c].get('n', 0)):>5}"
        for n, w in zip(names, widths):
            t = tables[n][c]
            row += f" {t['strict']:>{w}.3f} {t.get('partial', float('nan')):>8.3f}"
        lines.append(row)
    return "\n".join(lines)
