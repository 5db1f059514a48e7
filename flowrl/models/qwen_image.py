"""Qwen-Image (`QwenImagePipeline` components): a Qwen2.5-VL prompt encoder whose embeddings vary
in length from prompt to prompt (a padding mask travels with them), latents packed 2x2 as FLUX.1
packs them, the pipeline's dynamic shifting with a terminal sigma, and true classifier-free
guidance on a negative prompt with the pipeline's rescaling of the guided velocity to the
conditional one's norm (Flow-GRPO trains through the same guided velocity)."""

from __future__ import annotations

import torch

from flowrl.models import register_family
from flowrl.models.base import FlowPolicy, pack_2x2, pad_cat, unpack_2x2
from flowrl.models.flux import flux_pipeline_sigmas


@register_family
class QwenImagePolicy(FlowPolicy):
    """v = rescale(v_neg + g (v_cond - v_neg)) on the negative prompt `negative_prompt` when
    model.guidance_scale (the pipeline's true_cfg_scale) is above 1, as `QwenImagePipeline.__call__`
    does; at 1 the conditional velocity alone, one forward."""

    kind = "qwen_image"
    pipeline_name = "QwenImagePipeline"
    guidance_argument = "true_cfg_scale"  # its guidance_scale is for guidance-distilled checkpoints
    trains_with_cfg = True
    known_models = {
        "Qwen/Qwen-Image": {
            "transformer": ("QwenImageTransformer2DModel", {
                "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": False, "in_channels": 64,
                "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60, "out_channels": 16, "patch_size": 2}),
            "text_encoders": [("Qwen2_5_VLForConditionalGeneration", ("Qwen2_5_VLConfig", {  # Qwen2.5-VL-7B-Instruct, as the pipeline loads it
                "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False},
                "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                  "out_hidden_size": 3584}}))],
            "vae": ("AutoencoderKLQwenImage", {}),  # the class's defaults are Qwen-Image's VAE (z_dim 16, 8x spatial)
        },
    }
    variable_length = True
    negative_prompt = " "  # what Flow-GRPO trains and evaluates Qwen-Image with

    def _encode_uncached(self, prompts):
        return {**self._encode_texts(prompts), **self.negative_once(lambda: self._encode_texts([self.negative_prompt]))}

    def _encode_texts(self, texts):
        embeds, mask = self.pipe.encode_prompt(prompt=list(texts), device=self.text_device,
                                               max_sequence_length=self.cfg.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"embeds": embeds, "mask": mask}

    def pipeline_sigmas(self, num_steps):
        # QwenImagePipeline.__call__ builds its grid as FluxPipeline's does: linspace(1, 1 / T, T) and mu
        return flux_pipeline_sigmas(self.pipe.scheduler, num_steps, self.latent_shape()[0])

    def latent_shape(self):
        return self._packed_latent_shape()

    def _velocity(self, x, sigma, cond):
        h, w = self._latent_hw()
        return self._guided_velocity(x.to(self.device, self.dtype), sigma, cond, [(1, h // 2, w // 2)], x.shape[1])

    def _guided_velocity(self, tokens, sigma, cond, img_shapes, keep):
        """The transformer over image `tokens` [B, N, C] (in the network's dtype) whose RoPE shapes are
        `img_shapes` (one (frames, rows, columns) per image the tokens hold, the same for every row), its
        prediction for the first `keep` tokens (the noisy target's; an edit's condition tokens follow them),
        guided on the negative prompt when model.guidance_scale is above 1; in fp32."""
        g = self.guidance_scale
        use_cfg = g > 1.0
        embeds, mask = cond["embeds"], cond["mask"]
        if use_cfg:  # one forward over both halves, the text streams padded to one length
            tokens = torch.cat([tokens, tokens])
            embeds, mask = pad_cat([embeds, cond["neg_embeds"]]), pad_cat([mask, cond["neg_mask"]])
        rows = tokens.shape[0]
        v = self.net(
            hidden_states=tokens,
            timestep=self.timestep_rows(sigma, rows),  # the pipeline passes t / 1000: sigma itself
            guidance=None,
            encoder_hidden_states=embeds.to(self.dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[list(img_shapes)] * rows,
            return_dict=False,
        )[0][:, :keep].float()
        if use_cfg:
            v_cond, v_neg = v.chunk(2)
            guided = v_neg + g * (v_cond - v_neg)
            v = guided * (v_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
        return v

    # ---- the VAE: a video VAE with one frame, latents normalised per channel ----------------------
    def encode_images(self, images):
        x = images.to(self.device, torch.float32) * 2 - 1
        with torch.no_grad():
            latents = self.vae.encode(x[:, :, None].to(self.dtype)).latent_dist.mean.float()  # [B, C, 1, h, w]
        mean, std = self.per_channel_latent_stats(latents)
        return pack_2x2(((latents - mean) / std)[:, :, 0])

    def decode(self, latents):
        unpacked = unpack_2x2(latents, *self._latent_hw())[:, :, None].to(self.device, self.dtype)  # one frame
        mean, std = self.per_channel_latent_stats(unpacked)
        with torch.no_grad():
            image = self.vae.decode(unpacked * std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
