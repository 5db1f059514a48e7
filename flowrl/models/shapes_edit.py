"""The editing world's model (issue 86): a small FLUX.1 Kontext-architecture editor for shapes-world edits.

It is a real `FluxKontextPipeline` directory: `FluxTransformer2DModel` working in pixel space (no VAE), a small
`CLIPTextModel` (its pooled output) and a small `T5EncoderModel` (its hidden states), both over one word-level
tokenizer of the edit grammar (flowrl/models/shapes.py's `word_tokenizer`). Without a VAE the Kontext pipeline
assumes 16 latent channels, so a 32x32 image is sampled as its 2x2 space-to-depth with a zero fourth channel
(16 channels at 16x16, `fold_pixels`), packed by the pipeline into 8x8 tokens of 64 channels (FLUX's own
in_channels): 64 generated tokens and 64 source tokens per forward. `scripts/pretrain_shapes_edit.py` trains it
from random weights on the editing world's train split; the result ships in `flowrl/assets/shapes-edit-kontext`
and loads through the same adapter as FLUX.1 Kontext (`model.path: builtin:shapes-edit`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.shapes import MAX_TOKENS, word_tokenizer, zero_modulation


def edit_vocabulary() -> list[str]:
    """Every word of the edit grammar's instructions."""
    from rewards.shapes_edit_world import all_edits

    return sorted({w for e in all_edits() for w in e.instruction.split()})


def build_shapes_edit_pipeline(words: list[str], num_layers: int = 2, num_single_layers: int = 4, heads: int = 4,
                               head_dim: int = 32, text_hidden: int = 64, text_layers: int = 2, seed: int = 0,
                               zero_init: bool = True):
    """A randomly initialised pixel-space FluxKontextPipeline for the editing world (not yet saved). Without
    guidance embedding: classifier-free guidance is the pipeline's true CFG on an empty negative prompt.
    `zero_init`: adaLN-Zero (Peebles & Xie 2023): every block starts as the identity and the output at zero."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok = word_tokenizer(words, MAX_TOKENS)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_hidden,
        pooled_projection_dim=text_hidden, guidance_embeds=False,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),  # (source/target, row, column)
    )
    if zero_init:
        zero_modulation(transformer)
    torch.manual_seed(seed + 1)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=text_layers,
        num_attention_heads=2, max_position_embeddings=MAX_TOKENS, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    ))
    torch.manual_seed(seed + 2)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok), d_model=text_hidden, d_kv=text_hidden // 2, d_ff=2 * text_hidden, num_layers=text_layers,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=MAX_TOKENS, dropout_rate=0.0,
        pad_token_id=tok.pad_token_id, decoder_start_token_id=tok.pad_token_id,
    ))
    return FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=None, text_encoder=clip, tokenizer=tok,
        text_encoder_2=t5, tokenizer_2=word_tokenizer(words, MAX_TOKENS), transformer=transformer,
    )


def shapes_edit_model_dir() -> Path:
    """Where the pretrained editing model ships inside the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "shapes-edit-kontext"
