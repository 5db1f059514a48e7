"""The plain-diffusers code that draws what `flowrl sample` draws from an exported run (`flowrl
export`): the pipeline class and the components saved as none (the pixel-space shapes model has no
VAE and no T5), the adapter where only it was exported, the sample's initial noise as a seeded
torch.randn, the run's evaluation grid (passed as `sigmas` where flowrl's grid is not the
pipeline's own), its guidance and size, and for a model without a VAE the pixels from the latents."""

from __future__ import annotations

from pathlib import Path

from flowrl.models.base import absent_components, resolve_model_path, resolve_schedule
from flowrl.sampling.noise import initial_noise_seed


def snippet_prompt(cfg) -> str:
    """The prompt the export's snippet draws: the run's first held-out prompt."""
    return (cfg.data.eval_prompts or ["a photo of a cat"])[0]


def diffusers_snippet(policy, cfg, out: Path, prompt: str, seed: int = 0, merged: bool = True) -> str:
    """Python source that loads the export in `out` with diffusers alone and draws the first image
    of `flowrl sample --prompt PROMPT --seed SEED` on it (the same noise, grid and guidance)."""
    cls, s, m = policy.pipeline_name, cfg.sampling, cfg.model
    source = out if merged else Path(resolve_model_path(m.path))
    optional = set(getattr(policy.pipeline_class, "_optional_components", ()))  # diffusers fills these with None itself
    absent = "".join(f", {name}=None" for name in absent_components(str(source)) if name not in optional)
    custom_grid = resolve_schedule(s.schedule, m.path) != "pipeline"  # flowrl's shifted_linear grid: the pipeline's own differs
    imports = [cls, "FlowMatchEulerDiscreteScheduler"] if custom_grid else [cls]
    lines = ["import torch", f"from diffusers import {', '.join(imports)}", ""]
    lines.append(f"pipe = {cls}.from_pretrained({str(source)!r}{absent}, torch_dtype=torch.{_dtype_name(policy)})")
    if not merged:
        lines.append(f"pipe.load_lora_weights({str(out)!r})")
    steps = s.eval_num_steps
    grid = ""
    if custom_grid:
        lines += [f"pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift={s.shift}, "
                  "use_dynamic_shifting=False)"]
        grid = f", sigmas=[1 - i / {steps} for i in range({steps})]"
    shape = (1, *policy.latent_shape())
    lines += [f"# flowrl sample --seed {seed}: its initial noise, then the run's {steps}-step ODE",
              f"latents = torch.randn({shape}, generator=torch.Generator().manual_seed({initial_noise_seed(seed)}))"]
    pixels = policy.vae is None  # the transformer works in pixels: the pipeline returns them as its "latents"
    scale = 1 if not pixels else getattr(policy.pipe, "vae_scale_factor", 8)  # diffusers divides the size by it
    args = [repr(prompt), f"latents=latents.to(pipe.dtype), height={m.height * scale}, width={m.width * scale}",
            f"num_inference_steps={steps}{grid}", f"{policy.guidance_argument}={m.guidance_scale}"]
    negative = getattr(policy, "negative_prompt", None)
    if negative is not None and m.guidance_scale > 1.0:
        args.append(f"negative_prompt={negative!r}")
    args.append(f"max_sequence_length={m.max_sequence_length}")  # flowrl passes it as configured (the shapes model: 0 T5 tokens)
    if policy.video:
        lines += [f"frames = pipe({', '.join(args)}).frames[0]  # [frames, H, W, 3]"]
    elif pixels:
        lines += [f"x = pipe({', '.join(args)}, output_type='latent').images",
                  "image = (x.float() / 2 + 0.5).clamp(0, 1)  # [1, 3, H, W] pixels: this model has no VAE"]
    else:
        lines += [f"image = pipe({', '.join(args)}).images[0]", "image.save('sample.png')"]
    return "\n".join(lines) + "\n"


def _dtype_name(policy) -> str:
    return str(policy.dtype).removeprefix("torch.")
