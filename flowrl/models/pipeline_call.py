"""How a family's own diffusers pipeline draws flowrl's ODE sample from flowrl's initial noise: one
`PipelineCall` (the scheduler flowrl samples with, the grid, the keyword arguments of `__call__`) that
`FlowPolicy.diffusers_call` runs and flowrl/models/snippet.py prints as source, so that the code a user
is shown is the code the tests run.

flowrl's grid reaches the pipeline in one of two ways. `sampling.schedule: pipeline` is the pipeline's
own, but flowrl's transitions are one-step Euler, so a pipeline that ships a multistep solver (SANA's
DPM-Solver++, Wan's UniPC) gets `FlowMatchEulerDiscreteScheduler(shift=flow_shift)` in its place, the
scheduler flowrl's grid came from (`euler_scheduler`). shifted_linear is time_shift(linspace(1, 0, T + 1),
sampling.shift): linspace(1, 1 / T, T) passed as `sigmas` to a plain `FlowMatchEulerDiscreteScheduler(
shift=sampling.shift)`, which shifts them and appends the final 0 (none of the pipeline's dynamic
shifting or terminal stretch: those belong to its own grid); a pipeline whose `__call__` takes no
`sigmas` (WanPipeline) gets them through its scheduler's `set_timesteps`.

An adapter restricted to lora.sigma_range acts at the steps whose sigma lies in (low, high] and leaves
the others to the base network; a diffusers pipeline applies a loaded adapter at every step, so a gated
call turns it on and off before each step with a step-end callback (`gate_adapter`)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch


class LinearSigmas(list):
    """linspace(1, 1 / T, T), the unshifted grid a pipeline's scheduler shifts; printed as the
    expression that makes it rather than T numbers."""

    def __init__(self, steps: int):
        super().__init__(1 - i / steps for i in range(steps))
        self.steps = steps

    def __repr__(self) -> str:
        return f"[1 - i / {self.steps} for i in range({self.steps})]"


def euler_scheduler(scheduler):
    """The Euler flow-matching scheduler flowrl samples with: the pipeline's own where it is one,
    else one with the shipped multistep solver's flow shift (SANA's DPM-Solver++, Wan's UniPC): flowrl's
    transitions are one-step Euler (ODE) or Euler-Maruyama (SDE), whose log-probabilities a multistep
    solver does not have."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    return FlowMatchEulerDiscreteScheduler(shift=float(scheduler.config.get("flow_shift", 1.0) or 1.0))


@dataclass
class PipelineCall:
    """One call of a family's pipeline that draws flowrl's ODE sample (all but prompt, latents and
    output_type). Every value prints as the Python that makes it (`repr`)."""

    arguments: dict[str, Any]  # keyword arguments of __call__: size, steps, guidance, the family's own
    scheduler_shift: float | None  # swap in FlowMatchEulerDiscreteScheduler(shift=...); None: the pipeline's own is flowrl's
    scheduler_sigmas: LinearSigmas | None  # flowrl's grid for a __call__ without `sigmas`: bound into set_timesteps
    reason: str = ""  # why the scheduler is swapped (a comment in the printed code)
    adapter_range: tuple[float, float] | None = None  # lora.sigma_range the loaded adapter is gated to; None: every step
    adapter_at_first_step: bool = True  # whether the gated adapter acts at the grid's first sigma


def gate_adapter(pipe, step, timestep, tensors, low, high):
    """A diffusers step-end callback: the pipeline's adapter on for the next step where its sigma lies in
    (low, high] (lora.sigma_range), off (the base network) elsewhere, as flowrl samples."""
    sigmas = pipe.scheduler.sigmas
    if step + 1 < len(sigmas) - 1:  # the grid's last entry is the final 0, not a step
        (pipe.enable_lora if low < float(sigmas[step + 1]) <= high else pipe.disable_lora)()
    return tensors


def pipeline_call(policy, num_steps: int, pipeline_grid: bool, shift: float, gated: bool = False) -> PipelineCall:
    """The call of `policy`'s pipeline that samples flowrl's `num_steps`-step ODE on the pipeline's own grid
    (`pipeline_grid`: sampling.schedule resolves to pipeline) or on shifted_linear's with sampling.shift `shift`;
    `gated`: with the pipeline's loaded adapter acting only inside the policy's lora.sigma_range."""
    call = _grid_call(policy, {**policy.pipeline_arguments(), "num_inference_steps": num_steps}, num_steps, pipeline_grid, shift)
    if gated and policy.lora_sigma_range is not None:
        if "callback_on_step_end" not in inspect.signature(policy.pipeline_class.__call__).parameters:
            raise ValueError(f"{policy.pipeline_name}.__call__ takes no callback_on_step_end, so it cannot gate an adapter "
                             "to lora.sigma_range")
        first = float(policy.sigmas(num_steps, "pipeline" if pipeline_grid else "shifted_linear", shift)[0])
        call.adapter_range, call.adapter_at_first_step = policy.lora_sigma_range, policy.adapter_acts_at(first)
    return call


def _grid_call(policy, arguments: dict, num_steps: int, pipeline_grid: bool, shift: float) -> PipelineCall:
    scheduler = policy.pipe.scheduler
    if not pipeline_grid:
        sigmas = LinearSigmas(num_steps)
        takes_sigmas = "sigmas" in inspect.signature(policy.pipeline_class.__call__).parameters
        if takes_sigmas:
            arguments["sigmas"] = sigmas
        return PipelineCall(arguments, float(shift), None if takes_sigmas else sigmas,
                            f"flowrl's shifted_linear grid: linspace(1, 0) time-shifted by sampling.shift {float(shift)}")
    euler = euler_scheduler(scheduler)
    if euler is scheduler:
        return PipelineCall(arguments, None, None)
    return PipelineCall(arguments, float(euler.config.shift), None,
                        f"flowrl's Euler step on the grid of the shipped {type(scheduler).__name__}'s flow_shift")


def flowrl_scheduler(call: PipelineCall, scheduler):
    """The scheduler `call` samples with, in place of the pipeline's `scheduler` (itself where kept)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if call.scheduler_shift is None:
        return scheduler
    euler = FlowMatchEulerDiscreteScheduler(shift=call.scheduler_shift)
    if call.scheduler_sigmas is not None:
        euler.set_timesteps = functools.partial(euler.set_timesteps, sigmas=call.scheduler_sigmas)
    return euler


@torch.no_grad()
def draw(policy, pipe, latents: torch.Tensor, prompts: list[str], num_steps: int, pipeline_grid: bool, shift: float,
         gated: bool = False) -> torch.Tensor:
    """`pipe` (the family's diffusers pipeline) sampling from flowrl's initial noise `latents` [B, *latent_shape]:
    images [B, 3, H, W] (videos [B, 3, F, H, W]) in [0, 1], fp32 on the CPU, as `policy.decode` of flowrl's ODE
    sample gives them; `gated`: `pipe`'s loaded adapter acts only inside the policy's lora.sigma_range. The
    pipeline's scheduler is swapped only for the call, and its adapter left on after it."""
    call = pipeline_call(policy, num_steps, pipeline_grid, shift, gated)
    arguments = dict(call.arguments)
    if call.adapter_range is not None:
        low, high = call.adapter_range
        arguments["callback_on_step_end"] = functools.partial(gate_adapter, low=low, high=high)
        (pipe.enable_lora if call.adapter_at_first_step else pipe.disable_lora)()
    pixels = policy.vae is None  # the transformer works in pixels: the pipeline returns them as its "latents"
    own = pipe.scheduler
    pipe.scheduler = flowrl_scheduler(call, own)
    try:
        if policy.edits:  # the instructions as the prompts, the sources as the pipeline takes them
            arguments.update(policy.pipeline_source_arguments(prompts))
            prompts = [p.instruction for p in prompts]
        out = pipe(prompt=list(prompts), latents=policy.pipeline_latents(latents).to(pipe.device, pipe.dtype), **arguments,
                   output_type="latent" if pixels else "pt")  # a copy of the prompts: some pipelines template the list in place
    finally:
        pipe.scheduler = own
        if call.adapter_range is not None:
            pipe.enable_lora()
    if policy.video:
        return out.frames.transpose(1, 2).float().cpu()  # [B, F, 3, H, W] as flowrl's [B, 3, F, H, W]
    if pixels:
        return policy.decode(out.images.float()).cpu()
    return out.images.float().cpu()
