"""FLUX.1 Kontext (`FluxKontextPipeline`): FLUX.1-dev's transformer editing a source image. Its prompts are
EditPrompts (flowrl/models/edit_prompt.py): the text encoders read the instruction, and the source, VAE-encoded
and packed like the noise, rides in the sequence after the generated tokens with rotary ids whose first axis is 1;
the prediction is cropped to the generated tokens, the only ones stepped.

Matched against diffusers 0.42 `pipelines/flux/pipeline_flux_kontext.py`: `prepare_latents` (image ids with c0 = 1),
`_encode_vae_image` (posterior mode, (z - shift) * scale), `__call__` (cat([latents, image_latents]) and
`noise_pred[:, : latents.size(1)]`; mu of the dynamic shift from the generated tokens alone, as FluxPipeline's).

The source is resized to the output size (model.height x model.width, floored to the 16-pixel token grid), as
flow_grpo's counting_flux_kontext does (source and output 512^2; no PREFERRED_KONTEXT_RESOLUTIONS bucket), so a batch
of edits has one sequence length."""

from __future__ import annotations

import torch

from flowrl.models import register_family
from flowrl.models.base import pack_2x2
from flowrl.models.edit_prompt import instruction_of
from flowrl.models.flux import FluxPolicy
from flowrl.models.sd3 import CLIP_L, T5_XXL, VAE_16


def resize_source(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A source [3, H, W] in [0, 1] as [1, 3, height, width]: antialiased bicubic (what flow_grpo's PIL
    `ref_image.resize((512, 512))` does), unchanged where the size is already the output's."""
    image = image[None].float()
    if tuple(image.shape[-2:]) == (height, width):
        return image
    resized = torch.nn.functional.interpolate(image, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return resized.clamp(0, 1)


@register_family
class FluxKontextPolicy(FluxPolicy):
    """FLUX.1 Kontext [dev]: guidance-distilled (the embedding, model.guidance_scale; the model card's 2.5), one
    forward per step over 2N tokens (N generated, N from the source)."""

    kind = "flux_kontext"
    pipeline_name = "FluxKontextPipeline"
    edits = True
    source_images = 1  # at the output's size: 2N image tokens per forward
    known_models = {
        "black-forest-labs/FLUX.1-Kontext-dev": {  # FLUX.1-dev's transformer config
            "transformer": FluxPolicy.known_models["black-forest-labs/FLUX.1-dev"]["transformer"],
            "text_encoders": [("CLIPTextModel", CLIP_L), ("T5EncoderModel", T5_XXL)],
            "vae": VAE_16,
        },
    }

    def _encode_uncached(self, prompts):
        return super()._encode_uncached([instruction_of(p) for p in prompts])

    def source_size(self) -> tuple[int, int]:
        """The source's pixel size: the output's on the token grid (what the pipeline floors height and width to)."""
        h, w = self._latent_hw()
        return h * self.vae_scale_factor, w * self.vae_scale_factor

    def encode_source(self, image):
        if self.vae is None:  # pixel space (the editing world's model): the source folded as the noise is
            return {"source": pack_2x2(self._vae_encode(resize_source(image, *self.source_size())))}
        # the pipeline's own preprocessing (2x - 1) and VAE encoding (mode, (z - shift) * scale, in the VAE's dtype)
        pixels = self.pipe.image_processor.preprocess(resize_source(image, *self.source_size()), *self.source_size())
        latents = self.pipe._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)
        return {"source": pack_2x2(latents)}

    def _source_ids(self, b: int) -> torch.Tensor:
        """The source tokens' rotary ids: the generated grid's with c0 = 1 (prepare_latents' image_ids)."""
        ids = self._image_ids(b).clone()
        ids[..., 0] = 1
        return ids

    def _velocity(self, x, sigma, cond):
        n = x.shape[1]
        hidden = torch.cat([x.to(self.device, self.dtype), cond["source"].to(self.device, self.dtype)], dim=1)
        ids = torch.cat([self._image_ids(x.shape[0]), self._source_ids(x.shape[0])], dim=0)  # dim 0 is the sequence
        return self._forward(hidden, ids, sigma, cond)[:, :n]

    def pipeline_arguments(self):
        # max_area = height x width: __call__ rescales the output to max_area (1024^2 by default) at the requested
        # aspect; at the output's own area it keeps height and width (floored to 16, as flowrl's latents)
        # (a pixel-space model's height and width are in the units the pipeline assumes without a VAE: the same area)
        args = super().pipeline_arguments()
        return {**args, "max_area": args["height"] * args["width"], "_auto_resize": False}

    def pipeline_source_code(self, path):
        h, w = self.source_size()
        lines = ["import numpy as np", "from PIL import Image",
                 f"image = torch.from_numpy(np.array(Image.open({path!r}).convert('RGB'))).permute(2, 0, 1)[None].float() / 255",
                 f"if image.shape[-2:] != ({h}, {w}):  # the output's size, as flowrl resizes it",
                 f"    image = torch.nn.functional.interpolate(image, size=({h}, {w}), mode='bicubic', antialias=True, "
                 "align_corners=False).clamp(0, 1)"]
        if self.vae is None:  # pixel space: folded as the noise is, a tensor with the pipeline's latent channels
            r = self.vae_scale_factor
            lines.append(f"image = torch.nn.functional.pixel_unshuffle(torch.nn.functional.pad(image * 2 - 1, (0, 0, 0, 0, 0, 1)), "
                         f"{r})  # the pixels folded {r}x{r} with a zero 4th channel: this model has no VAE")
        return lines

    def pipeline_source_arguments(self, prompts):
        # the sources already at the output size, [B, 3, H, W] in [0, 1]: with _auto_resize off, __call__ keeps a
        # tensor's own size (its resize to the same size is the identity) and preprocesses it as encode_source does
        sources = torch.cat([resize_source(p.image(), *self.source_size()) for p in prompts])
        if self.vae is None:  # pixel space: a tensor with the pipeline's latent channels is taken as the source's latents
            return {"image": self._vae_encode(sources)}
        return {"image": sources}
