"""FLUX.2 [klein] (model.kind flux2_klein) against diffusers' own Flux2KleinPipeline, on tiny random
pipelines saved to disk: the ODE equals the pipeline's __call__ for the undistilled base with
guidance and for the distilled model (which ignores it), latents pack and normalise by the VAE's
batch-norm statistics as the pipeline's, a LoRA trained by flowrl (Flow-GRPO's SDE) reproduces
`flowrl sample` in diffusers, and DiffusionNFT trains. The adapter's ratio, KL, sigma-range and
LoRA-format tests run in test_models.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux2KleinPipeline

from flowrl.models import load_policy
from flowrl.models.tiny import build_tiny_flux2_klein
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from family_checks import PROMPTS, SEEDS, check_lora_reproduces_flowrl_sample, check_nft_trains, train_args


def _policy(path, guidance):
    return load_policy(ModelConfig(kind="flux2_klein", path=path, height=64, width=64, guidance_scale=guidance,
                                   max_sequence_length=64), device="cpu")


@pytest.mark.parametrize("distilled", [False, True], ids=["base-guided", "distilled"])
def test_ode_equals_the_pipeline_call(tiny_flux2_klein_dir, tmp_path, distilled):
    path = str(build_tiny_flux2_klein(tmp_path / "distilled", distilled=True)) if distilled else tiny_flux2_klein_dir
    policy = _policy(path, 4.0)
    assert policy.guided == (not distilled)
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(5, "pipeline", 3.0)), len(PROMPTS))
    pipe = Flux2KleinPipeline.from_pretrained(path)
    # the pipeline takes latents [B, 4C, h/2, w/2] where flowrl keeps tokens [B, h/2 x w/2, 4C]
    theirs = pipe(prompt=list(PROMPTS), latents=policy.pipeline_latents(traj.latents[:, 0]), height=64, width=64,
                  num_inference_steps=5, guidance_scale=4.0, max_sequence_length=64, output_type="latent").images
    # the pipeline returns unpatchified, de-normalised latents: flowrl's decode path before the VAE
    mean, std = policy._bn_stats(traj.final)
    ours = Flux2KleinPipeline._unpatchify_latents(policy.pipeline_latents(traj.final) * std + mean)
    assert (theirs - ours).abs().max() <= 1e-5


def test_latents_pack_and_normalise_as_the_pipeline_does(tiny_flux2_klein_dir):
    policy = _policy(tiny_flux2_klein_dir, 1.0)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    pipe = policy.pipe
    with torch.no_grad():
        want = Flux2KleinPipeline._pack_latents(pipe._encode_vae_image(images * 2 - 1, generator=None))
    assert torch.allclose(policy.encode_images(images), want, atol=1e-6)
    assert not torch.allclose(policy.vae.bn.running_var, torch.ones_like(policy.vae.bn.running_var))  # the statistics act


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_flux2_klein_dir):
    pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2_klein_dir)
    args = train_args("flux2_klein", tiny_flux2_klein_dir, 4.0)
    check_lora_reproduces_flowrl_sample(tmp_path / "run", args, pipe)


def test_diffusion_nft_trains(tmp_path, tiny_flux2_klein_dir):
    check_nft_trains(tmp_path / "run", train_args("flux2_klein", tiny_flux2_klein_dir, 4.0))
