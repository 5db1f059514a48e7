"""ImageReward (Xu et al., NeurIPS 2023): BLIP's text encoder cross-attending to its ViT-L image
encoder, and an MLP on the text's [CLS] feature, trained on 137k expert comparisons of
generated images; the score is standardised by the training set's mean and std, so 0 is an
average image and one unit is one standard deviation.

The architecture is transformers' BLIP vision and text models (the same layers as BLIP's own
code) and the MLP of the aesthetic predictor (ImageReward's head is that MLP, layer for layer).
The official weights are the pickled `ImageReward.pt` of the hub repo THUDM/ImageReward, in
BLIP's module names; `python scripts/convert_imagereward_checkpoint.py ImageReward.pt` renames
them once into a directory (config.json and model.safetensors) in the reward cache, or where
`checkpoint` points. The tokenizer is BLIP's: bert-base-uncased with [DEC] and [ENC] added.
Scoring follows the reference's `score`: the image resized (shorter side, bicubic) and
centre-cropped to 224 with CLIP's normalisation, the prompt padded to 35 tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from flowrl.errors import UserError
from rewards.aesthetic import AestheticHead
from rewards.hub import load_pretrained, resolve_device, resolve_dtype, reward_cache_dir, to_pil
from rewards.registry import register

IMAGEREWARD_HUB_REPO = "THUDM/ImageReward"
CHECKPOINT_DIR = "imagereward"
TOKENIZER = "google-bert/bert-base-uncased"
# ImageReward-v1.0's standardisation: the mean and std of the MLP's output on its training set
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
PROMPT_TOKENS = 35
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HEAD_DIM = 64  # BLIP's ViTs and BERT-base both use 64-wide attention heads
VISION_LN_EPS = 1e-6  # BLIP's ViT (timm's LayerNorm eps), not transformers' BLIP default of 1e-5

# BLIP's ViT names -> transformers' BlipVisionModel names; the text encoder's names are the same in both
VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


class ImageRewardModel(nn.Module):
    """visual_encoder (BlipVisionModel), text_encoder (BlipTextModel with cross-attention, no
    pooler) and mlp (the 5-layer head): `forward` returns the standardised reward [N]."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        self.visual_encoder = BlipVisionModel(BlipVisionConfig(**config["vision"]))
        self.text_encoder = BlipTextModel(BlipTextConfig(**config["text"]), add_pooling_layer=False)
        self.mlp = AestheticHead(config["text"]["hidden_size"])
        self.image_size = config["vision"]["image_size"]

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        image_embeds = self.visual_encoder(pixel_values=pixels).last_hidden_state
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text_encoder(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask
        )
        features = text.last_hidden_state[:, 0].float()  # the [CLS] token after cross-attending to the image
        return (self.mlp(features).squeeze(-1) - SCORE_MEAN) / SCORE_STD

    @classmethod
    def from_directory(cls, path: Path) -> "ImageRewardModel":
        from safetensors.torch import load_file

        model = cls(json.loads((path / "config.json").read_text()))
        state = load_file(str(path / "model.safetensors"))
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise UserError(f"reward 'imagereward': '{path}' does not fit its config.json ({str(exc).splitlines()[0]}); convert ImageReward.pt again") from None
        return model


def _count(state: dict, pattern: str) -> int:
    return len({m.group(1) for k in state if (m := re.match(pattern, k))})


def from_original(state: dict[str, torch.Tensor], vision_heads: int | None = None, text_heads: int | None = None) -> tuple[dict, dict]:
    """ImageReward.pt's state dict (BLIP's names: blip.visual_encoder.*, blip.text_encoder.*,
    mlp.layers.*) -> (config, state dict of ImageRewardModel). The sizes are read from the
    tensors' shapes; the head counts, which shapes do not hold, default to width / 64."""
    vision = {k.removeprefix("blip.visual_encoder."): v for k, v in state.items() if k.startswith("blip.visual_encoder.")}
    text = {k.removeprefix("blip.text_encoder."): v for k, v in state.items() if k.startswith("blip.text_encoder.")}
    needed = ("cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.mlp.fc1.weight")
    if not all(k in vision for k in needed) or "embeddings.word_embeddings.weight" not in text or "mlp.layers.0.weight" not in state:
        raise UserError(
            "this file is not ImageReward's checkpoint: it needs blip.visual_encoder.*, blip.text_encoder.* and mlp.layers.* "
            f"weights (download ImageReward.pt from the hub repo {IMAGEREWARD_HUB_REPO})"
        )
    width = vision["cls_token"].shape[-1]
    patch = vision["patch_embed.proj.weight"].shape[-1]
    grid = round((vision["pos_embed"].shape[1] - 1) ** 0.5)
    vocab, hidden = text["embeddings.word_embeddings.weight"].shape
    config = {
        "vision": dict(
            hidden_size=width, intermediate_size=vision["blocks.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=_count(vision, r"^blocks\.(\d+)\."), num_attention_heads=vision_heads or width // HEAD_DIM,
            image_size=grid * patch, patch_size=patch, layer_norm_eps=VISION_LN_EPS,
        ),
        "text": dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=text["encoder.layer.0.intermediate.dense.weight"].shape[0],
            num_hidden_layers=_count(text, r"^encoder\.layer\.(\d+)\."), num_attention_heads=text_heads or hidden // HEAD_DIM,
            max_position_embeddings=text["embeddings.position_embeddings.weight"].shape[0],
            encoder_hidden_size=text["encoder.layer.0.crossattention.self.key.weight"].shape[1],
            pad_token_id=0, bos_token_id=vocab - 2, sep_token_id=None,  # BLIP's tokenizer: [DEC] is the second-last id
        ),
    }
    converted = {}
    for key, value in vision.items():
        for pattern, target in VISION_RENAMES:
            if re.match(pattern, key):
                converted["visual_encoder." + re.sub(pattern, target, key)] = value
                break
    converted.update({"text_encoder." + k: v for k, v in text.items() if k != "embeddings.position_ids"})  # a buffer, not a weight
    converted.update({k: v for k, v in state.items() if k.startswith("mlp.layers.")})
    return config, converted


def blip_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """The reference transform on 8-bit images: the shorter side resized to `size` (PIL bicubic,
    as torchvision's Resize does on PIL images), a centred size x size crop, CLIP's normalisation."""
    from PIL import Image

    crops = []
    for image in to_pil(images):
        w, h = image.size
        short, long = min(w, h), max(w, h)
        new_long = int(size * long / short)  # torchvision's rounding of the longer side
        nw, nh = (size, new_long) if w <= h else (new_long, size)
        image = image.resize((nw, nh), Image.BICUBIC)
        left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
        crops.append(torch.from_numpy(np.asarray(image.crop((left, top, left + size, top + size))).copy()))
    pixels = torch.stack(crops).permute(0, 3, 1, 2).float() / 255
    return (pixels - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]


def checkpoint_dir(checkpoint: str | None) -> Path:
    path = Path(checkpoint).expanduser() if checkpoint else reward_cache_dir() / CHECKPOINT_DIR
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise UserError(
            f"reward 'imagereward' needs its converted weights (config.json and model.safetensors) in '{path}'; download ImageReward.pt "
            f"from the hub repo {IMAGEREWARD_HUB_REPO} and convert it once with `python scripts/convert_imagereward_checkpoint.py "
            "ImageReward.pt`, or set reward.options.imagereward.checkpoint"
        )
    return path


class ImageRewardScorer:
    def __init__(self, checkpoint: str | None, tokenizer: str, device: str, dtype: str):
        from transformers import AutoTokenizer

        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        model = ImageRewardModel.from_directory(checkpoint_dir(checkpoint))
        # the head stays in float32: the reference casts the [CLS] feature to float before it
        model.visual_encoder.to(self.dtype)
        model.text_encoder.to(self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = load_pretrained(AutoTokenizer.from_pretrained, tokenizer, reward="imagereward", what="the BERT tokenizer")
        # BLIP's tokenizer: bert-base-uncased plus [DEC] (its bos) and [ENC]; scoring uses neither, but a
        # prompt that spells one out must read as the single token the model was trained with
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        self.tokenizer.add_tokens(["[ENC]"], special_tokens=True)

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        pixels = blip_pixels(images, self.model.image_size).to(self.device, self.dtype)
        text = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=PROMPT_TOKENS, return_tensors="pt")
        return self.model(pixels, text["input_ids"].to(self.device), text["attention_mask"].to(self.device)).float().cpu()


@register("imagereward", f"ImageReward: BLIP ViT-L + BERT cross-attention and an MLP, standardised (weights: {IMAGEREWARD_HUB_REPO}, converted once)", factory=True)
def imagereward(checkpoint: str | None = None, tokenizer: str = TOKENIZER, device: str = "auto", dtype: str = "fp32"):
    """`checkpoint`: the converted directory (default: the reward cache, where the converter writes);
    `tokenizer`: bert-base-uncased's hub id or a local directory."""
    return ImageRewardScorer(checkpoint, tokenizer, device, dtype)
