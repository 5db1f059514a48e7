"""`flowrl check CONFIG`: the parity a run rests on, checked in minutes before GPU hours are spent on it
(porting a model otherwise means printing ratios by hand "until the ratio is exactly 1").

(a) log-probs: one batch of the configured training sampler (iteration 0's training spec, its SDE
    window), every trained step recomputed as the GRPO objective recomputes it (training mode, with
    grad, trainer.mixed_precision's autocast) gives the rollout's log-prob: the ratio is 1 at each step.
(b) the pipeline: flowrl's ODE sample (`flowrl sample`'s) equals the family's own diffusers pipeline
    `__call__` from the same seed (`FlowPolicy.diffusers_call`).
(c) the adapter: a one-step change of the LoRA, saved with `save_lora` and loaded into the pipeline with
    `load_lora_weights`, draws in plain diffusers what flowrl draws with it (an adapter gated to
    lora.sigma_range turned on and off between the pipeline's steps, flowrl/models/pipeline_call.py).

The adapter is changed once, before (a): with a fresh adapter (lora_B = 0) its branch adds nothing, and
neither a training-mode difference inside it (dropout) nor an error in its saved keys or scale could show.
(b) and (c) compare in fp32: in bf16 the pipeline rounds its latents to bf16 between steps where flowrl
keeps them in fp32, which alone moves a sample as far as a wrong grid does; a lower model.dtype (or a
quantised model) is loaded again in fp32 for them. (c) reuses the loaded pipeline, flowrl's adapter
removed, rather than a second copy of the model."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import tempfile
from typing import Callable

import torch

from flowrl.core.seeds import sample_seed
from flowrl.errors import UserError
from flowrl.models import load_policy
from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.precision import autocast_precision
from flowrl.sampling.rollout import rollout
from flowrl.train.images import ode_images
from flowrl.train.prompts import load_prompts
from flowrl.train.registry import add_adapter
from flowrl.train.rollouts.common import recompute_transition, training_spec

RATIO_TOLERANCE = 1e-5  # |ratio - 1|: 0 up to float error, a tenth of Flow-GRPO's clip range
# images in [0, 1], both sides in fp32: a quarter of one 8-bit level, invisible in a saved image and far below what
# a wrong grid, latent layout or guidance does (on the tiny models, 6e-3 and more)
IMAGE_TOLERANCE = 1e-3
# the adapter's change: each adapted weight moves by this fraction of a default-initialised weight's RMS
# (1 / sqrt(fan_in)), a step far larger than one optimizer step makes, so that an error in the saved adapter's
# keys or scale shows well above the tolerance
ADAPTER_CHANGE = 0.1
ADAPTER_SEED = 0
SAMPLES = 2  # prompts (of two lengths where the config has them) for (b) and (c)


@dataclasses.dataclass
class Outcome:
    name: str
    passed: bool | None  # None: skipped (`note` says why)
    difference: float | None = None
    tolerance: float | None = None
    note: str = ""


def run_check(cfg, say: Callable[[str], None] = print) -> int:
    """The three checks on `cfg`, their table printed through `say`; 0 when every check that ran passed, else 1."""
    policy = _policy(cfg, cfg.model)
    m, s = cfg.model, cfg.sampling
    say(f"flowrl check: {m.kind} {m.path} ({m.dtype}), sampler {s.sampler}, {s.num_steps} training steps, "
        f"{s.eval_num_steps} sampling steps; " + ("the LoRA after a seeded change of lora_B" if policy.has_lora
                                                  else "the whole transformer trained (lora.enabled false)")
        + ("" if _full_precision(m) else "; (b) and (c) on the model loaded again in fp32"))
    outcomes = [check_log_probs(cfg, policy, say)]
    policy = _in_fp32(cfg, policy)
    prompts, seeds = _sample_rows(cfg)
    pipeline, base = check_pipeline(cfg, policy, prompts, seeds)
    outcomes += [pipeline, check_adapter_replay(cfg, policy, prompts, seeds, base)]
    say(format_table(outcomes))
    return 1 if any(o.passed is False for o in outcomes) else 0


# ---- the policy as the trainer builds it, its adapter changed ------------------------------------------
def _policy(cfg, model_cfg):
    policy = load_policy(model_cfg)
    policy.pipe.set_progress_bar_config(disable=True)
    if cfg.lora.enabled:
        add_adapter(policy, cfg)
        change_adapter(policy, ADAPTER_SEED)
    else:
        policy.enable_full_finetune()
    return policy


def change_adapter(policy, seed: int) -> None:
    """Set every lora_B to seeded noise scaled so that the adapter's change of its weight, scaling x B A, has
    an RMS of ADAPTER_CHANGE / sqrt(fan_in) (a default-initialised weight's RMS is about 1 / sqrt(fan_in))."""
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in policy.transformer.modules():
            if not isinstance(module, LoraLayer) or "default" not in module.lora_B:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=generator))
            change = module.scaling["default"] * (b.flatten(1) @ a.flatten(1))  # conv layers: [out, in x k x k]
            b.mul_(ADAPTER_CHANGE / change.shape[1] ** 0.5 / change.pow(2).mean().sqrt())


def _in_fp32(cfg, policy):
    """The policy (b) and (c) compare: itself in fp32, else loaded again in fp32 and unquantised, the same adapter."""
    m = cfg.model
    if _full_precision(m):
        return policy
    del policy
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return _policy(cfg, dataclasses.replace(m, dtype="fp32", quantize="none", quantize_text_encoders="none"))


def _full_precision(m) -> bool:
    return m.dtype == "fp32" and m.quantize == "none" and m.quantize_text_encoders == "none"


# ---- (a) the log-prob ratio of training forwards ------------------------------------------------------
RATIO = "(a) log-prob ratio, training mode"


def check_log_probs(cfg, policy, say: Callable[[str], None]) -> Outcome:
    """One batch of the training sampler, then every trained step recomputed in training mode."""
    if cfg.sampling.sampler == "ode":
        return Outcome(RATIO, None, note="sampling.sampler ode draws no log-probabilities; nothing to recompute")
    spec = training_spec(cfg, 0, policy)
    steps = spec.trained_steps()
    if not steps:
        return Outcome(RATIO, None, note="the SDE window of iteration 0 holds no step with noise; nothing to recompute")
    prompts, seeds = _training_rows(cfg)
    worst = 0.0
    with _training_autocast(cfg, policy):
        traj = rollout(policy, prompts, seeds, spec, len(prompts))
        policy.transformer.train()  # as the GRPO objective's update: dropout and the like act here
        try:
            for t in steps:
                recomputed = recompute_transition(policy, traj, spec, slice(None), t).log_prob.detach().float().cpu()
                ratio = torch.exp(recomputed - traj.log_probs[:, t])
                deviation = float((ratio - 1).abs().nan_to_num(nan=float("inf")).max())  # a NaN ratio fails
                worst = max(worst, deviation)
                say(f"  step {t} (sigma {float(spec.sigmas[t]):.4f} -> {float(spec.sigmas[t + 1]):.4f}): ratio "
                    f"{float(ratio.min()):.8f} .. {float(ratio.max()):.8f} over {len(prompts)} samples")
        finally:
            policy.transformer.eval()
    return Outcome(RATIO, worst <= RATIO_TOLERANCE, worst, RATIO_TOLERANCE)


def _training_rows(cfg) -> tuple[list[str], list[int]]:
    """One sampling batch of iteration 0 as the flat rollout draws it: data.group_size samples per prompt."""
    prompts = load_prompts(cfg.data)
    rows = [p for p in prompts for _ in range(cfg.data.group_size)][: cfg.sampling.batch_size]
    return rows, [sample_seed(cfg.trainer.seed, 0, j) for j in range(len(rows))]


def _training_autocast(cfg, policy):
    """trainer.mixed_precision's autocast, as accelerate wraps the trainer's forwards (one process)."""
    precision = autocast_precision(cfg.trainer.mixed_precision, policy.device.type == "cpu")
    if precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(policy.device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


# ---- (b) the pipeline's own call, (c) the adapter in plain diffusers ------------------------------------
def _sample_rows(cfg) -> tuple[list[str], list[int]]:
    prompts = list(dict.fromkeys([*cfg.data.eval_prompts, *load_prompts(cfg.data)]))[:SAMPLES]
    return prompts, list(range(len(prompts)))


def _both_ways(cfg, policy, pipe, prompts, seeds) -> tuple[torch.Tensor, torch.Tensor]:
    """flowrl's ODE images and the pipeline's, from the same seeds (`flowrl sample`'s steps and grid)."""
    s = cfg.sampling
    ours = ode_images(policy, prompts, seeds, policy.sigmas(s.eval_num_steps, s.schedule, s.shift), s.batch_size)
    theirs = policy.diffusers_call(pipe, seeded_noise(seeds, INITIAL, policy.latent_shape()), prompts, s.eval_num_steps,
                                   s.schedule, s.shift)
    if theirs.shape != ours.shape:
        raise UserError(f"the {policy.pipeline_name} drew samples of shape {tuple(theirs.shape[1:])} where flowrl draws "
                        f"{tuple(ours.shape[1:])}")
    return ours, theirs


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, inf where either holds a non-finite value (a NaN never passes a tolerance silently:
    an adapter loaded with missing keys can leave uninitialised weights)."""
    return float((a - b).abs().nan_to_num(nan=float("inf")).max())


def check_pipeline(cfg, policy, prompts, seeds) -> tuple[Outcome, torch.Tensor]:
    """(b) on the base model (the adapter disabled on both sides); also returns flowrl's base images."""
    with policy.reference() if policy.has_lora else contextlib.nullcontext():
        ours, theirs = _both_ways(cfg, policy, policy.pipe, prompts, seeds)
    difference = largest_difference(ours, theirs)
    return Outcome(f"(b) ODE = {policy.pipeline_name}.__call__", difference <= IMAGE_TOLERANCE, difference, IMAGE_TOLERANCE), ours


def check_adapter_replay(cfg, policy, prompts, seeds, base: torch.Tensor) -> Outcome:
    """(c): flowrl's samples with the changed adapter against the pipeline's with that adapter saved and loaded.
    Leaves the policy without flowrl's adapter: its pipeline holds the one diffusers loaded."""
    name = "(c) LoRA step replayed in diffusers"
    if not policy.has_lora:
        return Outcome(name, None, note="lora.enabled is false: no adapter to replay")
    with tempfile.TemporaryDirectory() as directory:
        policy.save_lora(directory)
        s = cfg.sampling
        ours = ode_images(policy, prompts, seeds, policy.sigmas(s.eval_num_steps, s.schedule, s.shift), s.batch_size)
        policy.transformer.unload_lora()  # flowrl's adapter out: the pipeline's transformer is the base model again
        policy.pipe.load_lora_weights(directory)
        theirs = policy.diffusers_call(policy.pipe, seeded_noise(seeds, INITIAL, policy.latent_shape()), prompts,
                                       s.eval_num_steps, s.schedule, s.shift, gated=True)  # lora.sigma_range as flowrl's
    difference, moved = largest_difference(ours, theirs), largest_difference(ours, base)
    note = f"the change moved flowrl's sample by {moved:.3g}"
    if moved <= IMAGE_TOLERANCE:
        return Outcome(name, False, difference, IMAGE_TOLERANCE, note + ", within the tolerance: nothing was compared")
    return Outcome(name, difference <= IMAGE_TOLERANCE, difference, IMAGE_TOLERANCE, note)


# ---- the table ----------------------------------------------------------------------------------------------
def format_table(outcomes: list[Outcome]) -> str:
    rows = [("check", "result", "largest difference", "tolerance")]
    for o in outcomes:
        result = "skipped" if o.passed is None else "pass" if o.passed else "FAIL"
        rows.append((o.name, result, "-" if o.difference is None else f"{o.difference:.3g}",
                     "-" if o.tolerance is None else f"{o.tolerance:.0e}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"{o.name}: {o.note}" for o in outcomes if o.note]
    return "\n".join(lines)
