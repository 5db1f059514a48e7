"""The training checks every model family's tests run (test_qwen_image.py, test_z_image.py,
test_flux2.py, test_flux2_klein.py, test_sana.py, test_wan.py): Flow-GRPO's SDE trains 2 iterations and its LoRA, loaded into
the family's own diffusers pipeline with `load_lora_weights`, reproduces `flowrl sample`; and
DiffusionNFT trains 2 iterations and moves the adapter."""

from __future__ import annotations

import math

from flowrl.cli import main
from flowrl.runs import load_run_policy, ode_samples
from flowrl.sampling.noise import INITIAL, seeded_noise
from run_checks import run_metrics, trainable

PROMPTS = ["a red circle", "two small blue squares on a table"]  # two lengths: variable-length text streams pad
SEEDS = [3, 4]


def train_args(kind: str, path: str, guidance: float) -> list[str]:
    """`flowrl train` on the tiny JPEG preset with the family's tiny pipeline: 1 prompt x 4, 3 steps,
    2 iterations, a rank-4 LoRA on the attention projections every family has."""
    return ["train", "tiny_jpeg", f"model.kind={kind}", f"model.path={path}", f"model.guidance_scale={guidance}",
            "model.max_sequence_length=64", "sampling.num_steps=3", "sampling.eval_num_steps=4", "data.group_size=4",
            "sampling.batch_size=4", "data.prompts_per_iteration=1", "lora.rank=4", "lora.alpha=8",
            "lora.target_modules=[to_q,to_k,to_v,to_out.0]", "trainer.iterations=2", "run.tracker=none",
            "run.progress=false", "run.sample_every=0"]


def check_lora_reproduces_flowrl_sample(run, args: list[str], pipe) -> None:
    """Train with Flow-GRPO's SDE into `run`; `pipe`, the family's own diffusers pipeline, samples as the
    policy's `diffusers_call` makes it (flowrl's initial noise in the pipeline's layout, its grid, guidance)."""
    assert main([*args, "sampling.sampler=flow_grpo", "--run-dir", str(run)]) == 0
    cfg, policy, ckpt = load_run_policy(run)
    ours = ode_samples(cfg, policy, PROMPTS, SEEDS)  # what `flowrl sample` draws
    latents, s = seeded_noise(SEEDS, INITIAL, policy.latent_shape()), cfg.sampling
    base = policy.diffusers_call(pipe, latents, PROMPTS, s.eval_num_steps, s.schedule, s.shift)
    pipe.load_lora_weights(str(ckpt / "ema_lora"))
    theirs = policy.diffusers_call(pipe, latents, PROMPTS, s.eval_num_steps, s.schedule, s.shift)
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-5
    assert (base - ours).abs().max() > 1e-4  # the adapter changed the samples, so the match above means something


def check_nft_trains(run, args: list[str]) -> None:
    assert main([*args, "objective.kind=nft", "sampling.sampler=ode", "trainer.kl_beta=0", "objective.nft.timesteps=2",
                 "--run-dir", str(run)]) == 0
    rows = run_metrics(run)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert any(v.abs().sum() > 0 for k, v in trainable(run, 2).items() if "lora_B" in k)  # the adapter left its zero init
