"""The embedded default model: a small SD3-architecture text-to-image model for the shapes world.

It is a real `StableDiffusion3Pipeline` directory: `SD3Transformer2DModel` working in pixel
space (no VAE: `vae` is None, the transformer sees RGB images in [-1, 1] directly, 32x32 with
4x4 patches), two small `CLIPTextModelWithProjection` encoders over a word-level tokenizer
(`PreTrainedTokenizerFast` around a `tokenizers` WordLevel model), and no T5 (the pipeline
then pads with zeros, `model.max_sequence_length` of them). `scripts/pretrain_shapes.py`
trains it from random weights; the result ships in `flowrl/assets/shapes-sd3`, loaded with
`from_pretrained` through the same SD3 adapter as real SD3 (`model.path: builtin:shapes`).
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ("[PAD]", "[UNK]")
BOS, EOS = "[BOS]", "[EOS]"
MAX_TOKENS = 16  # the longest prompt of the grammar is 11 words, plus BOS and EOS


def word_tokenizer(words: list[str], max_length: int = MAX_TOKENS):
    """A word-level tokenizer: one id per word, BOS/EOS around every prompt. EOS has the
    largest id, so CLIP's pooled output (taken at the EOS position) is well defined."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *sorted(set(words)), BOS, EOS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token="[PAD]", unk_token="[UNK]",
        model_max_length=max_length,
    )


def _text_encoder(tokenizer, hidden: int, projection: int, layers: int, heads: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=tokenizer.model_max_length, projection_dim=projection,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))


def build_shapes_pipeline(words: list[str], image_size: int = 32, patch_size: int = 4, num_layers: int = 6,
                          heads: int = 4, head_dim: int = 32, text_hidden: int = 64, text_layers: int = 2, seed: int = 0,
                          zero_init: bool = False):
    """A randomly initialised pixel-space SD3 pipeline for the shapes world (not yet saved).
    `zero_init`: adaLN-Zero (Peebles & Xie 2023, DiT): the modulation layers and the output
    projection start at zero, so every block starts as the identity and the model predicts 0."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tok = word_tokenizer(words)
    projection = text_hidden
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=image_size, patch_size=patch_size, in_channels=3, out_channels=3, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=heads,
        joint_attention_dim=2 * text_hidden,  # the two CLIP hidden states, concatenated
        caption_projection_dim=heads * head_dim, pooled_projection_dim=2 * projection,
        pos_embed_max_size=image_size // patch_size,
    )
    if zero_init:
        zero_modulation(transformer)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=None,
        text_encoder=_text_encoder(tok, text_hidden, projection, text_layers, 2, seed + 1),
        tokenizer=tok,
        text_encoder_2=_text_encoder(tok, text_hidden, projection, text_layers, 2, seed + 2),
        tokenizer_2=word_tokenizer(words),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def zero_modulation(transformer) -> None:
    """adaLN-Zero for an MMDiT (SD3's, FLUX's single- and double-stream blocks): every modulation layer and the
    output projection at zero."""
    from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle

    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, (AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous)):
                module.linear.weight.zero_()
                module.linear.bias.zero_()
        transformer.proj_out.weight.zero_()
        transformer.proj_out.bias.zero_()


def save_shapes_pipeline(pipe, directory: str | Path) -> Path:
    """`save_pretrained`, plus null entries for the absent components (the VAE, SD3's T5) in
    model_index.json, so that a plain `<Pipeline>.from_pretrained` loads them as None."""
    import inspect
    import json

    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    index_file = directory / "model_index.json"
    index = json.loads(index_file.read_text())
    components = inspect.signature(type(pipe).__init__).parameters
    for name in ("vae", "text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor"):
        if name in components:
            index.setdefault(name, [None, None])
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return directory


def shapes_model_dir() -> Path:
    """Where the pretrained shapes pipeline ships inside the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "shapes-sd3"
