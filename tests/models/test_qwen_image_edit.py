"""Qwen-Image-Edit (model.kind qwen_image_edit) against diffusers' own QwenImageEditPlusPipeline, on a tiny
random pipeline saved to disk and loaded through load_policy: flowrl's ODE on edits (instruction + source
image file) equals the pipeline's __call__ with true CFG; another source under the same instruction changes
the VL's text embeddings, the condition tokens and the sample; sources of two aspects batch without changing
each other; a LoRA saved by flowrl reproduces flowrl's sample in the pipeline called as `diffusers_call`
calls it (the source passed as `image=`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from PIL import Image

from flowrl.errors import UserError
from flowrl.models import load_policy
from flowrl.models.edit_prompt import EditPrompt
from flowrl.models.qwen_image_edit import image_only_vl_processor
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.schema import LoraConfig, ModelConfig

SIZE, STEPS, GUIDANCE = 128, 3, 4.0
SEEDS = [3, 4]


def _policy(path):
    return load_policy(ModelConfig(kind="qwen_image_edit", path=path, height=SIZE, width=SIZE, guidance_scale=GUIDANCE),
                       device="cpu")


def _pipeline(path):
    # the processor as flowrl's loader assembles it: transformers builds no Qwen2VLProcessor without torchvision
    pipe = QwenImageEditPlusPipeline.from_pretrained(path, processor=image_only_vl_processor(path))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def policy(tiny_qwen_image_edit_dir):
    return _policy(tiny_qwen_image_edit_dir)  # its cache holds each edit's conditioning across the tests


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two source image files: a square one and a 4:3 one (another condition grid)."""
    folder, rng = tmp_path_factory.mktemp("sources"), np.random.default_rng(0)
    paths = []
    for name, (h, w) in (("square.png", (64, 64)), ("wide.png", (48, 64))):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
        paths.append(folder / name)
    return paths


def test_ode_equals_the_pipeline_call_with_true_cfg(policy, tiny_qwen_image_edit_dir, sources):
    prompts = [EditPrompt("make it red", sources[0]), EditPrompt("add two blue squares", sources[1])]
    traj = rollout(policy, prompts, SEEDS, SamplerSpec.ode(policy.sigmas(STEPS, "pipeline", 3.0)), len(prompts))
    pipe = _pipeline(tiny_qwen_image_edit_dir)
    for i, prompt in enumerate(prompts):  # the pipeline takes one prompt at a time
        with Image.open(prompt.source) as image:
            theirs = pipe(prompt=[prompt.instruction], image=image.convert("RGB"), negative_prompt=" ",
                          true_cfg_scale=GUIDANCE, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                          latents=traj.latents[i : i + 1, 0], output_type="latent").images
        assert (theirs - traj.final[i : i + 1]).abs().max() <= 1e-5
    # the pipeline's grid (Qwen-Image's: dynamically shifted, stretched to end at shift_terminal before 0)
    assert policy.sigmas(STEPS, "auto", 3.0)[-2] == pytest.approx(0.02, abs=1e-6)
    # the template's system part is what the pipeline drops (prompt_template_encode_start_idx), so the
    # embeddings begin at the user's turn: the picture and the instruction
    system = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(system).input_ids) == pipe.prompt_template_encode_start_idx


def test_another_source_under_the_same_instruction_changes_the_conditioning_and_the_sample(policy, sources):
    red = torch.zeros(3, 64, 64)
    red[0] = 1.0
    prompts = [EditPrompt("make it red", sources[0]), EditPrompt("make it red", red, name="red")]
    cond = policy.encode(prompts)
    assert cond["source"].shape[1] == 32 * 32 and cond["source_grid"].tolist() == [[32, 32]] * 2  # 1024² through a 16x VAE
    assert (cond["source"][0] - cond["source"][1]).abs().max() > 1e-2  # the VAE's copy
    assert (cond["embeds"][0] - cond["embeds"][1]).abs().max() > 1e-3  # the VL reads the picture too
    assert (cond["neg_embeds"][0] - cond["neg_embeds"][1]).abs().max() > 1e-3  # so does the negative prompt
    traj = rollout(policy, prompts, [3, 3], SamplerSpec.ode(policy.sigmas(STEPS, "pipeline", 3.0)), len(prompts))
    assert torch.equal(traj.latents[0, 0], traj.latents[1, 0])  # one seed: the same initial noise
    # a random tiny network: the source moves the sample by about 5e-3, far above float rounding (1e-6)
    assert (traj.final[0] - traj.final[1]).abs().max() > 1e-3


def test_a_prompt_without_a_source_is_one_sentence(policy):
    with pytest.raises(UserError, match="^model.kind qwen_image_edit edits a source image, so every prompt needs one"):
        policy.encode(["a red circle"])


def test_sources_of_two_aspects_batch_without_changing_each_other(policy, sources):
    # the transformer reads one set of RoPE shapes per batch: rows whose condition grids differ run apart
    prompts = [EditPrompt("make it red", sources[0]), EditPrompt("add two blue squares", sources[1])]
    x = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cond = policy.encode(prompts)
        together = policy.velocity(x, torch.tensor([0.8, 0.6]), cond)
        alone = torch.cat([policy.velocity(x[i : i + 1], s, policy.encode([p]))
                           for i, (p, s) in enumerate(zip(prompts, [0.8, 0.6]))])
    assert cond["source_grid"].tolist() == [[32, 32], [28, 37]]  # 1024 x 1024 and 1184 x 896 (calculate_dimensions)
    assert (together - alone).abs().max() <= 1e-5


def test_a_lora_saved_by_flowrl_reproduces_flowrls_sample_in_diffusers(tmp_path, tiny_qwen_image_edit_dir, sources):
    policy = _policy(tiny_qwen_image_edit_dir)
    policy.add_lora(LoraConfig(rank=4, alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():  # a trained adapter's stand-in: lora_B away from its zero init
        for name, p in policy.named_trainable_parameters().items():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    policy.save_lora(tmp_path)
    prompts = [EditPrompt("make it red", sources[0]), EditPrompt("add two blue squares", sources[1])]
    traj = rollout(policy, prompts, SEEDS, SamplerSpec.ode(policy.sigmas(STEPS, "pipeline", 3.0)), len(prompts))
    ours = policy.decode(traj.final)
    latents = seeded_noise(SEEDS, INITIAL, policy.latent_shape())
    assert torch.equal(latents, traj.latents[:, 0])
    pipe = _pipeline(tiny_qwen_image_edit_dir)
    base = policy.diffusers_call(pipe, latents, prompts, STEPS)  # the sources as `image=`, one prompt per call
    pipe.load_lora_weights(str(tmp_path))
    theirs = policy.diffusers_call(pipe, latents, prompts, STEPS)
    assert theirs.shape == ours.shape == (2, 3, SIZE, SIZE) and (theirs - ours).abs().max() <= 1e-5
    assert (base - ours).abs().max() > 1e-3  # the adapter changed the samples, so the match above means something
