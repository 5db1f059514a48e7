"""Wan2.1 text-to-video (model.kind wan) against diffusers' own WanPipeline, on a tiny random pipeline
that ships UniPC as Wan does: flowrl samples with the Euler flow-matching step, so its ODE over video
latents [C, F', H, W] equals the pipeline's __call__ with FlowMatchEulerDiscreteScheduler(shift=flow_shift)
swapped in, with and without guidance; a LoRA trained by flowrl (Flow-GRPO's SDE, the JPEG reward on
the frames) reproduces `flowrl sample` in that pipeline; DiffusionNFT trains and `flowrl sample` writes
its videos. The adapter's ratio, KL, sigma-range and LoRA-format tests run in test_models.py (one frame)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline
from PIL import Image

from flowrl.cli import main
from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import ModelConfig
from family_checks import PROMPTS, SEEDS, check_lora_reproduces_flowrl_sample, check_nft_trains, train_args

FRAMES = 5  # two latent frames: the first, then four packed into one


def _euler_pipeline(path) -> WanPipeline:
    pipe = WanPipeline.from_pretrained(path)
    assert isinstance(pipe.scheduler, UniPCMultistepScheduler)  # what Wan ships
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return pipe


def _video_args(path: str) -> list[str]:
    return [*train_args("wan", path, 5.0), f"model.num_frames={FRAMES}", "model.height=32", "model.width=32"]


@pytest.mark.parametrize("guidance", [1.0, 5.0], ids=["no-cfg", "cfg"])
def test_ode_equals_the_pipeline_call_with_the_euler_scheduler(tiny_wan_dir, guidance):
    policy = load_policy(ModelConfig(kind="wan", path=tiny_wan_dir, height=32, width=48, num_frames=FRAMES,
                                     guidance_scale=guidance, max_sequence_length=64), device="cpu")
    assert policy.latent_shape() == (4, 2, 4, 6)
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(5, "pipeline", 3.0)), len(PROMPTS))
    theirs = _euler_pipeline(tiny_wan_dir)(prompt=list(PROMPTS), latents=traj.latents[:, 0], height=32, width=48,
                                           num_frames=FRAMES, num_inference_steps=5, guidance_scale=guidance,
                                           max_sequence_length=64, output_type="latent").frames
    assert (theirs - traj.final).abs().max() <= 1e-5
    video = policy.decode(traj.final)
    assert video.shape == (2, 3, FRAMES, 32, 48) and 0 <= video.min() and video.max() <= 1


def test_videos_encode_to_the_latents_they_decode_from(tiny_wan_dir):
    # encode(decode(z)) is not z for a random VAE; the check is the pipeline's own normalisation:
    # flowrl's latents are (posterior mean - latents_mean) / latents_std, as WanPipeline undoes them
    policy = load_policy(ModelConfig(kind="wan", path=tiny_wan_dir, height=32, width=32, num_frames=FRAMES), device="cpu")
    video = torch.rand(1, 3, FRAMES, 32, 32)
    latents = policy.encode_images(video)
    c = policy.vae.config
    raw = policy.vae.encode(video * 2 - 1).latent_dist.mean
    mean, std = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1), torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    assert latents.shape == (1, *policy.latent_shape()) and torch.allclose(latents, (raw - mean) / std, atol=1e-6)
    with torch.no_grad():
        expected = (policy.vae.decode(latents * std + mean).sample / 2 + 0.5).clamp(0, 1)
    assert torch.allclose(policy.decode(latents), expected, atol=1e-6)


def test_a_lora_trained_with_flow_grpo_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_wan_dir):
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)  # as shipped: WanPolicy.diffusers_call swaps in the Euler scheduler
    check_lora_reproduces_flowrl_sample(tmp_path / "run", _video_args(tiny_wan_dir), pipe)


def test_diffusion_nft_trains_and_flowrl_sample_writes_videos(tmp_path, tiny_wan_dir):
    run = tmp_path / "run"
    check_nft_trains(run, _video_args(tiny_wan_dir))
    out = tmp_path / "sheet.png"
    assert main(["sample", "--run", str(run), "--prompt", "a red circle", "-n", "2", "--out", str(out)]) == 0
    with Image.open(out.with_suffix(".webp")) as animated:  # the grid, frame by frame
        assert animated.n_frames == FRAMES and animated.is_animated
    with Image.open(out) as strip:  # the frame strip: two videos, one row of FRAMES frames each
        assert strip.width > strip.height
    assert main(["sample", "--run", str(run), "--prompt", "a red circle", "-n", "2", "--out-dir", str(tmp_path / "dir")]) == 0
    for name in ("000000.webp", "000001.webp"):
        with Image.open(tmp_path / "dir" / name) as video:
            assert video.n_frames == FRAMES and video.size == (32, 32)


def test_num_frames_is_checked(tiny_wan_dir):
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="model.num_frames must be 1 plus a multiple of 4"):
        load_config("tiny_jpeg", ["model.kind=wan", f"model.path={tiny_wan_dir}", "model.num_frames=6"])
    with pytest.raises(ConfigError, match="model.num_frames must be 1 for model.kind sd3"):
        load_config("tiny_jpeg", ["model.num_frames=5"])
