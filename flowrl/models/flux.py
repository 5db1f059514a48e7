"""FLUX.1 (`FluxPipeline` components). Latents are kept packed (2x2 patches as tokens), the
layout the transformer consumes; the step math is elementwise, so packing does not matter."""

from __future__ import annotations

import copy
import functools

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
    """Guidance-distilled FLUX.1-dev: guidance enters as an embedding, one forward per step. A transformer without
    the guidance embedding (the editing world's model) is guided as the pipeline's true CFG: model.guidance_scale is
    `true_cfg_scale`, on the empty negative prompt, v = v_neg + g (v_cond - v_neg)."""

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
        encoded = self._encode_texts(prompts)
        if self.true_cfg:
            encoded.update(self.negative_once(lambda: self._encode_texts([""])))
        return encoded

    def _encode_texts(self, texts):
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=list(texts), prompt_2=None, device=self.text_device, max_sequence_length=self.cfg.max_sequence_length
        )
        return {"embeds": embeds, "pooled": pooled}

    @functools.cached_property
    def true_cfg(self) -> bool:
        """Guided on a negative prompt (two halves per forward), not by the guidance embedding. Read from the
        transformer's config file where only the text encoders are loaded (model.text_encoders cached)."""
        if self.transformer is not None:
            return not self.transformer.config.guidance_embeds
        from diffusers import FluxTransformer2DModel

        return not FluxTransformer2DModel.load_config(self.model_dir, subfolder="transformer").get("guidance_embeds", False)

    @property
    def guidance_argument(self) -> str:
        return "true_cfg_scale" if self.true_cfg else "guidance_scale"

    def pipeline_arguments(self):
        args = super().pipeline_arguments()
        if self.true_cfg and self.guidance_scale > 1.0:
            args["negative_prompt"] = ""  # the pipeline guides only where it is given one
        return args

    def pipeline_sigmas(self, num_steps):
        return flux_pipeline_sigmas(self.pipe.scheduler, num_steps, self.latent_shape()[0])

    def latent_shape(self):
        return self._packed_latent_shape()

    def latent_channels(self):
        return self.transformer.config.in_channels // 4  # tokens are 2x2 latent patches

    def _velocity(self, x, sigma, cond):
        return self._forward(x.to(self.device, self.dtype), self._image_ids(x.shape[0]), sigma, cond)

    def _image_ids(self, b: int) -> torch.Tensor:
        """The generated tokens' rotary ids (c0 = 0, row, column) [h/2 x w/2, 3], as FluxPipeline's."""
        h, w = self._latent_hw()
        return self.pipeline_class._prepare_latent_image_ids(b, h // 2, w // 2, self.device, self.dtype)

    def _forward(self, hidden_states, img_ids, sigma, cond):
        """The transformer on `hidden_states` [B, N, 4C] (ids `img_ids` [N, 3]) with the guidance embedding, or
        true CFG's two halves in one forward."""
        b = hidden_states.shape[0]
        embeds, pooled = cond["embeds"], cond["pooled"]
        g = self.guidance_scale
        halves = self.true_cfg and g > 1.0
        if halves:
            hidden_states = torch.cat([hidden_states, hidden_states])
            embeds = torch.cat([embeds, cond["neg_embeds"].to(embeds.device).expand(b, -1, -1)])
            pooled = torch.cat([pooled, cond["neg_pooled"].to(pooled.device).expand(b, -1)])
        rows = hidden_states.shape[0]
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((rows,), g, device=self.device, dtype=torch.float32)
        t = self.timestep_rows(sigma, rows)  # FLUX takes sigma itself
        v = self.net(
            hidden_states=hidden_states,
            timestep=t,
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0].float()
        if halves:
            v_cond, v_neg = v.chunk(2)
            v = v_neg + g * (v_cond - v_neg)
        return v

    def pipeline_pixels_code(self, name):
        h, w = self._latent_hw()
        lines = [f"{name} = {name}.unflatten(1, ({h // 2}, {w // 2})).unflatten(-1, ({name}.shape[-1] // 4, 2, 2))"
                 f".permute(0, 3, 1, 4, 2, 5).flatten(4, 5).flatten(2, 3)  # the tokens as latents [1, C, {h}, {w}]"]
        if self.vae_scale_factor > 1:
            lines.append(f"{name} = torch.nn.functional.pixel_shuffle({name}, {self.vae_scale_factor})[:, :3]  # pixels, folded "
                         f"{self.vae_scale_factor}x{self.vae_scale_factor} with a zero 4th channel, unfolded")
        return lines

    def encode_images(self, images):
        return pack_2x2(self._vae_encode(images))

    def decode(self, latents):
        return self._vae_decode(unpack_2x2(latents, *self._latent_hw()))
