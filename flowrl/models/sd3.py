"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline` components)."""

from __future__ import annotations

import copy

import torch

from flowrl.models import register_family
from flowrl.models.base import FlowPolicy

# the published configs of the text encoders and the VAE SD3 shares with FLUX.1 (and Z-Image, the VAE)
CLIP_L = ("CLIPTextConfig", {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                             "projection_dim": 768, "vocab_size": 49408})
CLIP_G = ("CLIPTextConfig", {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
                             "projection_dim": 1280, "vocab_size": 49408})
T5_XXL = ("T5Config", {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
                       "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False})
VAE_16 = ("AutoencoderKL", {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
                            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
                            "layers_per_block": 2})


def sd3_pipeline_sigmas(scheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """The sigmas `StableDiffusion3Pipeline.__call__` samples on (diffusers 0.42): the scheduler's
    own `set_timesteps`, with `mu` from the image's token count when it shifts dynamically."""
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

    kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", None):
        c = scheduler.config
        kwargs["mu"] = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                       c.get("base_shift", 0.5), c.get("max_shift", 1.16))
    scheduler = copy.deepcopy(scheduler)  # set_timesteps changes the scheduler's state
    retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)
    return scheduler.sigmas.float().cpu()


@register_family
class SD3Policy(FlowPolicy):
    """Classifier-free guidance: v = v_uncond + g (v_cond - v_uncond), empty negative prompt."""

    kind = "sd3"
    pipeline_name = "StableDiffusion3Pipeline"
    trains_with_cfg = True
    token_patch = None  # patches of its config's patch_size over the 8x VAE latents
    prompt_tokens = 256  # T5's, model.max_sequence_length's default
    extra_prompt_tokens = 77  # CLIP's, in front of T5's
    known_models = {
        "stabilityai/stable-diffusion-3.5-medium": {
            "transformer": ("SD3Transformer2DModel", {
                "attention_head_dim": 64, "caption_projection_dim": 1536, "in_channels": 16, "joint_attention_dim": 4096,
                "num_attention_heads": 24, "num_layers": 24, "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048,
                "pos_embed_max_size": 384, "qk_norm": "rms_norm", "sample_size": 128, "dual_attention_layers": list(range(13))}),
            "text_encoders": [("CLIPTextModelWithProjection", CLIP_L), ("CLIPTextModelWithProjection", CLIP_G),
                              ("T5EncoderModel", T5_XXL)],
            "vae": VAE_16,
        },
    }

    def _encode_uncached(self, prompts):
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.text_device,
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
