"""Pipelines of real-sized transformers with random weights, saved to a directory, for the GPU
checks (nothing is downloaded; the GPU machine reaches no hub).

    python scripts/random_pipeline.py DIR                    # SD3.5-Medium's transformer config, bf16
    python scripts/random_pipeline.py DIR --model flux1      # FLUX.1-dev's (12B)
    python scripts/random_pipeline.py DIR --tiny             # a narrow transformer of 3 blocks (the checks' --cpu-smoke)

The transformer has the real config (scripts/plan_memory.py's KNOWN_MODELS); the text encoders
are one-layer models whose outputs have the real widths (CLIP pooled 768 and 1280, T5 4096), the
VAE a small one with the real 16 latent channels, so the transformer dominates time and memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flowrl.train.memory_plan import KNOWN_MODELS

MODELS = {"sd35": "stabilityai/stable-diffusion-3.5-medium", "flux1": "black-forest-labs/FLUX.1-dev"}
SD35 = MODELS["sd35"]


def _vae(scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                         latent_channels=16, norm_num_groups=4, sample_size=64, scaling_factor=scaling_factor,
                         shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False)


def _clip(tok, projection: int = 0, hidden: int = 32):
    """A one-layer CLIP text encoder: with a `projection` of that width (SD3's pooled outputs), or
    without one (FLUX's CLIPTextModel, whose pooled output is its hidden state of width `hidden`)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, projection_dim=projection or 512)
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def build_pipeline(path: Path, tiny: bool, tiny_layers: int = 2, model: str = "sd35") -> Path:
    """The pipeline of `model` (MODELS) with its real transformer config (a narrow one of `tiny_layers`
    blocks with `tiny`) and small encoders and VAE of the real output widths, saved to `path`."""
    from transformers import T5Config, T5EncoderModel

    from flowrl.models.tiny import _clip_tokenizer, _t5_tokenizer

    kwargs = dict(KNOWN_MODELS[MODELS[model]]["transformer"][1])
    tok, tok3 = _clip_tokenizer(), _t5_tokenizer()
    torch.manual_seed(0)
    if model == "flux1":
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        if tiny:
            kwargs.update(num_layers=1, num_single_layers=max(tiny_layers - 1, 1), num_attention_heads=2, attention_head_dim=16,
                          joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6])
        transformer = FluxTransformer2DModel(**kwargs).to(torch.bfloat16)
        t5 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=kwargs["joint_attention_dim"], d_kv=8, d_ff=64, num_layers=1,
                                     num_heads=2, pad_token_id=tok3.pad_token_id, eos_token_id=tok3.eos_token_id))
        pipe = FluxPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
                            vae=_vae(0.3611, 0.1159), text_encoder=_clip(tok, hidden=kwargs["pooled_projection_dim"]),
                            tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok3)
        pipe.save_pretrained(str(path))
        return path
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    if tiny:
        kwargs.update(num_layers=tiny_layers, num_attention_heads=2, attention_head_dim=16, caption_projection_dim=32,
                      dual_attention_layers=[0], joint_attention_dim=64, pooled_projection_dim=32)
    projections = (768, 1280) if not tiny else (16, 16)
    transformer = SD3Transformer2DModel(**kwargs).to(torch.bfloat16)
    t5 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=kwargs["joint_attention_dim"], d_kv=8, d_ff=64, num_layers=1,
                                 num_heads=2, pad_token_id=tok3.pad_token_id, eos_token_id=tok3.eos_token_id))
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=_vae(1.5305, 0.0609), text_encoder=_clip(tok, projections[0]), tokenizer=tok,
                                    text_encoder_2=_clip(tok, projections[1]), tokenizer_2=_clip_tokenizer(),
                                    text_encoder_3=t5, tokenizer_3=tok3)
    pipe.save_pretrained(str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--model", choices=list(MODELS), default="sd35")
    ap.add_argument("--tiny", action="store_true", help="a narrow transformer (the checks' --cpu-smoke)")
    ap.add_argument("--tiny-layers", type=int, default=3)
    a = ap.parse_args(argv)
    print(f"random_pipeline: saved {build_pipeline(a.dir, a.tiny, a.tiny_layers, a.model)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
