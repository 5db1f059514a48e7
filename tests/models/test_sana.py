"""SANA (model.kind sana) against diffusers' own SanaPipeline, on a tiny random pipeline that ships
DPM-Solver++ as SANA does: flowrl samples with the Euler flow-matching step, so its ODE equals the
pipeline's __call__ with FlowMatchEulerDiscreteScheduler(shift=flow_shift) swapped in, with and
without guidance; a LoRA trained by flowrl (Flow-GRPO's SDE) reproduces `flowrl sample` in that
pipeline, and DiffusionNFT trains. The adapter's ratio, KL, sigma-range and LoRA-format tests run
in test_models.py."""

from __future__ import annotations

import math

import pytest
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, SanaPipeline

from flowrl.cli import _load_run_policy, _ode_images, main
from flowrl.models import load_policy
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from run_checks import run_metrics, trainable

PROMPTS = ["a red circle", "two small blue squares on a table"]
SEEDS = [3, 4]


def _euler_pipeline(path) -> SanaPipeline:
    pipe = SanaPipeline.from_pretrained(path)
    assert isinstance(pipe.scheduler, DPMSolverMultistepScheduler)  # what SANA ships
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return pipe


@pytest.mark.parametrize("guidance", [1.0, 4.5], ids=["no-cfg", "cfg"])
def test_ode_equals_the_pipeline_call_with_the_euler_scheduler(tiny_sana_dir, guidance):
    policy = load_policy(ModelConfig(kind="sana", path=tiny_sana_dir, height=64, width=64, guidance_scale=guidance,
                                     max_sequence_length=64), device="cpu")
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(5, "pipeline", 3.0)), len(PROMPTS))
    theirs = _euler_pipeline(tiny_sana_dir)(prompt=list(PROMPTS), latents=traj.latents[:, 0], height=64, width=64,
                                            num_inference_steps=5, guidance_scale=guidance, max_sequence_length=64,
                                            use_resolution_binning=False, output_type="latent").images
    assert (theirs - traj.final).abs().max() <= 1e-5


TRAIN = ["train", "tiny_jpeg", "model.kind=sana", "model.guidance_scale=4.5", "model.max_sequence_length=64",
         "sampling.num_steps=3", "sampling.eval_num_steps=4", "data.group_size=4", "sampling.batch_size=4",
         "data.prompts_per_iteration=1", "lora.rank=4", "lora.alpha=8", "lora.target_modules=[to_q,to_k,to_v,to_out.0]",
         "trainer.iterations=2", "run.tracker=none", "run.progress=false", "run.sample_every=0"]


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_sana_dir):
    run = tmp_path / "run"
    assert main([*TRAIN, f"model.path={tiny_sana_dir}", "sampling.sampler=flow_grpo", "--run-dir", str(run)]) == 0
    cfg, policy, ckpt = _load_run_policy(run)
    ours = _ode_images(cfg, policy, PROMPTS, SEEDS)  # what `flowrl sample` draws

    def pipeline_images(pipe):
        latents = seeded_noise(SEEDS, INITIAL, policy.latent_shape())
        return pipe(prompt=list(PROMPTS), guidance_scale=4.5, latents=latents, height=64, width=64, num_inference_steps=4,
                    max_sequence_length=64, use_resolution_binning=False, output_type="pt").images

    pipe = _euler_pipeline(tiny_sana_dir)
    base = pipeline_images(pipe)
    pipe.load_lora_weights(str(ckpt / "ema_lora"))
    theirs = pipeline_images(pipe)
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-5
    assert (base - ours).abs().max() > 1e-4  # the adapter changed the samples, so the match above means something


def test_diffusion_nft_trains(tmp_path, tiny_sana_dir):
    run = tmp_path / "run"
    assert main([*TRAIN, f"model.path={tiny_sana_dir}", "objective.kind=nft", "sampling.sampler=ode",
                 "trainer.kl_beta=0", "objective.nft.timesteps=2", "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)  # the adapter left its zero init
