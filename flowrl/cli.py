"""`flowrl train | sample | eval | offline build | rewards | serve-reward`: parse, build, call. User mistakes print one
sentence on stderr and exit 2, without a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flowrl.errors import UserError

EXIT_USER_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowrl", description="RL alignment of rectified-flow text-to-image models")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run RL training, GRPO or DiffusionNFT (no CONFIG: the default preset)")
    t.add_argument("config", nargs="?", help="a YAML file or a preset name from configs/")
    t.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. trainer.lr=1e-5")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    t.add_argument("--run-dir", metavar="DIR", help="write the run here instead of run.output_dir/run.name")

    s = sub.add_parser("sample", help="sample a PNG grid from a run's latest checkpoint (EMA weights when present)")
    s.add_argument("--run", required=True, metavar="DIR")
    s.add_argument("--prompt", required=True, action="append", help="repeat for several prompts")
    s.add_argument("-n", type=int, default=4, help="images per prompt")
    s.add_argument("--out", help="output PNG (default: RUN/samples/sample.png)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--steps", type=int, help="ODE steps (default: sampling.eval_num_steps)")
    s.add_argument("--checkpoint", type=int, metavar="ITER", help="the checkpoint of this iteration (default: the latest)")

    e = sub.add_parser("eval", help="mean reward per channel on a prompt file")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory (its latest checkpoint)")
    src.add_argument("--config", help="a config or preset: evaluate its base model")
    e.add_argument("--checkpoint", type=int, metavar="ITER", help="with --run: the checkpoint of this iteration (default: the latest)")
    e.add_argument("--prompts", metavar="FILE", help="one prompt per line, or builtin:shapes-heldout "
                   "(the default when the reward is shapes: a GenEval-style per-category table)")
    e.add_argument("-n", type=int, default=1, help="images per prompt")
    e.add_argument("--per-category", type=int, default=150, help="built-in prompt sets: images per category (default 150)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--judge", metavar="REWARD", help="an auxiliary judge reward for GDRO's corrected score next to each channel "
                   "(default: reward.judge); its scores map from reward.judge_range onto 1-5")
    e.add_argument("overrides", nargs="*", help="dot-list overrides of the config (model.guidance_scale=3.0 ...)")

    o = sub.add_parser("offline", help="group stores for offline training (objective.kind gdro, rollout.kind offline)")
    osub = o.add_subparsers(dest="offline_command", required=True)
    b = osub.add_parser("build", help="sample data.group_size images per prompt once, score them, write a group store")
    b.add_argument("config", nargs="?", help="a YAML file or a preset name (its model, sampler, prompts and rewards)")
    b.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. data.group_size=6")
    b.add_argument("-o", "--out", required=True, metavar="DIR", help="the store directory (run again to finish a partial one)")
    b.add_argument("--run", metavar="DIR", help="sample with this run's checkpoint instead of the base model")
    b.add_argument("--checkpoint", type=int, metavar="ITER", help="with --run: the checkpoint of this iteration (default: the latest)")
    b.add_argument("--num-prompts", type=int, metavar="N", help="N prompts drawn from the prompt set (default: all of it)")
    b.add_argument("--shard-groups", type=int, default=32, metavar="G", help="groups per shard file (default 32)")

    sub.add_parser("rewards", help="list the registered rewards")

    r = sub.add_parser("serve-reward", help="serve a registered reward over HTTP for remote clients (reward `remote`)")
    r.add_argument("name", help="a reward listed by `flowrl rewards`")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    r.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    r.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a reward option, as under reward.options.NAME (repeat), e.g. -o device=cuda -o batch_size=16")
    r.add_argument("--verbose", action="store_true", help="log every request")
    return p


def _split_config_and_overrides(config, overrides):
    # `flowrl train trainer.lr=1e-5` (no config, only overrides) is allowed too
    if config is not None and "=" in config:
        return None, [config, *overrides]
    return config, overrides


def cmd_train(args) -> int:
    from flowrl.config import load_config
    from flowrl.train.run_dir import CONFIG_FILE
    from flowrl.train.loop import Trainer

    config, overrides = _split_config_and_overrides(args.config, args.overrides)
    if args.resume:
        run = Path(args.resume)
        if not (run / CONFIG_FILE).is_file():
            raise UserError(f"--resume '{run}' is not a run directory (no {CONFIG_FILE})")
        if config is not None:
            raise UserError("--resume takes its config from the run directory; give only overrides such as trainer.iterations=100")
        cfg = load_config(run / CONFIG_FILE, overrides)
    else:
        cfg = load_config(config, overrides)
    if _launches_cpu_processes(cfg):
        return _relaunch(cfg.run.cpu_processes, args.argv)
    if args.resume:
        trainer = Trainer(cfg, run_dir=run, resume=True)
    else:
        trainer = Trainer(cfg, run_dir=args.run_dir)
    if trainer.accelerator.is_main_process:
        print(f"run directory: {trainer.run.path}", file=sys.stderr)
        if cfg.trainer.mixed_precision == "auto":
            print(f"trainer.mixed_precision auto: {trainer.mixed_precision} on this device", file=sys.stderr)
    history = trainer.train()
    if history and trainer.accelerator.is_main_process:
        if "reward_mean" in history[0]:
            print(f"reward {history[0]['reward_mean']:.4g} -> {history[-1]['reward_mean']:.4g} over {len(history)} iterations; "
                  f"run: {trainer.run.path}")
        else:
            print(f"{len(history)} iterations; run: {trainer.run.path}")
    return 0


LAUNCHED_ENV = "FLOWRL_LAUNCHED"  # set for the processes a relaunch starts, so they never relaunch again


def _launches_cpu_processes(cfg) -> bool:
    """Whether this `flowrl train` should start `run.cpu_processes` copies of itself: a CPU run,
    not itself one of the processes of a launcher."""
    import torch

    from flowrl.models.base import pick_device

    inside = LAUNCHED_ENV in os.environ or "WORLD_SIZE" in os.environ
    return cfg.run.cpu_processes > 1 and not inside and pick_device(cfg.model.device) == torch.device("cpu")


def _relaunch(processes: int, argv: list[str]) -> int:
    """The same command as `processes` processes joined by gloo, in torchrun's environment
    (accelerate reads it): rank 0 writes the run directory, the processes split every
    iteration's rollouts, and the cores are split between them. Started here rather than by a
    launcher so that a user error keeps its one sentence and exit code 2: when one process
    fails, the others are stopped and its exit code is returned."""
    import socket
    import subprocess
    import time

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // processes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, LAUNCHED_ENV: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes), "OMP_NUM_THREADS": str(threads),
           "CUDA_VISIBLE_DEVICES": ""}  # a CPU run
    print(f"flowrl: launching {processes} CPU processes of {threads} thread(s) each (run.cpu_processes)", file=sys.stderr)
    procs = [subprocess.Popen([sys.executable, "-m", "flowrl.cli", *argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(processes)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait()
                return failed[0] if failed else 0
            time.sleep(0.2)
    except KeyboardInterrupt:  # the processes got the same Ctrl-C and stop on their own
        for p in procs:
            p.wait()
        raise


def _load_run_policy(run: Path, overrides=(), iteration: int | None = None):
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.train.checkpoint import checkpoint_iterations, checkpoint_name, latest_checkpoint
    from flowrl.train.run_dir import CONFIG_FILE, RunDir

    if not (run / CONFIG_FILE).is_file():
        raise UserError(f"--run '{run}' is not a run directory (no {CONFIG_FILE})")
    cfg = load_config(run / CONFIG_FILE, list(overrides))
    policy = load_policy(cfg.model)
    root = RunDir(run).checkpoints
    if iteration is None:
        ckpt = latest_checkpoint(root)
        if ckpt is None:
            raise UserError(f"--run '{run}' has no checkpoint yet")
    else:
        ckpt = root / checkpoint_name(iteration)
        if not ckpt.is_dir():
            have = ", ".join(map(str, checkpoint_iterations(root))) or "none"
            raise UserError(f"--checkpoint {iteration}: '{run}' has no checkpoint of that iteration; it has {have}")
    if cfg.lora.enabled:
        policy.add_lora(cfg.lora, seed=cfg.trainer.seed)
        policy.load_lora(ckpt / ("ema_lora" if (ckpt / "ema_lora").is_dir() else "lora"))
    else:
        from safetensors.torch import load_file

        weights = load_file(str(ckpt / "trainable.safetensors"))
        policy.transformer.load_state_dict(weights, strict=False)
    return cfg, policy, ckpt


def _ode_images(cfg, policy, prompts, seeds, steps=None):
    from flowrl.train.evaluate import ode_images

    s = cfg.sampling
    return ode_images(policy, prompts, seeds, policy.sigmas(steps or s.eval_num_steps, s.schedule, s.shift), s.batch_size)


def cmd_sample(args) -> int:
    from flowrl.train.images import save_grid

    if args.n < 1:
        raise UserError(f"-n must be >= 1; got {args.n}")
    run = Path(args.run)
    cfg, policy, ckpt = _load_run_policy(run, iteration=args.checkpoint)
    prompts = [p for p in args.prompt for _ in range(args.n)]
    seeds = [args.seed + j % args.n for j in range(len(prompts))]
    images = _ode_images(cfg, policy, prompts, seeds, args.steps)
    out = Path(args.out) if args.out else run / "samples" / "sample.png"
    save_grid(images, out, columns=args.n)
    print(f"wrote {out} ({len(prompts)} images from {ckpt.name})")
    return 0


def cmd_eval(args) -> int:
    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.train.evaluate import evaluate, format_category_table
    from flowrl.train.prompts import read_prompt_file
    from rewards import MultiReward

    if args.n < 1 or args.per_category < 1:
        raise UserError(f"-n and --per-category must be >= 1; got {args.n} and {args.per_category}")
    source = args.prompts
    prompts = read_prompt_file(source, field="--prompts", per_category=args.per_category) if source else None
    if args.checkpoint is not None and not args.run:
        raise UserError("--checkpoint picks a checkpoint of --run; with --config there is none")
    if args.run:
        cfg, policy, ckpt = _load_run_policy(Path(args.run), args.overrides, args.checkpoint)
        what = f"{args.run} ({ckpt.name})"
    else:
        cfg = load_config(args.config, args.overrides)
        policy, what = load_policy(cfg.model), f"base model {cfg.model.path}"
    reward = MultiReward.from_config(cfg.reward)
    judge_name = args.judge or cfg.reward.judge
    judge = None
    if judge_name:
        if args.judge:
            from flowrl.config import validate

            cfg.reward.judge = args.judge
            validate(cfg, validate_paths=False)  # one sentence for an unknown judge
        judge = MultiReward({judge_name: 1.0}, options={k: v for k, v in cfg.reward.options.items() if k == judge_name})
        if len(judge.channel_names) != 1:
            raise UserError(f"reward.judge '{judge_name}' returns {len(judge.channel_names)} channels; a judge must return one")
    if prompts is None:
        if "shapes" not in reward.channels:
            raise UserError("--prompts is required unless the config's reward is shapes (then builtin:shapes-heldout is the default)")
        source = "builtin:shapes-heldout"
        prompts = read_prompt_file(source, field="--prompts", per_category=args.per_category)
    expanded = [p for p in prompts for _ in range(args.n)]
    result = evaluate(cfg, policy, reward, expanded, seed=args.seed, progress=True, judge=judge)
    print(f"eval of {what} on {len(prompts)} prompts x {args.n} images ({source})")
    means = result.means()
    width = max(len(c) for c in means)
    for name, value in means.items():
        print(f"{name:<{width}}  {value:.4f}")
    table = result.category_table()
    if table is not None:
        print(format_category_table({Path(args.run).name if args.run else "base model": table}))
    return 0


def cmd_offline(args) -> int:
    import torch

    from flowrl.config import load_config
    from flowrl.models import load_policy
    from flowrl.offline.build import build_store
    from flowrl.train.prompts import load_prompts
    from flowrl.train.rollouts.flat import training_spec
    from rewards import MultiReward

    config, overrides = _split_config_and_overrides(args.config, args.overrides)
    if args.run:
        cfg, policy, ckpt = _load_run_policy(Path(args.run), overrides, args.checkpoint)
        model = {"model": cfg.model.path, "checkpoint": str(ckpt)}
    else:
        if args.checkpoint is not None:
            raise UserError("--checkpoint picks a checkpoint of --run; without --run the base model samples")
        cfg = load_config(config, overrides)
        policy, model = load_policy(cfg.model), {"model": cfg.model.path, "checkpoint": None}
    if args.shard_groups < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise UserError(f"--shard-groups and --num-prompts must be >= 1; got {args.shard_groups} and {args.num_prompts}")
    prompts = load_prompts(cfg.data)
    if args.num_prompts is not None:  # a seeded draw, cycling through the set when N exceeds it
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.trainer.seed)).tolist()
        prompts = [prompts[order[j % len(order)]] for j in range(args.num_prompts)]
    s = cfg.sampling
    source = {**model, "sampler": s.sampler, "num_steps": s.num_steps, "schedule": s.schedule, "shift": s.shift,
              "guidance_scale": cfg.model.guidance_scale, "height": cfg.model.height, "width": cfg.model.width}
    store = build_store(policy, MultiReward.from_config(cfg.reward), prompts, args.out, training_spec(cfg, 0, policy),
                        cfg.data.group_size, cfg.trainer.seed, s.batch_size, source, args.shard_groups, progress=cfg.run.progress)
    print(f"wrote {args.out}: {len(store)} groups of {cfg.data.group_size} ({', '.join(store.channel_names)})")
    return 0


def cmd_rewards(args) -> int:
    from rewards import describe_rewards

    for name, desc in describe_rewards():
        print(f"{name:<24} {desc}")
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


def _is_first_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    handler = {"train": cmd_train, "sample": cmd_sample, "eval": cmd_eval, "offline": cmd_offline, "rewards": cmd_rewards,
               "serve-reward": cmd_serve_reward}[args.command]
    try:
        return handler(args)
    except UserError as exc:
        if _is_first_process():  # the processes of one run hit the same mistake: say it once
            print(f"flowrl: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if _is_first_process() and LAUNCHED_ENV not in os.environ:  # a relaunched run: its launcher says it
            print("flowrl: interrupted; the last checkpoint is intact (resume with --resume RUN_DIR)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
