"""CLIP-family preference rewards on transformers: PickScore and CLIP score.

Both embed the image and the prompt with a `CLIPModel` and its processor, loaded with
`from_pretrained` from a hub id or a local directory, and score each (image, prompt) pair by
the cosine of the two embeddings; PickScore multiplies by the model's learned
`logit_scale.exp()`, as in its README. Images are rounded to 8-bit PIL images first, as the
reference code scores saved images. transformers loads lazily, when a reward is built.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rewards.hub import load_pretrained, pooled, resolve_device, resolve_dtype, to_pil
from rewards.registry import register

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIP_MODEL = "openai/clip-vit-large-patch14"


class CLIPPairScorer:
    """scale x cosine(image embedding, text embedding) for each (image, prompt) pair."""

    def __init__(self, reward: str, path: str, processor: str, device: str, dtype: str, logit_scaled: bool):
        from transformers import AutoProcessor, CLIPModel

        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        model = load_pretrained(CLIPModel.from_pretrained, path, reward=reward, what="the CLIP model", dtype=self.dtype)
        self.processor = load_pretrained(AutoProcessor.from_pretrained, processor, reward=reward, what="the CLIP processor")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.logit_scaled = logit_scaled
        self.max_length = self.model.config.text_config.max_position_embeddings

    @torch.inference_mode()
    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """The CLIP image embeddings [N, D]: the feature space of the monitor's diversity and GARDO's novelty
        (docs/monitor.md) when this reward is loaded."""
        pixels = self.processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
        return pooled(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))).float()

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        text = self.processor(text=list(prompts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        image_emb = self.image_features(images)
        text_emb = pooled(
            self.model.get_text_features(input_ids=text["input_ids"].to(self.device), attention_mask=text["attention_mask"].to(self.device))
        ).float()
        cosine = torch.nn.functional.cosine_similarity(image_emb, text_emb, dim=-1)
        scale = self.model.logit_scale.float().exp() if self.logit_scaled else 1.0
        return (scale * cosine).cpu()


@register("pickscore", f"PickScore: logit_scale x CLIP-H cosine, a Pick-a-Pic preference model ({PICKSCORE_MODEL})", factory=True)
def pickscore(path: str = PICKSCORE_MODEL, processor: str = PICKSCORE_PROCESSOR, device: str = "auto", dtype: str = "fp32"):
    return CLIPPairScorer("pickscore", path, processor, device, dtype, logit_scaled=True)


@register("clip_score", f"CLIP score: cosine of the image and prompt embeddings, in [-1, 1] ({CLIP_MODEL})", factory=True)
def clip_score(path: str = CLIP_MODEL, processor: str | None = None, device: str = "auto", dtype: str = "fp32"):
    """`processor` defaults to the model's own directory or hub id."""
    return CLIPPairScorer("clip_score", path, processor or path, device, dtype, logit_scaled=False)
