"""The memory planner's text encoders off the GPU, its reward models, and --fit (flowrl/train/memory_plan.py,
flowrl/train/memory_fit.py, scripts/plan_memory.py)."""

from __future__ import annotations

import dataclasses

import pytest

from flowrl.config import load_config
from flowrl.errors import UserError
from flowrl.train.memory_fit import STEPS, fit
from flowrl.train.memory_plan import GIB, REWARD_NETWORKS, Launch, count, load_model, plan, plan_peak, reward_models


def _row(rows, what: str) -> float:
    return next(g for w, g, _ in rows if w == what)


@pytest.fixture(scope="module")
def tiny_sd3(tiny_sd3_dir):
    return load_model(tiny_sd3_dir)


def test_text_encoders_off_the_gpu_leave_only_the_vae(tiny_sd3):
    launch = Launch(lora_rank=4, dtype="bf16", height=64, width=64)
    vae = tiny_sd3.frozen_params - sum(map(count, tiny_sd3.text_encoders))
    for mode in ("cpu", "cached"):
        rows = plan(tiny_sd3, dataclasses.replace(launch, text_encoders=mode))
        assert _row(rows, "text encoders and VAE") == 2 * vae / GIB
    assert _row(plan(tiny_sd3, launch), "text encoders and VAE") == 2 * tiny_sd3.frozen_params / GIB
    with pytest.raises(UserError, match="quantize_text_encoders nf4 has nothing to quantise"):
        plan(tiny_sd3, dataclasses.replace(launch, text_encoders="cached", quantize_text_encoders="nf4"))


def test_reward_models_count_their_parameters_in_their_dtype(tiny_sd3):
    # the published fp32 checkpoints: PickScore_v1's model.safetensors 3.94 GB, openai/clip-vit-large-patch14's 1.71 GB
    assert REWARD_NETWORKS["pickscore"][1]() * 4 == pytest.approx(3.94e9, rel=0.01)
    assert REWARD_NETWORKS["clip_score"][1]() * 4 == pytest.approx(1.71e9, rel=0.01)
    launch = Launch(lora_rank=4, height=64, width=64, rewards={"pickscore": ["pickscore", "fp32"], "clip": ["clip_score", "bf16"]})
    rows = plan(tiny_sd3, launch)
    expected = REWARD_NETWORKS["pickscore"][1]() * 4 + REWARD_NETWORKS["clip_score"][1]() * 2
    assert _row(rows, "reward models") == expected / GIB
    assert plan_peak(rows) - plan_peak(plan(tiny_sd3, dataclasses.replace(launch, rewards={}))) == pytest.approx(expected / GIB)


def test_a_config_counts_the_reward_models_it_puts_on_the_gpu():
    cfg = load_config("tiny_jpeg", ["reward.weights={pickscore: 1.0, hpsv2: 1.0, clip_score: 0.5, brightness: 1.0}",
                                    "reward.options={hpsv2: {dtype: bf16}, clip_score: {device: cpu}}"], validate_paths=False)
    # brightness has no network; clip_score runs on the CPU
    assert reward_models(cfg) == {"pickscore": ["pickscore", "fp32"], "hpsv2": ["hpsv2", "bf16"]}


def test_fit_switches_features_on_in_order_and_drops_those_made_unnecessary(tiny_sd3):
    launch = Launch(lora_rank=4, dtype="bf16", height=256, width=256, batch=8, rewards={"pickscore": ["pickscore", "fp32"]})
    as_configured = plan_peak(plan(tiny_sd3, launch))
    assert fit(tiny_sd3, launch, as_configured).steps == []  # already within: nothing changes
    # a budget only the cached encoders plus bf16 rewards meet: checkpointing and 8-bit AdamW (on first) are dropped again
    target = dataclasses.replace(launch, text_encoders="cached", rewards={"pickscore": ["pickscore", "bf16"]})
    found = fit(tiny_sd3, launch, plan_peak(plan(tiny_sd3, target)))
    assert found.fits and found.launch == target
    assert [s.name for s in found.steps] == ["prompts cached, text encoders off the GPU", "reward models in bf16"]
    assert found.overrides == ["model.text_encoders=cached", "reward.options.pickscore.dtype=bf16"]
    # nothing fits: every feature on and the batch down to 1
    found = fit(tiny_sd3, launch, 0.01)
    assert not found.fits and found.launch.batch == 1 and found.launch.quantize == "nf4" and found.launch.gradient_checkpointing


def test_fit_passes_over_what_fsdp2_refuses(tiny_sd3):
    launch = Launch(lora_rank=4, gpus_per_node=2, distributed="fsdp2", height=64, width=64, batch=2)
    found = fit(tiny_sd3, launch, 0.0)
    assert found.launch.optimizer == "adamw" and found.launch.quantize == "none"  # 8-bit AdamW and NF4: not under fsdp2
    assert found.launch.text_encoders == "cached" and found.launch.batch == 1
    assert {s.name for s in STEPS} - {s.name for s in found.steps} == {"8-bit AdamW", "NF4 frozen base", "reward models in bf16"}


def test_plan_memory_fits_a_preset_and_its_overrides_reproduce_the_plan(capsys):
    from script_loader import load_script

    script = load_script("plan_memory")
    assert script.main(["sd35_medium_pickscore_1gpu", "--fit", "6GiB"]) == 0
    out = capsys.readouterr().out
    head, with_line, overrides_line = out.splitlines()[:3]
    assert head.startswith("sd35_medium_pickscore_1gpu: fits 6 GiB per GPU at a planned peak of ")
    peak = float(head.rsplit(" ", 2)[-2])
    assert peak <= 6 and "NF4 frozen base" in with_line and "prompts cached" in with_line
    overrides = overrides_line.removeprefix("  overrides: ").split()
    # the printed overrides, applied to the preset, plan the printed peak
    cfg = load_config("sd35_medium_pickscore_1gpu", overrides, validate_paths=False)
    model, launch = script.config_launch("sd35_medium_pickscore_1gpu", None)
    assert plan_peak(plan(model, Launch.from_config(cfg))) == pytest.approx(peak, abs=0.005)
    assert plan_peak(plan(model, launch)) > 6  # the preset as it is does not fit
    assert script.main(["sd35_medium_pickscore_1gpu", "--fit", "lots"]) == 2
    assert "--fit takes a size such as 12GiB or 80GB; got 'lots'" in capsys.readouterr().err


def test_plan_memory_reads_a_presets_gpu_count_and_sizes():
    from script_loader import load_script

    script = load_script("plan_memory")
    assert script.budget_gib("80GB") == pytest.approx(80e9 / GIB) and script.budget_gib("12GiB") == 12 == script.budget_gib("12")
    presets = script.image_presets()
    assert "flux2_dev_pickscore_8gpu" in presets and "tiny_jpeg" not in presets and "text_add" not in presets
    _, launch = script.config_launch("flux2_dev_pickscore_8gpu", None)
    assert launch.gpus == 8 and launch.distributed == "fsdp2" and set(launch.rewards) == {"clip_score", "pickscore"}


def test_kontext_counts_its_source_tokens_beside_the_generated_ones():
    # FLUX.1 Kontext's transformer is FLUX.1-dev's; its sequence carries the source's 1024 tokens after the 1024
    # generated ones at 512x512 (flowrl/models/flux_kontext.py), so its activations are those of 2048 + 128 tokens
    from flowrl.train.memory_plan import activation_bytes

    launch = Launch(lora_rank=64, dtype="bf16", height=512, width=512, batch=3, max_sequence_length=128)
    kontext, dev = load_model("black-forest-labs/FLUX.1-Kontext-dev"), load_model("black-forest-labs/FLUX.1-dev")
    assert (kontext.image_tokens(512, 512), dev.image_tokens(512, 512)) == (2048, 1024)
    ours, _ = activation_bytes(kontext, launch, 57)
    theirs, _ = activation_bytes(dev, launch, 57)
    assert ours / theirs == pytest.approx((2048 + 128) / (1024 + 128))
    assert _row(plan(kontext, launch), "activations (estimate)") > _row(plan(dev, launch), "activations (estimate)")
