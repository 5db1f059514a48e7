"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline` components)."""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline

from flowrl.models.base import FlowPolicy


class SD3Policy(FlowPolicy):
    """Classifier-free guidance: v = v_uncond + g (v_cond - v_uncond), empty negative prompt."""

    pipeline_class = StableDiffusion3Pipeline

    def _encode_uncached(self, prompts):
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=True,
            negative_prompt=[""] * len(prompts),
            max_sequence_length=self.cfg.max_sequence_length,
        )
        return {"embeds": pe, "neg_embeds": npe, "pooled": pooled, "neg_pooled": npooled}

    def latent_shape(self):
        c = self.transformer.config.in_channels
        return (c, self.cfg.height // self.vae_scale_factor, self.cfg.width // self.vae_scale_factor)

    def _velocity(self, x, sigma, cond):
        g = self.guidance_scale
        use_cfg = g != 1.0
        x_in = x.to(self.device, self.dtype)
        emb, pooled = cond["embeds"], cond["pooled"]
        if use_cfg:
            x_in = torch.cat([x_in, x_in])
            emb = torch.cat([cond["neg_embeds"], emb])
            pooled = torch.cat([cond["neg_pooled"], pooled])
        # SD3 is conditioned on t = 1000 sigma (FlowMatchEulerDiscreteScheduler.timesteps)
        t = torch.full((x_in.shape[0],), float(sigma) * 1000.0, device=self.device, dtype=torch.float32)
        v = self.net(hidden_states=x_in, timestep=t, encoder_hidden_states=emb, pooled_projections=pooled, return_dict=False)[0]
        v = v.float()
        if use_cfg:
            v_uncond, v_cond = v.chunk(2)
            v = v_uncond + g * (v_cond - v_uncond)
        return v

    def decode(self, latents):
        return self._vae_decode(latents)
