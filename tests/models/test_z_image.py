"""Z-Image (model.kind z_image) against diffusers' own ZImagePipeline, on a tiny random pipeline
saved to disk: the ODE equals the pipeline's __call__ without guidance (Turbo's setting) and with
it, prompts of different lengths batch without changing each other, a LoRA trained by flowrl
(Flow-GRPO's SDE) reproduces `flowrl sample` in diffusers, and DiffusionNFT trains. The adapter's
ratio, KL, sigma-range and LoRA-format tests run in test_models.py."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import ZImagePipeline

from flowrl.cli import _load_run_policy, _ode_images, main
from flowrl.models import load_policy
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from run_checks import run_metrics, trainable

PROMPTS = ["a red circle", "two small blue squares on a table"]
SEEDS = [3, 4]


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


TRAIN = ["train", "tiny_jpeg", "model.kind=z_image", "model.guidance_scale=3.0", "model.max_sequence_length=64",
         "sampling.num_steps=3", "sampling.eval_num_steps=4", "data.group_size=4", "sampling.batch_size=4",
         "data.prompts_per_iteration=1", "lora.rank=4", "lora.alpha=8", "lora.target_modules=[to_q,to_k,to_v,to_out.0]",
         "trainer.iterations=2", "run.tracker=none", "run.progress=false", "run.sample_every=0"]


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_z_image_dir):
    run = tmp_path / "run"
    assert main([*TRAIN, f"model.path={tiny_z_image_dir}", "sampling.sampler=flow_grpo", "--run-dir", str(run)]) == 0
    cfg, policy, ckpt = _load_run_policy(run)
    ours = _ode_images(cfg, policy, PROMPTS, SEEDS)  # what `flowrl sample` draws

    def pipeline_images(pipe):
        latents = seeded_noise(SEEDS, INITIAL, policy.latent_shape())
        # a copy of the prompts: the pipeline templates the list it is given in place
        return pipe(prompt=list(PROMPTS), guidance_scale=3.0, latents=latents, height=64, width=64, num_inference_steps=4,
                    max_sequence_length=64, output_type="pt").images

    pipe = ZImagePipeline.from_pretrained(tiny_z_image_dir)
    base = pipeline_images(pipe)
    pipe.load_lora_weights(str(ckpt / "ema_lora"))
    theirs = pipeline_images(pipe)
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-5
    assert (base - ours).abs().max() > 1e-4  # the adapter changed the samples, so the match above means something


def test_diffusion_nft_trains(tmp_path, tiny_z_image_dir):
    run = tmp_path / "run"
    assert main([*TRAIN, f"model.path={tiny_z_image_dir}", "objective.kind=nft", "sampling.sampler=ode",
                 "trainer.kl_beta=0", "objective.nft.timesteps=2", "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)  # the adapter left its zero init
