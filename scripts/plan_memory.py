"""Per-GPU memory of a flowrl training launch, planned on the meta device (no weights read).

    python scripts/plan_memory.py black-forest-labs/FLUX.1-dev --gpus 8 --nodes 2 --distributed fsdp2 --full \\
        --batch 1 --height 720 --width 720 --gradient-checkpointing
    python scripts/plan_memory.py stabilityai/stable-diffusion-3.5-medium --lora-rank 32 --height 512 --width 512
    python scripts/plan_memory.py Wan-AI/Wan2.1-T2V-1.3B-Diffusers --lora-rank 64 --height 256 --width 256 --frames 5
    python scripts/plan_memory.py black-forest-labs/FLUX.1-dev --full --optimizer adamw8bit --gradient-checkpointing
    python scripts/plan_memory.py black-forest-labs/FLUX.1-dev --lora-rank 32 --quantize nf4 --quantize-text-encoders nf4

MODEL is one of the known ids (their configs ship with flowrl) or a diffusers pipeline directory
or hub id (only its config files are read). docs/distributed.md states the assumptions.
"""

from __future__ import annotations

import argparse
import sys

from flowrl.errors import UserError
from flowrl.models.quantize import QUANTIZE_MODES
from flowrl.runtime.optimizers import OPTIMIZERS
from flowrl.train.memory_plan import KNOWN_MODELS, Launch, format_plan, load_model, plan, plan_json


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=f"{' | '.join(KNOWN_MODELS)} | a pipeline directory or hub id")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per node")
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
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        for flag, value in (("--gpus", a.gpus), ("--nodes", a.nodes), ("--batch", a.batch), ("--lora-rank", a.lora_rank)):
            if value < 1:
                raise UserError(f"{flag} must be at least 1; got {value}")
        launch = Launch(gpus_per_node=a.gpus, nodes=a.nodes, distributed=a.distributed, lora_rank=0 if a.full else a.lora_rank,
                        lora_targets=a.lora_targets, dtype=a.dtype, batch=a.batch, height=a.height, width=a.width, frames=a.frames,
                        gradient_checkpointing=a.gradient_checkpointing, ema=not a.no_ema, kl=not a.no_kl,
                        max_sequence_length=a.max_sequence_length, optimizer=a.optimizer,
                        quantize=a.quantize, quantize_text_encoders=a.quantize_text_encoders)
        model = load_model(a.model)
        rows = plan(model, launch)
    except UserError as exc:
        print(f"plan_memory: {exc}", file=sys.stderr)
        return 2
    print(plan_json(model, launch, rows) if a.json else format_plan(model, launch, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
