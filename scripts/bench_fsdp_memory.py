"""FSDP2 smoke run: full fine-tuning of an SD3.5-Medium-sized transformer on one GPU under
run.distributed=fsdp2, its peak memory against scripts/plan_memory.py's estimate (goal: within 15%).

    python scripts/bench_fsdp_memory.py            # on a CUDA machine (scripts/gpu_checks.sh)
    python scripts/bench_fsdp_memory.py --cpu-smoke  # the same code path with a tiny transformer, no memory reading

The pipeline is built from configs with random weights (nothing is downloaded): the transformer
with the SD3.5-Medium config in bf16, and small text encoders and VAE with the real ones' output
sizes, so the transformer's training state dominates the memory. The run is the flowrl trainer
itself (flowrl.train.loop.Trainer) for a few iterations without checkpoints; the reading is
torch.cuda.max_memory_allocated over them, and the plan is the planner's for the same launch
with the encoders' real parameter count replaced by the built ones'.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from flowrl.train.memory_plan import GIB, KNOWN_MODELS, Launch, format_plan, load_model, plan, plan_peak

SD35 = "stabilityai/stable-diffusion-3.5-medium"


def build_pipeline(path: Path, tiny: bool) -> Path:
    """SD3 pipeline: the SD3.5-Medium transformer config (a 2-block narrow one with --cpu-smoke),
    small CLIP and T5 encoders whose outputs have the real widths (pooled 768 + 1280, T5 4096)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from flowrl.models.tiny import _clip_tokenizer, _t5_tokenizer

    kwargs = dict(KNOWN_MODELS[SD35]["transformer"][1])
    if tiny:
        kwargs.update(num_layers=2, num_attention_heads=2, attention_head_dim=16, caption_projection_dim=32,
                      dual_attention_layers=[0], joint_attention_dim=64, pooled_projection_dim=32)
    t5_dim = kwargs["joint_attention_dim"]
    projections = (768, 1280) if not tiny else (16, 16)
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(**kwargs).to(torch.bfloat16)
    tok, tok3 = _clip_tokenizer(), _t5_tokenizer()

    def clip(projection):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=77, projection_dim=projection, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    t5 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=t5_dim, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                 pad_token_id=tok3.pad_token_id, eos_token_id=tok3.eos_token_id))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                        latent_channels=16, norm_num_groups=4, sample_size=64, scaling_factor=1.5305, shift_factor=0.0609,
                        use_quant_conv=False, use_post_quant_conv=False)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
                                    text_encoder=clip(projections[0]), tokenizer=tok, text_encoder_2=clip(projections[1]),
                                    tokenizer_2=_clip_tokenizer(), text_encoder_3=t5, tokenizer_3=tok3)
    pipe.save_pretrained(str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny transformer on the CPU: the code path, no reading")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="sampling.batch_size (training rows: x2 for CFG)")
    ap.add_argument("--iterations", type=int, default=2)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        print("bench_fsdp_memory needs a CUDA GPU (or --cpu-smoke for the code path); nothing measured")
        return 0
    resolution = 64 if a.cpu_smoke else a.resolution
    from flowrl.config import load_config
    from flowrl.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = build_pipeline(Path(tmp) / "pipe", tiny=a.cpu_smoke)
        print(f"pipeline built in {time.perf_counter() - t0:.1f} s")
        overrides = [
            f"model.path={model_dir}", "model.kind=sd3", "model.dtype=bf16", f"model.height={resolution}",
            f"model.width={resolution}", "model.max_sequence_length=128", "model.gradient_checkpointing=true",
            f"model.device={'cuda' if cuda else 'cpu'}", "lora.enabled=false", "run.distributed=fsdp2",
            "trainer.mixed_precision=bf16", "trainer.kl_beta=0.04", "trainer.ema=true", "trainer.lr=1e-5",
            "sampling.num_steps=4", "sampling.eval_num_steps=4", f"sampling.batch_size={a.batch}",
            "data.prompts_per_iteration=1", f"data.group_size={a.batch}", "model.guidance_scale=4.5",
            "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0",
            "reward.weights={brightness: 1.0}",
        ]
        cfg = load_config("tiny_jpeg", overrides)
        launch = Launch(gpus_per_node=1, distributed="fsdp2", lora_rank=0, dtype="bf16", batch=a.batch, height=resolution,
                        width=resolution, gradient_checkpointing=True, ema=True, kl=True, max_sequence_length=128)
        model = load_model(str(model_dir))
        rows = plan(model, launch)
        print(format_plan(model, launch, rows))
        trainer = Trainer(cfg, run_dir=Path(tmp) / "run")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(a.iterations):  # no checkpoints: only the training iterations' memory
            t0 = time.perf_counter()
            row = trainer.train_iteration()
            print(f"iteration {row['iteration']}: {time.perf_counter() - t0:.2f} s, loss {row['loss']:.4g}, "
                  f"grad norm {row['grad_norm']:.4g}, skipped {row['skipped_steps']}")
        planned = plan_peak(rows)
        if cuda:
            peak = torch.cuda.max_memory_allocated() / GIB
            print(f"peak torch.cuda.max_memory_allocated {peak:.2f} GiB; plan {planned:.2f} GiB; "
                  f"measured / plan {peak / planned:.3f} (goal 0.85-1.15)")
        else:
            print(f"plan {planned:.4f} GiB; no memory reading on the CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
