"""FLUX.2 [klein] (model.kind flux2_klein) against diffusers' own Flux2KleinPipeline, on tiny random
pipelines saved to disk: the ODE equals the pipeline's __call__ for the undistilled base with
guidance and for the distilled model (which ignores it), latents pack and normalise by the VAE's
batch-norm statistics as the pipeline's, a LoRA trained by flowrl (Flow-GRPO's SDE) reproduces
`flowrl sample` in diffusers, and DiffusionNFT trains. The adapter's ratio, KL, sigma-range and
LoRA-format tests run in test_models.py."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import Flux2KleinPipeline

from flowrl.cli import _load_run_policy, _ode_images, main
from flowrl.models import load_policy
from flowrl.models.tiny import build_tiny_flux2_klein
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from run_checks import run_metrics, trainable

PROMPTS = ["a red circle", "two small blue squares on a table"]
SEEDS = [3, 4]


def _policy(path, guidance):
    return load_policy(ModelConfig(kind="flux2_klein", path=path, height=64, width=64, guidance_scale=guidance,
                                   max_sequence_length=64), device="cpu")


def _as_pipeline_latents(packed: torch.Tensor, side: int = 4) -> torch.Tensor:
    """flowrl's packed tokens [B, h/2 x w/2, 4C] as the pipeline's `latents` argument [B, 4C, h/2, w/2]."""
    b, n, c = packed.shape
    return packed.permute(0, 2, 1).reshape(b, c, side, side)


@pytest.mark.parametrize("distilled", [False, True], ids=["base-guided", "distilled"])
def test_ode_equals_the_pipeline_call(tiny_flux2_klein_dir, tmp_path, distilled):
    path = str(build_tiny_flux2_klein(tmp_path / "distilled", distilled=True)) if distilled else tiny_flux2_klein_dir
    policy = _policy(path, 4.0)
    assert policy.guided == (not distilled)
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(5, "pipeline", 3.0)), len(PROMPTS))
    pipe = Flux2KleinPipeline.from_pretrained(path)
    theirs = pipe(prompt=list(PROMPTS), latents=_as_pipeline_latents(traj.latents[:, 0]), height=64, width=64,
                  num_inference_steps=5, guidance_scale=4.0, max_sequence_length=64, output_type="latent").images
    # the pipeline returns unpatchified, de-normalised latents: flowrl's decode path before the VAE
    mean, std = policy._bn_stats(traj.final)
    ours = Flux2KleinPipeline._unpatchify_latents(_as_pipeline_latents(traj.final) * std + mean)
    assert (theirs - ours).abs().max() <= 1e-5


def test_latents_pack_and_normalise_as_the_pipeline_does(tiny_flux2_klein_dir):
    policy = _policy(tiny_flux2_klein_dir, 1.0)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    pipe = policy.pipe
    with torch.no_grad():
        want = Flux2KleinPipeline._pack_latents(pipe._encode_vae_image(images * 2 - 1, generator=None))
    assert torch.allclose(policy.encode_images(images), want, atol=1e-6)
    assert not torch.allclose(policy.vae.bn.running_var, torch.ones_like(policy.vae.bn.running_var))  # the statistics act


TRAIN = ["train", "tiny_jpeg", "model.kind=flux2_klein", "model.guidance_scale=4.0", "model.max_sequence_length=64",
         "sampling.num_steps=3", "sampling.eval_num_steps=4", "data.group_size=4", "sampling.batch_size=4",
         "data.prompts_per_iteration=1", "lora.rank=4", "lora.alpha=8", "lora.target_modules=[to_q,to_k,to_v,to_out.0]",
         "trainer.iterations=2", "run.tracker=none", "run.progress=false", "run.sample_every=0"]


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_flux2_klein_dir):
    run = tmp_path / "run"
    assert main([*TRAIN, f"model.path={tiny_flux2_klein_dir}", "sampling.sampler=flow_grpo", "--run-dir", str(run)]) == 0
    cfg, policy, ckpt = _load_run_policy(run)
    ours = _ode_images(cfg, policy, PROMPTS, SEEDS)  # what `flowrl sample` draws

    def pipeline_images(pipe):
        latents = _as_pipeline_latents(seeded_noise(SEEDS, INITIAL, policy.latent_shape()))
        return pipe(prompt=list(PROMPTS), guidance_scale=4.0, latents=latents, height=64, width=64, num_inference_steps=4,
                    max_sequence_length=64, output_type="pt").images

    pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2_klein_dir)
    base = pipeline_images(pipe)
    pipe.load_lora_weights(str(ckpt / "ema_lora"))
    theirs = pipeline_images(pipe)
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-5
    assert (base - ours).abs().max() > 1e-4  # the adapter changed the samples, so the match above means something


def test_diffusion_nft_trains(tmp_path, tiny_flux2_klein_dir):
    run = tmp_path / "run"
    assert main([*TRAIN, f"model.path={tiny_flux2_klein_dir}", "objective.kind=nft", "sampling.sampler=ode",
                 "trainer.kl_beta=0", "objective.nft.timesteps=2", "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)  # the adapter left its zero init
