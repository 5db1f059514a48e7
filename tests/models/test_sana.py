"""SANA (model.kind sana) against diffusers' own SanaPipeline, on a tiny random pipeline that ships
DPM-Solver++ as SANA does: flowrl samples with the Euler flow-matching step, so its ODE equals the
pipeline's __call__ with FlowMatchEulerDiscreteScheduler(shift=flow_shift) swapped in, with and
without guidance; a LoRA trained by flowrl (Flow-GRPO's SDE) reproduces `flowrl sample` in that
pipeline, and DiffusionNFT trains. The adapter's ratio, KL, sigma-range and LoRA-format tests run
in test_models.py."""

from __future__ import annotations

import pytest
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, SanaPipeline

from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from family_checks import PROMPTS, SEEDS, check_lora_reproduces_flowrl_sample, check_nft_trains, train_args


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


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_sana_dir):
    pipe = SanaPipeline.from_pretrained(tiny_sana_dir)  # as shipped: SanaPolicy.diffusers_call swaps in the Euler scheduler
    args = train_args("sana", tiny_sana_dir, 4.5)
    check_lora_reproduces_flowrl_sample(tmp_path / "run", args, pipe)


def test_diffusion_nft_trains(tmp_path, tiny_sana_dir):
    check_nft_trains(tmp_path / "run", train_args("sana", tiny_sana_dir, 4.5))
