"""Qwen-Image (model.kind qwen_image) against diffusers' own QwenImagePipeline, on a tiny random
pipeline saved to disk: the ODE equals the pipeline's __call__ with and without true CFG, prompts of
different lengths batch without changing each other, latents pack and normalise as the pipeline's,
a LoRA trained by flowrl (Flow-GRPO's SDE, 2 iterations) reproduces `flowrl sample` in diffusers,
and DiffusionNFT trains. The adapter's ratio, KL, sigma-range and LoRA-format tests run in
test_models.py beside SD3's and FLUX's."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImagePipeline

from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from family_checks import SEEDS, check_lora_reproduces_flowrl_sample, check_nft_trains, train_args

PROMPTS = ["a red circle", "two small blue squares on a table"]  # two lengths: the text streams are padded


def _policy(path, guidance, size=64):
    return load_policy(ModelConfig(kind="qwen_image", path=path, height=size, width=size, guidance_scale=guidance,
                                   max_sequence_length=64), device="cpu")


def _pipeline_latents(path, latents, guidance, size=64, steps=5):
    pipe = QwenImagePipeline.from_pretrained(path)
    cfg = {"negative_prompt": " ", "true_cfg_scale": guidance} if guidance > 1 else {}
    return pipe(prompt=PROMPTS, latents=latents, height=size, width=size, num_inference_steps=steps, max_sequence_length=64,
                output_type="latent", **cfg).images


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["no-cfg", "true-cfg"])
def test_ode_equals_the_pipeline_call(tiny_qwen_image_dir, guidance):
    policy = _policy(tiny_qwen_image_dir, guidance)
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(5, "pipeline", 3.0)), len(PROMPTS))
    theirs = _pipeline_latents(tiny_qwen_image_dir, traj.latents[:, 0], guidance)
    assert (theirs - traj.final).abs().max() <= 1e-5
    # the grid is the pipeline's: dynamically shifted and stretched to end at shift_terminal before 0
    sigmas = policy.sigmas(5, "auto", 3.0)
    assert sigmas[-1] == 0 and sigmas[-2] == pytest.approx(0.02, abs=1e-6)


def test_the_template_drop_leaves_the_prompt_alone(tiny_qwen_image_dir):
    # the pipeline drops the first prompt_template_encode_start_idx tokens of the encoder's output: the
    # system part of its template, as the tiny tokenizer splits it too (else the prompt would be cut)
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image_dir)
    system = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(system).input_ids) == pipe.prompt_template_encode_start_idx


def test_a_prompt_batched_with_a_longer_one_gets_the_velocity_it_gets_alone(tiny_qwen_image_dir):
    policy = _policy(tiny_qwen_image_dir, 4.0)
    x = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = policy.velocity(x, 0.7, policy.encode(PROMPTS))
        alone = torch.cat([policy.velocity(x[i : i + 1], 0.7, policy.encode([p])) for i, p in enumerate(PROMPTS)])
    cond = policy.encode(PROMPTS)
    assert cond["embeds"].shape[1] == cond["mask"].shape[1] and not bool(cond["mask"][0].all())  # the short one is padded
    assert (together - alone).abs().max() <= 1e-5


def test_latents_pack_and_normalise_as_the_pipeline_does(tiny_qwen_image_dir):
    policy = _policy(tiny_qwen_image_dir, 1.0)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    vae, c = policy.vae, policy.vae.config
    with torch.no_grad():
        z = vae.encode(images[:, :, None] * 2 - 1).latent_dist.mean
    mean, std = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1), torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    b, ch, _, h, w = z.shape
    # the img2img pipeline's normalisation, (z - mean) x (1 / std), then QwenImagePipeline._pack_latents
    want = QwenImagePipeline._pack_latents(((z - mean) * (1.0 / std))[:, :, 0], b, ch, h, w)
    assert torch.allclose(policy.encode_images(images), want, atol=1e-6)
    # decoding: the pipeline's _unpack_latents, z / (1 / std) + mean, the VAE, its first frame
    latents = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        unpacked = QwenImagePipeline._unpack_latents(latents, 64, 64, policy.vae_scale_factor)
        frames = vae.decode(unpacked / (1.0 / std) + mean, return_dict=False)[0][:, :, 0]
    assert torch.allclose(policy.decode(latents), (frames / 2 + 0.5).clamp(0, 1), atol=1e-6)


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_qwen_image_dir):
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image_dir)  # called with true_cfg_scale and the negative prompt " "
    args = train_args("qwen_image", tiny_qwen_image_dir, 4.0)
    check_lora_reproduces_flowrl_sample(tmp_path / "run", args, pipe)


def test_diffusion_nft_trains(tmp_path, tiny_qwen_image_dir):
    check_nft_trains(tmp_path / "run", train_args("qwen_image", tiny_qwen_image_dir, 4.0))
