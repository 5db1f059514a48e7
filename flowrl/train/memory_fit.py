"""The cheapest launch that fits a memory budget (scripts/plan_memory.py --fit, docs/distributed.md).

From a launch, the memory features are switched on one at a time, each kept once on, in a fixed order of
increasing cost to the run: first those that cost only time or nothing (gradient checkpointing, 8-bit
AdamW moments, prompts encoded once with the encoders off the GPU), then those that change what is
computed (the reward models in bf16, the frozen base in NF4), then a smaller batch per forward (halved
down to 1; trainer.gradient_accumulation_steps raised by the same factor keeps the optimizer's batch).
A feature the launch refuses (an 8-bit optimizer or NF4 under fsdp2) is passed over. The first launch
whose planned peak is within the budget is the answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from flowrl.errors import UserError
from flowrl.train.memory_plan import Launch, Model, plan, plan_peak


@dataclass(frozen=True)
class Step:
    name: str  # what it does, as printed
    apply: Callable[[Launch], Launch]  # the launch with it on
    overrides: Callable[[Launch], list[str]]  # the config's dot-list overrides for it, from the launch as configured


def _set(**fields) -> Callable[[Launch], Launch]:
    return lambda launch: dataclasses.replace(launch, **fields)


def _rewards_bf16(launch: Launch) -> Launch:
    return dataclasses.replace(launch, rewards={name: [kind, "bf16"] for name, (kind, _) in launch.rewards.items()})


STEPS = (
    Step("gradient checkpointing", _set(gradient_checkpointing=True), lambda _: ["model.gradient_checkpointing=true"]),
    Step("8-bit AdamW", _set(optimizer="adamw8bit"), lambda _: ["trainer.optimizer=adamw8bit"]),
    Step("prompts cached, text encoders off the GPU", _set(text_encoders="cached", quantize_text_encoders="none"),
         lambda launch: ["model.text_encoders=cached"] + (["model.quantize_text_encoders=none"] if launch.quantize_text_encoders != "none"
                                                          else [])),
    Step("reward models in bf16", _rewards_bf16, lambda launch: [f"reward.options.{n}.dtype=bf16" for n in launch.rewards]),
    Step("NF4 frozen base", _set(quantize="nf4"), lambda _: ["model.quantize=nf4"]),
)


def halved_batch(launch: Launch) -> Step:
    batch = max(1, launch.batch // 2)
    return Step(f"batch {batch} per forward", _set(batch=batch), lambda _: [f"sampling.batch_size={batch}"])


@dataclass
class Fit:
    launch: Launch  # the cheapest launch that fits, or the cheapest tried when none does
    configured: Launch  # the launch it started from
    rows: list[tuple[str, float, str]]  # its plan
    steps: list[Step]  # the features switched on, in order
    fits: bool
    batch_factor: int = 1  # how many times smaller the batch per forward is than the launch's

    @property
    def overrides(self) -> list[str]:
        """The config's dot-list overrides that make the launch (a later one of a key replacing an earlier one)."""
        out: dict[str, str] = {}
        for step in self.steps:
            out.update(o.split("=", 1) for o in step.overrides(self.configured))
        return [f"{k}={v}" for k, v in out.items()]


def fit(model: Model, launch: Launch, budget_gib: float) -> Fit:
    """The cheapest launch within `budget_gib` GiB per GPU: STEPS switched on in order (then the batch halved) until the
    plan fits, then each feature that the later ones made unnecessary switched off again, the first first."""
    chosen, passed, rows = [], [], plan(model, launch)
    current = launch
    while plan_peak(rows) > budget_gib:
        step = next((s for s in STEPS if s not in chosen and s not in passed and s.apply(current) != current), None)
        if step is None:
            if current.batch == 1:
                return Fit(current, launch, rows, chosen, False, launch.batch)
            step = halved_batch(current)
        try:
            rows = plan(model, step.apply(current))
        except UserError:  # refused for this launch (bitsandbytes under fsdp2): passed over
            passed.append(step)
            continue
        chosen.append(step)
        current = step.apply(current)
    for step in [s for s in chosen if s in STEPS]:
        without = [s for s in chosen if s is not step]
        if plan_peak(plan(model, _applied(launch, without))) <= budget_gib:
            chosen = without
    current = _applied(launch, chosen)
    return Fit(current, launch, plan(model, current), chosen, True, launch.batch // current.batch)


def _applied(launch: Launch, steps: list[Step]) -> Launch:
    for step in steps:
        launch = step.apply(launch)
    return launch


def format_fit(name: str, result: Fit, budget_gib: float) -> str:
    peak = plan_peak(result.rows)
    head = (f"{name}: fits {budget_gib:g} GiB per GPU at a planned peak of {peak:.2f} GiB" if result.fits
            else f"{name}: does not fit {budget_gib:g} GiB per GPU; the cheapest plan peaks at {peak:.2f} GiB")
    names = [s.name for s in result.steps if s in STEPS] + ([f"batch {result.launch.batch} per forward"] if result.batch_factor > 1 else [])
    lines = [head, f"  with: {', '.join(names) if names else 'the launch as configured'}"]
    if result.overrides:
        lines.append(f"  overrides: {' '.join(result.overrides)}")
    if result.batch_factor > 1:
        lines.append(f"  and trainer.gradient_accumulation_steps x {result.batch_factor}, to keep the samples per optimizer step")
    return "\n".join(lines)
