"""Wan2.1 text-to-video (`WanPipeline` components): a UMT5 prompt encoder (each prompt's tokens kept,
zeros to max_sequence_length, no mask, as the pipeline passes them), the 3D transformer on video
latents [C, F', H/8, W/8] (F' = (F - 1) / 4 + 1 latent frames for F frames) at t = 1000 sigma, the
Wan VAE's per-channel latent mean and std, and classifier-free guidance
v = v_neg + g (v_cond - v_neg) on the empty negative prompt above 1.

Wan ships UniPC, a multistep solver, on flow sigmas shifted by `flow_shift`; flowrl's transitions are
one-step Euler (ODE) or Euler-Maruyama (SDE), so flowrl samples Wan with the Euler flow-matching step on
`FlowMatchEulerDiscreteScheduler(shift=flow_shift)`'s grid, as Flow-Factory and DanceGRPO train it (the
tests check the equality with the pipeline with that scheduler swapped in). Samples decode to videos
[B, 3, F, H, W]; rewards score their frames (rewards/video.py). Wan2.2's two experts and per-token
timesteps are not supported."""

from __future__ import annotations

import torch

from flowrl.errors import UserError
from flowrl.models import register_family
from flowrl.models.base import FlowPolicy
from flowrl.models.pipeline_call import euler_scheduler
from flowrl.models.sd3 import sd3_pipeline_sigmas


@register_family
class WanPolicy(FlowPolicy):
    kind = "wan"
    pipeline_name = "WanPipeline"
    video = True
    trains_with_cfg = True
    cross_attention = True
    known_models = {
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {
            "transformer": ("WanTransformer3DModel", {
                "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-6, "ffn_dim": 8960, "freq_dim": 256, "in_channels": 16,
                "num_attention_heads": 12, "num_layers": 30, "out_channels": 16, "patch_size": [1, 2, 2],
                "qk_norm": "rms_norm_across_heads", "text_dim": 4096}),
            "text_encoders": [("UMT5EncoderModel", ("UMT5Config", {  # UMT5-XXL's encoder
                "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 256384,
                "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False}))],
            "vae": ("AutoencoderKLWan", {}),  # the class's defaults are Wan2.1's VAE (z_dim 16, 8x spatial, 4x temporal)
        },
    }
    negative_prompt = ""  # WanPipeline's when none is given

    def __init__(self, pipe, cfg, device="cpu"):
        if pipe.transformer_2 is not None or pipe.config.boundary_ratio is not None or pipe.config.expand_timesteps:
            raise UserError(f"model.path '{cfg.path}' is a Wan2.2 pipeline (two experts or per-token timesteps); "
                            "model.kind wan trains Wan2.1's one transformer")
        super().__init__(pipe, cfg, device)

    def _encode_uncached(self, prompts):
        return {**self._encode_texts(prompts), **self.negative_once(lambda: self._encode_texts([self.negative_prompt]))}

    def _encode_texts(self, texts):
        embeds, _ = self.pipe.encode_prompt(prompt=list(texts), do_classifier_free_guidance=False, device=self.text_device,
                                            max_sequence_length=self.cfg.max_sequence_length)
        return {"embeds": embeds}

    def pipeline_sigmas(self, num_steps):
        return sd3_pipeline_sigmas(euler_scheduler(self.pipe.scheduler), num_steps, 0)

    def latent_frames(self) -> int:
        return (self.cfg.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1

    def latent_shape(self):
        f = self.vae_scale_factor
        return (self.transformer.config.in_channels, self.latent_frames(), self.cfg.height // f, self.cfg.width // f)

    def pipeline_arguments(self):
        return {**super().pipeline_arguments(), "num_frames": self.cfg.num_frames}

    def _velocity(self, x, sigma, cond):
        g = self.guidance_scale
        use_cfg = g > 1.0
        x_in = x.to(self.device, self.dtype)
        embeds = cond["embeds"]
        if use_cfg:  # one forward over both halves (the pipeline makes two; equal up to the last bits)
            x_in = torch.cat([x_in, x_in])
            embeds = torch.cat([embeds, cond["neg_embeds"]])
        t = self.timestep_rows(sigma, x_in.shape[0], scale=1000.0)
        v = self.net(hidden_states=x_in, timestep=t, encoder_hidden_states=embeds.to(self.dtype), return_dict=False)[0].float()
        if use_cfg:
            v_cond, v_neg = v.chunk(2)
            v = v_neg + g * (v_cond - v_neg)
        return v

    def encode_images(self, images):
        """Videos [B, 3, F, H, W] in [0, 1] -> latents (the VAE's posterior mean, normalised per channel)."""
        if images.dim() != 5:
            raise UserError(f"Wan encodes videos [B, 3, F, H, W]; got a tensor of shape {tuple(images.shape)}")
        x = images.to(self.device, torch.float32) * 2 - 1
        with torch.no_grad():
            latents = self.vae.encode(x.to(self.dtype)).latent_dist.mean.float()
        mean, std = self.per_channel_latent_stats(latents)
        return (latents - mean) / std

    def decode(self, latents):
        """Latents -> videos [B, 3, F, H, W] in [0, 1], fp32."""
        latents = latents.to(self.device, self.dtype)
        mean, std = self.per_channel_latent_stats(latents)
        with torch.no_grad():
            video = self.vae.decode(latents * std + mean, return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1)
