"""`flowrl train|eval|sample` for a text config (`task: text`) or a text run (docs/text.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from flowrl.errors import UserError
from flowrl.runtime.run_dir import CONFIG_FILE, default_run_dir
from flowrl.text.config import TextConfig, is_text_config, load_text_config


def is_text_run(run: str | Path | None) -> bool:
    return run is not None and is_text_config(Path(run) / CONFIG_FILE)


def resolve(config: str | None, overrides: list[str], resume: str | None, run_dir: str | None) -> tuple[TextConfig, Path]:
    """The config and run directory of `flowrl train` (fixed before any process starts, so all name the same)."""
    if resume:
        return load_text_config(Path(resume) / CONFIG_FILE, overrides), Path(resume)
    cfg = load_text_config(config, overrides)
    return cfg, Path(run_dir) if run_dir else default_run_dir(cfg, "text-")


def train(cfg: TextConfig, run_dir: Path, resume: bool) -> int:
    from flowrl.text.train import TextTrainer

    trainer = TextTrainer(cfg, run_dir=run_dir, resume=resume)
    main = trainer.accelerator.is_main_process
    if main:
        print(f"run directory: {trainer.run.path}", file=sys.stderr)
    history = trainer.train()
    if history and main:
        print(trainer.closing_line())
        if cfg.data.eval_split:
            print(held_out_line(trainer.policy, cfg))
    return 0


def eval_parts(cfg: TextConfig):
    """The held-out prompts (data.eval_split) and the reward that scores them."""
    from flowrl.text.data import load_prompt_set
    from rewards.text import TextReward

    return (load_prompt_set(cfg, cfg.data.eval_split),
            TextReward(dict(cfg.reward.weights), dict(cfg.reward.options), cfg.reward.on_invalid))


def held_out_line(policy, cfg: TextConfig) -> str:
    """The trained weights' greedy score on the held-out split, each reward channel's mean; a
    split that cannot be loaded is named, not fatal (the run itself is finished and saved)."""
    from flowrl.text.train import evaluate_text

    try:
        data, reward = eval_parts(cfg)
    except UserError as e:
        return f"held-out: not scored ({e})"
    result = evaluate_text(policy, data, cfg, reward)
    scores = ", ".join(f"{name} {result['all'][name]:.4f}" for name in reward.names)
    return f"held-out {cfg.data.eval_split} ({len(data)} prompts, greedy): {scores}"


def policy_for(run: str | None, config: str | None, overrides: list[str], checkpoint: int | str | None = None):
    """The trained policy of a run's checkpoint (latest by default), or a config's base model."""
    from flowrl.text.policy import load_text_policy
    from flowrl.runtime.checkpoint import find_checkpoint

    if run is None:
        cfg = load_text_config(config, overrides)
        return cfg, load_text_policy(cfg, trainable=False), f"base model {cfg.model.path}"
    cfg = load_text_config(Path(run) / CONFIG_FILE, overrides)
    ckpt = find_checkpoint(Path(run) / "checkpoints", checkpoint, run)
    policy = load_text_policy(cfg, trainable=False)
    policy.load_trained(ckpt / ("adapter" if cfg.lora.enabled else "model"))
    return cfg, policy, f"{run} ({ckpt.name})"


def format_eval(result: dict, what: str, names: list[str]) -> str:
    keys = [k for k in result if k != "count"]
    lines = [f"eval of {what}: greedy completions", f"{'bucket':<8} {'prompts':>7}  " + "  ".join(f"{n:>12}" for n in names)]
    for k in keys:
        lines.append(f"{k:<8} {result['count'][k]:>7}  " + "  ".join(f"{result[k][n]:>12.4f}" for n in names))
    return "\n".join(lines)


def evaluate(run: str | None, config: str | None, overrides: list[str], checkpoint: int | None, base: bool = False) -> int:
    """Greedy accuracy per bucket of a run's checkpoint or a config's base model; for a run with
    `base`, beside the base model's (loaded as the run's config names it) and the change."""
    from flowrl.text.policy import load_text_policy
    from flowrl.text.train import evaluate_text

    cfg, policy, what = policy_for(run, config, overrides, checkpoint)
    data, reward = eval_parts(cfg)
    result = evaluate_text(policy, data, cfg, reward)
    title = f"{what} on {cfg.data.source} ({cfg.data.eval_split})"
    if run is None or not base:
        print(format_eval(result, title, reward.names))
        return 0
    base_result = evaluate_text(load_text_policy(cfg, trainable=False), data, cfg, reward)
    print(format_eval_comparison(base_result, result, title, reward.names))
    return 0


def format_eval_comparison(base: dict, run: dict, what: str, names: list[str]) -> str:
    """Per bucket and reward: the base model's score, the run's and the change."""
    keys = [k for k in run if k != "count"]
    head = f"{'bucket':<8} {'prompts':>7}" + "".join(f"  {n + ' base':>16} {'run':>8} {'change':>8}" for n in names)
    lines = [f"eval of {what}: greedy completions, beside the base model", head]
    for k in keys:
        lines.append(f"{k:<8} {run['count'][k]:>7}" + "".join(f"  {base[k][n]:>16.4f} {run[k][n]:>8.4f} {run[k][n] - base[k][n]:>+8.4f}"
                                                            for n in names))
    return "\n".join(lines)


def sample(run: str | None, config: str | None, overrides: list[str], prompts: list[str], n: int, seed: int,
           checkpoint: int | None) -> int:
    cfg, policy, what = policy_for(run, config, overrides, checkpoint)
    expanded = [p for p in prompts for _ in range(n)]
    gen = policy.generate(expanded, [seed + j % n for j in range(len(expanded))], cfg.generation)
    print(f"completions from {what} (temperature {cfg.generation.temperature:g}):")
    for p, text, cut in zip(expanded, gen.texts, gen.truncated.tolist()):
        print(f"{p!r} -> {text!r}{' (truncated)' if cut else ''}")
    return 0



