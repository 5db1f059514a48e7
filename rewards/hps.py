"""HPSv2 / HPSv2.1 (Human Preference Score): an OpenCLIP ViT-H-14 fine-tuned on human
preferences; the score is the cosine of the image and prompt embeddings.

open-clip-torch is the optional extra `hps` (it needs torchvision, which has no CPU build on
some machines) and is imported only when the reward is built. The official weights are the
pickled `HPS_v2.1_compressed.pt` / `HPS_v2_compressed.pt` of the hub repo xswu/HPSv2; convert
the one you want once with `python scripts/convert_hps_checkpoint.py FILE.pt`, which writes
safetensors to the reward cache (or pass `checkpoint` to point elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from flowrl.errors import UserError
from rewards.hub import resolve_device, resolve_dtype, reward_cache_dir
from rewards.registry import register

HPS_ARCHITECTURE = "ViT-H-14"
HPS_HUB_REPO = "xswu/HPSv2"
CHECKPOINT_FILE = "hps_v2.1.safetensors"
EXTRA_HINT = "pip install 'flowrl[hps]'"


def import_open_clip():
    try:
        import open_clip
    except ImportError as exc:  # open_clip itself, or what it imports (torchvision) is missing
        missing = exc.name if exc.name and exc.name != "open_clip" else "open-clip-torch"
        raise UserError(f"reward 'hpsv2' needs the optional extra hps ({missing} is not installed): {EXTRA_HINT}") from None
    except Exception as exc:  # installed but broken, typically a torchvision without this machine's CUDA
        raise UserError(f"reward 'hpsv2' could not import open_clip ({type(exc).__name__}: {str(exc).splitlines()[0]}); reinstall with {EXTRA_HINT} and a matching torchvision") from None
    return open_clip


def resize_longest_and_pad(images: torch.Tensor, size: int, mean, std) -> torch.Tensor:
    """HPSv2's evaluation transform: scale the longest side to `size` (bicubic), zero-pad the
    rest centred, then normalise. images: [N, 3, H, W] in [0, 1]."""
    h, w = images.shape[-2:]
    scale = size / max(h, w)
    nh, nw = round(h * scale), round(w * scale)
    x = images.float()
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = (size - nh) // 2, (size - nw) // 2
    x = F.pad(x, (left, size - nw - left, top, size - nh - top), value=0.0)
    mean = torch.tensor(mean, dtype=x.dtype, device=x.device)[:, None, None]
    std = torch.tensor(std, dtype=x.dtype, device=x.device)[:, None, None]
    return (x - mean) / std


def checkpoint_path(checkpoint: str | None) -> Path:
    path = Path(checkpoint).expanduser() if checkpoint else reward_cache_dir() / CHECKPOINT_FILE
    if path.suffix != ".safetensors" or not path.is_file():
        raise UserError(
            f"reward 'hpsv2' needs its checkpoint as a .safetensors file at '{path}'; download HPS_v2.1_compressed.pt from the hub "
            f"repo {HPS_HUB_REPO} and convert it once with `python scripts/convert_hps_checkpoint.py FILE.pt`, or set reward.options.hpsv2.checkpoint"
        )
    return path


class HPSScorer:
    def __init__(self, checkpoint: str | None, device: str, dtype: str):
        open_clip = import_open_clip()
        from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

        from open_clip.factory import load_checkpoint

        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        path = checkpoint_path(checkpoint)
        model = open_clip.create_model(HPS_ARCHITECTURE, pretrained=None, device="cpu")
        try:  # open_clip's loader: reads safetensors, adapts older open_clip key layouts, strict
            load_checkpoint(model, str(path))
        except RuntimeError as exc:
            raise UserError(f"reward 'hpsv2': the checkpoint does not fit OpenCLIP {HPS_ARCHITECTURE} ({str(exc).splitlines()[0]})") from None
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        size = model.visual.image_size
        self.image_size = size[0] if isinstance(size, (tuple, list)) else int(size)
        self.mean, self.std = OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
        self.tokenizer = open_clip.get_tokenizer(HPS_ARCHITECTURE)

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        # round to 8 bits first, as HPSv2 scores saved images
        images = (images.detach().float().clamp(0, 1) * 255).round() / 255
        pixels = resize_longest_and_pad(images.to(self.device), self.image_size, self.mean, self.std).to(self.dtype)
        tokens = self.tokenizer(list(prompts)).to(self.device)
        image_emb = self.model.encode_image(pixels, normalize=True).float()
        text_emb = self.model.encode_text(tokens, normalize=True).float()
        return (image_emb * text_emb).sum(-1).cpu()


@register("hpsv2", f"HPSv2 / HPSv2.1 human preference score, OpenCLIP {HPS_ARCHITECTURE} (weights: {HPS_HUB_REPO}; extra hps)", factory=True)
def hpsv2(checkpoint: str | None = None, device: str = "auto", dtype: str = "fp32"):
    """`checkpoint`: the converted safetensors (default: the reward cache, where the converter writes)."""
    return HPSScorer(checkpoint, device, dtype)
