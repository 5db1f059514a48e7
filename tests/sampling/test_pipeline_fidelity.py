"""flowrl samples what the diffusers pipeline samples (sampling.schedule pipeline): ODE rollouts of
tiny SD3 and FLUX pipelines equal the pipelines' own __call__ (FLUX at two resolutions, so that
dynamic shifting's mu differs), a LoRA trained by flowrl reproduces `flowrl sample` in plain
diffusers (the checkpoint's adapter, `flowrl export`'s adapter or its merged pipeline), the code
`flowrl export` prints draws `flowrl sample`'s image for every family, the presets' grids are their
references' grids, and the SDE steps keep their precision."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

from flowrl.cli import main
from flowrl.runs import load_run_policy, ode_samples
from flowrl.config import load_config
from flowrl.schema import ModelConfig
from flowrl.models import load_policy
from flowrl.models.flux import flux_pipeline_sigmas
from flowrl.models.sd3 import sd3_pipeline_sigmas
from flowrl.train.prompts import snippet_prompt
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.rollout import SamplerSpec, rollout
from flowrl.sampling.steps import cps_step, dance_grpo_step, gaussian_log_prob
from tiny_families import EXPORT_SCHEDULES, TINY_FAMILIES, tiny_family_args

PROMPTS = ["a red circle", "two blue squares"]
SEEDS = [3, 4]


def _flowrl_ode(policy, steps):
    traj = rollout(policy, PROMPTS, SEEDS, SamplerSpec.ode(policy.sigmas(steps, "pipeline", 3.0)), len(PROMPTS))
    return traj.latents[:, 0], traj.final


def test_sd3_ode_equals_the_pipeline_call(tiny_sd3_dir):
    cfg = ModelConfig(kind="sd3", path=tiny_sd3_dir, height=64, width=64, guidance_scale=4.5, max_sequence_length=32)
    policy = load_policy(cfg, device="cpu")
    x0, final = _flowrl_ode(policy, steps=6)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    out = pipe(prompt=PROMPTS, latents=x0, height=64, width=64, num_inference_steps=6, guidance_scale=4.5,
               max_sequence_length=32, output_type="latent").images
    assert (out - final).abs().max() <= 1e-5


@pytest.mark.parametrize("size", [64, 128])
def test_flux_ode_equals_the_pipeline_call_with_dynamic_shifting(tiny_flux_dir, size):
    cfg = ModelConfig(kind="flux", path=tiny_flux_dir, height=size, width=size, guidance_scale=3.5, max_sequence_length=32)
    policy = load_policy(cfg, device="cpu")
    x0, final = _flowrl_ode(policy, steps=5)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    out = pipe(prompt=PROMPTS, latents=x0, height=size, width=size, num_inference_steps=5, guidance_scale=3.5,
               max_sequence_length=32, output_type="latent").images
    assert (out - final).abs().max() <= 1e-5
    # dynamic shifting: the grid depends on the resolution, and is not the fixed shift-3 grid
    assert not torch.allclose(policy.sigmas(5, "pipeline", 3.0), policy.sigmas(5, "shifted_linear", 3.0))


def test_flux_grids_differ_between_the_two_resolutions(tiny_flux_dir):
    grids = [load_policy(ModelConfig(kind="flux", path=tiny_flux_dir, height=s, width=s), device="cpu").sigmas(5, "auto", 3.0)
             for s in (64, 128)]
    assert not torch.allclose(*grids)  # auto is pipeline for a model that is not built in


def _printed_snippet(capsys) -> torch.Tensor:
    """Run the plain-diffusers code `flowrl export` printed last (in the current directory, where it saves its
    file); its sample as flowrl's images [1, 3, H, W] (videos [1, 3, F, H, W])."""
    printed = capsys.readouterr().out
    code = printed.split("In plain diffusers", 1)[1].split("\n\n", 1)[1]
    namespace: dict = {}
    exec(compile(code, "printed-snippet", "exec"), namespace)
    if "frames" in namespace:  # [1, F, H, W, 3]
        assert Path("sample.mp4").is_file()
        return torch.from_numpy(namespace["frames"]).permute(0, 4, 1, 2, 3)
    assert Path("sample.png").is_file()
    return torch.from_numpy(namespace["images"]).permute(0, 3, 1, 2)


def test_the_printed_export_snippet_draws_flowrl_samples_image_of_the_pixel_space_shapes_model(tmp_path, capsys, monkeypatch):
    # the built-in shapes model: no VAE and no T5 (components saved as none), flowrl's shifted_linear grid (not the
    # pipeline's), 0 T5 tokens; the printed code must load the merged pipeline and draw what `flowrl sample` draws
    monkeypatch.chdir(tmp_path)  # the printed code saves sample.png here
    run, merged = tmp_path / "run", tmp_path / "merged"
    assert main(["train", "tiny_jpeg", "model.path=builtin:shapes", "model.height=32", "model.width=32", "sampling.num_steps=3",
                 "sampling.eval_num_steps=4", "data.group_size=4", "sampling.batch_size=4", "data.prompts_per_iteration=1",
                 "lora.rank=4", "lora.alpha=8", "trainer.iterations=1", "run.tracker=none", "run.progress=false",
                 "run.sample_every=0", "trainer.ema_decay=0.5",  # an EMA one step from the base still moves the sample
                 "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--merge", "-o", str(merged)]) == 0
    theirs = _printed_snippet(capsys)
    cfg, policy, _ = load_run_policy(run)
    prompt = [snippet_prompt(cfg.data)]  # the run's first held-out prompt
    ours = ode_samples(cfg, policy, prompt, [0])
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-5
    with policy.reference():  # the adapter moved the sample, so the match means something
        assert (ode_samples(cfg, policy, prompt, [0]) - ours).abs().max() > 1e-4
    assert (merged / "sample_with_diffusers.py").read_text().startswith("import torch")


def test_an_adapter_gated_to_a_sigma_range_replays_in_diffusers_through_the_printed_step_callback(tmp_path, capsys, monkeypatch):
    # lora.sigma_range [0.55, 1] (the default preset's gate): flowrl samples the eval grid's steps at 1 and 0.75 with
    # the adapter and those at 0.5 and 0.25 with the base network; the printed code's step-end callback does the same
    monkeypatch.chdir(tmp_path)
    run, lora = tmp_path / "run", tmp_path / "lora"
    assert main(["train", "tiny_jpeg", "model.path=builtin:shapes", "model.height=32", "model.width=32", "sampling.num_steps=3",
                 "sampling.eval_num_steps=4", "data.group_size=4", "sampling.batch_size=4", "data.prompts_per_iteration=1",
                 "lora.rank=4", "lora.alpha=8", "lora.sigma_range=[0.55, 1.0]", "sampling.window.strategy=fixed",
                 "sampling.window.size=1", "trainer.iterations=1", "trainer.ema=false", "run.tracker=none", "run.progress=false",
                 "run.sample_every=0", "--run-dir", str(run)]) == 0
    assert main(["export", "--run", str(run), "--merge", "-o", str(tmp_path / "merged")]) == 2  # a fused adapter acts everywhere
    capsys.readouterr()
    assert main(["export", "--run", str(run), "-o", str(lora)]) == 0
    theirs = _printed_snippet(capsys)
    cfg, policy, _ = load_run_policy(run)
    prompt = [snippet_prompt(cfg.data)]
    ours = ode_samples(cfg, policy, prompt, [0])
    assert (theirs - ours).abs().max() <= 1e-5
    # the control: the adapter at every step (what diffusers does without the callback) draws something else
    monkeypatch.setattr(policy, "lora_sigma_range", None)
    assert (ode_samples(cfg, policy, prompt, [0]) - ours).abs().max() > 1e-4


def test_a_flux_lora_trained_by_flowrl_reproduces_flowrl_sample_in_diffusers(tmp_path, tiny_flux_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the printed code saves sample.png here
    run = tmp_path / "run"
    args = ["train", "tiny_jpeg", "model.kind=flux", f"model.path={tiny_flux_dir}", "model.guidance_scale=3.5",
            "model.max_sequence_length=32", "sampling.num_steps=3", "sampling.eval_num_steps=4", "data.group_size=4",
            "sampling.batch_size=4", "data.prompts_per_iteration=1", "lora.rank=4", "lora.alpha=8",
            "lora.target_modules=[to_q,to_k,to_v,to_out.0]", "trainer.iterations=1", "run.tracker=none",
            "run.progress=false", "run.sample_every=0", "--run-dir", str(run)]
    assert main(args) == 0
    cfg, policy, ckpt = load_run_policy(run)
    assert cfg.sampling.schedule == "auto" and not torch.allclose(policy.sigmas(4, "auto", 3.0), policy.sigmas(4, "shifted_linear", 3.0))
    ours = ode_samples(cfg, policy, PROMPTS, SEEDS)  # what `flowrl sample` draws

    latents = seeded_noise(SEEDS, INITIAL, policy.latent_shape())

    def pipeline_sample(pipe):  # FluxPipeline.__call__ as FluxPolicy.diffusers_call makes it (the pipeline's own grid)
        return policy.diffusers_call(pipe, latents, PROMPTS, 4, cfg.sampling.schedule, cfg.sampling.shift)

    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    pipe.load_lora_weights(str(ckpt / "ema_lora"))
    theirs = pipeline_sample(pipe)
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-5
    base = pipeline_sample(FluxPipeline.from_pretrained(tiny_flux_dir))
    assert (base - ours).abs().max() > 1e-4  # the adapter changed the samples, so the match above means something

    # flowrl export: the LoRA alone for load_lora_weights, and a standalone pipeline with it fused in
    merged, lora = tmp_path / "merged", tmp_path / "lora"
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--merge", "-o", str(merged)]) == 0
    assert (pipeline_sample(FluxPipeline.from_pretrained(str(merged))) - ours).abs().max() <= 1e-5
    # the printed code: flowrl sample's first image of the first held-out prompt at seed 0
    first = ode_samples(cfg, policy, [snippet_prompt(cfg.data)], [0])
    assert (_printed_snippet(capsys) - first).abs().max() <= 1e-5
    assert main(["export", "--run", str(run), "-o", str(lora)]) == 0
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    pipe.load_lora_weights(str(lora))
    assert (pipeline_sample(pipe) - ours).abs().max() <= 1e-5
    assert (_printed_snippet(capsys) - first).abs().max() <= 1e-5  # the base plus the LoRA
    assert main(["export", "--run", str(run), "-o", str(lora)]) == 2  # never written over


EDIT_EXPORTS = {
    # the editing world's preset on its tiny pixel-space model: true CFG, the pixels folded 2x2, an adapter gated to
    # the sigmas DGPO trains (exported alone, replayed with the printed step callback)
    "edit_shapes": ("edit_shapes", "tiny_shapes_edit_dir", ["sampling.num_steps=4"], []),
    # FLUX.1 Kontext with a VAE and the guidance embedding, merged
    "flux_kontext": ("tiny_jpeg", "tiny_flux_kontext_dir", ["model.kind=flux_kontext", "model.height=64", "model.width=64",
                                                            "model.max_sequence_length=16", "sampling.num_steps=3"], ["--merge"]),
}


@pytest.mark.parametrize("case", list(EDIT_EXPORTS))
def test_the_printed_snippet_of_an_edit_export_edits_the_saved_source_as_flowrl_sample_does(case, tmp_path, capsys, monkeypatch,
                                                                                           request):
    from flowrl.train.edit_data import read_edits

    preset, fixture, model, export = EDIT_EXPORTS[case]
    monkeypatch.chdir(tmp_path)
    run, out = tmp_path / "run", tmp_path / "export"
    assert main(["train", preset, f"model.path={request.getfixturevalue(fixture)}", *model, "data.edits=builtin:shapes-edit-heldout",
                 "sampling.eval_num_steps=4", "data.group_size=4", "sampling.batch_size=4", "data.prompts_per_iteration=1",
                 "lora.rank=4", "lora.alpha=8", "trainer.iterations=1", "trainer.budget_minutes=0", "run.cpu_processes=1",
                 "run.tracker=none", "run.progress=false", "run.sample_every=0", "trainer.ema_decay=0.5", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), *export, "-o", str(out)]) == 0
    theirs = _printed_snippet(capsys)
    cfg, policy, _ = load_run_policy(run)
    edit = snippet_prompt(cfg.data)
    assert edit == read_edits("builtin:shapes-edit-heldout")[0]  # the run's first edit, its source saved beside the export
    assert torch.equal(torch.from_numpy(np.asarray(Image.open(out / "source.png"))).permute(2, 0, 1) / 255, edit.image())
    ours = ode_samples(cfg, policy, [edit], [0])
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-4
    with policy.reference():  # the trained adapter moved the sample, so the match means something
        assert (ode_samples(cfg, policy, [edit], [0]) - ours).abs().max() > 1e-4


@pytest.mark.parametrize("kind", list(TINY_FAMILIES))
def test_the_printed_snippet_of_a_merged_export_draws_flowrl_sample_for_every_family(kind, tmp_path, capsys, monkeypatch, request):
    # each family's own call: FLUX.2's latent layout, Qwen-Image's true_cfg_scale and negative prompt, SANA's and Wan's
    # Euler scheduler in place of their multistep solvers, Wan's frames and its grid through the scheduler (its __call__
    # takes no sigmas), flowrl's shifted_linear grid for half the families (tests/tiny_families.py)
    monkeypatch.chdir(tmp_path)  # the printed code saves sample.png (sample.mp4) here
    run, merged = tmp_path / "run", tmp_path / "merged"
    args = tiny_family_args(kind, request, EXPORT_SCHEDULES[kind])
    assert main(["train", *args, "trainer.iterations=1", "run.tracker=none", "run.progress=false", "run.sample_every=0",
                 "trainer.ema_decay=0.5", "--run-dir", str(run)]) == 0  # an EMA one step from the base still moves the sample
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--merge", "-o", str(merged)]) == 0
    theirs = _printed_snippet(capsys)
    cfg, policy, _ = load_run_policy(run)
    prompt = [snippet_prompt(cfg.data)]
    ours = ode_samples(cfg, policy, prompt, [0])
    # 1e-4: flowrl adds the adapter's output, the merged pipeline computes with the adapter fused into its weights
    assert theirs.shape == ours.shape and (theirs - ours).abs().max() <= 1e-4
    with policy.reference():  # the trained adapter moved the sample, so the match means something
        assert (ode_samples(cfg, policy, prompt, [0]) - ours).abs().max() > 1e-4


# ---- the presets' grids against their references, written out ------------------------------
FLOW_GRPO_SD35_10 = [1.0, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.2780, 0.0089, 0.0]  # StableDiffusion3Pipeline
DANCE_GRPO_16 = [1.0, 0.9783, 0.9545, 0.9286, 0.9, 0.8684, 0.8333, 0.7941, 0.75, 0.7, 0.6429, 0.5769, 0.5, 0.4091, 0.3, 0.1667, 0.0]
FLUX_DEV_1024_10 = [1.0, 0.966, 0.9266, 0.8805, 0.8257, 0.7595, 0.678, 0.5751, 0.4412, 0.2598, 0.0]  # FluxPipeline


@pytest.mark.parametrize("name", ["sd35_medium_pickscore_1gpu", "sd35_medium_pickscore_8gpu"])
def test_sd35_presets_sample_on_the_pipeline_grid_flow_grpo_uses(name):
    cfg = load_config(name, validate_paths=False)
    assert cfg.sampling.schedule == "pipeline" and cfg.sampling.num_steps == 10
    # SD3.5-Medium's scheduler: FlowMatchEulerDiscreteScheduler, shift 3, no dynamic shifting
    sigmas = sd3_pipeline_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), 10, (cfg.model.height // 16) * (cfg.model.width // 16))
    assert sigmas.tolist() == pytest.approx(FLOW_GRPO_SD35_10, abs=5e-5)


@pytest.mark.parametrize("name", ["flux1_dev_hps_1gpu", "flux1_dev_hps_8gpu"])
def test_flux_presets_sample_on_dance_grpos_shifted_linear_grid(name):
    from flowrl.sampling.schedules import shifted_sigmas

    cfg = load_config(name, validate_paths=False)
    s = cfg.sampling
    assert s.schedule == "shifted_linear" and s.num_steps == 16 and s.shift == 3.0
    assert shifted_sigmas(s.num_steps, s.shift).tolist() == pytest.approx(DANCE_GRPO_16, abs=5e-5)


def test_flux_dev_pipeline_grid_at_1024():
    flux_dev = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)
    assert flux_pipeline_sigmas(flux_dev, 10, 64 * 64).tolist() == pytest.approx(FLUX_DEV_1024_10, abs=5e-5)


def test_bad_schedule_is_one_sentence():
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="^sampling.schedule must be one of auto, pipeline, shifted_linear; got 'karras'$"):
        load_config("tiny_jpeg", ["sampling.schedule=karras"])


# ---- step precision --------------------------------------------------------------------------
def test_dance_grpo_mean_keeps_fp32_precision_near_sigma_zero():
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    sigma, sigma_next, eta = 0.001, 0.0005, 0.7
    # the published formula in fp64: score from x0_hat = x - sigma v
    x64, v64 = x.double(), v.double()
    x0_hat = x64 - sigma * v64
    score = -(x64 - (1 - sigma) * x0_hat) / sigma**2
    dt = sigma_next - sigma
    want = x64 + dt * v64 - 0.5 * eta**2 * score * dt
    got = dance_grpo_step(x, v, sigma, sigma_next, x_next=x, noise_level=eta).mean
    assert ((got.double() - want).abs() / want.abs()).max() < 1e-6


def test_cps_reference_log_prob_is_flow_grpos_and_exact_is_the_density():
    gen = torch.Generator().manual_seed(1)
    x, v, noise = (torch.randn(3, 8, generator=gen) for _ in range(3))
    exact = cps_step(x, v, 0.6, 0.4, noise=noise, noise_level=0.5)
    ref = cps_step(x, v, 0.6, 0.4, noise=noise, noise_level=0.5, logprob="reference")
    assert torch.equal(exact.next_x, ref.next_x) and torch.equal(exact.mean, ref.mean)
    assert torch.allclose(exact.log_prob, gaussian_log_prob(exact.next_x, exact.mean, exact.std))
    assert torch.allclose(ref.log_prob, -((ref.next_x - ref.mean) ** 2).mean(dim=1))
    # the exact density scales the squared error by 1 / (2 std^2): ratios move that many times as far
    again = cps_step(x, v, 0.6, 0.4, x_next=exact.next_x + 0.01, noise_level=0.5)
    again_ref = cps_step(x, v, 0.6, 0.4, x_next=exact.next_x + 0.01, noise_level=0.5, logprob="reference")
    scale = (again.log_prob - exact.log_prob) / (again_ref.log_prob - ref.log_prob)
    assert torch.allclose(scale, torch.full_like(scale, 1 / (2 * float(exact.std) ** 2)), rtol=1e-3)
    spec = SamplerSpec(torch.tensor([1.0, 0.6, 0.4, 0.0]), torch.ones(3, dtype=torch.bool), "cps", 0.5, "mean", "reference")
    assert torch.equal(spec.step(1, x, v, noise=noise).log_prob, ref.log_prob)
    assert not math.isclose(float(ref.log_prob[0]), float(exact.log_prob[0]))
    assert np.isfinite(ref.log_prob.numpy()).all()
