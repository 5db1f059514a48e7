"""FLUX.2 [dev] (model.kind flux2) against diffusers' own Flux2Pipeline, on a tiny random pipeline
(a 30-layer Mistral 3 behind a Pixtral processor, the transformer with its guidance embedder): the
ODE equals the pipeline's __call__ at two guidance scales (the embedding, one forward, no negative
prompt), a LoRA trained by flowrl (Flow-GRPO's SDE) reproduces `flowrl sample` in diffusers, and
DiffusionNFT trains. The adapter's ratio, KL, sigma-range and LoRA-format tests run in test_models.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux2Pipeline

from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from family_checks import PROMPTS, SEEDS, check_lora_reproduces_flowrl_sample, check_nft_trains, train_args


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_equals_the_pipeline_call(tiny_flux2_dir, guidance):
    policy = load_policy(ModelConfig(kind="flux2", path=tiny_flux2_dir, height=64, width=64, guidance_scale=guidance,
                                     max_sequence_length=64), device="cpu")
    assert not policy.guided and "neg_embeds" not in policy.encode(PROMPTS[:1])
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(5, "pipeline", 3.0)), len(PROMPTS))
    pipe = Flux2Pipeline.from_pretrained(tiny_flux2_dir)
    # the pipeline takes latents [B, 4C, h/2, w/2] where flowrl keeps tokens [B, h/2 x w/2, 4C]
    theirs = pipe(prompt=list(PROMPTS), latents=policy.pipeline_latents(traj.latents[:, 0]), height=64, width=64,
                  num_inference_steps=5, guidance_scale=guidance, max_sequence_length=64, output_type="latent").images
    assert theirs.shape == traj.final.shape and (theirs - traj.final).abs().max() <= 1e-5  # both packed tokens


def test_the_guidance_scale_moves_the_velocity(tiny_flux2_dir):
    # the embedder is the only way guidance reaches a guidance-distilled model: it must act
    policy = load_policy(ModelConfig(kind="flux2", path=tiny_flux2_dir, height=64, width=64, max_sequence_length=64), device="cpu")
    x, cond = torch.randn(1, *policy.latent_shape()), policy.encode(PROMPTS[:1])
    with torch.no_grad(), policy.guidance(1.0):
        low = policy.velocity(x, 0.5, cond)
    with torch.no_grad(), policy.guidance(4.0):
        high = policy.velocity(x, 0.5, cond)
    assert not torch.allclose(low, high)


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_flux2_dir):
    pipe = Flux2Pipeline.from_pretrained(tiny_flux2_dir)
    check_lora_reproduces_flowrl_sample(tmp_path / "run", train_args("flux2", tiny_flux2_dir, 4.0), pipe)


def test_diffusion_nft_trains(tmp_path, tiny_flux2_dir):
    check_nft_trains(tmp_path / "run", train_args("flux2", tiny_flux2_dir, 4.0))
