"""Qwen-Image-Edit (`QwenImageEditPlusPipeline`, the 2509/2511 checkpoints): Qwen-Image whose prompt is an
edit (flowrl/models/edit_prompt.py). As diffusers 0.42's pipelines/qwenimage/pipeline_qwenimage_edit_plus.py
does in `__call__`, the source becomes two copies (`calculate_dimensions` keeps its aspect): one of ≈384²
pixels that Qwen2.5-VL reads inside the prompt template as "Picture 1: <|vision_start|><|image_pad|>
<|vision_end|>" before the instruction (`_get_qwen_prompt_embeds`), the negative prompt encoded with the same
image; and one of ≈1024² that the VAE encodes into normalised packed latents (`prepare_latents`,
`_encode_vae_image`), appended after the noisy target's tokens in every forward, with RoPE shapes
[target, source] (`img_shapes`: the source is frame 1), the prediction cropped to the target's tokens. The
grid and true CFG with its per-token norm rescale are Qwen-Image's.

The pipeline takes a source as a PIL image (it reads `image.size`), so flowrl rounds a source to 8 bits as
diffusers' `numpy_to_pil` does and resizes it with the pipeline's own `image_processor`: an image file's
source is exactly what the pipeline gets. Its `__call__` takes one prompt at a time; `diffusers_call`
draws a batch prompt by prompt."""

from __future__ import annotations

import functools
from typing import Any

import torch

from flowrl.errors import UserError
from flowrl.models import register_family
from flowrl.models.base import pack_2x2
from flowrl.models.qwen_image import QwenImagePolicy


@register_family
class QwenImageEditPolicy(QwenImagePolicy):
    """v(x | instruction, source): Qwen-Image's guided velocity over the target's tokens followed by the
    source's condition tokens, cropped to the target's, as `QwenImageEditPlusPipeline.__call__` denoises."""

    kind = "qwen_image_edit"
    pipeline_name = "QwenImageEditPlusPipeline"
    edits = True
    # the source's VAE copy at the pipeline's ≈1024² (VAE_IMAGE_SIZE): (1024 / 16)² tokens beside the target's; its
    # 384² copy (CONDITION_IMAGE_SIZE) adds about (384 / 28)² image tokens to the prompt's
    extra_prompt_tokens = 4096 + 188
    known_models = {  # Qwen-Image-Edit-2509's transformer, Qwen2.5-VL-7B and VAE are Qwen-Image's
        "Qwen/Qwen-Image-Edit-2509": QwenImagePolicy.known_models["Qwen/Qwen-Image"],
    }

    # ---- loading: the VL's processor without torchvision ----------------------------------------------------
    @classmethod
    def _load_pipeline(cls, path: str, cfg, **components) -> Any:
        """The pipeline, its `processor` assembled from its tokenizer and image processor where torchvision is
        missing: transformers then cannot build a Qwen2VLProcessor at all (its unused video processor's class check
        fails), though the image processor has a PIL backend that the pipeline's images need no more than."""
        import importlib.util

        if "processor" not in components and importlib.util.find_spec("torchvision") is None:
            try:
                components["processor"] = image_only_vl_processor(path)
            except (OSError, ValueError) as exc:
                raise UserError(f"model.path '{cfg.path}' has no loadable Qwen2.5-VL processor (its processor folder): "
                                f"{str(exc).splitlines()[0]}") from None
        return super()._load_pipeline(path, cfg, **components)

    # ---- prompts: the instruction and the source through the VL, the source through the VAE ------------------
    def _encode_uncached(self, prompts):
        # one EditPrompt (FlowPolicy.encode encodes one prompt at a time); the negative prompt reads the same image
        (prompt,) = prompts  # an EditPrompt: FlowPolicy.encode refuses a plain prompt first
        picture = [self._source_copies(prompt.image())[0]]
        return {**self._encode_edit(prompt.instruction, picture),
                **{"neg_" + k: v for k, v in self._encode_edit(self.negative_prompt, picture).items()}}

    def _encode_edit(self, text: str, pictures: list) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(prompt=[text], image=pictures, device=self.text_device)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"embeds": embeds, "mask": mask}

    def encode_source(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """The source's VAE copy as the pipeline's condition tokens [1, N, 4C] (`prepare_latents`: the posterior's
        mode, (z - latents_mean) / latents_std, packed 2x2) and their latent grid (rows, columns) / 2 for RoPE."""
        vae_image = self._source_copies(image)[1].to(self.device, self.dtype)  # [1, 3, 1, H, W] in [-1, 1]
        latents = self.vae.encode(vae_image).latent_dist.mode().float()  # retrieve_latents(sample_mode="argmax")
        mean, std = self.per_channel_latent_stats(latents)
        latents = ((latents - mean) / std)[:, :, 0]
        h, w = latents.shape[-2:]
        return {"source": pack_2x2(latents), "source_grid": torch.tensor([[h // 2, w // 2]])}

    def _source_copies(self, image: torch.Tensor):
        """The pipeline's two copies of a source [3, H, W] in [0, 1] (`__call__`, given it as a PIL image): the VL's
        PIL image of ≈CONDITION_IMAGE_SIZE pixels and the VAE's tensor [1, 3, 1, h, w] of ≈VAE_IMAGE_SIZE."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE,
                                                                                calculate_dimensions)

        picture = source_pil(image)
        width, height = picture.size
        condition_w, condition_h = calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)
        vae_w, vae_h = calculate_dimensions(VAE_IMAGE_SIZE, width / height)
        processor = self.pipe.image_processor
        return (processor.resize(picture, condition_h, condition_w),
                processor.preprocess(picture, vae_h, vae_w).unsqueeze(2))

    # ---- the network: the target's tokens, then the source's -------------------------------------------------
    def _velocity(self, x, sigma, cond):
        # the transformer takes one set of RoPE shapes for a batch (QwenEmbedRope reads the first row's), so rows whose
        # sources differ in aspect (their condition grids) run apart
        grids = cond["source_grid"].tolist()
        if len(set(map(tuple, grids))) == 1:
            return self._edit_velocity(x, sigma, cond, grids[0])
        v = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        sigmas = torch.as_tensor(sigma).reshape(-1)
        for grid in dict.fromkeys(map(tuple, grids)):
            members = torch.tensor([tuple(g) == grid for g in grids])
            part = {k: t[members.to(t.device)] for k, t in cond.items()}
            sigma_part = sigmas[members] if sigmas.numel() > 1 else sigma
            v[members.to(self.device)] = self._edit_velocity(x[members.to(x.device)], sigma_part, part, list(grid))
        return v

    def _edit_velocity(self, x, sigma, cond, grid):
        rows, columns = grid
        source = cond["source"][:, : rows * columns]  # a batch pads every source to the longest one's tokens
        h, w = self._latent_hw()
        tokens = torch.cat([x.to(self.device, self.dtype), source.to(self.device, self.dtype)], dim=1)
        return self._guided_velocity(tokens, sigma, cond, [(1, h // 2, w // 2), (1, rows, columns)], x.shape[1])

    # ---- the pipeline's own call ------------------------------------------------------------------------------
    def pipeline_source_arguments(self, prompts) -> dict[str, Any]:
        """`image=`: one prompt's source as the PIL image the pipeline resizes into its two copies."""
        if len(prompts) != 1:
            raise ValueError(f"QwenImageEditPlusPipeline.__call__ takes one prompt at a time; got {len(prompts)}")
        return {"image": source_pil(prompts[0].image())}

    def pipeline_source_code(self, path):
        return ["from PIL import Image", f"image = Image.open({path!r}).convert('RGB')"]

    def diffusers_call(self, pipe, latents, prompts, num_steps, schedule="pipeline", shift=3.0, gated=False):
        # QwenImageEditPlusPipeline.__call__ refuses a batch_size above 1: one call per prompt
        draw = super().diffusers_call
        return torch.cat([draw(pipe, latents[i : i + 1], [p], num_steps, schedule, shift, gated) for i, p in enumerate(prompts)])


def source_pil(image: torch.Tensor):
    """A source [3, H, W] in [0, 1] as the 8-bit PIL image the pipeline takes (diffusers' `numpy_to_pil`
    rounding): the pixels of the image file it was read from."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(image[None].float().cpu()))[0]


def image_only_vl_processor(path: str):
    """The pipeline's Qwen2VLProcessor from `path`'s processor folder, built without a video processor."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    folder = {"subfolder": "processor"}
    return _image_only_processor_class()(image_processor=Qwen2VLImageProcessor.from_pretrained(path, **folder),
                                         tokenizer=AutoTokenizer.from_pretrained(path, **folder))


@functools.cache
def _image_only_processor_class():
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor whose absent video processor passes the class check (transformers looks its class
        up among the torchvision-backed processors, which fails without torchvision); images and text are
        processed by Qwen2VLProcessor's own code."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyQwen2VLProcessor
