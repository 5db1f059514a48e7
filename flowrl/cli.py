"""`flowrl train | sample | eval | offline build | export | check | config show | rewards | serve-reward`: parse, build, call. User mistakes print one
sentence on stderr and exit 2, without a traceback."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from flowrl.errors import UserError
from flowrl.presets import preset_names
from flowrl.quiet import silence_known_messages
from flowrl.runs import (load_run_policy, no_file_on_the_way, ode_samples, policy_for, split_config_and_overrides,
                         train_images)
from flowrl.runtime.processes import (EXIT_INTERRUPTED, LAUNCHED_ENV, die_with_launcher, interrupted_message, is_first_process,
                                    launches_cpu_processes, relaunch)

EXIT_USER_ERROR = 2
# `flowrl export` loads the run's base unquantised (model.quantize): the adapter is written, or fused, in full precision
FULL_PRECISION = ("model.quantize=none", "model.quantize_text_encoders=none")


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is a user error like any other: one sentence, exit 2."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _int(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high], the range declared with the argument."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {f'in {low}-{high}' if high is not None else f'>= {low}'}; "
                                             f"got '{text}'")
        return value

    return parse


def _checkpoint_arg(text: str) -> int | str:
    """An argparse type for --checkpoint: an iteration (>= 0) or best (the monitor's best by gold reward)."""
    from flowrl.runtime.checkpoint import parse_checkpoint_arg

    try:
        return parse_checkpoint_arg(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an iteration (an integer >= 0) or best; got '{text}'") from None


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flowrl", description="RL alignment of rectified-flow text-to-image models")
    p.add_argument("--version", action="version", version=f"flowrl {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _sample_parser(sub)
    _eval_parser(sub)
    _offline_parser(sub)
    _export_parser(sub)
    _check_parser(sub)
    _config_parser(sub)
    sub.add_parser("rewards", help="list the registered rewards")
    _serve_reward_parser(sub)
    return p


def _train_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl train` and its arguments."""
    t = sub.add_parser("train", help="run RL training: GRPO, DiffusionNFT, DGPO or GDRO (no CONFIG: the default preset, DGPO on the shapes model)",
                       epilog=f"presets (CONFIG): {', '.join(preset_names())}. Overrides may come anywhere on the line.")
    t.add_argument("config", nargs="?", help="a YAML file or a preset name from configs/")
    t.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. trainer.lr=1e-5")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    t.add_argument("--run-dir", metavar="DIR", help="write the run here instead of run.output_dir/run.name")


def _sample_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl sample` and its arguments."""
    s = sub.add_parser("sample", help="sample a PNG grid from a run's latest checkpoint (EMA weights when present) or a base model; "
                       "--search aligns the samples at inference time")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (its latest checkpoint)")
    src.add_argument("--config", help="a config or preset: sample its base model")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", action="append", help="repeat for several prompts")
    which.add_argument("--prompts", metavar="FILE", help="one prompt per line (# comments skipped)")
    s.add_argument("--image", metavar="SRC", help="an editing model's source image: each prompt is an instruction that edits "
                   "it (the grid's rows open with the source)")
    s.add_argument("-n", type=_int(1), default=4, help="images (videos) per prompt")
    s.add_argument("--out", help="output PNG grid (default: sample-<run or config>.png here, numbered rather than overwritten)")
    s.add_argument("--out-dir", metavar="DIR", help="instead of a grid: one PNG per image and samples.jsonl (prompt, seed, "
                   "steps, source, and rewards with --reward); the same command again samples only what is missing")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--steps", type=_int(1), help="ODE steps (default: sampling.eval_num_steps)")
    s.add_argument("--checkpoint", type=_checkpoint_arg, metavar="ITER|best",
                   help="the checkpoint of this iteration, or best (the best by monitor.gold; default: the latest)")
    _search_arguments(s)
    s.add_argument("overrides", nargs="*", help="dot-list overrides of the config (search.lam=20 ...)")


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl eval` and its arguments."""
    e = sub.add_parser("eval", help="mean reward per channel on a prompt file")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (its latest checkpoint)")
    src.add_argument("--config", help="a config or preset: evaluate its base model")
    e.add_argument("--checkpoint", type=_checkpoint_arg, metavar="ITER|best",
                   help="with --run: the checkpoint of this iteration, or best (the best by monitor.gold; default: the latest)")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--prompts", metavar="FILE", help="one prompt per line, or builtin:shapes-heldout "
                       "(the default when the reward is shapes: a GenEval-style per-category table)")
    which.add_argument("--edits", metavar="FILE", help="an editing model's eval set: a .jsonl or .parquet file (or hub dataset) "
                       "of instruction and source rows, as data.edits (with shapes_edit: a table per edit type)")
    e.add_argument("-n", type=_int(1), default=1, help="images (videos) per prompt")
    e.add_argument("--no-base", action="store_true", help="with --run: skip the base model's scores (by default the run's "
                   "are printed beside the base's, the adapter disabled, on the same prompts and seeds, and the change)")
    e.add_argument("--per-category", type=_int(1), default=150, help="built-in prompt sets: images per category (default 150)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--judge", metavar="REWARD", nargs="?", const="", help="an auxiliary judge reward (alone: the config's "
                   "reward.judge): its mean, and GDRO's corrected score next to each channel, its scores mapped from "
                   "reward.judge_range onto 1-5")
    _search_arguments(e)
    e.add_argument("overrides", nargs="*", help="dot-list overrides of the config (model.guidance_scale=3.0 ...)")


def _offline_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl offline build` and its arguments."""
    o = sub.add_parser("offline", help="group stores for offline training (objective.kind gdro, rollout.kind offline)")
    osub = o.add_subparsers(dest="offline_command", required=True)
    b = osub.add_parser("build", help="sample data.group_size images per prompt once, score them, write a group store")
    b.add_argument("config", nargs="?", help="a YAML file or a preset name (its model, sampler, prompts and rewards)")
    b.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. data.group_size=6")
    b.add_argument("-o", "--out", required=True, metavar="DIR", help="the store directory (run again to finish a partial one)")
    b.add_argument("--run", metavar="DIR", help="sample with this run's checkpoint instead of the base model")
    b.add_argument("--checkpoint", type=_checkpoint_arg, metavar="ITER|best",
                   help="with --run: the checkpoint of this iteration, or best (the best by monitor.gold; default: the latest)")
    b.add_argument("--num-prompts", type=_int(1), metavar="N", help="N prompts drawn from the prompt set (default: all of it)")
    b.add_argument("--shard-groups", type=_int(1), default=32, metavar="G", help="groups per shard file (default 32)")


def _export_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl export` and its arguments."""
    x = sub.add_parser("export", help="a run's checkpoint for plain diffusers: its LoRA (load_lora_weights), or with --merge "
                       "a standalone pipeline directory with the weights fused into the transformer")
    x.add_argument("--run", required=True, metavar="DIR", help="a run directory (its latest checkpoint; EMA weights when present)")
    x.add_argument("--checkpoint", type=_checkpoint_arg, metavar="ITER|best",
                   help="the checkpoint of this iteration, or best (the best by monitor.gold; default: the latest)")
    x.add_argument("--merge", action="store_true", help="write the whole pipeline, the LoRA fused in (`<Pipeline>.from_pretrained(DIR)`)")
    x.add_argument("-o", "--out", required=True, metavar="DIR", help="a new or empty directory")


def _check_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl check` and its arguments."""
    c = sub.add_parser("check", help="parity before a run (flowrl/train/check.py): the training sampler's log-probs recomputed in "
                       "training mode (ratio 1), flowrl's ODE against the diffusers pipeline's own call, and a one-step LoRA "
                       "change replayed in plain diffusers; exit 1 when a check fails",
                       epilog=f"presets (CONFIG): {', '.join(preset_names())}. Overrides may come anywhere on the line.")
    c.add_argument("config", nargs="?", help="a YAML file or a preset name (default: the default preset)")
    c.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. model.height=256 sampling.eval_num_steps=8")


def _config_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl config show` and its arguments."""
    c = sub.add_parser("config", help="print a resolved config")
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="the resolved config as YAML, each key with its description (only the KEYs given)",
                           epilog=f"presets (CONFIG): {', '.join(preset_names())}")
    show.add_argument("config", nargs="?", help="a YAML file or a preset name (default: the default preset)")
    show.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. trainer.lr=1e-5, and keys or sections to show, "
                      "e.g. model.quantize")


def _serve_reward_parser(sub: argparse._SubParsersAction) -> None:
    """Add `flowrl serve-reward` and its arguments."""
    r = sub.add_parser("serve-reward", help="serve a registered reward over HTTP for remote clients (reward `remote`)")
    r.add_argument("name", help="a reward listed by `flowrl rewards`")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    r.add_argument("--port", type=_int(0, 65535), default=8000, help="port to listen on (default 8000; 0: any free port)")
    r.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a reward option, as under reward.options.NAME (repeat), e.g. -o device=cuda -o batch_size=16")
    r.add_argument("--verbose", action="store_true", help="log every request")


def _search_arguments(p: argparse.ArgumentParser) -> None:
    from flowrl.search.options import SEARCH_METHOD_NAMES  # torch-free: `flowrl --help` need not load it

    p.add_argument("--search", choices=SEARCH_METHOD_NAMES, help="inference-time search (search.method): best-of-N, SMC "
                   "steering, tree sampling or greedy tree search, on search.num_steps SDE steps (docs/search.md)")
    p.add_argument("--budget", type=_int(1), metavar="NFE", help="with --search: network evaluations per image, one per sample per "
                   "step (search.budget; default four samples' worth)")
    p.add_argument("--reward", metavar="NAME", help="with --search: the searched reward (search.reward; default: reward.weights); "
                   "flowrl sample without --search: each image's score (in its grid caption, or samples.jsonl with --out-dir)")


def _search_overrides(args) -> list[str]:
    """--search, --budget and --reward as config overrides (they win over the positional ones)."""
    if args.search is None:
        scores_samples = hasattr(args, "out_dir")  # `flowrl sample --reward`: each image's scores (eval's --reward is a search's)
        if args.budget is not None or (args.reward is not None and not scores_samples):
            raise UserError("--budget and --reward set up a search; add --search bon|smc|dts|dts_star"
                            + (" (without --search, --reward scores each image)" if hasattr(args, "out_dir") else ""))
        return []
    out = [f"search.method={args.search}"]
    if args.budget is not None:
        out.append(f"search.budget={args.budget}")
    if args.reward is not None:
        out.append(f"search.reward={args.reward}")
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flowrl")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """argparse, but a dot-list override (key=value) is accepted after an option too:
    `flowrl train --run-dir runs/a trainer.lr=1e-4`."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    if len(overrides) < len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "judge", None) and "=" in args.judge:  # a bare --judge, then an override it took for its value
        overrides, args.judge = [args.judge, *overrides], ""
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def cmd_train(args) -> int:
    from importlib import import_module

    from flowrl.config import load_config
    from flowrl.text.cli import is_text_config, is_text_run
    from flowrl.runtime.run_dir import CONFIG_FILE, default_run_dir

    config, overrides = split_config_and_overrides(args.config, args.overrides)
    if args.resume and config is not None:
        raise UserError("--resume takes its config from the run directory; give only overrides such as trainer.iterations=100")
    if is_text_config(config) or is_text_run(args.resume):  # `task: text`: the causal-LM path (docs/text.md)
        from flowrl.text import cli as text

        cfg, run_dir = text.resolve(config, overrides, args.resume, args.run_dir)
        start = lambda: text.train(cfg, run_dir, bool(args.resume))  # noqa: E731
        warm_up = lambda: import_module("flowrl.text.train")  # noqa: E731
    else:
        if args.resume:
            run = Path(args.resume)
            if not (run / CONFIG_FILE).is_file():
                raise UserError(f"--resume '{run}' is not a run directory (no {CONFIG_FILE})")
            cfg = load_config(run / CONFIG_FILE, overrides)
        else:
            cfg = load_config(config, overrides)
        # fixed here, so that the processes of a relaunch and an interrupted run's message name the same directory
        run_dir = run if args.resume else Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
        start = lambda: train_images(cfg, run_dir, bool(args.resume))  # noqa: E731
        warm_up = lambda: _warm_up_images(cfg.model.kind)  # noqa: E731
    no_file_on_the_way(run_dir, "the run directory (--run-dir, run.output_dir)")
    if launches_cpu_processes(cfg):
        argv = args.argv if args.resume or args.run_dir else [*args.argv, "--run-dir", str(run_dir)]
        return relaunch(cfg.run.cpu_processes, argv, run_dir, main, warm_up)
    try:
        return start()
    except KeyboardInterrupt:
        if is_first_process() and LAUNCHED_ENV not in os.environ:  # a relaunched run: its launcher says it
            print(interrupted_message(run_dir), file=sys.stderr)
        return EXIT_INTERRUPTED


def _warm_up_images(kind: str) -> None:
    """What the processes of a relaunch train with, imported once before they fork: the trainer, and the family's
    diffusers pipeline (imported on first use, DiffusersClass: a few seconds of CPU that each process would pay)."""
    from importlib import import_module

    import_module("flowrl.train.loop")
    try:
        import_module("flowrl.models").policy_class(kind).pipeline_class
    except ImportError:  # a package it needs is missing: the processes say so in one sentence where they load it
        pass


def _writable_file(path: Path, flag: str) -> Path:
    """An output file path whose folders can exist, and that is no folder itself."""
    no_file_on_the_way(path.parent, flag)
    if path.is_dir():
        raise UserError(f"{flag} '{path}' is a folder; give a file name such as {path / 'sample.png'}")
    return path


def cmd_sample(args) -> int:
    from flowrl.text.cli import is_text_config, is_text_run
    from flowrl.train.images import save_grid
    from flowrl.train.prompts import read_prompt_file

    prompts_in = args.prompt or read_prompt_file(args.prompts, field="--prompts")
    if args.image is not None:
        from flowrl.models.edit_prompt import EditPrompt

        prompts_in = [EditPrompt(p, args.image) for p in prompts_in]
        EditPrompt.image(prompts_in[0])  # a missing or unreadable image is one sentence before the model loads
    if is_text_run(args.run) or is_text_config(args.config):  # prints completions
        from flowrl.text import cli as text

        if args.out_dir:
            raise UserError("--out-dir writes images; a text run's completions are printed")
        return text.sample(args.run, args.config, list(args.overrides), prompts_in, args.n, args.seed, args.checkpoint)

    search = _search_overrides(args)
    if args.out_dir:
        return _sample_to_dir(args, prompts_in, search)
    out = _writable_file(Path(args.out) if args.out else _unused_file(_default_sample_name(args)), "--out")
    cfg, policy, what, source = policy_for(args.run, args.checkpoint, args.config, list(args.overrides) + search)
    prompts = [p for p in prompts_in for _ in range(args.n)]
    seeds = [args.seed + j % args.n for j in range(len(prompts))]
    columns = args.n if args.n > 1 else math.ceil(math.sqrt(len(prompts)))  # a row per prompt, or one square-ish grid
    if not search:
        images = ode_samples(cfg, policy, prompts, seeds, args.steps)
        captions = prompts
        if args.reward is not None:  # each image labelled with its score
            from rewards import MultiReward

            reward = MultiReward.single(args.reward, cfg.reward)
            captions = [f"{p} ({args.reward}={r:.3f})" for p, r in zip(prompts, (reward(images, prompts) @ reward.channel_weights).tolist())]
        if args.image is not None:  # source | edits: each prompt's row opens with the image it edits
            from flowrl.train.images import with_sources

            (images, captions), columns = with_sources(images, prompts, captions, args.n), args.n + 1
        save_grid(images, out, columns=columns, captions=captions)
        print(f"wrote {out} ({len(prompts)} images from {source})")
        return 0
    if args.steps is not None:
        raise UserError("--steps sets the ODE steps of plain samples; a search takes search.num_steps=N")
    from flowrl.search.policy import search_policy
    from flowrl.search.report import write_search_report

    result, problem = search_policy(cfg, policy, prompts, seeds, progress=True)
    images = problem.images(result.latents[-1])
    save_grid(images, out, columns=columns, captions=[f"{p} (r={r:.3f})" for p, r in zip(prompts, result.rewards[-1].tolist())])
    report = write_search_report(out.with_suffix(".json"), cfg, result, prompts, seeds, what)
    t = report["total"]
    print(f"wrote {out} and {out.with_suffix('.json').name}: {len(prompts)} images from {source} by {cfg.search.method}, "
          f"mean searched reward {report['mean_reward']:.4f}; spent {t['nfe']} network evaluations, {t['decodes']} decodes, "
          f"{t['reward_calls']} reward calls in {result.seconds[-1]:.1f} s")
    return 0


def _default_sample_name(args) -> Path:
    """sample-<run or config>[-search-<method>].png in the current directory."""
    source = Path(args.run).resolve().name if args.run else Path(args.config).stem
    return Path(f"sample-{source}" + (f"-search-{args.search}" if args.search else "") + ".png")


def _unused_file(path: Path) -> Path:
    """`path`, or with -2, -3, ... before its suffix: the first name no file has (never overwrites)."""
    candidate, k = path, 1
    while candidate.exists():
        k += 1
        candidate = path.with_name(f"{path.stem}-{k}{path.suffix}")
    return candidate


def _sample_to_dir(args, prompts: list[str], search: list[str]) -> int:
    """`sample --out-dir`: the ODE samples of every prompt, batch by batch with a progress bar,
    each written as its own PNG with a manifest row (flowrl/train/sample_dir.py)."""
    from tqdm.auto import tqdm

    from flowrl.train.sample_dir import MANIFEST, SampleDir
    from rewards import MultiReward

    if search:
        raise UserError("--out-dir writes plain ODE samples; a search writes its grid and report (--out)")
    if args.out:
        raise UserError("--out writes a grid and --out-dir one file per image; give one of them")
    cfg, policy, what, source = policy_for(args.run, args.checkpoint, args.config, list(args.overrides))
    steps = args.steps or cfg.sampling.eval_num_steps
    jobs = [{"prompt": p, "seed": args.seed + j, "steps": steps, "source": what} for p in prompts for j in range(args.n)]
    no_file_on_the_way(Path(args.out_dir), "--out-dir")
    out = SampleDir(args.out_dir, jobs)
    reward = MultiReward.single(args.reward, cfg.reward) if args.reward else None
    todo, batch = out.todo(), cfg.sampling.batch_size
    for start in tqdm(range(0, len(todo), batch), desc="flowrl sample", unit="batch", disable=not todo):
        indices = todo[start : start + batch]
        chunk = [jobs[i]["prompt"] for i in indices]
        images = ode_samples(cfg, policy, chunk, [jobs[i]["seed"] for i in indices], steps)
        scores = None
        if reward is not None:
            values = reward(images, chunk)
            scores = {name: values[:, k] for k, name in enumerate(reward.channel_names)}
        out.write(indices, images, scores)
    kept = len(jobs) - len(todo)
    print(f"wrote {len(todo)} images to {out.path} ({MANIFEST}), {kept} already there; {len(jobs)} from {source}")
    return 0


SNIPPET = "sample_with_diffusers.py"  # written beside an export: the code that samples it


def cmd_export(args) -> int:
    """`flowrl export`: what plain diffusers loads. Without --merge the adapter alone, in the
    layout `pipe.load_lora_weights(DIR)` reads; with it the run's pipeline (its text encoders,
    VAE and scheduler as the base model has them) with the adapter fused into the transformer's
    weights and removed, so `<Pipeline>.from_pretrained(DIR)` samples what `flowrl sample` does.
    A run over a quantised base (model.quantize) exports from the full-precision base: the adapter
    as trained, or fused into the full-precision weights (not rounded into 4 or 8 bits)."""
    from flowrl.text.cli import is_text_run

    if is_text_run(args.run):
        raise UserError("flowrl export writes diffusers pipelines; a text run's checkpoint is already a transformers model "
                        "(RUN/checkpoints/iter_N/model)")
    out = Path(args.out)
    no_file_on_the_way(out, "--out")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out '{out}' is not empty; give a new or empty directory")
    cfg, policy, ckpt = load_run_policy(Path(args.run), FULL_PRECISION, args.checkpoint)
    weights = "EMA " if (ckpt / "ema_lora").is_dir() or (ckpt / "ema_transformer").is_dir() else ""
    if not args.merge:
        if not policy.has_lora:
            raise UserError(f"--run '{args.run}' trained the whole transformer (lora.enabled false); export it with --merge")
        policy.save_lora(out)
        print(f"wrote {out}: the {weights}LoRA of {ckpt.name} (pipe.load_lora_weights('{out}'))")
        _print_snippet(cfg, policy, out, merged=False)
        return 0
    if policy.lora_sigma_range is not None:
        raise UserError(f"--merge: the run's adapter acts only at sigmas in lora.sigma_range {list(policy.lora_sigma_range)}, "
                        "which a fused transformer cannot; export the LoRA alone (without --merge)")
    if policy.has_lora:
        policy.transformer.fuse_lora()
        policy.transformer.unload_lora()
    policy.pipe.save_pretrained(str(out), safe_serialization=True)
    print(f"wrote {out}: {policy.pipeline_class.__name__} with the {weights}weights of {ckpt.name} fused in")
    _print_snippet(cfg, policy, out, merged=True)
    return 0


def _print_snippet(cfg, policy, out: Path, merged: bool) -> None:
    """Print (and keep beside the export, as sample_with_diffusers.py) the plain-diffusers code that
    draws `flowrl sample`'s first image of the run's first held-out prompt."""
    from flowrl.models.snippet import diffusers_snippet, write_snippet_source
    from flowrl.train.prompts import snippet_prompt

    prompt = snippet_prompt(cfg.data)
    code = diffusers_snippet(policy, cfg, out, prompt, seed=0, merged=merged)
    (out / SNIPPET).write_text(code)
    if policy.edits:
        write_snippet_source(prompt, out)
    note = ""
    if not merged and policy.lora_sigma_range is not None:
        note = (f" (the run's adapter acts only at sigmas in lora.sigma_range {list(policy.lora_sigma_range)}: gate_adapter turns it "
                "on and off between the pipeline's steps)")
    sample = f"--prompt {prompt!r}" if not policy.edits else f"--image {out / 'source.png'} --prompt {prompt.instruction!r}"
    print(f"\nIn plain diffusers, flowrl sample {sample} --seed 0 (also in {out / SNIPPET}){note}:\n\n{code}")


def cmd_check(args) -> int:
    from flowrl.config import load_config
    from flowrl.text.config import is_text_config
    from flowrl.train.check import run_check

    config, overrides = split_config_and_overrides(args.config, args.overrides)
    if is_text_config(config):
        raise UserError("flowrl check compares flowrl's sampler with a diffusers pipeline; give an image config, not a text one")
    return run_check(load_config(config, overrides))


def cmd_eval(args) -> int:
    from flowrl.text.cli import is_text_config, is_text_run

    if is_text_run(args.run) or is_text_config(args.config):  # greedy accuracy per bucket
        from flowrl.text import cli as text

        return text.evaluate(args.run, args.config, list(args.overrides), args.checkpoint, base=not args.no_base)
    from flowrl.train.evaluate import ARTEFACT_LEGEND, JUDGE_LEGEND, format_category_table, format_comparison
    from flowrl.train.prompts import read_prompt_file

    if args.edits:
        from flowrl.train.edit_data import read_edits

        prompts = read_edits(args.edits, field="--edits")
    else:
        prompts = read_prompt_file(args.prompts, field="--prompts", per_category=args.per_category) if args.prompts else None
    result, base, what, source = _evaluate(args, prompts, args.edits or args.prompts, with_base=bool(args.run) and not args.no_base)
    print(f"eval of {what} on {len(result.prompts) // args.n} prompts x {args.n} images ({source})")
    if base is None:
        means = result.means()
        width = max(len(c) for c in means)
        for name, value in means.items():
            print(f"{name:<{width}}  {value:.4f}")
    else:
        print(format_comparison(base.means(), result.means()))
    if result.judge is not None:
        print(JUDGE_LEGEND.format(judge=args.judge, low=result.judge_range[0], high=result.judge_range[1]))
    if result.artefacts:
        print(ARTEFACT_LEGEND)
    table = result.category_table()
    if table is not None:
        run_name = Path(args.run).name if args.run else "base model"
        tables = {"base": base.category_table(), run_name: table} if base is not None else {run_name: table}
        print(format_category_table(tables))
    return 0


def evaluate_policy(args, prompts: list[str] | None, source: str | None):
    """`flowrl eval`'s scores (and flowrl.api.evaluate's): the policy of args.run or args.config on
    `prompts` (None: the shapes reward's held-out set), args.n images each, with the judge and the
    search asked for. Returns the EvalResult, what was evaluated, and where the prompts came from."""
    result, _, what, source = _evaluate(args, prompts, source, with_base=False)
    return result, what, source


def _evaluate(args, prompts: list[str] | None, source: str | None, with_base: bool):
    """evaluate_policy's work; with `with_base`, also the base model's scores on the same prompts and
    seeds (the adapter disabled; None for a search, or a run without an adapter, which says so)."""
    from flowrl.train.evaluate import evaluate
    from flowrl.train.prompts import read_prompt_file
    from rewards import MultiReward

    search = _search_overrides(args)
    cfg, policy, what, _ = policy_for(args.run, args.checkpoint, args.config, list(args.overrides) + search)
    reward = MultiReward.from_config(cfg.reward)
    judge = None
    if args.judge is not None:  # only when asked: its rows come with the one line of legend that says what they are
        from flowrl.config import validate

        if not (args.judge or cfg.reward.judge):
            raise UserError("--judge alone scores with the config's reward.judge, which is unset; give --judge REWARD")
        args.judge = cfg.reward.judge = args.judge or cfg.reward.judge
        validate(cfg, validate_paths=False)  # one sentence for an unknown judge
        judge = MultiReward.single(args.judge, cfg.reward)
        if len(judge.channel_names) != 1:
            raise UserError(f"--judge '{args.judge}' returns {len(judge.channel_names)} channels; a judge must return one")
    if prompts is None:
        if "shapes" not in reward.channels:
            raise UserError("--prompts is required unless the config's reward is shapes (then builtin:shapes-heldout is the default)")
        source = "builtin:shapes-heldout"
        prompts = read_prompt_file(source, field="--prompts", per_category=args.per_category)
    expanded = [p for p in prompts for _ in range(args.n)]
    if search:
        from flowrl.search.policy import search_policy
        from flowrl.train.evaluate import score_images

        found, problem = search_policy(cfg, policy, expanded, [args.seed + j for j in range(len(expanded))], progress=True)
        result = score_images(cfg, reward, problem.images(found.latents[-1]), expanded, judge, patch=getattr(policy, "pixel_patch", None))
        t = found.totals()
        what += (f", {cfg.search.method} search on {cfg.search.reward or 'reward.weights'} (mean {found.rewards[-1].mean():.4f}), "
                 f"{t['nfe'] / len(expanded):.0f} network evaluations, {t['decodes'] / len(expanded):.0f} decodes and "
                 f"{t['reward_calls'] / len(expanded):.0f} reward calls per image")
        return result, None, what, source
    result = evaluate(cfg, policy, reward, expanded, seed=args.seed, progress=True, judge=judge)
    if not with_base:
        return result, None, what, source
    if not policy.has_lora:
        print("the base model is not evaluated beside a full fine-tuning run: score it with flowrl eval --config")
        return result, None, what, source
    with policy.reference():  # the same network with the adapter disabled: the model the run started from
        base = evaluate(cfg, policy, reward, expanded, seed=args.seed, progress=True, judge=judge, desc="eval sampling (base)")
    return result, base, what, source


def cmd_offline(args) -> int:
    import torch

    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.offline.build import build_store
    from flowrl.train.prompts import load_prompts
    from flowrl.train.rollouts.common import training_spec
    from rewards import MultiReward

    config, overrides = split_config_and_overrides(args.config, args.overrides)
    if args.run:
        cfg, policy, ckpt = load_run_policy(Path(args.run), overrides, args.checkpoint)
        model = {"model": cfg.model.path, "checkpoint": str(ckpt)}
    else:
        if args.checkpoint is not None:
            raise UserError("--checkpoint picks a checkpoint of --run; without --run the base model samples")
        cfg = load_config(config, overrides)
        policy, model = load_policy(cfg.model), {"model": cfg.model.path, "checkpoint": None}
    prompts = load_prompts(cfg.data)
    if args.num_prompts is not None:  # a seeded draw, cycling through the set when N exceeds it
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.trainer.seed)).tolist()
        prompts = [prompts[order[j % len(order)]] for j in range(args.num_prompts)]
    s = cfg.sampling
    source = {**model, "sampler": s.sampler, "num_steps": s.num_steps, "schedule": s.schedule, "shift": s.shift,
              "guidance_scale": cfg.model.guidance_scale, "height": cfg.model.height, "width": cfg.model.width,
              **({"edits": cfg.data.edits} if cfg.data.edits else {})}  # an edit store trains with these edits' sources
    store = build_store(policy, MultiReward.from_config(cfg.reward), prompts, args.out, training_spec(cfg, 0, policy),
                        cfg.data.group_size, cfg.trainer.seed, s.batch_size, source, args.shard_groups, progress=cfg.run.progress)
    print(f"wrote {args.out}: {len(store)} groups of {cfg.data.group_size} ({', '.join(store.channel_names)})")
    return 0


def cmd_config(args) -> int:
    from flowrl.config import load_config
    from flowrl.config_help import describe

    config, overrides = split_config_and_overrides(args.config, args.overrides)
    if config is not None and _names_a_key(config):  # `flowrl config show model.quantize`: a key of the default config
        config, overrides = None, [config, *overrides]
    from flowrl.text.config import is_text_config, load_text_config

    if is_text_config(config):
        print(load_text_config(config, overrides).to_yaml(), end="")
        return 0
    keys = [o for o in overrides if "=" not in o]
    overrides = [o for o in overrides if "=" in o]
    print(describe(load_config(config, overrides, validate_paths=False), keys), end="")
    return 0


def _names_a_key(name: str) -> bool:
    """A dotted config key or a section name (model.quantize, model), not a file or a preset."""
    import dataclasses

    from flowrl.schema import Config

    sections = {f.name for f in dataclasses.fields(Config)}
    return name.split(".")[0] in sections and name not in preset_names() and not Path(name).exists()


def cmd_rewards(args) -> int:
    from rewards import describe_rewards

    for name, desc in describe_rewards():
        print(f"{name:<24} {desc}")
    from rewards.text import TEXT_REWARDS

    print("\ntext rewards (task: text), called with the dataset's columns:")
    for name, spec in TEXT_REWARDS.items():
        print(f"{name:<24} {spec.description}")
    return 0


def cmd_serve_reward(args) -> int:
    from omegaconf import OmegaConf

    from rewards.server import RewardServer, build_served_reward

    options = {}
    for item in args.option:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--option '{item}' must have the form KEY=VALUE, for example device=cuda")
        options[key] = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]  # typed as config overrides are
    server = RewardServer(build_served_reward(args.name, options), args.host, args.port, verbose=args.verbose)
    print(f"serving reward '{args.name}' on {server.url} (POST /score, GET /info); stop with Ctrl-C", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    silence_known_messages()
    try:
        args = parse_args(argv)
    except UserError as exc:
        print(f"flowrl: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    args.argv = list(sys.argv[1:] if argv is None else argv)
    handler = {"train": cmd_train, "sample": cmd_sample, "eval": cmd_eval, "export": cmd_export, "check": cmd_check, "offline": cmd_offline, "rewards": cmd_rewards,
               "serve-reward": cmd_serve_reward, "config": cmd_config}[args.command]
    try:
        return handler(args)
    except UserError as exc:
        if is_first_process():  # the processes of one run hit the same mistake: say it once
            print(f"flowrl: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if is_first_process() and LAUNCHED_ENV not in os.environ:
            print("flowrl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
