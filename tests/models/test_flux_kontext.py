"""FLUX.1 Kontext (model.kind flux_kontext) against diffusers' own FluxKontextPipeline, on a tiny random pipeline
saved to disk: flowrl's ODE from EditPrompts equals the pipeline's __call__ given the instructions and the sources
(a non-square output, a source that needs resizing and one that does not), a source read from a file
reproduces as the PIL image a user hands the pipeline, the source changes the sample, a LoRA on flow_grpo's
Kontext modules saved by flowrl reproduces flowrl's sample through `load_lora_weights`, and the training path
recomputes the SDE's log-probs (ratio 1, fp32 and bf16) with gradients reaching the adapter.

Not in tests/tiny_families.py: its sweeps train the tiny_jpeg preset, whose prompts are plain text, which an
editing family refuses (an edit dataset does not exist yet)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from flowrl.errors import UserError
from flowrl.models import load_policy
from flowrl.models.edit_prompt import EditPrompt
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import LoraConfig, ModelConfig

INSTRUCTIONS = ["make it red", "add two blue squares"]
SEEDS = [3, 4]
STEPS = 4
# flow_grpo's counting_flux_kontext LoRA targets (scripts/train_flux_kontext.py), as the preset names them
KONTEXT_TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                   "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                   "ff_context.net.2", "proj_mlp"]


def _policy(path, height=64, width=64):
    return load_policy(ModelConfig(kind="flux_kontext", path=path, height=height, width=width, guidance_scale=2.5,
                                   max_sequence_length=32), device="cpu")


def _sources(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=gen) for h, w in shapes]


def _edits(sources, instructions=INSTRUCTIONS):
    return [EditPrompt(text, source, name=f"source{i}") for i, (text, source) in enumerate(zip(instructions, sources))]


def _ode(policy, prompts):
    traj = rollout(policy, prompts, SEEDS, SamplerSpec.ode(policy.sigmas(STEPS, "pipeline", 3.0)), len(prompts))
    return traj.latents[:, 0], traj.final


def _pipeline(pipe, x0, image, height=64, width=64):
    # max_area = the output's area keeps height x width (its default 1024^2 would rescale it); _auto_resize off keeps
    # the sources at the size given (not a PREFERRED_KONTEXT_RESOLUTIONS bucket)
    return pipe(prompt=list(INSTRUCTIONS), image=image, latents=x0, height=height, width=width, max_area=height * width,
                _auto_resize=False, num_inference_steps=STEPS, guidance_scale=2.5, max_sequence_length=32,
                output_type="latent").images


def test_ode_equals_the_pipeline_call_with_the_sources(tiny_flux_kontext_dir):
    height, width = 64, 96  # not square: max_area and the source resize keep the aspect (64 x 64 in the tests below)
    policy = _policy(tiny_flux_kontext_dir, height, width)
    # one source at the output size, one of another size and aspect (resized to the output size by flowrl)
    sources = _sources((height, width), (48, 80))
    x0, final = _ode(policy, _edits(sources))
    # the pipeline receives the sources at the output size (pipeline_source_arguments), [B, 3, H, W] in [0, 1]
    image = policy.pipeline_source_arguments(_edits(sources))["image"]
    assert image.shape == (2, 3, height, width) and torch.equal(image[0], sources[0])
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    theirs = _pipeline(pipe, x0, image, height, width)
    assert (theirs - final).abs().max() <= 1e-5
    # the grid the call set: FluxPipeline's dynamic shift from the generated tokens alone (not the source's too)
    assert torch.allclose(policy.sigmas(STEPS, "pipeline", 3.0), pipe.scheduler.sigmas.float(), atol=1e-7)


def test_a_source_file_reproduces_as_the_pil_image_handed_to_the_pipeline_and_the_source_matters(tiny_flux_kontext_dir, tmp_path):
    policy = _policy(tiny_flux_kontext_dir)
    paths = []
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        array = np.full((64, 64, 3), colour, np.uint8)
        array[16:48, 16:48] = 255 - array[16:48, 16:48]  # a square of the complement: the source has structure
        Image.fromarray(array).save(tmp_path / f"source{i}.png")
        paths.append(tmp_path / f"source{i}.png")
    one_instruction = [INSTRUCTIONS[0]] * 2
    prompts = [EditPrompt(text, path) for text, path in zip(one_instruction, paths)]
    assert prompts[0] != prompts[1]  # one instruction, two sources: two keys
    x0, final = _ode(policy, prompts)
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    pil = [Image.open(p).convert("RGB") for p in paths]  # what a user of diffusers hands the pipeline
    theirs = pipe(prompt=one_instruction, image=pil, latents=x0, height=64, width=64, max_area=64 * 64, _auto_resize=False,
                  num_inference_steps=STEPS, guidance_scale=2.5, max_sequence_length=32, output_type="latent").images
    assert (theirs - final).abs().max() <= 1e-5
    # the control: from one noise with one instruction, the two sources give two samples
    both = rollout(policy, prompts, [SEEDS[0]] * 2, SamplerSpec.ode(policy.sigmas(STEPS, "pipeline", 3.0)), 2)
    assert torch.equal(both.latents[0, 0], both.latents[1, 0]) and torch.equal(both.final[0], final[0])
    assert (both.final[0] - both.final[1]).abs().max() > 1e-3


def test_a_prompt_without_a_source_is_one_sentence(tiny_flux_kontext_dir):
    policy = _policy(tiny_flux_kontext_dir)
    with pytest.raises(UserError, match="^model.kind flux_kontext edits a source image, so every prompt needs one"):
        policy.encode(["a red circle"])  # a prompt file's plain lines
    with pytest.raises(UserError, match="got the plain prompt .a red circle.$"):
        policy.encode([EditPrompt("make it red", torch.rand(3, 64, 64), name="square"), "a red circle"])


def test_a_lora_saved_by_flowrl_reproduces_flowrl_sample_in_diffusers_with_the_sources(tiny_flux_kontext_dir, tmp_path):
    policy = _policy(tiny_flux_kontext_dir)
    policy.add_lora(LoraConfig(rank=4, alpha=8, target_modules=KONTEXT_TARGETS))
    gen = torch.Generator().manual_seed(5)
    for name, p in policy.named_trainable_parameters().items():  # a trained adapter's stand-in: lora_B off its zero init
        if "lora_B" in name:
            p.data = 0.3 * torch.randn(p.shape, generator=gen)
    policy.save_lora(tmp_path / "lora")
    prompts = _edits(_sources((64, 64), (40, 72)))
    ours = policy.decode(_ode(policy, prompts)[1])  # flowrl's ODE sample as images
    latents = seeded_noise(SEEDS, INITIAL, policy.latent_shape())
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext_dir)
    base = policy.diffusers_call(pipe, latents, prompts, STEPS)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    theirs = policy.diffusers_call(pipe, latents, prompts, STEPS)
    assert theirs.shape == ours.shape == (2, 3, 64, 64) and (theirs - ours).abs().max() <= 1e-5
    assert (base - ours).abs().max() > 1e-3  # the adapter changed the samples, so the match above means something


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_recomputes_the_behaviour_log_prob_and_reaches_the_adapter(tiny_flux_kontext_dir, dtype):
    # Flow-GRPO's SDE from EditPrompts, then each transition recomputed with grad from the same cond (the training
    # path): ratio 1 on fresh samples, in bf16 too (the source encoded in model.dtype as the pipeline does)
    from flowrl.sampling.rollout import transition
    from flowrl.sampling.schedules import shifted_sigmas

    policy = load_policy(ModelConfig(kind="flux_kontext", path=tiny_flux_kontext_dir, dtype=dtype, guidance_scale=2.5,
                                     max_sequence_length=32), device="cpu")
    policy.add_lora(LoraConfig(rank=4, alpha=8))
    prompts = _edits(_sources((64, 64), (40, 72)))
    assert policy.encode(prompts)["source"].dtype == policy.dtype
    spec = SamplerSpec(shifted_sigmas(3), torch.ones(3, dtype=torch.bool), "flow_grpo", 0.7, "mean")
    traj = rollout(policy, prompts, SEEDS, spec, batch_size=2)
    cond = policy.encode(prompts)
    policy.transformer.train()
    for t in spec.trained_steps():
        out = transition(policy, traj, spec, slice(0, 2), t, cond)
        assert torch.allclose(torch.exp(out.log_prob - traj.log_probs[:, t]), torch.ones(2), atol=1e-5, rtol=0)
    out.log_prob.mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_trainable_parameters().items() if "lora_B" in n)
