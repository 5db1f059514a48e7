"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline` components)."""

from __future__ import annotations

import copy

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

from flowrl.models.base import FlowPolicy


def sd3_pipeline_sigmas(scheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """The sigmas `StableDiffusion3Pipeline.__call__` samples on (diffusers 0.42): the scheduler's
    own `set_timesteps`, with `mu` from the image's token count when it shifts dynamically."""
    kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", None):
        c = scheduler.config
        kwargs["mu"] = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                       c.get("base_shift", 0.5), c.get("max_shift", 1.16))
    scheduler = copy.deepcopy(scheduler)  # set_timesteps changes the scheduler's state
    retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)
    return scheduler.sigmas.float().cpu()


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

    def pipeline_sigmas(self, num_steps):
        _, h, w = self.latent_shape()
        patch = self.transformer.config.patch_size
        return sd3_pipeline_sigmas(self.pipe.scheduler, num_steps, (h // patch) * (w // patch))

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
        t = self.timestep_rows(sigma, x_in.shape[0], scale=1000.0)
        v = self.net(hidden_states=x_in, timestep=t, encoder_hidden_states=emb, pooled_projections=pooled, return_dict=False)[0]
        v = v.float()
        if use_cfg:
            v_uncond, v_cond = v.chunk(2)
            v = v_uncond + g * (v_cond - v_uncond)
        return v

    def decode(self, latents):
        return self._vae_decode(latents)
