"""Rewards for how much of its source image an edit keeps (issue 86): what an editing run weighs beside
a reward for the change itself (`shapes_edit`, `vlm_judge` with `mode: edit`), so that redrawing the whole
image does not pay. Both read each sample's source image (a `sources` parameter, rewards/registry.py), so
they score edits (`EditPrompt`s) only.

- `image_similarity`: the cosine of the CLIP image embeddings of the edited image and its source, in
  [-1, 1]: Flow-GRPO's `image_similarity_score`, its consistency reward for FLUX.1 Kontext (CLIP ViT-L/14).
  Global: it does not say where the image changed.
- `pixel_preservation`: the share of the pixels that should stay that did stay (`pixel_preservation`'s
  docstring), using the edit's reference target, where it has one, to tell the two regions apart.
"""

from __future__ import annotations

import torch

from flowrl.errors import UserError
from rewards.models import CLIP_MODEL, CLIPPairScorer
from rewards.registry import at_size, register


class ImageSimilarity:
    """cosine(CLIP image embedding of each sample, that of its source)."""

    def __init__(self, path: str, processor: str, device: str, dtype: str):
        self.clip = CLIPPairScorer("image_similarity", path, processor, device, dtype, logit_scaled=False)
        # an attribute, not a method: the registry's wrapper that passes the sources copies the instance's attributes
        # (functools.wraps), so the monitor and GARDO still find this encoder on the built reward
        self.image_features = self.clip.image_features

    def __call__(self, images: torch.Tensor, prompts, sources: torch.Tensor) -> torch.Tensor:
        features = self.image_features(torch.cat([images, sources]))  # one pass through CLIP for both halves
        return torch.nn.functional.cosine_similarity(features[: len(images)], features[len(images):], dim=-1).cpu()


@register("image_similarity", "preservation: cosine of the CLIP image embeddings of each edited image and its source, in "
          f"[-1, 1] (Flow-GRPO's image_similarity_score; {CLIP_MODEL}); compares each sample with its source image", factory=True)
def image_similarity(path: str = CLIP_MODEL, processor: str | None = None, device: str = "auto", dtype: str = "fp32"):
    """`processor` defaults to the model's own directory or hub id."""
    return ImageSimilarity(path, processor or path, device, dtype)


def unchanged(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Images [..., 3, H, W] -> [..., H, W] bool: the pixels whose largest per-channel absolute difference is at most
    `tolerance`."""
    return (a - b).abs().amax(dim=-3) <= tolerance


def preserved_share(images: torch.Tensor, sources: torch.Tensor, keep: torch.Tensor, tolerance: float) -> torch.Tensor:
    """[N] float: of the pixels in `keep` [N, H, W] (bool), the share unchanged from the source; 1 where `keep` is empty."""
    counted = keep.sum(dim=(1, 2))
    kept = (unchanged(images, sources, tolerance) & keep).sum(dim=(1, 2))
    return torch.where(counted > 0, kept / counted.clamp(min=1), 1.0).float()


# factory=True: a plain function would be wrapped for `sources` twice (rewards/shapes_edit.py says why)
@register("pixel_preservation", "preservation: the share of pixels within `tolerance` of the source, counted where the "
          "edit's reference target keeps the source too (everywhere without a reference); compares each sample with its "
          "source image", factory=True)
def pixel_preservation(tolerance: float = 0.1):
    """The share of the pixels to keep that were kept, in [0, 1].

    A pixel is kept when its largest per-channel absolute difference from the source is at most `tolerance`
    (on the [0, 1] scale; 0.1 lets resampling and a VAE's round trip through, not a recolour). The pixels
    counted are the region to keep: where the edit's prompt carries a reference target
    (`EditPrompt.reference_image()`, resized to the sample's size as the source is), the pixels where the
    reference itself keeps the source by the same test, so the region the instruction changes is not held
    against the edit; without a reference, every pixel. An image whose region to keep is empty (the
    reference changes every pixel) scores 1.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise UserError(f"reward.options.pixel_preservation.tolerance must be a number in (0, 1), the largest per-channel "
                        f"difference on the [0, 1] scale that a kept pixel may show; got {tolerance!r}")
    tolerance = float(tolerance)

    def score(images: torch.Tensor, prompts, sources: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(images.shape[0], *images.shape[-2:], dtype=torch.bool, device=images.device)
        for i, prompt in enumerate(prompts):
            # the registry has checked that the prompts are edits; a direct caller's plain prompt has no reference
            reference = prompt.reference_image() if hasattr(prompt, "reference_image") else None
            if reference is not None:
                keep[i] = unchanged(at_size(reference, images.shape[-2:]).to(images.device), sources[i], tolerance)
        return preserved_share(images, sources, keep, tolerance).cpu()

    return score
