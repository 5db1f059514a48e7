"""FLUX.2: [klein] (`Flux2KleinPipeline` components; the 4B/9B distilled models and their undistilled
bases) and [dev] (`Flux2Pipeline`, the 32B guidance-distilled model). Both stack the hidden states of
three layers of their prompt encoder side by side (padded to max_sequence_length, no mask): Qwen3's for
[klein], Mistral Small 3.1's behind its system message for [dev]. Latents are patchified 2x2 by the
pipeline and kept packed as tokens [B, h/2 x w/2, 4C] normalised by the VAE's batch-norm statistics,
with 4D rotary ids, on a grid whose shift depends on the step count (`compute_empirical_mu`).
Guidance: classifier-free on the empty prompt for the undistilled [klein] bases, none for the distilled
[klein] models, and the guidance embedding (no negative prompt) for [dev]."""

from __future__ import annotations

import copy

import numpy as np
import torch

from flowrl.models import register_family
from flowrl.models.base import FlowPolicy


def flux2_pipeline_sigmas(scheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """The sigmas `Flux2KleinPipeline.__call__` samples on (diffusers 0.42): linspace(1, 1 / T, T)
    shifted by an empirical mu of the token count and of T itself."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

    sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
    scheduler = copy.deepcopy(scheduler)  # set_timesteps changes the scheduler's state
    retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=compute_empirical_mu(image_seq_len, num_steps))
    return scheduler.sigmas.float().cpu()


@register_family
class Flux2KleinPolicy(FlowPolicy):
    """v = v_neg + g (v_cond - v_neg) when model.guidance_scale is above 1 and the pipeline is not
    the distilled model (`is_distilled` in its config), as the pipeline guides; else one forward."""

    kind = "flux2_klein"
    pipeline_name = "Flux2KleinPipeline"
    known_models = {
        "black-forest-labs/FLUX.2-klein-9B": {
            "transformer": ("Flux2Transformer2DModel", {
                "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32, "attention_head_dim": 128,
                "joint_attention_dim": 12288, "guidance_embeds": False}),  # the other fields: the class's defaults, as FLUX.2 [dev]'s
            "text_encoders": [("Qwen3ForCausalLM", ("Qwen3Config", {  # Qwen3-8B
                "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}))],
            "vae": ("AutoencoderKLFlux2", {}),
        },
    }

    def _encode_uncached(self, prompts):
        return {**self._encode_texts(prompts), **self.negative_once(lambda: self._encode_texts([""]))}  # the pipeline's negative

    def _encode_texts(self, texts):
        embeds, text_ids = self.pipe.encode_prompt(prompt=list(texts), device=self.text_device,
                                                   max_sequence_length=self.cfg.max_sequence_length)
        return {"embeds": embeds, "text_ids": text_ids}

    def pipeline_sigmas(self, num_steps):
        return flux2_pipeline_sigmas(self.pipe.scheduler, num_steps, self.latent_shape()[0])

    def latent_shape(self):
        return self._packed_latent_shape()

    def pipeline_latents(self, latents):
        h, w = self._latent_hw()
        return latents.transpose(1, 2).unflatten(2, (h // 2, w // 2))

    def pipeline_latents_code(self, name):
        h, w = self._latent_hw()
        return f"{name}.transpose(1, 2).unflatten(2, ({h // 2}, {w // 2}))  # flowrl's tokens as the pipeline's [B, 4C, h/2, w/2]"

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1.0 and not self.pipe.config.is_distilled

    def guidance_embedding(self, rows: int) -> torch.Tensor | None:
        """What the transformer's guidance embedder gets: nothing for [klein]."""
        return None

    def _velocity(self, x, sigma, cond):
        b = x.shape[0]
        x_in = x.to(self.device, self.dtype)
        embeds, text_ids = cond["embeds"], cond["text_ids"]
        if self.guided:  # one forward over both halves (the text streams have one length: max_sequence_length)
            x_in = torch.cat([x_in, x_in])
            embeds, text_ids = torch.cat([embeds, cond["neg_embeds"]]), torch.cat([text_ids, cond["neg_text_ids"]])
        h, w = self._latent_hw()
        rows = x_in.shape[0]
        img_ids = self.pipeline_class._prepare_latent_ids(x_in.new_empty(rows, 1, h // 2, w // 2)).to(self.device)
        v = self.net(
            hidden_states=x_in,
            encoder_hidden_states=embeds.to(self.dtype),
            timestep=self.timestep_rows(sigma, rows),  # the pipeline passes t / 1000: sigma itself
            img_ids=img_ids,
            txt_ids=text_ids,
            guidance=self.guidance_embedding(rows),
            return_dict=False,
        )[0].float()
        if self.guided:
            v_cond, v_neg = v[:b], v[b:]
            v = v_neg + self.guidance_scale * (v_cond - v_neg)
        return v

    # ---- the VAE: 2x2 patches normalised by its batch-norm statistics -------------------------------
    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def encode_images(self, images):
        from diffusers import Flux2KleinPipeline  # its latent layout, [dev]'s too

        x = images.to(self.device, torch.float32) * 2 - 1
        with torch.no_grad():
            latents = self.vae.encode(x.to(self.dtype)).latent_dist.mode().float()
        patches = Flux2KleinPipeline._patchify_latents(latents)
        mean, std = self._bn_stats(patches)
        return Flux2KleinPipeline._pack_latents((patches - mean) / std)

    def decode(self, latents):
        from diffusers import Flux2KleinPipeline

        h, w = self._latent_hw()
        b, _, c = latents.shape
        patches = latents.to(self.device, self.dtype).permute(0, 2, 1).reshape(b, c, h // 2, w // 2)  # the packing undone
        mean, std = self._bn_stats(patches)
        with torch.no_grad():
            image = self.vae.decode(Flux2KleinPipeline._unpatchify_latents(patches * std + mean), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


@register_family
class Flux2Policy(Flux2KleinPolicy):
    """FLUX.2 [dev]: guidance-distilled, so model.guidance_scale goes into the transformer's guidance
    embedding for every row, as `Flux2Pipeline.__call__` passes it, with one forward and no negative
    prompt (as FLUX.1 [dev])."""

    kind = "flux2"
    pipeline_name = "Flux2Pipeline"
    known_models = {
        "black-forest-labs/FLUX.2-dev": {
            "transformer": ("Flux2Transformer2DModel", {}),  # the class's defaults are FLUX.2 [dev]'s (8 + 48 blocks, 6144 wide)
            "text_encoders": [("Mistral3ForConditionalGeneration", ("Mistral3Config", {  # Mistral-Small-3.1-24B, as Flux2Pipeline loads it
                "text_config": {"model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
                                "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                "tie_word_embeddings": False},
                "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                                  "num_attention_heads": 16, "head_dim": 64, "image_size": 1540, "patch_size": 14},
                "tie_word_embeddings": False}))],
            "vae": ("AutoencoderKLFlux2", {}),
        },
    }

    def _encode_uncached(self, prompts):
        return self._encode_texts(prompts)

    @property
    def guided(self) -> bool:
        return False

    def guidance_embedding(self, rows):
        return torch.full((rows,), float(self.guidance_scale), device=self.device, dtype=torch.float32)
