#!/usr/bin/env python3
"""Benchmark BranchGRPO trees against flat GRPO, side by side in one run on the same model.

Four trainers (each its own Trainer, same model, reward, prompts, seed and batch size):

  flat        flat GRPO in the DanceGRPO setting: 16 samples per prompt, 20 steps, the
              dance_grpo SDE (noise 0.3) on every step, every step trained;
  tree        BranchGRPO: one tree per prompt, splits at steps 0, 3, 6, 9 with branching 2
              (16 leaves), SDE everywhere, every edge trained (rollout.tree.between=sde);
  tree+depth  the same tree with depth pruning (--prune-depths, in split depths: default depth 4,
              the segment after the last split): same rollouts, fewer trained edges;
  mix         BranchGRPO-Mix: SDE only inside a progressive window of --mix-window steps and at
              the splits, ODE elsewhere; only SDE edges trained.

Each trainer runs --warmup iterations, then --iterations timed iterations, interleaved round
robin so machine-load drift hits all alike. Printed per method: NFE per leaf (sampling
forwards per final sample), trained edges per iteration, median seconds per iteration (sampling,
reward, training) and the ratio to flat, e.g. `tree 0.41x flat`.

--compile none,blocks: the four trainers once per model.compile mode (eight, all interleaved in
the same rounds), each mode's ratios to its own flat, and each compiled trainer's
`compiled_graphs` per timed iteration (0 when nothing recompiled after warm-up).

--reward-budget SECONDS: then, for each method in turn, a fresh trainer trains for that much
wall time; the reward reached is the mean reward of deterministic (ODE, eval_num_steps) samples
of the training prompts, 2 fixed seeds each, with the EMA weights when EMA is on. The untrained
model's score on the same samples is printed as the baseline.

Usage:
  .venv/bin/python scripts/bench_tree.py --quick                     # a short run: 8 steps, 1 iteration
  .venv/bin/python scripts/bench_tree.py --smoke                     # every code path in seconds, measuring nothing
  .venv/bin/python scripts/bench_tree.py --iterations 3 --reward-budget 600
  .venv/bin/python scripts/bench_tree.py --model builtin:shapes --reward shapes --reward-budget 600
  .venv/bin/python scripts/bench_tree.py --model builtin:shapes --reward shapes --iterations 2 --compile none,blocks
  .venv/bin/python scripts/bench_tree.py --gpu-sampling                # tree vs flat sampling time on a GPU
Trailing key=value arguments override the config of all four trainers (e.g. model.device=cuda).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl.runtime.budget import machine_name

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench_rollout's preset, random_pipeline


def method_overrides(args) -> dict[str, list[str]]:
    splits = ",".join(map(str, args.split_steps))
    tree = ["rollout.kind=tree", f"rollout.tree.split_steps=[{splits}]", "rollout.tree.branching=[2]", "rollout.tree.between=sde",
            "sampling.window.strategy=all"]  # every step SDE and trained (presets may set a window)
    return {
        # every step trained, the last too (as the trees train it), not Flow-GRPO's 9 of 10
        "flat": ["rollout.kind=flat", "sampling.window.strategy=all", "sampling.window.trained_fraction=1.0"],
        "tree": tree,
        "tree+depth": tree + ["rollout.tree.depth_unit=split", f"rollout.tree.prune_depths=[{','.join(map(str, args.prune_depths))}]"],
        "mix": tree[:-2] + ["rollout.tree.between=window", "sampling.window.strategy=progressive",
                            f"sampling.window.size={args.mix_window}", "sampling.window.start=0",
                            f"sampling.window.shift_every={args.mix_shift_every}"],
    }


def common_overrides(args) -> list[str]:
    leaves = 2 ** len(args.split_steps)
    return [
        f"model.path={args.model}", f"reward.weights={{{args.reward}: 1.0}}", f"sampling.num_steps={args.steps}",
        "objective.kind=grpo",  # trees train edges by the PPO surrogate (the default preset trains NFT)
        "sampling.sampler=dance_grpo", f"sampling.noise_level={args.noise}", f"data.group_size={leaves}",
        f"data.prompts_per_iteration={args.prompts_per_iteration}", "run.tracker=none", "run.progress=false",
        "run.sample_every=0", "run.checkpoint_every=0", f"trainer.seed={args.seed}", *args.overrides,
    ]


def build(args, name: str, extra: list[str], root: Path, tag: str):
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer

    cfg = load_config(args.config, common_overrides(args) + extra)
    return Trainer(cfg, run_dir=root / f"{tag}-{name.replace('+', '-')}")


@torch.no_grad()
def eval_reward(trainer, seeds_per_prompt: int = 2, max_prompts: int = 0) -> float:
    """Mean weighted reward of ODE samples of the training prompts (the first `max_prompts` when
    > 0; fixed seeds, EMA weights if on), by flowrl's evaluation (`flowrl eval`'s samples and scores)."""
    from flowrl.train.evaluate import evaluate

    prompts = [p for p in trainer.prompts[: max_prompts or None] for _ in range(seeds_per_prompt)]
    ctx = trainer.ema.swapped_in(trainer.params) if trainer.ema is not None else contextlib.nullcontext()
    with ctx:  # seeds 90000 + index: never used by training (sample_seed is much larger)
        return evaluate(trainer.cfg, trainer.policy, trainer.reward_fn, prompts, seed=90_000).means()["weighted sum"]


def trained_edges(row: dict) -> int:
    if "trees" in row:
        return int(row["trained_transitions"])
    return int(row["samples"] * row["trained_steps"])  # flat: every trained step of every sample


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench_tree-") as tmp:  # run directories are scratch
        return run_in(args, Path(tmp))


def compile_modes(args) -> list[str | None]:
    """--compile's model.compile modes; [None]: the preset's own."""
    return args.compile.split(",") if args.compile else [None]


def timed_trainers(args, methods: dict[str, list[str]], root: Path) -> dict[tuple[str, str | None], object]:
    """One trainer per (method, compile mode), in that order."""
    return {(name, mode): build(args, name, extra + ([f"model.compile={mode}"] if mode else []), root, f"time-{mode or 'preset'}")
            for mode in compile_modes(args) for name, extra in methods.items()}


def label(key: tuple[str, str | None]) -> str:
    name, mode = key
    return name if mode is None else f"{name} [{mode}]"


def run_in(args, root: Path) -> int:
    methods = method_overrides(args)
    trainers = timed_trainers(args, methods, root)
    first = next(iter(trainers.values()))
    n_params = sum(p.numel() for p in first.policy.transformer.parameters())
    cfg = first.cfg
    print(f"bench_tree: {args.model} ({type(first.policy.transformer).__name__}, {n_params / 1e6:.2f}M params), "
          f"reward {args.reward}, device {first.policy.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{machine_name()}")
    print(f"workload: {cfg.data.prompts_per_iteration} prompt(s) x {cfg.data.group_size} samples per iteration, "
          f"{cfg.sampling.num_steps} steps, dance_grpo SDE noise {cfg.sampling.noise_level}, batch {cfg.sampling.batch_size}; "
          f"tree splits at {args.split_steps} (branching 2); depth pruning {args.prune_depths}; mix window {args.mix_window} "
          f"steps; model.compile {', '.join(sorted({t.cfg.model.compile for t in trainers.values()}))}; "
          f"{args.warmup} warm-up + {args.iterations} timed iterations each, interleaved")
    for _ in range(args.warmup):
        for t in trainers.values():
            t.train_iteration()
    times: dict[tuple, list[float]] = {key: [] for key in trainers}
    graphs: dict[tuple, list[int]] = {key: [] for key in trainers}
    rows: dict[tuple, dict] = {}
    for _ in range(args.iterations):
        for key, t in trainers.items():
            t0 = time.perf_counter()
            rows[key] = t.train_iteration()
            times[key].append(time.perf_counter() - t0)
            graphs[key].append(rows[key].get("compiled_graphs", 0))
    med = {key: statistics.median(v) for key, v in times.items()}
    width = max(len(label(key)) for key in trainers)
    print(f"{'method':<{width}} {'NFE/leaf':>8} {'trained edges':>13} {'s/iter':>9}  {'sampling':>8} {'reward':>7} {'training':>8}"
          f"  compiled_graphs, seconds per timed iteration")
    for key, row in rows.items():
        nfe = row.get("nfe_per_leaf", float(cfg.sampling.num_steps))
        compiled = graphs[key] if "compiled_graphs" in row else "-"
        print(f"{label(key):<{width}} {nfe:8.2f} {trained_edges(row):13d} {med[key]:9.3f}  {row['time_sampling']:8.3f} "
              f"{row['time_reward']:7.3f} {row['time_training']:8.3f}  {compiled}, {' '.join(f'{t:.2f}' for t in times[key])}")
    for key in trainers:
        print(f"{label(key)} {med[key] / med[('flat', key[1])]:.2f}x flat")
    modes = compile_modes(args)
    for mode in modes[1:]:  # what compiling saves each method, measured in the same rounds
        for name in methods:
            print(f"{name} [{mode}] {med[(name, mode)] / med[(name, modes[0])]:.2f}x {name} [{modes[0]}]")
    del trainers, first

    if args.reward_budget:
        print(f"reward after {args.reward_budget:g} s of training per method (ODE eval, eval_num_steps "
              f"{cfg.sampling.eval_num_steps}, 2 seeds per training prompt"
              f"{f' of the first {args.eval_prompts}' if args.eval_prompts else ''}; methods run one after another):")
        base = None
        mode = compile_modes(args)[-1]  # the last of --compile
        for name, extra in methods.items():
            t = build(args, name, extra + ([f"model.compile={mode}"] if mode else []), root, "budget")
            if base is None:
                base = eval_reward(t, max_prompts=args.eval_prompts)
                print(f"untrained: eval reward {base:.4f}")
            start, iters = time.perf_counter(), 0
            while time.perf_counter() - start < args.reward_budget:
                t.train_iteration()
                iters += 1
            spent = time.perf_counter() - start
            print(f"{name}: {iters} iterations in {spent:.1f} s, eval reward {eval_reward(t, max_prompts=args.eval_prompts):.4f} (untrained {base:.4f})")
            del t
    return 0


def gpu_sampling(args) -> int:
    """Sampling time of one BranchGRPO tree against one flat group of the same number of leaves, each
    drawn by its registered rollout's `sample` (sampling and scoring, as training runs it) in a Trainer
    of the SD3.5-Medium Flow-GRPO preset (bf16, CFG, its LoRA) over a pipeline whose transformer has
    the SD3.5-Medium config and random weights: what the tree's shared prefixes save on a GPU, where a
    level of few nodes does not fill a batch. With --smoke: a two-block random pipeline on the CPU in
    fp32 (the code path)."""
    from bench_rollout import GPU_PRESET
    from random_pipeline import build_pipeline

    if not args.smoke and not torch.cuda.is_available():
        print("--gpu-sampling needs a CUDA GPU; skipped")
        return 0
    import diffusers

    from flowrl.core.tree import tree_nfe

    diffusers.utils.logging.set_verbosity_error()  # the "cast with to()" notice of a random pipeline
    cuda = not args.smoke
    leaves = 2 ** len(args.split_steps)
    gpu = [f"model.device={'cuda' if cuda else 'cpu'}", f"model.height={args.gpu_resolution}", f"model.width={args.gpu_resolution}",
           f"sampling.batch_size={args.gpu_batch}", "data.prompt_file=null", "data.prompts=[a red fox in the snow]",
           "trainer.gradient_accumulation_steps=1", "monitor.enabled=false", "advantage.std=group",  # trees normalise per group
           *(["model.dtype=fp32", "trainer.mixed_precision=no"] if args.smoke else [])]  # the CPU computes bf16 slowly
    with tempfile.TemporaryDirectory(prefix="bench_tree-gpu-") as tmp:
        root = Path(tmp)
        # two blocks at least: the last SD3 block has no context output, so one block lacks the preset's LoRA targets
        model_dir = args.gpu_model or build_pipeline(root / "sd35", tiny=args.smoke, tiny_layers=2)
        sized = argparse.Namespace(**{**vars(args), "model": str(model_dir), "config": GPU_PRESET, "reward": "brightness",
                                      "prompts_per_iteration": 1, "overrides": gpu + args.overrides})
        methods = method_overrides(sized)
        trainers = {name: build(sized, name, methods[name], root, "gpu") for name in ("flat", "tree")}

        def timed(rollout) -> float:
            rollout.sample(0)  # warm-up
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rollout.sample(1)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        seconds = {name: timed(t.rollout) for name, t in trainers.items()}
        cfg = trainers["tree"].cfg
        for t in trainers.values():
            t.finish()
    splits = cfg.rollout.tree.splits()
    where = f"{torch.cuda.get_device_name()}, SD3.5-Medium-sized" if cuda else "cpu, two-block (--smoke)"
    print(f"gpu: {where} transformer (random, {cfg.model.dtype}, CFG {cfg.model.guidance_scale:g}, LoRA r{cfg.lora.rank}; "
          f"{GPU_PRESET}'s Trainer, the registered flat and tree rollouts), {args.gpu_resolution}x{args.gpu_resolution}, "
          f"{args.steps} steps, batch {args.gpu_batch}, {leaves} leaves per prompt")
    print(f"  flat  {leaves * args.steps} NFE  {seconds['flat']:.2f} s")
    print(f"  tree  {tree_nfe(args.steps, splits, 1)} NFE  {seconds['tree']:.2f} s  (splits at {sorted(splits)})")
    print(f"tree sampling {seconds['tree'] / seconds['flat']:.2f}x flat")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value config overrides applied to all four trainers")
    p.add_argument("--model", default="builtin:tiny-sd3", help="model.path: builtin:NAME, a pipeline directory or a hub id")
    p.add_argument("--reward", default="jpeg_compressibility", help="reward name (weight 1.0), e.g. shapes with builtin:shapes")
    p.add_argument("--config", default=None, help="base preset or YAML (default: tiny_jpeg for builtin:tiny-sd3, else the default preset)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--split-steps", type=int, nargs="+", default=[0, 3, 6, 9])
    p.add_argument("--prune-depths", type=int, nargs="+", default=[4])
    p.add_argument("--mix-window", type=int, default=4)
    p.add_argument("--mix-shift-every", type=int, default=25)
    p.add_argument("--noise", type=float, default=0.3, help="dance_grpo eta")
    p.add_argument("--prompts-per-iteration", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iterations", type=int, default=3, help="timed iterations per method")
    p.add_argument("--reward-budget", type=float, default=0.0, metavar="SECONDS", help="train each method this long, then score")
    p.add_argument("--eval-prompts", type=int, default=64, help="score the first N training prompts (0: all of them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", default=None, metavar="MODES", help="model.compile modes measured side by side, e.g. none,blocks "
                   "(default: the preset's); --reward-budget trains under the last")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 steps, splits 0-3, 1 timed iteration")
    p.add_argument("--gpu-sampling", action="store_true", help="time tree against flat sampling on an SD3.5-Medium-sized "
                   "random transformer on CUDA instead (sampling only)")
    p.add_argument("--gpu-model", default=None, metavar="DIR", help="--gpu-sampling's pipeline directory (default: a random "
                   "SD3.5-Medium-sized one built in a temporary directory)")
    p.add_argument("--gpu-resolution", type=int, default=512)
    p.add_argument("--gpu-batch", type=int, default=16, help="sampling batch (nodes per forward) on the GPU")
    p.add_argument("--smoke", action="store_true", help="every code path in seconds, measuring nothing: 4 steps, splits 0-1 "
                   "(4 leaves), one timed iteration, one training iteration and a one-prompt eval per method for --reward-budget, "
                   "then --gpu-sampling's code on a two-block random pipeline on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.split_steps, args.prune_depths, args.mix_window, args.warmup, args.iterations = 4, [0, 1], [2], 2, 0, 1
        args.reward_budget, args.eval_prompts, args.gpu_resolution, args.gpu_batch = 1e-3, 1, 64, 4
    if args.gpu_sampling and not args.smoke:
        return gpu_sampling(args)
    if args.quick:
        args.steps, args.split_steps, args.mix_window, args.warmup, args.iterations = 8, [0, 1, 2, 3], 2, 1, 1
    if args.config is None and args.model == "builtin:tiny-sd3":
        args.config = "tiny_jpeg"
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flowrl.errors import UserError

    try:
        code = run(args)
    except UserError as exc:
        print(f"bench_tree: error: {exc}", file=sys.stderr)
        return 2
    return gpu_sampling(args) if args.smoke else code


if __name__ == "__main__":
    sys.exit(main())
