"""Z-Image (`ZImagePipeline` components; Z-Image and the distilled Z-Image-Turbo): a Qwen3 prompt
encoder (its chat template, the second-to-last hidden layer, each prompt at its own length), a
single-stream transformer that takes the batch as lists of latents and prompt features, runs on
the reversed clock t = 1 - sigma and predicts the negated velocity, and the pipeline's guidance
v = v_cond + g (v_cond - v_neg) on the empty negative prompt (off at g = 0, Turbo's setting)."""

from __future__ import annotations

import torch

from flowrl.models import register_family
from flowrl.models.base import FlowPolicy
from flowrl.models.flux import flux_pipeline_sigmas
from flowrl.models.sd3 import VAE_16


@register_family
class ZImagePolicy(FlowPolicy):
    kind = "z_image"
    pipeline_name = "ZImagePipeline"
    known_models = {
        "Tongyi-MAI/Z-Image-Turbo": {
            "transformer": ("ZImageTransformer2DModel", {}),  # the class's defaults are the released model's (dim 3840, 30 layers)
            "text_encoders": [("Qwen3Model", ("Qwen3Config", {  # Qwen3-4B
                "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}))],
            "vae": VAE_16,  # FLUX.1's
        },
    }
    variable_length = True

    def _encode_uncached(self, prompts):
        return {**self._encode_texts(prompts), **self.negative_once(lambda: self._encode_texts([""]))}  # the pipeline's negative

    def _encode_texts(self, texts):
        # a copy of the list: the pipeline writes its chat template into the list it is given
        (features,) = self.pipe._encode_prompt(prompt=list(texts), device=self.text_device,
                                               max_sequence_length=self.cfg.max_sequence_length)
        mask = torch.ones(1, features.shape[0], dtype=torch.long, device=features.device)
        return {"embeds": features[None], "mask": mask}  # [1, L, D]: this prompt's own length

    def pipeline_sigmas(self, num_steps):
        # ZImagePipeline.__call__: linspace(1, 1 / T, T) (get_default_z_image_sigmas) shifted by mu of the
        # 2x2-patch token count, as FluxPipeline's grid
        _, h, w = self.latent_shape()
        return flux_pipeline_sigmas(self.pipe.scheduler, num_steps, (h // 2) * (w // 2))

    def latent_shape(self):
        return (self.transformer.config.in_channels, self.cfg.height // self.vae_scale_factor, self.cfg.width // self.vae_scale_factor)

    def _velocity(self, x, sigma, cond):
        g = self.guidance_scale
        use_cfg = g > 0
        b = x.shape[0]
        x_in = x.to(self.device, self.dtype)
        features = self._features(cond["embeds"], cond["mask"])
        if use_cfg:  # the pipeline's one forward over the conditional rows, then the negative ones
            x_in = torch.cat([x_in, x_in])
            features = features + self._features(cond["neg_embeds"], cond["neg_mask"])
        # the model's clock runs the other way: t = (1000 - 1000 sigma) / 1000
        t = self.timestep_rows(1.0 - torch.as_tensor(sigma, dtype=torch.float64), x_in.shape[0])
        out = self.net(list(x_in.unsqueeze(2).unbind(0)), t, features, return_dict=False)[0]
        v = -torch.stack([o.float() for o in out]).squeeze(2)  # the network predicts -v
        if use_cfg:
            v_cond, v_neg = v[:b], v[b:]
            v = v_cond + g * (v_cond - v_neg)
        return v

    @staticmethod
    def _features(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """The padded batch back to the pipeline's list of per-prompt features [L_i, D]."""
        return [e[m.bool()] for e, m in zip(embeds, mask)]

    def decode(self, latents):
        return self._vae_decode(latents)

