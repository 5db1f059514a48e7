"""run.distributed fsdp2 and ddp on CPU processes joined by gloo: the same training as one process on
the same global batch; for fsdp2 also exact resume from shards, and exports that plain diffusers loads."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.config import ConfigError, load_config
from flowrl.errors import UserError
from flowrl.runtime.processes import run_cpu_processes
from dist_worker import train_and_write
from run_checks import run_metrics

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo launch is tested on Linux")

# brightness: a smooth reward, so tiny float differences between the layouts stay tiny in the metrics
SMOOTH = ["reward.weights={brightness: 1.0}"]
FULL_FINETUNE = ["lora.enabled=false", "trainer.lr=1e-3"]


def train_worker(out: Path, model_dir: str, overrides: list[str], processes: int) -> dict:
    if processes == 1:  # in this process: a fresh interpreter would only add its start-up
        train_and_write(out, model_dir, overrides)
    else:  # forked from this process as `run.cpu_processes` starts its processes (accelerate's launcher: test_training)
        assert run_cpu_processes(processes, lambda: train_and_write(out, model_dir, overrides) or 0) == 0
    rank0 = json.loads((out / "rank0.json").read_text())
    assert rank0["world"] == processes
    return {"history": rank0["history"], "full": load_file(str(out / "full.safetensors")),
            "sample": load_file(str(out / "sample.safetensors"))["final"], "checkpoint": out / "run" / "checkpoints" / "iter_000002"}


def assert_trains_as_one_process(one: dict, two: dict, lr: float, transitions: int) -> None:
    """`one` and `two` (train_worker's) took the same optimizer steps over the same global batches:
    one step an iteration, the same metrics and the same final weights, within float noise."""
    assert len(one["history"]) == len(two["history"]) == 2
    for a, b in zip(one["history"], two["history"]):
        assert a["trained_transitions"] == b["trained_transitions"] == transitions and a["optimizer_steps"] == b["optimizer_steps"] == 1
        for key in ("reward_mean", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
        # the policy loss is -mean(advantage x ratio) with ratios within 1e-5 of 1: terms of size 1
        # that cancel to about 1e-5, so it is compared on the terms' scale
        for key in ("loss", "policy_loss"):
            assert b[key] == pytest.approx(a[key], abs=5e-5), key
    assert one["history"][-1]["kl"] > 0  # the reference is not the trained network
    assert one["full"].keys() == two["full"].keys()
    # Adam divides each step by the gradient's own size, so a weight whose gradient is near float
    # noise may step differently by a fraction of lr (up to 0.063 lr on an Intel Xeon box, 0.05 on an AMD
    # EPYC); over all the weights the layouts agree to 1e-4 (per 64-element LoRA matrix, one such weight
    # alone lifted the mean gap to 1.05e-4 on the Xeon)
    gaps = {k: (a - two["full"][k]).abs() for k, a in one["full"].items()}
    for k, gap in gaps.items():
        assert gap.max() <= 0.1 * lr, k
    assert sum(g.sum() for g in gaps.values()) <= 1e-4 * sum(a.abs().sum() for a in one["full"].values())
    lora_b = [k for k in two["full"] if "lora_B" in k]
    assert not lora_b or any(two["full"][k].abs().sum() > 0 for k in lora_b)  # trained off the zero init


def plain_diffusers_sample(model_dir: str, kind: str, checkpoint: Path, lora: bool) -> torch.Tensor:
    """The worker's ODE sample, redrawn from the checkpoint's export loaded by diffusers alone."""
    from diffusers import FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline

    from flowrl.models.flux import FluxPolicy
    from flowrl.models.sd3 import SD3Policy
    from flowrl.sampling.rollout import SamplerSpec, rollout

    pipeline, transformer, policy_class = {"sd3": (StableDiffusion3Pipeline, SD3Transformer2DModel, SD3Policy),
                                           "flux": (FluxPipeline, FluxTransformer2DModel, FluxPolicy)}[kind]
    if lora:
        pipe = pipeline.from_pretrained(model_dir)
        pipe.load_lora_weights(str(checkpoint / "lora"))
    else:
        pipe = pipeline.from_pretrained(model_dir, transformer=transformer.from_pretrained(str(checkpoint / "transformer")))
    cfg = load_config("tiny_jpeg", [f"model.path={model_dir}", f"model.kind={kind}", "sampling.eval_num_steps=2"])
    policy = policy_class(pipe, cfg.model, "cpu")
    s = cfg.sampling
    spec = SamplerSpec.ode(policy.sigmas(s.eval_num_steps, s.schedule, s.shift))
    return rollout(policy, ["a red circle", "a blue square"], [7, 8], spec, 2).final


@pytest.mark.slow
def test_ddp_on_two_processes_trains_as_one_process_on_the_same_global_batch(tmp_path, tiny_sd3_dir):
    # run.distributed ddp (the default), not rank against rank (equal by construction) but against one
    # process: 4 samples of one prompt in 2 micro-batches, both in one optimizer step (one process
    # accumulating 2, or 2 processes 1 each, their gradients averaged by the all-reduce); the group's
    # advantages need the rewards gathered from both processes
    small = [*SMOOTH, "model.kind=sd3", "data.prompts_per_iteration=1", "sampling.num_steps=2",
             "sampling.window.trained_fraction=1.0"]  # both steps trained (Flow-GRPO's fraction would train one)
    one = train_worker(tmp_path / "one", tiny_sd3_dir, [*small, "trainer.gradient_accumulation_steps=2"], 1)
    two = train_worker(tmp_path / "two", tiny_sd3_dir, [*small, "trainer.gradient_accumulation_steps=1"], 2)
    assert_trains_as_one_process(one, two, load_config("tiny_jpeg").trainer.lr, transitions=2 * 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind, mode", [("sd3", "lora"), ("flux", "full")])
def test_fsdp2_on_two_processes_trains_as_one_process_on_the_same_global_batch(tmp_path, request, kind, mode):
    # one optimizer step per iteration over all 4 micro-batches: each of 2 processes trains 2 of
    # them, so both layouts take every step on the same global batch; full fine-tuning's KL runs
    # on a sharded frozen copy
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    extra = [*SMOOTH, f"model.kind={kind}", "sampling.window.trained_fraction=1.0", *(FULL_FINETUNE if mode == "full" else [])]
    one = train_worker(tmp_path / "one", model_dir, [*extra, "trainer.gradient_accumulation_steps=4"], 1)
    two = train_worker(tmp_path / "two", model_dir, [*extra, "trainer.gradient_accumulation_steps=2", "run.distributed=fsdp2"], 2)
    lr = 1e-3 if mode == "full" else load_config("tiny_jpeg").trainer.lr
    assert_trains_as_one_process(one, two, lr, transitions=4 * 3)
    # the checkpoint holds shards, no whole copy but the user-facing export, and that export
    # loaded by plain diffusers redraws the trained weights' sample
    ckpt = two["checkpoint"]
    assert (ckpt / "sharded").is_dir() and not (ckpt / "trainable.safetensors").exists()
    redrawn = plain_diffusers_sample(model_dir, kind, ckpt, lora=mode == "lora")
    assert torch.allclose(redrawn, two["sample"], atol=1e-5)
    if mode == "full":  # `flowrl sample --run` and `eval --run` load the EMA export of a sharded run
        from flowrl.runs import load_run_policy

        _, policy, _ = load_run_policy(ckpt.parent.parent)
        ema = load_file(str(ckpt / "ema_transformer" / "diffusion_pytorch_model.safetensors"))
        assert all(torch.equal(policy.transformer.state_dict()[k], v) for k, v in ema.items())
        assert not all(torch.equal(ema[k], two["full"][k]) for k in ema)  # the EMA, not the raw weights


@pytest.mark.slow
def test_fsdp2_resumes_from_its_shards_exactly(tmp_path, tiny_sd3_dir):
    # flowrl's own launch (run.cpu_processes) with gradient checkpointing; a run stopped after its
    # sharded checkpoint at iteration 2 (a copy of the uninterrupted run without what came later:
    # the state a crash in iteration 3 leaves) resumes from it and repeats the uninterrupted run,
    # metrics and exported weights
    args = ["tiny_jpeg", f"model.path={tiny_sd3_dir}", "sampling.num_steps=3", "data.prompts_per_iteration=2",
            "data.group_size=4", "sampling.batch_size=2", "run.tracker=none", "run.progress=false", "lora.rank=4",
            "lora.alpha=8", "run.sample_every=0", "run.checkpoint_every=2", "trainer.kl_beta=0.01", "run.cpu_processes=2",
            "run.distributed=fsdp2", "model.gradient_checkpointing=true"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(["train", *args, "trainer.iterations=3", "--run-dir", str(straight)]) == 0
    shutil.copytree(straight, stopped)
    shutil.rmtree(stopped / "checkpoints" / "iter_000003")
    (stopped / "checkpoints" / "latest").write_text("iter_000002")
    assert main(["train", "--resume", str(stopped)]) == 0
    assert run_metrics(stopped) == run_metrics(straight)
    for export in ("lora", "ema_lora"):
        a, b = (load_file(str(r / "checkpoints" / "iter_000003" / export / "pytorch_lora_weights.safetensors")) for r in (straight, stopped))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((stopped / "checkpoints" / "iter_000002" / "state.json").read_text())
    assert state["sharded"] == ["ema", "optimizer", "trainable"] and state["num_processes"] == 2


def test_full_finetune_reference_is_the_network_as_loaded(tiny_sd3_dir):
    from flowrl.models import load_policy
    from flowrl.train.sharding import reference_copy

    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}"])
    policy = load_policy(cfg.model, device="cpu")
    policy.set_reference_network(reference_copy(policy.transformer))
    policy.enable_full_finetune()
    x, cond = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(0)), policy.encode(["a", "b"])
    with torch.no_grad():
        before = policy.velocity(x, 0.5, cond)
        for p in policy.trainable_parameters():
            p.add_(0.01)
        with policy.reference():
            with policy.reference():  # re-entrant
                ref = policy.velocity(x, 0.5, cond)
            assert policy.net is not policy.transformer
        moved = policy.velocity(x, 0.5, cond)
    assert policy.net is policy.transformer
    assert torch.equal(ref, before) and not torch.allclose(moved, before)
    assert not any(p.requires_grad for p in policy._reference_net.parameters())


def test_distributed_settings_get_one_sentence(tiny_sd3_dir):
    base = [f"model.path={tiny_sd3_dir}"]
    with pytest.raises(ConfigError, match="run.distributed must be one of"):
        load_config("tiny_jpeg", [*base, "run.distributed=zero3"])
    with pytest.raises(ConfigError, match="trainer.mixed_precision must be no, bf16 or auto"):
        load_config("tiny_jpeg", [*base, "run.distributed=fsdp2", "trainer.mixed_precision=fp16"])
    with pytest.raises(ConfigError, match="run.distributed fsdp2 runs rollout.kind flat, not 'tree'"):
        load_config("tiny_jpeg", [*base, "run.distributed=fsdp2", "rollout.kind=tree", "rollout.tree.split_steps=[0]",
                                  "rollout.tree.branching=[4]", "data.group_size=4"])
    load_config("tiny_jpeg", [*base, "lora.enabled=false", "trainer.kl_beta=0.04"])  # full fine-tuning keeps a KL now


def test_a_whole_checkpoint_is_not_resumed_as_shards(tmp_path, tiny_sd3_dir, capsys):
    args = ["tiny_jpeg", f"model.path={tiny_sd3_dir}", "sampling.num_steps=2", "data.prompts_per_iteration=1",
            "data.group_size=2", "sampling.batch_size=2", "run.tracker=none", "run.progress=false", "run.sample_every=0",
            "trainer.iterations=1"]
    assert main(["train", *args, "--run-dir", str(tmp_path / "r")]) == 0
    assert main(["train", "--resume", str(tmp_path / "r"), "trainer.iterations=2", "run.distributed=fsdp2"]) == 2
    err = capsys.readouterr().err
    assert "was written whole (run.distributed ddp); resume it with run.distributed=ddp" in err and "Traceback" not in err
    assert not torch.distributed.is_initialized()  # the refused run's group of one ended with it (flowrl.api runs on after)


# ---- the memory planner -------------------------------------------------------------------
def test_memory_plan_counts_the_real_networks_and_divides_what_fsdp2_shards(tiny_sd3_dir):
    from diffusers import SD3Transformer2DModel

    from flowrl.train.memory_plan import GIB, Launch, load_model, lora_params, plan

    model = load_model(tiny_sd3_dir)  # meta device: the configs only
    real = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer")
    assert sum(p.numel() for p in model.transformer.parameters()) == sum(p.numel() for p in real.parameters())
    assert all(p.is_meta for p in model.transformer.parameters())

    # LoRA: rank x (in + out) per targeted Linear, the count peft builds
    from peft import LoraConfig, get_peft_model_state_dict

    real.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"]))
    assert lora_params(model.transformer, 4, ["to_q", "to_v"]) == sum(v.numel() for v in get_peft_model_state_dict(real).values())

    full = Launch(lora_rank=0, distributed="fsdp2", gpus_per_node=4, dtype="bf16")
    one = {w: g for w, g, _ in plan(model, Launch(lora_rank=0, distributed="ddp", dtype="bf16"))}
    four = {w: g for w, g, _ in plan(model, full)}
    n = sum(p.numel() for p in model.transformer.parameters())
    assert one["weights (fp32 master)"] == pytest.approx(4 * n / GIB)
    for row in ("weights (fp32 master)", "gradients (fp32)", "optimizer (AdamW, 2 fp32 moments)", "EMA (fp32)", "reference copy"):
        assert four[row] == pytest.approx(one[row] / 4), row
    assert one["reference copy"] == pytest.approx(2 * n / GIB)  # bf16 copy for the KL
    assert four["text encoders and VAE"] == one["text encoders and VAE"] > 0  # never sharded
    lora = {w: g for w, g, _ in plan(model, Launch(lora_rank=4, lora_targets=["to_q"]))}
    assert lora["reference copy"] == 0 and lora["weights (frozen base)"] == pytest.approx(2 * n / GIB)
    # checkpointing keeps one input per block instead of every block's activations
    ckpt = {w: g for w, g, _ in plan(model, Launch(gradient_checkpointing=True, height=512, width=512))}
    plain = {w: g for w, g, _ in plan(model, Launch(height=512, width=512))}
    assert ckpt["activations (estimate)"] < plain["activations (estimate)"]


def test_memory_plan_counts_bitsandbytes_8bit_moments_as_bitsandbytes_allocates_them(tiny_sd3_dir):
    import bitsandbytes
    from diffusers import SD3Transformer2DModel

    from flowrl.train.memory_plan import GIB, Launch, load_model, plan

    real = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer")
    params = list(real.parameters())
    optimizer = bitsandbytes.optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # the moments and their absmax; the two quantisation maps are shared by every 8-bit tensor
    allocated = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
                    if isinstance(t, torch.Tensor) and not k.startswith("qmap"))
    model = load_model(tiny_sd3_dir)
    rows = {w: g for w, g, _ in plan(model, Launch(lora_rank=0, optimizer="adamw8bit"))}
    assert rows["optimizer (adamw8bit, 2 8-bit moments)"] * GIB == allocated  # 10 tensors of 4096+ values in 8 bits
    adamw = {w: g for w, g, _ in plan(model, Launch(lora_rank=0))}["optimizer (AdamW, 2 fp32 moments)"]
    assert adamw * GIB == 8 * sum(p.numel() for p in params) > allocated
    assert rows["peak while training"] < {w: g for w, g, _ in plan(model, Launch(lora_rank=0))}["peak while training"]
    with pytest.raises(ConfigError, match="trainer.optimizer adamw8bit cannot step run.distributed fsdp2"):
        plan(model, Launch(lora_rank=0, optimizer="adamw8bit", distributed="fsdp2", gpus_per_node=2))


def test_plan_memory_script_prints_the_table_and_refuses_bad_launches(capsys):
    from script_loader import load_script

    script = load_script("plan_memory")
    assert script.main(["stabilityai/stable-diffusion-3.5-medium", "--lora-rank", "32", "--height", "512", "--width", "512"]) == 0
    out = capsys.readouterr().out
    assert "stabilityai/stable-diffusion-3.5-medium" in out and "plan peak" in out and "2.24B" in out
    assert script.main(["black-forest-labs/FLUX.1-dev", "--full", "--gpus", "8", "--nodes", "2", "--distributed", "fsdp2"]) == 0
    assert "11.90B x 4 B / 16 GPUs" in capsys.readouterr().out
    assert script.main(["black-forest-labs/FLUX.1-dev", "--full", "--optimizer", "adamw8bit"]) == 0
    assert "optimizer (adamw8bit, 2 8-bit moments)    22.52" in capsys.readouterr().out  # AdamW's 88.67 GiB / 3.94
    assert script.main(["stabilityai/stable-diffusion-3.5-medium", "--lora-rank", "32", "--quantize", "nf4",
                        "--quantize-text-encoders", "nf4"]) == 0
    out = capsys.readouterr().out
    assert "2.24B Linear weights x (0.5 B + 4 B per 64) nf4" in out and "text encoders 4.34B Linear weights" in out
    assert script.main(["stabilityai/stable-diffusion-3.5-medium", "--gpus", "0"]) == 2
    assert capsys.readouterr().err.strip() == "plan_memory: --gpus must be at least 1; got 0"
    assert script.main(["no/such-model-here"]) == 2
    assert "neither a known model" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_memory_plan_counts_quantised_weights_as_bitsandbytes_holds_them(tiny_sd3_dir, mode):
    pytest.importorskip("bitsandbytes")
    from flowrl.models import load_policy
    from flowrl.schema import ModelConfig
    from flowrl.train.memory_plan import GIB, Launch, load_model, plan, weight_bytes

    def held(module):  # the bytes of its parameters as loaded, with each quantised layer's absmax or row scales
        scales = [getattr(m.weight, "quant_state", None) for m in module.modules() if hasattr(m, "weight")]
        absmax = sum(s.absmax.nbytes for s in scales if s is not None)
        rows = sum(m.weight.SCB.nbytes for m in module.modules() if getattr(getattr(m, "weight", None), "SCB", None) is not None)
        return sum(p.nbytes for p in module.parameters()) + absmax + rows

    loaded = load_policy(ModelConfig(path=tiny_sd3_dir, quantize=mode, quantize_text_encoders=mode), device="cpu")
    model = load_model(tiny_sd3_dir)  # the meta-device networks the plan counts
    assert weight_bytes(model.transformer, mode, 4) == held(loaded.transformer)
    names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    assert [weight_bytes(e, mode, 4) for e in model.text_encoders] == [held(getattr(loaded.pipe, n)) for n in names]

    plain, quantised = ({w: g for w, g, _ in plan(model, Launch(lora_rank=4, dtype="fp32", quantize=q, quantize_text_encoders=q))}
                        for q in ("none", mode))
    assert quantised["weights (frozen base)"] == pytest.approx(weight_bytes(model.transformer, mode, 4) / GIB)
    assert quantised["weights (frozen base)"] < plain["weights (frozen base)"] / (3 if mode == "nf4" else 2)
    assert quantised["text encoders and VAE"] < plain["text encoders and VAE"]
    for launch in (Launch(lora_rank=0, quantize=mode), Launch(lora_rank=4, distributed="fsdp2", gpus_per_node=2, quantize=mode)):
        with pytest.raises(UserError, match=f"quantize {mode} plans a LoRA over the quantised base under ddp"):
            plan(model, launch)


def test_memory_plan_knows_qwen_image(tiny_qwen_image_dir):
    from diffusers import QwenImageTransformer2DModel

    from flowrl.train.memory_plan import GIB, Launch, load_model, plan

    tiny = load_model(tiny_qwen_image_dir)  # a local pipeline: its class names the kind, its configs build the parts
    real = QwenImageTransformer2DModel.from_pretrained(tiny_qwen_image_dir, subfolder="transformer")
    assert tiny.kind == "qwen_image" and tiny.frozen_params > 0
    assert sum(p.numel() for p in tiny.transformer.parameters()) == sum(p.numel() for p in real.parameters())
    model = load_model("Qwen/Qwen-Image")  # the shipped configs, nothing downloaded
    n = sum(p.numel() for p in model.transformer.parameters())
    assert 19e9 < n < 21e9 and 8.0e9 < model.frozen_params < 8.6e9  # the 20B MMDiT; Qwen2.5-VL-7B and the VAE
    rows = {w: g for w, g, _ in plan(model, Launch(lora_rank=64, height=512, width=512, max_sequence_length=64))}
    # 60 blocks x 54 B x hidden 3072 x (32 x 32 image tokens + 64 prompt tokens) x 2 rows: true CFG doubles the batch
    assert rows["activations (estimate)"] == pytest.approx(60 * 54 * 3072 * (32 * 32 + 64) * 2 / GIB)


def test_memory_plan_knows_z_image(tiny_z_image_dir):
    from diffusers import ZImageTransformer2DModel

    from flowrl.train.memory_plan import GIB, Launch, load_model, plan

    tiny = load_model(tiny_z_image_dir)
    real = ZImageTransformer2DModel.from_pretrained(tiny_z_image_dir, subfolder="transformer")
    assert tiny.kind == "z_image" and tiny.hidden == 32
    assert sum(p.numel() for p in tiny.transformer.parameters()) == sum(p.numel() for p in real.parameters())
    model = load_model("Tongyi-MAI/Z-Image-Turbo")
    n = sum(p.numel() for p in model.transformer.parameters())
    assert 5.5e9 < n < 6.5e9 and 3.9e9 < model.frozen_params < 4.3e9  # the 6B DiT; Qwen3-4B and the VAE
    rows = {w: g for w, g, _ in plan(model, Launch(lora_rank=64, height=512, width=512, max_sequence_length=64))}
    # no CFG for the distilled model: one row per sample, over every ZImageTransformerBlock (refiners included)
    blocks = len(model.blocks())
    assert rows["activations (estimate)"] == pytest.approx(blocks * 54 * 3840 * (32 * 32 + 64) / GIB)


def test_memory_plan_knows_flux2_dev(tiny_flux2_dir):
    from flowrl.train.memory_plan import Launch, load_model, plan

    assert load_model(tiny_flux2_dir).kind == "flux2"
    model = load_model("black-forest-labs/FLUX.2-dev")
    n = sum(p.numel() for p in model.transformer.parameters())
    assert 31e9 < n < 33e9 and 23.5e9 < model.frozen_params < 25e9  # the 32B transformer; Mistral Small 3.1 and the VAE
    one = {w: g for w, g, _ in plan(model, Launch(lora_rank=64, height=512, width=512))}
    eight = {w: g for w, g, _ in plan(model, Launch(gpus_per_node=8, distributed="fsdp2", lora_rank=64, height=512, width=512))}
    assert one["weights (frozen base)"] > 55 and eight["weights (frozen base)"] == one["weights (frozen base)"] / 8


def test_memory_plan_knows_wan_and_counts_video_tokens(tiny_wan_dir):
    from diffusers import WanTransformer3DModel

    from flowrl.train.memory_plan import GIB, Launch, load_model, plan

    tiny = load_model(tiny_wan_dir)
    real = WanTransformer3DModel.from_pretrained(tiny_wan_dir, subfolder="transformer")
    assert tiny.kind == "wan" and sum(p.numel() for p in tiny.transformer.parameters()) == sum(p.numel() for p in real.parameters())
    model = load_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    n = sum(p.numel() for p in model.transformer.parameters())
    assert 1.3e9 < n < 1.5e9 and 5.6e9 < model.frozen_params < 6.0e9  # the 1.3B DiT; UMT5-XXL's encoder and the VAE
    rows = {w: g for w, g, _ in plan(model, Launch(lora_rank=64, height=256, width=256, frames=5, max_sequence_length=512))}
    # 30 blocks x 54 B x hidden 1536 x 2 latent frames x 16 x 16 patches x 2 rows (CFG); the prompt enters by
    # cross-attention, not as tokens of the sequence
    assert rows["activations (estimate)"] == pytest.approx(30 * 54 * 1536 * (2 * 16 * 16) * 2 / GIB)


def test_memory_plan_knows_flux2_klein_and_sana():
    from flowrl.train.memory_plan import GIB, Launch, load_model, plan

    klein = load_model("black-forest-labs/FLUX.2-klein-9B")
    n = sum(p.numel() for p in klein.transformer.parameters())
    assert klein.kind == "flux2_klein" and 8.5e9 < n < 9.5e9 and 8.0e9 < klein.frozen_params < 8.5e9  # Qwen3-8B and the VAE
    sana = load_model("Efficient-Large-Model/Sana_1600M_1024px_diffusers")
    n = sum(p.numel() for p in sana.transformer.parameters())
    assert sana.kind == "sana" and 1.5e9 < n < 1.7e9 and len(sana.blocks()) == 20  # the patch embedding is not a block
    rows = {w: g for w, g, _ in plan(sana, Launch(lora_rank=32, height=1024, width=1024))}
    # 20 blocks x 54 B x hidden 2240 x (1024 / 32)^2 tokens x 2 rows (CFG)
    assert rows["activations (estimate)"] == pytest.approx(20 * 54 * 2240 * 32 * 32 * 2 / GIB)


@pytest.mark.parametrize("name", ["multi_gpu", "multi_node"])
def test_shipped_accelerate_configs_load_as_plain_multi_gpu_launches(name):
    from accelerate.commands.config.config_args import load_config_from_file

    from flowrl.presets import CONFIG_DIR

    cfg = load_config_from_file(str(CONFIG_DIR / "accelerate" / f"{name}.yaml"))
    assert cfg.distributed_type.value == "MULTI_GPU" and cfg.num_processes == 8 * cfg.num_machines
