"""Tiny, randomly initialised SD3, FLUX.1 (and Kontext, and the editing world's pixel-space Kontext), FLUX.2 [dev] and [klein], Qwen-Image, Z-Image, SANA and Wan2.1 pipelines built from configs.

They exist so that tests and the built-in default preset exercise the real loading code
(`from_pretrained` of a local pipeline directory) without downloading anything. The
architectures are the real diffusers classes, only with very small widths. Each builder that
`@builtin("tiny-NAME")` marks is also `model.path: builtin:tiny-NAME`.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Callable

import torch

_LETTERS = string.ascii_lowercase + string.digits

# builtin:NAME -> the function that saves that tiny pipeline into a directory (flowrl.models.base.BUILTIN_MODELS)
TINY_BUILDERS: dict[str, Callable[[str | Path], Path]] = {}


def builtin(name: str):
    """Decorator: the builder is the built-in model `builtin:<name>`."""
    def add(build):
        TINY_BUILDERS[name] = build
        return build

    return add


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    # Byte-level BPE vocabulary of single characters: every lowercase word tokenizes.
    pieces = ["<|startoftext|>", "<|endoftext|>", "!", "ab</w>"] + list(_LETTERS) + [c + "</w>" for c in _LETTERS]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("a", "b</w>")]  # transformers needs at least one merge; harmless
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token="<|endoftext|>", model_max_length=77)


def _t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in _LETTERS] + [("▁" + c, -2.5) for c in _LETTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def _clip_text_encoder(tokenizer, hidden: int, projection: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=projection,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(cfg)


def _t5_encoder(tokenizer, d_model: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return T5EncoderModel(cfg)


def _vae(latent_channels: int, seed: int, shift_factor: float | None):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    # 4 down blocks: 64x64 images -> 8x8 latents (vae_scale_factor 8), as in the real models.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=1.5,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


@builtin("tiny-sd3")
def build_tiny_sd3(path: str | Path, seed: int = 0, width: int = 32, num_layers: int = 2) -> Path:
    """Save a tiny random `StableDiffusion3Pipeline` to `path` and return the path."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    heads, head_dim = 2, width // 2
    clip_proj = 16
    tok, tok3 = _clip_tokenizer(), _t5_tokenizer()
    t5_dim = 32
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=num_layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=t5_dim,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=2 * clip_proj,
        out_channels=4,
        pos_embed_max_size=16,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(4, seed + 1, shift_factor=0.1),
        text_encoder=_clip_text_encoder(tok, 32, clip_proj, seed + 2),
        tokenizer=tok,
        text_encoder_2=_clip_text_encoder(tok, 32, clip_proj, seed + 3),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(tok3, t5_dim, seed + 4),
        tokenizer_3=tok3,
    )
    pipe.save_pretrained(str(path))
    return Path(path)


@builtin("tiny-flux")
def build_tiny_flux(path: str | Path, seed: int = 0, width: int = 32) -> Path:
    """Save a tiny random `FluxPipeline` (guidance-distilled, like FLUX.1-dev) to `path`."""
    from diffusers import FluxPipeline

    FluxPipeline(**_tiny_flux_components(seed, width)).save_pretrained(str(path))
    return Path(path)


def _tiny_flux_components(seed: int, width: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    heads, head_dim = 2, width // 2
    tok, tok2 = _clip_tokenizer(), _t5_tokenizer()
    t5_dim, clip_hidden = 32, 32
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels packed 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=t5_dim,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(seed + 2)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=clip_hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    return dict(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=_vae(4, seed + 1, shift_factor=0.1),
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=_t5_encoder(tok2, t5_dim, seed + 3),
        tokenizer_2=tok2,
    )


@builtin("tiny-flux-kontext")
def build_tiny_flux_kontext(path: str | Path, seed: int = 0, width: int = 32) -> Path:
    """Save a tiny random `FluxKontextPipeline` to `path`: FLUX.1 Kontext [dev] has FLUX.1-dev's components."""
    from diffusers import FluxKontextPipeline

    FluxKontextPipeline(**_tiny_flux_components(seed, width)).save_pretrained(str(path))
    return Path(path)


@builtin("tiny-shapes-edit")
def build_tiny_shapes_edit(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random pixel-space `FluxKontextPipeline` of the editing world's architecture (builtin:shapes-edit's,
    flowrl/models/shapes_edit.py: no VAE, no guidance embedding, the edit grammar's word tokenizer) to `path`."""
    from flowrl.models.shapes import save_shapes_pipeline
    from flowrl.models.shapes_edit import build_shapes_edit_pipeline, edit_vocabulary

    pipe = build_shapes_edit_pipeline(edit_vocabulary(), num_layers=1, num_single_layers=1, heads=2, head_dim=16,
                                      text_hidden=16, text_layers=1, seed=seed, zero_init=False)
    return save_shapes_pipeline(pipe, path)


# The words of QwenImagePipeline's prompt template before the user's prompt, as Qwen's tokenizer splits
# them: with a merge chain for each, the template's system part is the 34 tokens the pipeline drops
# from the encoder's output (prompt_template_encode_start_idx), as with the real tokenizer
_QWEN_TEMPLATE_WORDS = ("system", "Describe", " the", " image", " by", " detailing", " color", " shape", " size",
                        " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and",
                        " background", "user", "assistant")


def _qwen_tokenizer(extra_specials: tuple[str, ...] = (), words: tuple[str, ...] = _QWEN_TEMPLATE_WORDS):
    """A byte-level BPE Qwen2 tokenizer: single bytes, the template's `words` (one token each), and the chat
    template's special tokens (and `extra_specials`): every prompt tokenizes, offline."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>", *extra_specials]
    pieces, merges = sorted(ByteLevel.alphabet()), []  # the 256 byte-level characters
    for word in words:
        w = word.replace(" ", "\u0120")  # byte-level's space
        for i in range(2, len(w) + 1):  # a chain of merges, left to right: w[:i-1] + w[i-1]
            merges.append((w[: i - 1], w[i - 1]))
            pieces.append(w[:i])
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces + specials))}
    return Qwen2Tokenizer(vocab=vocab, merges=list(dict.fromkeys(merges)), additional_special_tokens=specials[1:])


@builtin("tiny-qwen-image")
def build_tiny_qwen_image(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random `QwenImagePipeline` to `path`: Qwen2.5-VL text encoder, the 3D-causal
    Qwen-Image VAE (8x spatial downsampling and per-channel latent mean/std, as the real one has),
    an MMDiT with 2x2 packed latents and dynamic shifting with a terminal sigma."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline

    tok = _qwen_tokenizer()
    transformer, text_encoder, scheduler = _tiny_qwen_parts(tok, seed)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=QWEN_Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], **_qwen_latent_stats())
    QwenImagePipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                      tokenizer=tok).save_pretrained(str(path))
    return Path(path)


QWEN_Z_DIM, QWEN_HIDDEN = 4, 16  # the tiny Qwen-Image pipelines' latent channels and text width


def _qwen_latent_stats() -> dict[str, list[float]]:
    """Per-channel latent mean and std of the tiny Qwen-Image VAEs (not 0 and 1, as the real one's are not)."""
    return {"latents_mean": [0.1 * i for i in range(QWEN_Z_DIM)], "latents_std": [1.0 + 0.2 * i for i in range(QWEN_Z_DIM)]}


def _tiny_qwen_parts(tok, seed: int, vision: dict | None = None):
    """The transformer (seeded `seed`), the Qwen2.5-VL text encoder (`seed + 2`; `vision`: more of its vision tower's
    config) and the scheduler that the tiny Qwen-Image and Qwen-Image-Edit pipelines share."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("vision_start", "vision_end", "image_pad", "video_pad")}
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * QWEN_Z_DIM, out_channels=QWEN_Z_DIM, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=QWEN_HIDDEN,
                                              guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    torch.manual_seed(seed + 2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": QWEN_HIDDEN, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": QWEN_HIDDEN,
                       **(vision or {})},
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"]))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                                time_shift_type="exponential")
    return transformer, text_encoder, scheduler


# The words of QwenImageEditPlusPipeline's prompt template before the user's turn, as Qwen's pre-tokenizer
# splits them, one token each: the template's system part is the 64 tokens the pipeline drops from the
# encoder's output (prompt_template_encode_start_idx), as with the real tokenizer
_QWEN_EDIT_TEMPLATE_WORDS = (
    " the", " key", " features", " of", " input", " image", " (", " shape", " size", " texture", " objects", " background",
    " then", " explain", " how", " user", " text", " instruction", " should", " alter", " or", " modify", " Generate", " a",
    " new", " that", " meets", " requirements", " while", " maintaining", " consistency", " with", " original", " where",
    " appropriate",
    # after the words with a space: their merge chains must rank before these, which begin with pairs inside them
    # (color's "co" in " consistency")
    "system", "user", "Describe", "color", "),", "'s", "Picture")


@builtin("tiny-qwen-image-edit")
def build_tiny_qwen_image_edit(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random `QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509's) to `path`: Qwen-Image's
    transformer and scheduler, a Qwen2.5-VL with a one-block vision tower and its processor (the tokenizer
    with the vision tokens and a Qwen2VLImageProcessor whose max_pixels turns the pipeline's 384² copy
    of a source into 16 image tokens), and the Qwen-Image VAE with 16x spatial downsampling (4 stages, no
    residual blocks in the encoder), so that the pipeline's fixed ≈1024² condition is 1024 tokens, not the
    real 8x VAE's 4096, and encodes in a fraction of a second on a CPU (16x, not more: the pipeline's sizes
    are multiples of 32, whose latents must be even to pack 2x2).

    The processor is saved by hand: transformers cannot build or save a Qwen2VLProcessor without its
    video processor, which needs torchvision (see QwenImageEditPolicy's loader)."""
    import json

    from diffusers import AutoencoderKLQwenImage, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor

    tok = _qwen_tokenizer(words=_QWEN_EDIT_TEMPLATE_WORDS)
    transformer, text_encoder, scheduler = _tiny_qwen_parts(tok, seed, vision={"fullatt_block_indexes": [0]})
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=QWEN_Z_DIM, dim_mult=[1] * 5, num_res_blocks=0,
                                 temperal_downsample=[False, True, True, False], **_qwen_latent_stats())
    QwenImageEditPlusPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                              processor=None).save_pretrained(str(path))
    # the processor's parts as a Qwen2VLProcessor directory holds them: its tokenizer and image processor (16 tokens of
    # 28² pixels, 2x2 patches of 14 merged, for any source: min_pixels = max_pixels)
    processor = Path(path) / "processor"
    tok.save_pretrained(str(processor))
    pixels = 16 * 28 * 28
    Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2,
                          temporal_patch_size=2).save_pretrained(str(processor))
    index_file = Path(path) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return Path(path)


_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@builtin("tiny-z-image")
def build_tiny_z_image(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random `ZImagePipeline` to `path`: a Qwen3 text encoder behind a chat template,
    FLUX.1's kind of VAE (AutoencoderKL with a shift factor) and the single-stream transformer with
    2x2 patches, its refiner layers and 3-axis RoPE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tok = _qwen_tokenizer()
    tok.chat_template = _CHAT_TEMPLATE
    hidden = 16
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
                                           n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=hidden,
                                           axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    torch.manual_seed(seed + 2)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    ZImagePipeline(scheduler=scheduler, vae=_vae(4, seed + 1, shift_factor=0.1), text_encoder=text_encoder, tokenizer=tok,
                   transformer=transformer).save_pretrained(str(path))
    return Path(path)


def _flux2_transformer_and_vae(seed: int, text_dim: int, guidance_embeds: bool):
    """FLUX.2's transformer (one double- and one single-stream block) and its VAE with the batch-norm
    latent statistics set away from 0 and 1."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    z = 4
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=4 * z, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_dim,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=z, norm_num_groups=4,
                             sample_size=64)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.5, 1.5, vae.bn.num_features))
    return transformer, vae


@builtin("tiny-flux2-klein")
def build_tiny_flux2_klein(path: str | Path, seed: int = 0, distilled: bool = False) -> Path:
    """Save a tiny random `Flux2KleinPipeline` to `path`: a 27-layer Qwen3 (the pipeline stacks the
    hidden states of layers 9, 18 and 27), the FLUX.2 VAE and transformer (`_flux2_transformer_and_vae`);
    `distilled` as the 4-step models (no guidance), else as the undistilled bases."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = _qwen_tokenizer()
    tok.chat_template = _CHAT_TEMPLATE
    hidden = 8
    transformer, vae = _flux2_transformer_and_vae(seed, 3 * hidden, guidance_embeds=False)
    torch.manual_seed(seed + 2)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=16,
                                                num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=2,
                                                head_dim=4, max_position_embeddings=1024))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer,
                       is_distilled=distilled).save_pretrained(str(path))
    return Path(path)


# Mistral's chat template over content lists, as Flux2Pipeline's `format_input` writes its messages
_MISTRAL_TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}]{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
                     "[/{{ m['role'] | upper }}]{% endfor %}")


@builtin("tiny-flux2")
def build_tiny_flux2(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random `Flux2Pipeline` (FLUX.2 [dev]) to `path`: a 30-layer Mistral 3 (the pipeline
    stacks the hidden states of layers 10, 20 and 30) with a tiny Pixtral vision tower, the FLUX.2 VAE,
    and the transformer with its guidance embedder. The real model's tokenizer is a PixtralProcessor,
    whose image half needs torchvision; text-to-image only calls its chat template and tokenizer, so the
    tiny pipeline ships the tokenizer alone with Mistral's template."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = _qwen_tokenizer(extra_specials=("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
    tok.chat_template = _MISTRAL_TEMPLATE
    hidden = 8
    transformer, vae = _flux2_transformer_and_vae(seed, 3 * hidden, guidance_embeds=True)
    torch.manual_seed(seed + 2)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 16,
                     "num_hidden_layers": 30, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                     "max_position_embeddings": 1024},
        vision_config={"model_type": "pixtral", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 4, "image_size": 64, "patch_size": 16},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                  transformer=transformer).save_pretrained(str(path))
    return Path(path)


@builtin("tiny-sana")
def build_tiny_sana(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random `SanaPipeline` to `path` with the scheduler SANA ships, DPM-Solver++ on
    flow sigmas (flow_shift 3): a Gemma 2 text encoder, the deep-compression autoencoder with two
    stages (2x here, 32x in the real one) and a one-layer linear-attention transformer."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tok = _qwen_tokenizer()
    hidden = 8
    torch.manual_seed(seed)
    transformer = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=4,
                                         num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=4,
                                         cross_attention_dim=8, caption_channels=hidden, sample_size=32)
    torch.manual_seed(seed + 1)
    vae = AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
                        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
                        decoder_block_out_channels=(8, 8), encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                        encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)), downsample_block_type="conv",
                        upsample_block_type="interpolate", scaling_factor=0.41407)
    torch.manual_seed(seed + 2)
    text_encoder = Gemma2Model(Gemma2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                            max_position_embeddings=4096))
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    SanaPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                 scheduler=scheduler).save_pretrained(str(path))
    return Path(path)


@builtin("tiny-wan")
def build_tiny_wan(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random `WanPipeline` (Wan2.1 text-to-video) to `path` with the scheduler Wan ships,
    UniPC on flow sigmas (flow_shift 3): a UMT5 text encoder, the causal 3D Wan VAE (8x in space, 4x in
    time) with its per-channel latent statistics, and a two-layer 3D transformer with (1, 2, 2) patches."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = _t5_tokenizer()
    z, text_dim = 4, 16
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z,
                                        out_channels=z, text_dim=text_dim, freq_dim=32, ffn_dim=32, num_layers=2,
                                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(base_dim=3, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                           latents_mean=[-0.3, 0.1, 0.4, -0.1], latents_std=[1.5, 0.8, 2.0, 1.2])
    torch.manual_seed(seed + 2)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=text_dim, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer,
                scheduler=scheduler).save_pretrained(str(path))
    return Path(path)
