"""The plain-diffusers code that draws what `flowrl sample` draws from an exported run (`flowrl
export`): the pipeline class and the components saved as none (the pixel-space shapes model has no
VAE and no T5), the adapter where only it was exported, the sample's initial noise as a seeded
torch.randn in the pipeline's latent layout, and the family's own call of its pipeline
(flowrl/models/pipeline_call.py: the scheduler and grid flowrl samples with, guidance, size, the
family's arguments), printed from the same `PipelineCall` that `FlowPolicy.diffusers_call` runs, with its
step-end callback where the adapter is gated to lora.sigma_range; for a model without a VAE, the pixels
from the latents."""

from __future__ import annotations

import inspect
from pathlib import Path

from flowrl.models.base import absent_components, resolve_model_path, resolve_schedule
from flowrl.models.pipeline_call import gate_adapter, pipeline_call
from flowrl.sampling.noise import initial_noise_seed


SOURCE_FILE = "source.png"  # an editing run's export: the source image the snippet edits, beside it


def write_snippet_source(prompt, out: Path) -> Path:
    """An edit's source as flowrl reads it, saved losslessly beside the export (8-bit PNG: the pixels of the
    image file it came from) for the snippet to load."""
    from diffusers.image_processor import VaeImageProcessor

    path = Path(out) / SOURCE_FILE
    VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(prompt.image()[None].float().cpu()))[0].save(path)
    return path


def diffusers_snippet(policy, cfg, out: Path, prompt: str, seed: int = 0, merged: bool = True) -> str:
    """Python source that loads the export in `out` with diffusers alone and draws the first image
    of `flowrl sample --prompt PROMPT --seed SEED` on it (the same noise, grid and guidance); an edit
    (an EditPrompt) is drawn from its source saved as out/source.png (`write_snippet_source`), as
    `flowrl sample --image source.png --prompt INSTRUCTION` draws it."""
    cls, s, m = policy.pipeline_name, cfg.sampling, cfg.model
    call = pipeline_call(policy, s.eval_num_steps, resolve_schedule(s.schedule, m.path) == "pipeline", s.shift, gated=not merged)
    source = out if merged else Path(resolve_model_path(m.path))
    optional = set(getattr(policy.pipeline_class, "_optional_components", ()))  # diffusers fills these with None itself
    absent = "".join(f", {name}=None" for name in absent_components(str(source)) if name not in optional)
    imports = [cls, "FlowMatchEulerDiscreteScheduler"] if call.scheduler_shift is not None else [cls]
    lines = ["import torch", f"from diffusers import {', '.join(imports)}"]
    if policy.video:
        lines.append("from diffusers.utils import export_to_video")
    if call.scheduler_sigmas is not None or call.adapter_range is not None:
        lines.insert(0, "import functools")
    if call.adapter_range is not None:
        lines += ["", "", inspect.getsource(gate_adapter).rstrip(), ""]
    lines += ["", f"pipe = {cls}.from_pretrained({str(source)!r}{absent}, torch_dtype=torch.{_dtype_name(policy)})"]
    if not merged:
        lines.append(f"pipe.load_lora_weights({str(out)!r})")
    if call.adapter_range is not None and not call.adapter_at_first_step:
        lines.append(f"pipe.disable_lora()  # the run's adapter acts only at sigmas in {list(call.adapter_range)}, not the first step's")
    lines += _scheduler_lines(call, cls)
    lines += [f"# flowrl sample --seed {seed}: its initial noise, then the run's {s.eval_num_steps}-step ODE",
              f"latents = torch.randn({(1, *policy.latent_shape())}, generator=torch.Generator().manual_seed({initial_noise_seed(seed)}))"]
    layout = policy.pipeline_latents_code("latents")
    if layout:
        lines.append(f"latents = {layout}")
    if policy.edits:
        lines.append("# the source it edits, as the pipeline takes it (what flowrl samples the edit from)")
        lines += policy.pipeline_source_code(str(Path(out) / SOURCE_FILE))
        prompt = prompt.instruction
    return "\n".join(lines + _call_lines(policy, call, prompt)) + "\n"


def _scheduler_lines(call, cls: str) -> list[str]:
    if call.scheduler_shift is None:
        return []
    lines = [f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={call.scheduler_shift})  # {call.reason}"]
    if call.scheduler_sigmas is not None:
        lines.append(f"pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, "
                     f"sigmas={call.scheduler_sigmas!r})  # {cls}.__call__ takes no sigmas")
    return lines


def _call_lines(policy, call, prompt: str) -> list[str]:
    """The pipeline's call and the saving of its output: images [1, H, W, 3] (frames [1, F, H, W, 3])
    in [0, 1] as numpy arrays, `flowrl sample`'s sample before it is rounded into a file."""
    gate = []
    if call.adapter_range is not None:  # the run's lora.sigma_range: the base network outside it
        low, high = call.adapter_range
        gate = [f"callback_on_step_end=functools.partial(gate_adapter, low={low!r}, high={high!r})"]
    image = ["image=image"] if policy.edits else []
    args = ", ".join([f"prompt={prompt!r}", *image, "latents=latents.to(pipe.dtype)",
                      *(f"{k}={v!r}" for k, v in call.arguments.items()), *gate])
    if policy.video:
        return [f"frames = pipe({args}, output_type='np').frames  # [1, F, H, W, 3] in [0, 1]",
                "export_to_video(frames[0], 'sample.mp4', fps=16)"]
    if policy.vae is None:  # the transformer works in pixels: the pipeline returns them as its "latents"
        lines = [f"x = pipe({args}, output_type='latent').images  # this model has no VAE: its latents are the pixels",
                 *policy.pipeline_pixels_code("x"),
                 "images = (x.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()  # [1, H, W, 3] in [0, 1]"]
    else:
        lines = [f"images = pipe({args}, output_type='np').images  # [1, H, W, 3] in [0, 1]"]
    return lines + ["pipe.numpy_to_pil(images)[0].save('sample.png')"]


def _dtype_name(policy) -> str:
    return str(policy.dtype).removeprefix("torch.")
