"""Z-Image (model.kind z_image) against diffusers' own ZImagePipeline, on a tiny random pipeline
saved to disk: the ODE equals the pipeline's __call__ without guidance (Turbo's setting) and with
it, prompts of different lengths batch without changing each other, a LoRA trained by flowrl
(Flow-GRPO's SDE) reproduces `flowrl sample` in diffusers, and DiffusionNFT trains. The adapter's
ratio, KL, sigma-range and LoRA-format tests run in test_models.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import ZImagePipeline

from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from family_checks import PROMPTS, SEEDS, check_lora_reproduces_flowrl_sample, check_nft_trains, train_args


def _policy(path, guidance):
    return load_policy(ModelConfig(kind="z_image", path=path, height=64, width=64, guidance_scale=guidance,
                                   max_sequence_length=64), device="cpu")


@pytest.mark.parametrize("guidance", [0.0, 3.0], ids=["turbo-no-guidance", "guidance"])
def test_ode_equals_the_pipeline_call(tiny_z_image_dir, guidance):
    policy = _policy(tiny_z_image_dir, guidance)
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(5, "pipeline", 3.0)), len(PROMPTS))
    pipe = ZImagePipeline.from_pretrained(tiny_z_image_dir)
    # a copy: ZImagePipeline writes its chat template into the caller's prompt list
    theirs = pipe(prompt=list(PROMPTS), latents=traj.latents[:, 0], height=64, width=64, num_inference_steps=5,
                  guidance_scale=guidance, max_sequence_length=64, output_type="latent").images
    assert (theirs - traj.final).abs().max() <= 1e-5


def test_a_prompt_batched_with_a_longer_one_gets_the_velocity_it_gets_alone(tiny_z_image_dir):
    policy = _policy(tiny_z_image_dir, 3.0)
    x = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = policy.velocity(x, 0.7, policy.encode(PROMPTS))
        alone = torch.cat([policy.velocity(x[i : i + 1], 0.7, policy.encode([p])) for i, p in enumerate(PROMPTS)])
    assert not bool(policy.encode(PROMPTS)["mask"][0].all())  # the short prompt is padded in the batch
    assert (together - alone).abs().max() <= 1e-5


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_z_image_dir):
    pipe = ZImagePipeline.from_pretrained(tiny_z_image_dir)
    args = train_args("z_image", tiny_z_image_dir, 3.0)
    check_lora_reproduces_flowrl_sample(tmp_path / "run", args, pipe)


def test_diffusion_nft_trains(tmp_path, tiny_z_image_dir):
    check_nft_trains(tmp_path / "run", train_args("z_image", tiny_z_image_dir, 3.0))
