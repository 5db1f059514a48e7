"""model.quantize / model.quantize_text_encoders (QLoRA): the tiny SD3 saved to disk and loaded through the real
`from_pretrained` path with bitsandbytes, on the CPU (bitsandbytes >= 0.48 runs nf4 and int8 there)."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import load_config
from flowrl.core import gaussian_kl
from flowrl.errors import ConfigError
from flowrl.models import load_policy
from flowrl.sampling.rollout import SamplerSpec, rollout, transition
from flowrl.sampling.schedules import shifted_sigmas
from flowrl.schema import LoraConfig, ModelConfig

bnb = pytest.importorskip("bitsandbytes")

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a cat"]
LAYER = {"nf4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}
FAST = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=4", "run.tracker=none", "run.progress=false", "lora.rank=4", "lora.alpha=8"]


def _quantized_policy(path, mode):
    policy = load_policy(ModelConfig(kind="sd3", path=path, quantize=mode, quantize_text_encoders=mode), device="cpu")
    policy.add_lora(LoraConfig(rank=4, alpha=8))
    return policy


def _layers(module, cls) -> int:
    return sum(isinstance(m, cls) for m in module.modules())


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_the_reference_is_the_same_quantised_base_ratio_one_and_kl_zero_at_init(tiny_sd3_dir, mode):
    policy = _quantized_policy(tiny_sd3_dir, mode)
    assert _layers(policy.transformer, LAYER[mode]) > 0 and _layers(policy.pipe.text_encoder_3, LAYER[mode]) > 0
    spec = SamplerSpec(shifted_sigmas(4), torch.ones(4, dtype=torch.bool), "flow_grpo", 0.7, "mean")
    traj = rollout(policy, PROMPTS, [11, 12, 13, 14], spec, batch_size=4)
    cond = policy.encode(PROMPTS)
    policy.transformer.train()
    for t in spec.trained_steps():
        out = transition(policy, traj, spec, slice(0, 4), t, cond)  # with grad, as in training
        assert out.log_prob.requires_grad
        assert torch.equal(out.log_prob, traj.log_probs[:, t]), t  # the same kernels as the rollout: ratio exactly 1
        with torch.no_grad(), policy.reference():
            ref = transition(policy, traj, spec, slice(0, 4), t, cond)
        assert gaussian_kl(out.mean.detach(), ref.mean, out.std).abs().max().item() == 0.0  # LoRA B = 0: policy = reference


@pytest.mark.parametrize("kind,fixture", [("qwen_image", "tiny_qwen_image_dir"), ("sana", "tiny_sana_dir"), ("wan", "tiny_wan_dir")])
def test_other_families_load_quantised_with_the_ratio_exactly_one(kind, fixture, request):
    # every family loads through FlowPolicy.from_config; their text encoders are Qwen2.5-VL, Gemma 2 and UMT5
    # (FLUX.1, FLUX.2 [dev] and [klein] and Z-Image pass too, measured once; left out here for time)
    path = request.getfixturevalue(fixture)
    frames = 5 if kind == "wan" else 1
    policy = load_policy(ModelConfig(kind=kind, path=path, quantize="nf4", quantize_text_encoders="int8", height=32, width=32,
                                     num_frames=frames), device="cpu")
    policy.add_lora(LoraConfig(rank=4, alpha=8))
    encoder = policy.pipe.text_encoder
    assert _layers(policy.transformer, bnb.nn.Linear4bit) > 0 and _layers(encoder, bnb.nn.Linear8bitLt) > 0
    spec = SamplerSpec(shifted_sigmas(2), torch.ones(2, dtype=torch.bool), "flow_grpo", 0.7, "mean")
    traj = rollout(policy, PROMPTS[:2], [1, 2], spec, batch_size=2)
    policy.transformer.train()
    out = transition(policy, traj, spec, slice(0, 2), 0, policy.encode(PROMPTS[:2]))
    assert torch.equal(out.log_prob.detach(), traj.log_probs[:, 0])
    out.log_prob.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in policy.trainable_parameters())


def test_only_the_lora_trains_over_the_nf4_base(tiny_sd3_dir):
    policy = _quantized_policy(tiny_sd3_dir, "nf4")
    trainable = policy.named_trainable_parameters()
    lora = policy.lora_state_dict()
    assert sum(p.numel() for p in trainable.values()) == sum(t.numel() for t in lora.values()) > 0
    assert all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert not any(p.requires_grad for n, p in policy.transformer.named_parameters() if "lora_" not in n)
    if not torch.cuda.is_available():  # the CPU load lifted diffusers' GPU check for itself only
        from diffusers.quantizers.bitsandbytes import bnb_quantizer

        with pytest.raises(RuntimeError, match="No GPU found"):
            bnb_quantizer.BnB4BitDiffusersQuantizer.validate_environment(None)


@pytest.mark.parametrize("overrides,says", [
    (["model.quantize=fp4"], "model.quantize must be one of none, nf4, int8"),
    (["model.quantize_text_encoders=int4"], "model.quantize_text_encoders must be one of none, nf4, int8"),
    (["model.quantize=nf4", "lora.enabled=false"], "model.quantize nf4 freezes the transformer"),
    (["model.quantize=nf4", "run.distributed=fsdp2"], "model.quantize nf4 runs with run.distributed ddp only"),
    (["model.quantize=int8", "rollout.kind=two_stage", "rollout.two_stage.candidates=8"],
     "rollout.kind two_stage builds its exploration copy"),
])
def test_what_a_quantised_base_cannot_do_is_refused_in_one_sentence(overrides, says):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_jpeg", overrides, validate_paths=False)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_missing_bitsandbytes_names_the_extra(monkeypatch):
    import flowrl.config

    monkeypatch.setattr(flowrl.config, "bitsandbytes_installed", lambda: False)
    for key in ("model.quantize", "model.quantize_text_encoders"):
        with pytest.raises(ConfigError, match=rf"{key} nf4 needs bitsandbytes, which is not installed: pip install 'flowrl\[memory\]'"):
            load_config("tiny_jpeg", [f"{key}=nf4"], validate_paths=False)
    load_config("tiny_jpeg", [], validate_paths=False)  # nothing quantised: bitsandbytes is not needed


def test_grpo_trains_the_lora_over_an_nf4_base_and_its_export_loads_on_full_precision(tmp_path, tiny_sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    from flowrl.cli import main
    from flowrl.train.loop import Trainer

    overrides = [*FAST, f"model.path={tiny_sd3_dir}", "model.quantize=nf4", "run.sample_every=0", "run.checkpoint_every=0",
                 "trainer.iterations=2", "trainer.kl_beta=0.01", "trainer.lr=1e-2"]
    trainer = Trainer(load_config("tiny_jpeg", overrides), run_dir=tmp_path / "run")
    assert _layers(trainer.policy.transformer, bnb.nn.Linear4bit) > 0
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    rows = trainer.train()
    update = torch.cat([(p.detach() - before[n]).flatten() for n, p in trainer.params.items()])
    assert torch.isfinite(update).all() and update.norm() > 0
    # every adapter matrix moved: gradients reach the first block through the frozen 4-bit layers above it
    assert all(not torch.equal(p, before[n]) for n, p in trainer.params.items()), [n for n, p in trainer.params.items()
                                                                                  if torch.equal(p, before[n])]
    for row in rows:
        assert all(torch.isfinite(torch.tensor(float(row[k]))) for k in ("loss", "kl", "reward_mean", "grad_norm")), row
        assert row["first_ratio_deviation"] < 1e-5
    assert rows[-1]["kl"] > 0  # the policy left its quantised reference

    # the adapter loads onto the plain full-precision pipeline, and --merge fuses it into those weights
    assert main(["export", "--run", str(tmp_path / "run"), "-o", str(tmp_path / "lora")]) == 0
    assert main(["export", "--run", str(tmp_path / "run"), "--merge", "-o", str(tmp_path / "merged")]) == 0
    base, adapted = (StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir) for _ in range(2))
    adapted.load_lora_weights(str(tmp_path / "lora"))
    merged = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "merged"))
    assert all(p.dtype == torch.float32 for p in merged.transformer.parameters())
    assert _layers(merged.transformer, bnb.nn.Linear4bit) == _layers(adapted.transformer, bnb.nn.Linear4bit) == 0
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.tensor([500.0, 900.0]),
                  encoder_hidden_states=torch.randn(2, 5, 32, generator=g), pooled_projections=torch.randn(2, 32, generator=g),
                  return_dict=False)
    with torch.no_grad():
        v_base, v_adapted, v_merged = (p.transformer(**inputs)[0] for p in (base, adapted, merged))
    assert not torch.allclose(v_base, v_adapted, atol=1e-5)  # the trained adapter acts
    assert torch.allclose(v_adapted, v_merged, atol=1e-5)  # fused into the full-precision weights, the same network
