"""The LAION aesthetic predictor (improved-aesthetic-predictor): an MLP on L2-normalised CLIP
ViT-L/14 image embeddings, predicting a 1-10 rating.

The head's original weights are a pickled `.pth` state dict; convert them once with
`python scripts/convert_aesthetic_head.py sac+logos+ava1-l14-linearMSE.pth`, which writes
safetensors to the reward cache (or pass `head` to point elsewhere). The CLIP vision tower
loads with `from_pretrained` from a hub id or a local directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from flowrl.errors import UserError
from rewards.hub import load_pretrained, pooled, resolve_device, resolve_dtype, reward_cache_dir, to_pil
from rewards.registry import register

AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
HEAD_FILE = "aesthetic_head.safetensors"
HIDDEN = (1024, 128, 64, 16)


class AestheticHead(nn.Module):
    """improved-aesthetic-predictor's MLP, layer for layer (so its state dict keys match):
    768 -> 1024 -> 128 -> 64 -> 16 -> 1 with dropouts and no activations."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, HIDDEN[0]),
            nn.Dropout(0.2),
            nn.Linear(HIDDEN[0], HIDDEN[1]),
            nn.Dropout(0.2),
            nn.Linear(HIDDEN[1], HIDDEN[2]),
            nn.Dropout(0.1),
            nn.Linear(HIDDEN[2], HIDDEN[3]),
            nn.Linear(HIDDEN[3], 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings)

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], source: str) -> "AestheticHead":
        if "layers.0.weight" not in state:
            raise UserError(f"aesthetic head '{source}' has no layers.0.weight; it is not an improved-aesthetic-predictor MLP state dict")
        head = cls(state["layers.0.weight"].shape[1])
        expected = head.state_dict()
        wrong = sorted(k for k in expected if k not in state or state[k].shape != expected[k].shape)
        extra = sorted(k for k in state if k not in expected)
        if wrong or extra:
            raise UserError(
                f"aesthetic head '{source}' does not match the improved-aesthetic-predictor MLP "
                f"(missing or misshapen: {', '.join(wrong) or 'none'}; unexpected: {', '.join(extra) or 'none'})"
            )
        head.load_state_dict({k: v.float() for k, v in state.items()})
        return head.eval().requires_grad_(False)

    @classmethod
    def from_safetensors(cls, path: str | Path) -> "AestheticHead":
        from safetensors.torch import load_file

        path = Path(path).expanduser()
        if not path.is_file():
            raise UserError(
                f"reward 'aesthetic' needs its MLP head at '{path}'; convert the original sac+logos+ava1-l14-linearMSE.pth "
                "once with `python scripts/convert_aesthetic_head.py FILE.pth`, or set reward.options.aesthetic.head"
            )
        try:
            state = load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise UserError(f"aesthetic head '{path}' is not a readable safetensors file ({str(exc).splitlines()[0]})") from None
        return cls.from_state_dict(state, str(path))


class AestheticScorer:
    def __init__(self, path: str, head: str | None, device: str, dtype: str):
        from transformers import AutoImageProcessor, CLIPModel

        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.head = AestheticHead.from_safetensors(head or reward_cache_dir() / HEAD_FILE).to(self.device)
        self.processor = load_pretrained(AutoImageProcessor.from_pretrained, path, reward="aesthetic", what="the CLIP image processor")
        # the whole CLIPModel, not CLIPVisionModelWithProjection: the vision class reads
        # projection_dim from vision_config, which a checkpoint may leave at its default
        clip = load_pretrained(CLIPModel.from_pretrained, path, reward="aesthetic", what="the CLIP model", dtype=self.dtype)
        self.clip = clip.to(self.device).eval().requires_grad_(False)
        width = self.head.layers[0].in_features
        if self.clip.config.projection_dim != width:
            raise UserError(f"reward 'aesthetic': the head takes {width}-dim embeddings but the CLIP model '{path}' gives {self.clip.config.projection_dim}")

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str] | None = None, metadata=None) -> torch.Tensor:
        pixels = self.processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
        embeddings = pooled(self.clip.get_image_features(pixel_values=pixels.to(self.device, self.dtype))).float()
        embeddings = embeddings / embeddings.norm(dim=-1, keepdim=True)
        return self.head(embeddings)[:, 0].cpu()


@register("aesthetic", f"LAION aesthetic predictor: MLP head on {AESTHETIC_CLIP} image embeddings, a 1-10 rating", factory=True)
def aesthetic(path: str = AESTHETIC_CLIP, head: str | None = None, device: str = "auto", dtype: str = "fp32"):
    """`head`: the converted safetensors head (default: the reward cache, where the converter writes)."""
    return AestheticScorer(path, head, device, dtype)
