"""Every adapter (SD3, FLUX.1, FLUX.2 [dev] and [klein], Qwen-Image, Z-Image, SANA, Wan2.1): loading, ratio = 1 on fresh samples, KL to the reference, LoRA I/O."""

from __future__ import annotations

import pytest
import torch

from flowrl.schema import LoraConfig, ModelConfig
from flowrl.core import gaussian_kl
from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, rollout, transition
from flowrl.sampling.schedules import shifted_sigmas

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a cat"]


def _policy(kind, path, dtype="fp32", guidance=4.5):
    policy = load_policy(ModelConfig(kind=kind, path=path, dtype=dtype, guidance_scale=guidance), device="cpu")
    policy.add_lora(LoraConfig(rank=4, alpha=8))
    return policy


def _spec(steps=4):
    return SamplerSpec(shifted_sigmas(steps), torch.ones(steps, dtype=torch.bool), "flow_grpo", 0.7, "mean")


KINDS = ["sd3", "flux", "flux2", "flux2_klein", "qwen_image", "z_image", "sana", "wan"]


@pytest.fixture
def tiny_dirs(tiny_sd3_dir, tiny_flux_dir, tiny_flux2_dir, tiny_flux2_klein_dir, tiny_qwen_image_dir, tiny_z_image_dir, tiny_sana_dir,
              tiny_wan_dir):
    return {"sd3": tiny_sd3_dir, "flux": tiny_flux_dir, "flux2": tiny_flux2_dir, "flux2_klein": tiny_flux2_klein_dir, "qwen_image": tiny_qwen_image_dir,
            "z_image": tiny_z_image_dir, "sana": tiny_sana_dir, "wan": tiny_wan_dir}


@pytest.fixture(params=KINDS)
def model_dir(request, tiny_dirs):
    return request.param, tiny_dirs[request.param]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ratio_is_one_on_fresh_samples(model_dir, dtype):
    kind, path = model_dir
    policy = _policy(kind, path, dtype)
    spec = _spec()
    traj = rollout(policy, PROMPTS, [11, 12, 13, 14], spec, batch_size=4)
    cond = policy.encode(PROMPTS)
    policy.transformer.train()
    for t in spec.trained_steps():
        out = transition(policy, traj, spec, slice(0, 4), t, cond)  # with grad, as in training
        ratio = torch.exp(out.log_prob - traj.log_probs[:, t])
        assert out.log_prob.requires_grad
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0), (t, ratio)


def _kl(policy, traj, spec, cond):
    total = 0.0
    for t in spec.trained_steps():
        with torch.no_grad():
            out = transition(policy, traj, spec, slice(0, 4), t, cond)
            with policy.reference():
                ref = transition(policy, traj, spec, slice(0, 4), t, cond)
        total += gaussian_kl(out.mean, ref.mean, out.std).mean().item()
    return total


def test_kl_zero_with_fresh_adapter_and_positive_after_a_step(model_dir):
    kind, path = model_dir
    policy = _policy(kind, path)
    spec = _spec()
    traj = rollout(policy, PROMPTS, [1, 2, 3, 4], spec, batch_size=4)
    cond = policy.encode(PROMPTS)
    assert _kl(policy, traj, spec, cond) == 0.0  # LoRA B starts at zero: the policy is the reference

    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-2)
    out = transition(policy, traj, spec, slice(0, 4), 0, cond)
    (-out.log_prob.mean()).backward()
    opt.step()
    assert _kl(policy, traj, spec, cond) > 0.0


def test_reference_is_the_base_network(tiny_sd3_dir):
    base = load_policy(ModelConfig(kind="sd3", path=tiny_sd3_dir), device="cpu")
    policy = _policy("sd3", tiny_sd3_dir)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05)
    x = torch.randn(2, *policy.latent_shape())
    cond = policy.encode(PROMPTS[:2])
    with torch.no_grad():
        v_base = base.velocity(x, 0.6, base.encode(PROMPTS[:2]))
        with policy.reference():
            v_ref = policy.velocity(x, 0.6, cond)
        v_lora = policy.velocity(x, 0.6, cond)
    assert torch.equal(v_base, v_ref)
    assert not torch.allclose(v_base, v_lora)


def test_adapter_sigma_range_leaves_other_sigmas_to_the_base_network(model_dir):
    kind, path = model_dir
    base = load_policy(ModelConfig(kind=kind, path=path, guidance_scale=4.5), device="cpu")
    policy = load_policy(ModelConfig(kind=kind, path=path, guidance_scale=4.5), device="cpu")
    policy.add_lora(LoraConfig(rank=4, alpha=8, sigma_range=[0.5, 1.0]))
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05)
    x = torch.randn(2, *policy.latent_shape())
    cond, base_cond = policy.encode(PROMPTS[:2]), base.encode(PROMPTS[:2])
    with torch.no_grad():
        assert torch.equal(policy.velocity(x, 0.5, cond), base.velocity(x, 0.5, base_cond))  # low end excluded
        assert torch.equal(policy.velocity(x, 0.2, cond), base.velocity(x, 0.2, base_cond))
        assert not torch.allclose(policy.velocity(x, 0.8, cond), base.velocity(x, 0.8, base_cond))
        assert not torch.allclose(policy.velocity(x, 1.0, cond), base.velocity(x, 1.0, base_cond))
        with policy.reference():  # a velocity outside the range inside the reference leaves the adapter off
            policy.velocity(x, 0.2, cond)
            assert torch.equal(policy.velocity(x, 0.8, cond), base.velocity(x, 0.8, base_cond))
        assert not torch.allclose(policy.velocity(x, 0.8, cond), base.velocity(x, 0.8, base_cond))


def test_acts_at_trained_reads_a_pipelines_own_grid_when_the_model_loads(tiny_flux_dir):
    # the default preset's lora.acts_at trained on a model whose grid is its pipeline's (FLUX's dynamic shifting): the
    # config cannot know it, so the adapter's range is set from the loaded grid, DGPO's first 5 of 10 steps trained
    from flowrl.config import load_config
    from flowrl.train.registry import add_adapter

    cfg = load_config(None, ["model.kind=flux", f"model.path={tiny_flux_dir}", "model.height=64", "model.width=64",
                             "model.max_sequence_length=32", "lora.target_modules=[to_q,to_k,to_v,to_out.0]"])
    assert cfg.sampling.schedule == "auto" and cfg.lora.sigma_range == [0.0, 1.0]
    policy = load_policy(cfg.model, device="cpu")
    add_adapter(policy, cfg)
    grid = policy.sigmas(10, cfg.sampling.schedule, cfg.sampling.shift).tolist()
    assert not torch.allclose(torch.tensor(grid[:10]), shifted_sigmas(10, cfg.sampling.shift)[:10])  # not the config's grid
    assert policy.lora_sigma_range == (round((grid[4] + grid[5]) / 2, 6), 1.0)
    assert policy.adapter_acts_at(grid[4]) and not policy.adapter_acts_at(grid[5])


def test_prompt_embeddings_are_cached(tiny_sd3_dir):
    policy = _policy("sd3", tiny_sd3_dir)
    a = policy.encode(["a red circle", "a cat"])
    calls = []
    original = policy._encode_uncached
    policy._encode_uncached = lambda prompts: calls.append(prompts) or original(prompts)
    b = policy.encode(["a cat", "a red circle", "a dog"])
    assert calls == [["a dog"]]
    assert torch.equal(b["embeds"][0], a["embeds"][1]) and torch.equal(b["embeds"][1], a["embeds"][0])


@pytest.mark.parametrize("kind", ["flux2_klein", "qwen_image", "z_image", "wan"])
def test_the_negative_prompt_is_encoded_once_for_every_prompt(kind, tiny_dirs):
    policy = load_policy(ModelConfig(kind=kind, path=tiny_dirs[kind], guidance_scale=4.5), device="cpu")
    calls = []
    original = policy._encode_texts
    policy._encode_texts = lambda texts: calls.append(list(texts)) or original(texts)
    cond = policy.encode(PROMPTS[:3])
    prompt_calls = [c for c in calls if c[0] in PROMPTS]
    assert prompt_calls == [[p] for p in PROMPTS[:3]] and len(calls) == 4  # each prompt once, the negative once
    policy.encode(["a dog"])
    assert len(calls) == 5  # the new prompt alone
    assert all(torch.equal(cond["neg_embeds"][0], row) for row in cond["neg_embeds"])


@pytest.mark.parametrize("kind", KINDS)
def test_decoded_images_and_reproducible_samples(kind, tiny_dirs):
    policy = _policy(kind, tiny_dirs[kind])
    spec = _spec()
    a = rollout(policy, PROMPTS[:2], [5, 6], spec, batch_size=1)
    b = rollout(policy, PROMPTS[1:2] + PROMPTS[:1], [6, 5], spec, batch_size=1)  # other order
    assert torch.equal(a.latents[0], b.latents[1]) and torch.equal(a.latents[1], b.latents[0])
    # other batching: the same sample up to GEMM rounding (kernels may block by batch size)
    c = rollout(policy, PROMPTS[:2], [5, 6], spec, batch_size=2)
    assert torch.allclose(a.latents, c.latents, atol=1e-4)
    images = policy.decode(a.final)
    one_frame = (2, 3, 1, 64, 64) if kind == "wan" else (2, 3, 64, 64)  # a video family: videos of model.num_frames 1
    assert images.shape == one_frame and torch.isfinite(images).all()
    assert images.min() >= 0 and images.max() <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_lora_saves_in_diffusers_format(kind, tiny_dirs, tmp_path):
    path = tiny_dirs[kind]
    policy = _policy(kind, path)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.03)
    policy.save_lora(tmp_path)
    x = torch.randn(1, *policy.latent_shape())
    with torch.no_grad():
        v_trained = policy.velocity(x, 0.5, policy.encode(["a cat"]))

    # the diffusers way: a fresh pipeline and load_lora_weights
    fresh = load_policy(ModelConfig(kind=kind, path=path, guidance_scale=4.5), device="cpu")
    fresh.pipe.load_lora_weights(str(tmp_path))
    with torch.no_grad():
        v_loaded = fresh.velocity(x, 0.5, fresh.encode(["a cat"]))
    assert torch.allclose(v_trained, v_loaded, atol=1e-5)

    # and our own resume path
    again = _policy(kind, path)
    again.load_lora(tmp_path)
    with torch.no_grad():
        assert torch.allclose(again.velocity(x, 0.5, again.encode(["a cat"])), v_trained, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_sd3_dir):
    grads = []
    for ckpt in (False, True):
        policy = load_policy(ModelConfig(kind="sd3", path=tiny_sd3_dir, gradient_checkpointing=ckpt), device="cpu")
        policy.add_lora(LoraConfig(rank=4, alpha=8))
        with torch.no_grad():
            for p in policy.trainable_parameters():
                p.add_(0.01)
        policy.transformer.train()
        x = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(0))
        policy.velocity(x, 0.7, policy.encode(PROMPTS[:2])).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.trainable_parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_bad_target_modules_are_named(tiny_sd3_dir):
    from flowrl.errors import UserError

    policy = load_policy(ModelConfig(kind="sd3", path=tiny_sd3_dir), device="cpu")
    with pytest.raises(UserError, match="not_a_module"):
        policy.add_lora(LoraConfig(target_modules=["to_q", "not_a_module"]))


def test_the_families_bench_trains_each_family_through_the_trainer_on_the_cpu(capsys):
    # the GPU check (scripts/gpu_checks.sh) with tiny networks: each family's 1-GPU preset (LoRA,
    # guidance, SDE window) trains through the trainer on a pipeline built in memory, and its plan prints
    from accelerate.state import AcceleratorState
    from script_loader import load_script

    from flowrl.train import loop

    # the presets train in bf16 autocast; accelerate keeps one precision per process, so its state is
    # cleared before and after (as test_training's bf16 run does)
    original = loop.load_policy
    AcceleratorState._reset_state()
    try:
        assert load_script("bench_families").main(["--cpu-smoke", "--iterations", "1"]) == 0
    finally:
        loop.load_policy = original
        AcceleratorState._reset_state()
    out = capsys.readouterr().out
    for family in ("qwen_image", "z_image", "wan"):
        assert f"{family}: pipeline built" in out
    assert out.count("iteration 0:") == 3 and "LoRA rank 64" in out and "plan peak" in out
