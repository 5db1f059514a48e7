"""Tests for the presets in configs/: every YAML validates, the multi-GPU presets split evenly
over 8 processes, and the LoRA target modules of every image preset exist in the real
diffusers transformer classes (checked on the tiny built-in architectures, offline)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.config import check_model_path, load_config
from flowrl.presets import CONFIG_DIR
from flowrl.schema import ModelConfig
from flowrl.errors import UserError

TEXT_PRESETS = ("text_add", "text_add_wide", "qwen25_05b_gsm8k_1gpu", "qwen25_15b_gsm8k_1gpu", "qwen25_05b_gsm8k_8gpu", "qwen25_15b_gsm8k_8gpu")  # task: text, tested in test_text.py
PRESETS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if p.stem not in TEXT_PRESETS)
MULTI_GPU = {"sd35_medium_pickscore_8gpu": 8, "flux1_dev_hps_8gpu": 8, "qwen_image_pickscore_8gpu": 8,
             "z_image_turbo_pickscore_8gpu": 8, "flux2_klein_9b_pickscore_8gpu": 8, "wan21_1_3b_pickscore_8gpu": 8,
             "flux2_dev_pickscore_8gpu": 8}
SD3_PRESETS = ("sd35_medium_pickscore_1gpu", "sd35_medium_pickscore_8gpu", "sd35_medium_dgpo_1gpu", "sd35_medium_fast_1gpu",
               "sd35_medium_dpo_1gpu", "sd35_medium_dppo_1gpu", "sd35_medium_pickscore_8gb")
FLUX_PRESETS = ("flux1_dev_hps_1gpu", "flux1_dev_hps_8gpu", "flux1_dev_gdro_1gpu", "flux1_dev_g2rpo_1gpu", "flux1_dev_hps_12gb")
FLUX_KONTEXT_PRESETS = ("flux_kontext_counting_1gpu",)
# the presets for small cards (issue 68) -> their card's size: a "12 GB" card holds 12 GiB (an RTX 3060 reports 12288 MiB)
SMALL_CARD_PRESETS = {"flux1_dev_hps_12gb": 12, "sd35_medium_pickscore_8gb": 8}
QWEN_IMAGE_PRESETS = ("qwen_image_pickscore_1gpu", "qwen_image_pickscore_8gpu")
Z_IMAGE_PRESETS = ("z_image_turbo_pickscore_1gpu", "z_image_turbo_pickscore_8gpu")
FLUX2_PRESETS = ("flux2_klein_9b_pickscore_1gpu", "flux2_klein_9b_pickscore_8gpu")
FLUX2_DEV_PRESETS = ("flux2_dev_pickscore_8gpu",)
WAN_PRESETS = ("wan21_1_3b_pickscore_1gpu", "wan21_1_3b_pickscore_8gpu")
IMAGE_PRESETS = (*SD3_PRESETS, *FLUX_PRESETS, *FLUX_KONTEXT_PRESETS, *QWEN_IMAGE_PRESETS, *Z_IMAGE_PRESETS, *FLUX2_PRESETS, *FLUX2_DEV_PRESETS, *WAN_PRESETS)
GROUP_OBJECTIVE_PRESETS = ("sd35_medium_dgpo_1gpu", "flux1_dev_gdro_1gpu")
OWN_SAMPLER_PRESETS = (*GROUP_OBJECTIVE_PRESETS, "flux1_dev_g2rpo_1gpu", "sd35_medium_fast_1gpu", "sd35_medium_dpo_1gpu",
                       "sd35_medium_dppo_1gpu")  # settings checked by their own tests


def _preset(name: str) -> Path:
    return CONFIG_DIR / f"{name}.yaml"


def test_the_named_presets_exist():
    names = {p.stem for p in PRESETS}
    for name in (*IMAGE_PRESETS, "default"):
        assert name in names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_and_validates(path):
    # hub ids and prompt files cannot be checked offline: validate everything else
    cfg = load_config(path, validate_paths=False)
    n = cfg.data.prompts_per_iteration * cfg.data.group_size
    assert n % cfg.sampling.batch_size == 0
    if not cfg.model.path.startswith("builtin:"):
        # a hub id passes the path check without touching the network or the disk
        check_model_path(cfg.model.path)
        assert not Path(cfg.model.path).exists()


@pytest.mark.parametrize("name,processes", sorted(MULTI_GPU.items()))
def test_multi_gpu_presets_split_evenly(name, processes):
    cfg = load_config(_preset(name), validate_paths=False)
    n = cfg.data.prompts_per_iteration * cfg.data.group_size
    per_process_batches, rest = divmod(n, processes * cfg.sampling.batch_size)
    assert rest == 0, f"{name}: {n} samples do not split into {processes} x batches of {cfg.sampling.batch_size}"
    # every process closes its accumulation groups exactly (no short last optimizer step)
    assert per_process_batches % cfg.trainer.gradient_accumulation_steps == 0


@pytest.mark.parametrize("name", [n for n in IMAGE_PRESETS if n not in MULTI_GPU])
def test_accumulation_closes_exactly_on_one_process(name):
    cfg = load_config(_preset(name), validate_paths=False)
    batches = cfg.data.prompts_per_iteration * cfg.data.group_size // cfg.sampling.batch_size
    assert batches % cfg.trainer.gradient_accumulation_steps == 0


@pytest.mark.parametrize("name", [n for n in (*SD3_PRESETS, *FLUX_PRESETS) if n not in OWN_SAMPLER_PRESETS])
def test_reference_settings(name):
    cfg = load_config(_preset(name), validate_paths=False)
    assert cfg.model.dtype == "bf16" and cfg.model.height % 16 == 0
    assert cfg.lora.enabled and (cfg.lora.rank, cfg.lora.alpha) == (32, 64)
    assert cfg.objective.grpo.clip_range == 1e-4 and cfg.advantage.clip == 5.0
    if name in SD3_PRESETS:
        assert cfg.model.kind == "sd3" and cfg.model.path == "stabilityai/stable-diffusion-3.5-medium"
        assert (cfg.model.height, cfg.model.guidance_scale) == (512, 4.5)
        assert (cfg.sampling.sampler, cfg.sampling.noise_level, cfg.sampling.num_steps) == ("flow_grpo", 0.7, 10)
        assert cfg.sampling.eval_num_steps == 40 and cfg.data.group_size == 24
        assert cfg.trainer.lr == 3e-4 and cfg.trainer.ema and cfg.trainer.kl_beta > 0
        assert _yaml_reward_weights(name) == {"pickscore": 1.0}
    else:
        assert cfg.model.kind == "flux" and cfg.model.path == "black-forest-labs/FLUX.1-dev"
        assert cfg.model.guidance_scale == 3.5 and cfg.model.gradient_checkpointing
        assert (cfg.sampling.sampler, cfg.sampling.noise_level, cfg.sampling.num_steps) == ("dance_grpo", 0.3, 16)
        assert cfg.data.group_size == 12
        assert _yaml_reward_weights(name) == {"hpsv2": 1.0}


CUDA_CONTEXT_GIB = 1.0  # what the plan leaves out and a card must hold beside it: at least the CUDA context


@pytest.mark.parametrize("name,card_gb", sorted(SMALL_CARD_PRESETS.items()))
def test_small_card_presets_plan_within_their_card(name, card_gb):
    """scripts/plan_memory.py's plan of the preset, with a GiB to spare for the CUDA context, fits its card; and the
    memory features it turns on are what make it fit (the same launch with them off does not)."""
    from script_loader import load_script

    from flowrl.train.memory_plan import plan, plan_peak

    model, launch = load_script("plan_memory").config_launch(name, None)
    assert plan_peak(plan(model, launch)) + CUDA_CONTEXT_GIB <= card_gb
    cfg = load_config(_preset(name), validate_paths=False)
    assert (cfg.model.quantize, cfg.model.text_encoders, cfg.model.gradient_checkpointing) == ("nf4", "cached", True)
    assert all(dtype == "bf16" for _, dtype in launch.rewards.values()) and launch.rewards
    full = dataclasses.replace(launch, quantize="none", text_encoders="device")
    assert plan_peak(plan(model, full)) > card_gb


def _assert_flow_factory_batching(name: str, cfg) -> None:
    """Flow-Factory's 48 prompts x 16 on 8 GPUs (one GPU's share, 6, on one), batch 1 per GPU, and 2
    optimizer steps per iteration on every process (its gradient_step_per_epoch)."""
    processes = MULTI_GPU.get(name, 1)
    batches = cfg.data.prompts_per_iteration * cfg.data.group_size // (processes * cfg.sampling.batch_size)
    assert batches // cfg.trainer.gradient_accumulation_steps == 2 and cfg.sampling.batch_size == 1
    assert cfg.data.prompts_per_iteration == (48 if processes == 8 else 6) and cfg.data.group_size == 16


# Flow-Factory's LoRA GRPO settings (its examples/grpo/lora/<family> configs), as config paths and values: what
# every family's presets share, then each family's own
FLOW_FACTORY_COMMON = {
    "lora.rank": 64, "lora.alpha": 128, "sampling.sampler": "flow_grpo", "sampling.schedule": "pipeline",
    "sampling.window.strategy": "random", "sampling.window.size": 1, "sampling.batch_size": 1, "data.group_size": 16,
    "advantage.std": "group", "advantage.clip": 5.0, "objective.grpo.clip_range": 1e-4, "trainer.weight_decay": 1e-4,
    "trainer.kl_beta": 0.0, "trainer.max_grad_norm": 1.0, "trainer.ema": True, "trainer.ema_decay": 0.9}
CLIP_AND_PICKSCORE = {"rewards": {"clip_score": 1.0, "pickscore": 0.5}, "advantage.kind": "gdpo"}
FLOW_FACTORY = {
    QWEN_IMAGE_PRESETS: {
        "model.kind": "qwen_image", "model.path": "Qwen/Qwen-Image", "model.dtype": "bf16", "model.height": 512,
        "model.guidance_scale": 4.0, "model.gradient_checkpointing": True, "sampling.noise_level": 1.0, "sampling.num_steps": 10,
        "sampling.eval_num_steps": 28, "sampling.window.choices": [1, 2, 3], "trainer.lr": 3e-4, **CLIP_AND_PICKSCORE},
    Z_IMAGE_PRESETS: {
        "model.kind": "z_image", "model.path": "Tongyi-MAI/Z-Image-Turbo", "model.dtype": "fp32", "model.height": 512,
        "model.guidance_scale": 0.0, "trainer.mixed_precision": "bf16", "sampling.noise_level": 0.7, "sampling.num_steps": 6,
        "sampling.eval_num_steps": 10, "sampling.window.choices": [1, 2, 3], "trainer.lr": 3e-4, "rewards": {"pickscore": 1.0}},
    FLUX2_PRESETS: {
        "model.kind": "flux2_klein", "model.path": "black-forest-labs/FLUX.2-klein-9B", "model.dtype": "bf16", "model.height": 384,
        "model.guidance_scale": 1.0, "model.gradient_checkpointing": False, "sampling.noise_level": 0.5, "sampling.num_steps": 4,
        "sampling.eval_num_steps": 10, "sampling.window.choices": [1, 2], "trainer.lr": 3e-4, "rewards": {"pickscore": 1.0}},
    FLUX2_DEV_PRESETS: {
        "model.kind": "flux2", "model.path": "black-forest-labs/FLUX.2-dev", "model.dtype": "bf16", "model.height": 512,
        "model.guidance_scale": 4.0, "model.gradient_checkpointing": False, "run.distributed": "fsdp2", "sampling.noise_level": 1.0,
        "sampling.num_steps": 8, "sampling.eval_num_steps": 28, "sampling.window.choices": [1, 2, 3], "trainer.lr": 3e-4,
        **CLIP_AND_PICKSCORE},
    WAN_PRESETS: {
        "model.kind": "wan", "model.path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "model.dtype": "bf16", "model.height": 256,
        "model.num_frames": 5, "model.guidance_scale": 5.0, "model.gradient_checkpointing": False, "sampling.noise_level": 0.9,
        "sampling.num_steps": 10, "sampling.eval_num_steps": 28, "sampling.window.choices": [1, 2, 3], "trainer.lr": 1e-4,
        "reward.frame_stride": 1, **CLIP_AND_PICKSCORE},
}


@pytest.mark.parametrize("name,family", [(n, names) for names in FLOW_FACTORY for n in names], ids=lambda v: v if isinstance(v, str) else "")
def test_family_presets_keep_flow_factorys_settings(name, family):
    from functools import reduce

    cfg = load_config(_preset(name), validate_paths=False)
    expected = {**FLOW_FACTORY_COMMON, **FLOW_FACTORY[family]}
    assert _yaml_reward_weights(name) == expected.pop("rewards")
    got = {path: reduce(getattr, path.split("."), cfg) for path in expected}
    assert got == expected
    _assert_flow_factory_batching(name, cfg)


def test_kontext_preset_keeps_flow_grpos_counting_flux_kontext_settings():
    # yifan123/flow_grpo config/grpo.py counting_flux_kontext on config/base.py (docs/ALGORITHMS IV.1)
    cfg = load_config(_preset("flux_kontext_counting_1gpu"), validate_paths=False)
    m, s, t = cfg.model, cfg.sampling, cfg.trainer
    assert (m.kind, m.path, m.dtype, m.height, m.width, m.guidance_scale, m.max_sequence_length) == (
        "flux_kontext", "black-forest-labs/FLUX.1-Kontext-dev", "bf16", 512, 512, 2.5, 128)
    assert (s.sampler, s.noise_level, s.num_steps, s.eval_num_steps, s.schedule, s.batch_size) == ("flow_grpo", 0.9, 6, 28, "pipeline", 3)
    assert (s.window.strategy, int(s.num_steps * s.window.trained_fraction)) == ("all", 5)  # timestep_fraction 0.99
    assert (cfg.lora.rank, cfg.lora.alpha, len(cfg.lora.target_modules)) == (64, 128, 13) and "proj_mlp" in cfg.lora.target_modules
    assert (cfg.data.group_size, cfg.advantage.std, cfg.advantage.clip, cfg.objective.grpo.clip_range) == (21, "global", 5.0, 1e-4)
    assert (t.lr, t.weight_decay, t.kl_beta, t.max_grad_norm, t.ema, t.ema_decay, t.mixed_precision) == (
        3e-4, 1e-4, 0.0, 1.0, True, 0.9, "bf16")
    batches = cfg.data.prompts_per_iteration * cfg.data.group_size // s.batch_size
    assert batches // t.gradient_accumulation_steps == 2  # the reference's 2 optimizer steps per epoch


def test_g2rpo_preset_keeps_the_reference_settings():
    cfg = load_config(_preset("flux1_dev_g2rpo_1gpu"), validate_paths=False)
    gr = cfg.rollout.granular
    assert (cfg.rollout.kind, cfg.objective.kind, cfg.model.kind) == ("granular", "grpo", "flux")
    assert (cfg.sampling.sampler, cfg.sampling.noise_level, cfg.sampling.num_steps, cfg.sampling.shift) == ("flow_grpo", 0.7, 16, 3.0)
    assert cfg.data.group_size == 12 and gr.branch_steps == list(range(8)) and gr.granularities == [1, 2]
    assert (gr.clip, gr.step_per_branch, cfg.objective.grpo.clip_range, cfg.trainer.kl_beta) == (5.0, True, 1e-4, 0.0)
    assert (gr.tail_grid, gr.tail_end, gr.step_order) == ("reference", "zero", "increasing")
    assert (cfg.model.guidance_scale, cfg.sampling.logprob_reduction, cfg.sampling.schedule) == (3.5, "mean", "shifted_linear")
    assert (cfg.trainer.weight_decay, cfg.trainer.adam_eps, cfg.trainer.max_grad_norm, cfg.trainer.lr_schedule) == (
        1e-4, 1e-8, 1.0, "constant")


def test_fast_preset_keeps_flow_grpo_fasts_settings():
    """yifan123/flow_grpo `pickscore_sd3_fast_nocfg`: no CFG, CPS at 0.8 with the code's log-prob, a
    window of 3 SDE steps starting at 0, 1 or 2 (ODE elsewhere, only the window trained), clip 1e-5,
    no KL, and 2 optimizer steps per iteration."""
    from flowrl.sampling.schedules import window_steps

    cfg = load_config(_preset("sd35_medium_fast_1gpu"), validate_paths=False)
    s, w = cfg.sampling, cfg.sampling.window
    assert (cfg.objective.kind, cfg.rollout.kind, cfg.model.guidance_scale) == ("grpo", "flat", 1.0)
    assert (s.sampler, s.cps_logprob, s.noise_level, s.num_steps, s.eval_num_steps) == ("cps", "reference", 0.8, 10, 40)
    assert (cfg.objective.grpo.clip_range, cfg.trainer.kl_beta, cfg.advantage.std, cfg.advantage.clip) == (1e-5, 0.0, "global", 5.0)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.trainer.lr, cfg.trainer.weight_decay, cfg.data.group_size) == (32, 64, 3e-4, 1e-4, 18)
    windows = {tuple(window_steps(w.strategy, s.num_steps, w.size, w.start, i, cfg.trainer.seed, choices=w.choices))
               for i in range(200)}
    assert windows == {(0, 1, 2), (1, 2, 3), (2, 3, 4)}  # randint(0, 2): inside steps 0-4
    batches = cfg.data.prompts_per_iteration * cfg.data.group_size // s.batch_size
    assert batches // cfg.trainer.gradient_accumulation_steps == 2


def test_dppo_preset_keeps_flow_factorys_dppo_settings():
    """Flow-Factory's geneval2_single DPPO config: no CFG, CPS at 0.7 with its log-prob -mean((x' - mean)^2)
    (its scheduler's CPS branch), 3 distinct SDE steps of 0-5, the divergence mask at 1e-6 in place of the
    clip, groups of 16, 2 optimizer steps per iteration."""
    cfg = load_config(_preset("sd35_medium_dppo_1gpu"), validate_paths=False)
    s, w, g = cfg.sampling, cfg.sampling.window, cfg.objective.grpo
    assert (cfg.objective.kind, cfg.rollout.kind, cfg.model.guidance_scale, s.sampler, s.noise_level, s.num_steps) == (
        "grpo", "flat", 1.0, "cps", 0.7, 10)
    assert s.cps_logprob == "reference"
    assert (w.strategy, w.size, w.choices, g.trust_region, g.divergence_threshold) == ("scattered", 3, list(range(6)), "divergence_mask", 1e-6)
    assert (cfg.data.group_size, cfg.trainer.lr, cfg.trainer.weight_decay, cfg.advantage.std, cfg.advantage.clip) == (16, 3e-4, 1e-4,
                                                                                                                     "global", 5.0)
    batches = cfg.data.prompts_per_iteration * cfg.data.group_size // s.batch_size
    assert batches // cfg.trainer.gradient_accumulation_steps == 2


def test_dpo_preset_keeps_flow_grpos_dpo_settings():
    """yifan123/flow_grpo `pickscore_sd3` DPO: the reference weights sample on the Flow-GRPO SDE (0.7) with
    CFG 4.5 over 40 steps, groups of 24, beta 100, 39 repetitions, no refresh, no KL, lr 3e-4."""
    from flowrl.train.objectives.dpo import DPO

    cfg = load_config(_preset("sd35_medium_dpo_1gpu"), validate_paths=False)
    s, o = cfg.sampling, cfg.objective.dpo
    assert (cfg.objective.kind, s.sampler, s.noise_level, s.num_steps, cfg.model.guidance_scale) == ("dpo", "flow_grpo", 0.7, 40, 4.5)
    assert (o.beta, o.sampler, o.reference_refresh, o.ties, o.timestep_draw, o.guidance_scale, o.stepping) == (
        100.0, "reference", 0, "reference", "logit_normal", 1.0, "iteration")
    assert DPO.timesteps(SimpleNamespace(opts=o, ctx=SimpleNamespace(cfg=cfg))) == 39
    assert (cfg.data.group_size, cfg.trainer.lr, cfg.trainer.weight_decay, cfg.trainer.kl_beta) == (24, 3e-4, 1e-4, 0.0)
    assert (cfg.lora.rank, cfg.lora.alpha) == (32, 64)


def test_group_objective_presets_keep_their_papers_settings():
    dgpo = load_config(_preset("sd35_medium_dgpo_1gpu"), validate_paths=False)
    assert (dgpo.objective.kind, dgpo.rollout.kind, dgpo.sampling.sampler) == ("dgpo", "flat", "ode")
    assert (dgpo.model.height, dgpo.model.guidance_scale, dgpo.sampling.num_steps, dgpo.data.group_size) == (512, 4.5, 10, 16)
    o = dgpo.objective.dgpo
    assert (o.beta, o.timesteps, o.clip_range, o.guidance_scale, dgpo.trainer.kl_beta) == (100.0, 4, 0.01, 1.0, 0.02)
    assert (o.loss_form, o.sigma_draw, o.grid_points, o.stepping, o.clip_old, o.sample_with_old_after) == (
        "reference", "grid", 5, "iteration", "ema", 500)
    assert (dgpo.data.prompts_per_iteration, dgpo.lora.rank, dgpo.lora.alpha) == (8, 64, 128)
    assert dgpo.sampling.batch_size % dgpo.data.group_size == 0  # whole groups per micro-batch
    gdro = load_config(_preset("flux1_dev_gdro_1gpu"), validate_paths=False)
    assert (gdro.objective.kind, gdro.rollout.kind, gdro.data.group_size) == ("gdro", "offline", 6)
    g = gdro.objective.gdro
    assert (g.form, g.tau, g.beta, g.error_reduction, g.gamma, gdro.trainer.lr, gdro.lora.rank) == (
        "top1", 0.05, 6.0, "sum", 1.0, 3e-4, 32)


def _yaml_reward_weights(name: str) -> dict:
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(OmegaConf.load(_preset(name)).reward.weights))


# Regression: a YAML's reward.weights replaces the schema default instead of merging into it.
@pytest.mark.parametrize("name", IMAGE_PRESETS)
def test_loaded_reward_weights_are_exactly_the_presets(name):
    cfg = load_config(_preset(name), validate_paths=False)
    assert cfg.reward.weights == _yaml_reward_weights(name)


# where each preset reward takes its model from: a nonexistent one must fail in one sentence
MODEL_OPTION = {"pickscore": "path", "hpsv2": "checkpoint", "clip_score": "path"}


@pytest.mark.parametrize("name", IMAGE_PRESETS)
def test_preset_rewards_with_a_missing_model_fail_clearly(name, tmp_path):
    """Building a preset's reward (trainer start) with a model that is not there raises a
    one-sentence UserError naming the reward, never a KeyError, an OSError or an ImportError.
    (hpsv2 needs open-clip-torch, which cannot import on CPU machines: the message names the
    extra there; with the extra installed it names the missing checkpoint.)"""
    from rewards import MultiReward, available_rewards

    load_config(_preset(name), validate_paths=False)
    for reward in _yaml_reward_weights(name):
        assert reward in available_rewards()
        options = {MODEL_OPTION[reward]: str(tmp_path / "no-such-model"), "device": "cpu"}
        with pytest.raises(UserError) as info:
            MultiReward({reward: 1.0}, options={reward: options})
        message = str(info.value)
        assert f"reward '{reward}'" in message and "\n" not in message
        assert "no-such-model" in message or "pip install 'flowrl[hps]'" in message


# ---- LoRA targets on the real architectures ------------------------------------------------


@pytest.fixture
def tiny_dirs(tiny_sd3_dir, tiny_flux_dir, tiny_flux_kontext_dir, tiny_qwen_image_dir, tiny_z_image_dir, tiny_flux2_klein_dir,
              tiny_wan_dir, tiny_flux2_dir):
    # the session's tiny pipelines (tests/conftest.py), built by flowrl.models.tiny
    return {"sd3": tiny_sd3_dir, "flux": tiny_flux_dir, "flux_kontext": tiny_flux_kontext_dir, "qwen_image": tiny_qwen_image_dir,
            "z_image": tiny_z_image_dir, "flux2_klein": tiny_flux2_klein_dir, "wan": tiny_wan_dir, "flux2": tiny_flux2_dir}


def _assert_targets_adapted(policy, targets):
    names = {n for n, _ in policy.transformer.named_modules()}
    for t in targets:
        hits = [n for n in names if (n == t or n.endswith("." + t)) and f"{n}.lora_A" in names]
        assert hits, f"LoRA target '{t}' wrapped no module of {type(policy.transformer).__name__}"


@pytest.mark.parametrize("name", IMAGE_PRESETS)
def test_lora_targets_exist_in_the_architecture(name, tiny_dirs):
    from flowrl.models import load_policy

    cfg = load_config(_preset(name), validate_paths=False)
    policy = load_policy(ModelConfig(kind=cfg.model.kind, path=str(tiny_dirs[cfg.model.kind]), device="cpu"))
    policy.add_lora(cfg.lora)  # raises UserError naming any target the transformer lacks
    _assert_targets_adapted(policy, cfg.lora.target_modules)
    assert policy.trainable_parameters()
    assert all(p.dtype.is_floating_point for p in policy.trainable_parameters())


def test_sd3_targets_leave_out_dual_attention_attn2():
    """SD3.5-Medium's dual-attention blocks carry a second image-only attention `attn2`; the
    presets follow Flow-GRPO's train_sd3.py and adapt only `attn` (prefix 'attn.')."""
    import torch
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig as PeftLoraConfig

    cfg = load_config(_preset("sd35_medium_pickscore_8gpu"), validate_paths=False)
    torch.manual_seed(0)
    t = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    t.add_adapter(PeftLoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules=list(cfg.lora.target_modules)))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in t.named_modules() if n.endswith(".lora_A")}
    assert "transformer_blocks.0.attn.to_q" in adapted and "transformer_blocks.0.attn.add_q_proj" in adapted
    assert not any(".attn2." in n for n in adapted)
