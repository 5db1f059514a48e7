"""FLUX.1 (`FluxPipeline` components). Latents are kept packed (2x2 patches as tokens), the
layout the transformer consumes; the step math is elementwise, so packing does not matter."""

from __future__ import annotations

import copy

import numpy as np
import torch

from flowrl.models import register_family
from flowrl.models.base import FlowPolicy, pack_2x2, unpack_2x2
from flowrl.models.sd3 import CLIP_L, T5_XXL, VAE_16


def flux_pipeline_sigmas(scheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """The sigmas `FluxPipeline.__call__` samples on (diffusers 0.42): linspace(1, 1 / T, T) given
    to the scheduler with `mu` interpolated from the packed latents' token count (dynamic shifting)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    c = scheduler.config
    sigmas = None if c.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
    mu = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    scheduler = copy.deepcopy(scheduler)  # set_timesteps changes the scheduler's state
    retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    return scheduler.sigmas.float().cpu()


@register_family
class FluxPolicy(FlowPolicy):
    """Guidance-distilled FLUX.1-dev: guidance enters as an embedding, one forward per step."""

    kind = "flux"
    pipeline_name = "FluxPipeline"
    known_models = {
        "black-forest-labs/FLUX.1-dev": {
            "transformer": ("FluxTransformer2DModel", {
                "attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
                "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
                "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]}),
            "text_encoders": [("CLIPTextModel", CLIP_L), ("T5EncoderModel", T5_XXL)],
            "vae": VAE_16,
        },
    }

    def _encode_uncached(self, prompts):
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.text_device, max_sequence_length=self.cfg.max_sequence_length
        )
        return {"embeds": embeds, "pooled": pooled}

    def pipeline_sigmas(self, num_steps):
        return flux_pipeline_sigmas(self.pipe.scheduler, num_steps, self.latent_shape()[0])

    def latent_shape(self):
        return self._packed_latent_shape()

    def _velocity(self, x, sigma, cond):
        return self._forward(x.to(self.device, self.dtype), self._image_ids(x.shape[0]), sigma, cond)

    def _image_ids(self, b: int) -> torch.Tensor:
        """The generated tokens' rotary ids (c0 = 0, row, column) [h/2 x w/2, 3], as FluxPipeline's."""
        h, w = self._latent_hw()
        return self.pipeline_class._prepare_latent_image_ids(b, h // 2, w // 2, self.device, self.dtype)

    def _forward(self, hidden_states, img_ids, sigma, cond):
        """The transformer on `hidden_states` [B, N, 4C] (ids `img_ids` [N, 3]) with the guidance embedding."""
        b = hidden_states.shape[0]
        txt_ids = torch.zeros(cond["embeds"].shape[1], 3, device=self.device, dtype=self.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, device=self.device, dtype=torch.float32)
        t = self.timestep_rows(sigma, b)  # FLUX takes sigma itself
        v = self.net(
            hidden_states=hidden_states,
            timestep=t,
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["embeds"],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return v.float()

    def encode_images(self, images):
        return pack_2x2(self._vae_encode(images))

    def decode(self, latents):
        return self._vae_decode(unpack_2x2(latents, *self._latent_hw()))
