"""Per-GPU memory of a flowrl training launch, planned on the meta device (no weights read).

    python scripts/plan_memory.py black-forest-labs/FLUX.1-dev --gpus 8 --nodes 2 --distributed fsdp2 --full \\
        --batch 1 --height 720 --width 720 --gradient-checkpointing
    python scripts/plan_memory.py stabilityai/stable-diffusion-3.5-medium --lora-rank 32 --height 512 --width 512
    python scripts/plan_memory.py Wan-AI/Wan2.1-T2V-1.3B-Diffusers --lora-rank 64 --height 256 --width 256 --frames 5
    python scripts/plan_memory.py black-forest-labs/FLUX.1-dev --full --optimizer adamw8bit --gradient-checkpointing
    python scripts/plan_memory.py black-forest-labs/FLUX.1-dev --lora-rank 32 --quantize nf4 --quantize-text-encoders nf4
    python scripts/plan_memory.py flux1_dev_hps_1gpu                 # a preset (or a YAML file): its launch, its rewards
    python scripts/plan_memory.py --fit 12GiB                        # every image preset: the cheapest launch within 12 GiB
    python scripts/plan_memory.py sd35_medium_pickscore_1gpu --fit 6GiB

MODEL is one of the known ids (their configs ship with flowrl) or a diffusers pipeline directory
or hub id (only its config files are read), or a preset name or config file: then the launch is the
config's (its GPU count from a name ending in _Ngpu, else --gpus), the flags above are ignored, and
the reward models it loads onto the GPU are counted. --fit switches memory features on in a fixed
order of cost (flowrl/train/memory_fit.py) and prints the first launch within the budget, with the
config overrides that make it. docs/distributed.md states the assumptions.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from flowrl.errors import UserError
from flowrl.models.base import resolve_model_path
from flowrl.models.quantize import QUANTIZE_MODES
from flowrl.models.text_cache import TEXT_ENCODER_MODES
from flowrl.presets import CONFIG_DIR
from flowrl.runtime.optimizers import OPTIMIZERS
from flowrl.train.memory_fit import fit, format_fit
from flowrl.train.memory_plan import GIB, KNOWN_MODELS, REWARD_NETWORKS, Launch, format_plan, load_model, plan, plan_json


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help=f"{' | '.join(KNOWN_MODELS)} | a pipeline directory or hub id | a preset or "
                    "config file (with --fit and no MODEL: every image preset)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per node (default 1, or a preset's _Ngpu)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--distributed", choices=["ddp", "fsdp2"], default="ddp")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="full fine-tuning (the default is LoRA)")
    mode.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--lora-targets", nargs="+", default=["to_q", "to_k", "to_v", "to_out.0"])
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--batch", type=int, default=1, help="samples per training forward (sampling.batch_size)")
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--frames", type=int, default=1, help="frames per video (model.num_frames; Wan)")
    ap.add_argument("--max-sequence-length", type=int, default=0, help="T5 tokens per prompt; 0: the pipeline's default")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--no-ema", action="store_true")
    ap.add_argument("--no-kl", action="store_true", help="full fine-tuning without a KL term: no reference copy")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="trainer.optimizer")
    ap.add_argument("--quantize", choices=QUANTIZE_MODES, default="none", help="model.quantize: the frozen transformer (LoRA)")
    ap.add_argument("--quantize-text-encoders", choices=QUANTIZE_MODES, default="none", help="model.quantize_text_encoders")
    ap.add_argument("--text-encoders", choices=TEXT_ENCODER_MODES, default="device", help="model.text_encoders (cpu, cached: off the GPU)")
    ap.add_argument("--reward", action="append", default=[], metavar="KIND[:DTYPE]",
                    help=f"a reward model on the GPU ({' | '.join(REWARD_NETWORKS)}; dtype fp32 by default); repeatable")
    ap.add_argument("--fit", metavar="SIZE", help="a per-GPU budget (12GiB, 80GB): print the cheapest launch within it")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap.parse_args(argv)


def budget_gib(size: str) -> float:
    """'12GiB', '12G' or '12' GiB; '80GB' in 10^9 bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|GB|G)?\s*", size or "", re.IGNORECASE)
    if not m:
        raise UserError(f"--fit takes a size such as 12GiB or 80GB; got '{size}'")
    value = float(m.group(1))
    return value * 1e9 / GIB if (m.group(2) or "").upper() == "GB" else value


def image_presets() -> list[str]:
    """The presets of a published image model: not the text ones (`task: text`), nor those of the built-in tiny models."""
    skip = re.compile(r"^task:\s*text|^\s*path:\s*builtin:", re.MULTILINE)
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if not skip.search(p.read_text()))


def is_config(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or (CONFIG_DIR / f"{name}.yaml").is_file()


def config_launch(name: str, gpus: int | None):
    """A preset's or config file's model and launch (its GPU count from a name ending in _Ngpu unless --gpus)."""
    from flowrl.config import load_config

    cfg = load_config(name, validate_paths=False)
    if gpus is None:
        m = re.search(r"_(\d+)gpu$", Path(name).stem)
        gpus = int(m.group(1)) if m else 1
    return load_model(resolve_model_path(cfg.model.path)), Launch.from_config(cfg, gpus_per_node=gpus)


def flag_launch(a: argparse.Namespace) -> Launch:
    gpus = 1 if a.gpus is None else a.gpus
    for flag, value in (("--gpus", gpus), ("--nodes", a.nodes), ("--batch", a.batch), ("--lora-rank", a.lora_rank)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1; got {value}")
    rewards = {}
    for entry in a.reward:
        kind, _, dtype = entry.partition(":")
        rewards[kind] = [kind, dtype or "fp32"]
    return Launch(gpus_per_node=gpus, nodes=a.nodes, distributed=a.distributed, lora_rank=0 if a.full else a.lora_rank,
                  lora_targets=a.lora_targets, dtype=a.dtype, batch=a.batch, height=a.height, width=a.width, frames=a.frames,
                  gradient_checkpointing=a.gradient_checkpointing, ema=not a.no_ema, kl=not a.no_kl,
                  max_sequence_length=a.max_sequence_length, optimizer=a.optimizer, quantize=a.quantize,
                  quantize_text_encoders=a.quantize_text_encoders, text_encoders=a.text_encoders, rewards=rewards)


def report(name: str, a: argparse.Namespace) -> str:
    model, launch = config_launch(name, a.gpus) if is_config(name) else (load_model(name), flag_launch(a))
    if a.fit is None:
        rows = plan(model, launch)
        return plan_json(model, launch, rows) if a.json else format_plan(model, launch, rows)
    budget = budget_gib(a.fit)
    found = fit(model, launch, budget)
    if a.json:
        return plan_json(model, found.launch, found.rows)
    return f"{format_fit(name, found, budget)}\n{format_plan(model, found.launch, found.rows)}"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        if a.model is None and a.fit is None:
            raise UserError("name a MODEL (a model id, pipeline, preset or config file), or give --fit SIZE for every image preset")
        names = [a.model] if a.model is not None else image_presets()
        for i, name in enumerate(names):
            print(("\n" if i else "") + report(name, a), flush=True)
    except UserError as exc:
        print(f"plan_memory: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
