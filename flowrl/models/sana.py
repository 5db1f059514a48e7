"""SANA (`SanaPipeline` components): a Gemma 2 prompt encoder behind the pipeline's "complex human
instruction" (the instruction's tokens dropped again, the prompt's kept with a mask), a
linear-attention transformer conditioned on t = 1000 sigma x timestep_scale, the deep-compression
autoencoder (32x), and classifier-free guidance on the empty prompt above 1.

SANA's pipelines ship DPM-Solver++ (a multistep solver on flow sigmas). flowrl's rollouts are
one-step Euler (ODE) or Euler-Maruyama (SDE) transitions, whose log-probabilities a multistep
solver does not have, so flowrl samples SANA with the Euler flow-matching step on the grid that
`FlowMatchEulerDiscreteScheduler(shift=flow_shift)` gives: what the pipeline samples with that
scheduler swapped in (the tests check that equality)."""

from __future__ import annotations

import inspect

import torch

from flowrl.models import register_family
from flowrl.models.base import FlowPolicy
from flowrl.models.pipeline_call import euler_scheduler
from flowrl.models.sd3 import sd3_pipeline_sigmas


@register_family
class SanaPolicy(FlowPolicy):
    kind = "sana"
    pipeline_name = "SanaPipeline"
    trains_with_cfg = True
    cross_attention = True
    token_patch = None  # its config's patch_size (1) over the autoencoder's latents
    latent_scale = 32  # the deep-compression autoencoder
    known_models = {
        "Efficient-Large-Model/Sana_1600M_1024px_diffusers": {
            "transformer": ("SanaTransformer2DModel", {}),  # the class's defaults are SANA 1.6B's (20 layers, 2240 wide)
            "text_encoders": [("Gemma2Model", ("Gemma2Config", {  # Gemma 2 2B
                "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}))],
            "vae": ("AutoencoderDC", {  # DC-AE f32c32: the class's defaults with linear attention in the three deep stages
                "encoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
                "decoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3}),
        },
    }

    @property
    def complex_human_instruction(self) -> list[str]:
        """The instruction `SanaPipeline.__call__` prepends to every prompt by default."""
        return inspect.signature(self.pipe.__call__).parameters["complex_human_instruction"].default

    def _encode_uncached(self, prompts):
        embeds, mask, neg, neg_mask = self.pipe.encode_prompt(
            prompt=list(prompts), do_classifier_free_guidance=True, negative_prompt="", device=self.text_device,
            max_sequence_length=self.cfg.max_sequence_length, complex_human_instruction=self.complex_human_instruction)
        return {"embeds": embeds, "mask": mask, "neg_embeds": neg, "neg_mask": neg_mask}

    def pipeline_sigmas(self, num_steps):
        return sd3_pipeline_sigmas(euler_scheduler(self.pipe.scheduler), num_steps, 0)

    def latent_shape(self):
        return (self.transformer.config.in_channels, self.cfg.height // self.vae_scale_factor, self.cfg.width // self.vae_scale_factor)

    def pipeline_arguments(self):
        return {**super().pipeline_arguments(), "use_resolution_binning": False}  # flowrl samples the configured size itself

    def _velocity(self, x, sigma, cond):
        g = self.guidance_scale
        use_cfg = g > 1.0
        x_in = x.to(self.device, self.dtype)
        embeds, mask = cond["embeds"], cond["mask"]
        if use_cfg:  # the pipeline's order: the unconditional half first
            x_in = torch.cat([x_in, x_in])
            embeds, mask = torch.cat([cond["neg_embeds"], embeds]), torch.cat([cond["neg_mask"], mask])
        t = self.timestep_rows(sigma, x_in.shape[0], scale=1000.0 * self.transformer.config.timestep_scale)
        v = self.net(x_in, encoder_hidden_states=embeds.to(self.dtype), encoder_attention_mask=mask, timestep=t,
                     return_dict=False)[0].float()
        if use_cfg:
            v_uncond, v_cond = v.chunk(2)
            v = v_uncond + g * (v_cond - v_uncond)
        if self.transformer.config.out_channels // 2 == self.vae.config.latent_channels:  # a learned-sigma head: v first
            v = v.chunk(2, dim=1)[0]
        return v

    def decode(self, latents):
        with torch.no_grad():
            image = self.vae.decode(latents.to(self.device, self.dtype) / self.vae.config.scaling_factor, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def encode_images(self, images):
        x = images.to(self.device, torch.float32) * 2 - 1
        with torch.no_grad():
            latents = self.vae.encode(x.to(self.dtype)).latent.float()  # the autoencoder is deterministic
        return latents * self.vae.config.scaling_factor
