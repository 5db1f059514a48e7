"""One Flow-GRPO training iteration of each model family at its real size (Qwen-Image, Z-Image-Turbo,
Wan2.1 1.3B at the preset's 5 frames), with random weights:
seconds per iteration and peak memory against scripts/plan_memory.py's plan for the same launch.

    python scripts/bench_families.py                          # on a CUDA machine (scripts/gpu_checks.sh)
    python scripts/bench_families.py --families qwen_image    # one family
    python scripts/bench_families.py --cpu-smoke              # the same code path with tiny networks, no reading

Nothing is downloaded: each family's transformer is built from the config its hub id ships with
(flowrl.train.memory_plan.KNOWN_MODELS), in bf16 with random weights, in memory; the text encoder
is a one-layer model of the family's class with the real output width (the transformer's
training state dominates the memory, and the plan counts the encoders built here), the VAE a
small one with the real latent channels. The run is flowrl's trainer (flowrl.train.loop.Trainer)
with the family's 1-GPU preset's LoRA and guidance at 512x512, batch 1, gradient checkpointing;
the pipeline is handed to it in memory instead of being loaded. The reading is the second
iteration's time and torch.cuda.max_memory_allocated over both.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from flowrl.train.memory_plan import GIB, KNOWN_MODELS, Launch, Model, count, format_plan, on_meta, plan, plan_peak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import append_result, use_cuda  # noqa: E402

FAMILIES = {"qwen_image": ("Qwen/Qwen-Image", "qwen_image_pickscore_1gpu"),
            "z_image": ("Tongyi-MAI/Z-Image-Turbo", "z_image_turbo_pickscore_1gpu"),
            "wan": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan21_1_3b_pickscore_1gpu")}


def build_pipeline(kind: str, tiny: bool):
    """The family's pipeline in memory: the real transformer config (a narrow 1-2 layer one with
    `tiny`), a one-layer text encoder of the real width, a small VAE with the real latent channels."""
    from flowrl.models.tiny import _CHAT_TEMPLATE, _qwen_tokenizer, _vae

    name, _ = FAMILIES[kind]
    kwargs = dict(KNOWN_MODELS[name]["transformer"][1])
    tok = _qwen_tokenizer()
    torch.manual_seed(0)
    if kind == "qwen_image":
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        if tiny:
            kwargs.update(num_layers=1, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=16, axes_dims_rope=[8, 4, 4])
        width = kwargs["joint_attention_dim"]
        transformer = QwenImageTransformer2DModel(**kwargs)
        ids = {n: tok.convert_tokens_to_ids(f"<|{n}|>") for n in ("vision_start", "vision_end", "image_pad", "video_pad")}
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={"vocab_size": len(tok), "hidden_size": width, "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": width},
            vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"], image_token_id=ids["image_pad"],
            video_token_id=ids["video_pad"]))
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=kwargs["out_channels"], dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                                    time_shift_type="exponential")
        return QwenImagePipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok)
    if kind == "wan":
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        from flowrl.models.tiny import _t5_tokenizer

        if tiny:
            kwargs.update(num_layers=1, num_attention_heads=2, attention_head_dim=12, ffn_dim=32, text_dim=16, freq_dim=32)
        transformer = WanTransformer3DModel(**kwargs)
        t5 = _t5_tokenizer()
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(t5), d_model=kwargs["text_dim"], d_kv=8, d_ff=64, num_layers=1,
                                                   num_heads=2, pad_token_id=t5.pad_token_id, eos_token_id=t5.eos_token_id))
        vae = AutoencoderKLWan(base_dim=8, z_dim=kwargs["in_channels"], dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        return WanPipeline(tokenizer=t5, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    if tiny:
        kwargs.update(dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4],
                      axes_lens=[256, 32, 32])
    transformer = ZImageTransformer2DModel(**kwargs)
    width = transformer.config.cap_feat_dim
    tok.chat_template = _CHAT_TEMPLATE
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=width, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024))
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
                          vae=_vae(transformer.config.in_channels, 1, shift_factor=0.1), text_encoder=text_encoder, tokenizer=tok,
                          transformer=transformer)


def bench(kind: str, cuda: bool, iterations: int, resolution: int) -> dict:
    from flowrl.config import load_config
    from flowrl.models import policy_class
    from flowrl.train import loop

    name, preset = FAMILIES[kind]
    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 20B parameters built in fp32 first would need 80 GB
    try:
        with torch.device("cuda" if cuda else "cpu"):
            pipe = build_pipeline(kind, tiny=not cuda)
    finally:
        torch.set_default_dtype(previous)
    print(f"{kind}: pipeline built in {time.perf_counter() - t0:.1f} s ({count(pipe.transformer) / 1e9:.2f}B transformer)")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(preset, [
            "model.dtype=bf16", f"model.height={resolution}", f"model.width={resolution}",
            "model.max_sequence_length=64", f"model.device={'cuda' if cuda else 'cpu'}", "model.gradient_checkpointing=true",
            "sampling.num_steps=4", "sampling.eval_num_steps=4", "sampling.batch_size=1", "data.prompts_per_iteration=1",
            "data.group_size=2", "data.prompts=[a red circle]", "data.prompt_file=null", "trainer.gradient_accumulation_steps=1",
            "reward.weights={brightness: 1.0}", "run.tracker=none", "run.progress=false", "run.sample_every=0",
            "run.checkpoint_every=0"], validate_paths=False)
        # the pipeline in memory instead of from_pretrained of the preset's hub id
        loop.load_policy = lambda model_cfg, device=None, prompts=None: policy_class(kind)(pipe, model_cfg, device or "cpu")
        trainer = loop.Trainer(cfg, run_dir=Path(tmp) / "run")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            row = trainer.train_iteration()
            seconds.append(time.perf_counter() - t0)
            print(f"  iteration {row['iteration']}: {seconds[-1]:.2f} s, loss {row['loss']:.4g}")
    frozen = sum(count(m) for m in (pipe.text_encoder, pipe.vae))
    # the plan's network: the same config without the adapter the trainer added, on the meta device
    transformer = on_meta(lambda: trainer.policy.transformer_class.from_config(pipe.transformer.config))
    model = Model(name, kind, transformer, frozen)
    launch = Launch(lora_rank=cfg.lora.rank, lora_targets=list(cfg.lora.target_modules), dtype="bf16", batch=1,
                    height=resolution, width=resolution, frames=cfg.model.num_frames, gradient_checkpointing=True, ema=True,
                    kl=False, max_sequence_length=64)
    rows = plan(model, launch)
    print(format_plan(model, launch, rows))
    out = {"family": kind, "seconds_per_iteration": seconds[-1], "plan_gib": plan_peak(rows)}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        print(f"{kind}: {seconds[-1]:.2f} s per iteration; peak {out['peak_gib']:.2f} GiB, plan {out['plan_gib']:.2f} GiB, "
              f"measured / plan {out['peak_gib'] / out['plan_gib']:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny networks on the CPU: the code path, no reading")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per family (scripts/gpu_checks.sh)")
    a = ap.parse_args(argv)
    cuda = use_cuda("bench_families", a.cpu_smoke)
    if cuda is None:
        return 0
    for kind in a.families:
        result = bench(kind, cuda, a.iterations, a.resolution if cuda else 64)
        append_result(a.out, {"check": "families", **result, "cpu_smoke": not cuda})
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
