"""When the clean-sample objectives (DGPO, GDRO, DiffusionNFT) take their optimizer steps.

An epoch trains every micro-batch at every one of its sigmas: (micro-batch, sigma) pairs, in
micro-batch order. `step_plan` splits those pairs into optimizer steps; each pair's loss is divided
by the number of pairs in its step, so a step's gradient is the mean over its pairs (what
accelerate's gradient accumulation does in the references, which divide the loss by the
accumulation count).

- `iteration`: one step over every pair of the epoch. DGPO's code (Luo-Yihong/DGPO) and
  DiffusionNFT's (NVlabs/DiffusionNFT) accumulate over all their batches and timesteps and step
  once per epoch ("update once per epoch").
- `micro_batch` (flowrl's earlier stepping): a step every `sigmas_per_step` sigmas of each
  micro-batch (0: all of them); with trainer.gradient_accumulation_steps k > 1, a step every k
  micro-batches over all their sigmas.
"""

from __future__ import annotations

from flowrl.errors import ConfigError, check_choice

STEPPINGS = ("iteration", "micro_batch")


def check_stepping(field: str, stepping: str, sigmas_per_step: int, timesteps: int, accumulation: int) -> None:
    """One sentence for a stepping the plan cannot follow."""
    check_choice(f"{field}.stepping", stepping, STEPPINGS)
    if stepping == "micro_batch" and accumulation > 1 and sigmas_per_step not in (0, timesteps):
        raise ConfigError(f"{field}.sigmas_per_step {sigmas_per_step} steps inside a micro-batch, which "
                          f"trainer.gradient_accumulation_steps {accumulation} cannot accumulate over micro-batches; set one of "
                          f"them to its default ({field}.sigmas_per_step=0 or trainer.gradient_accumulation_steps=1)")


def step_plan(batches: int, sigmas: int, stepping: str, sigmas_per_step: int = 0, accumulation: int = 1) -> list[list[tuple[int, int]]]:
    """The epoch's optimizer steps, each the list of (micro-batch, sigma index) pairs it
    accumulates, in training order (micro-batch-major)."""
    pairs = [(b, k) for b in range(batches) for k in range(sigmas)]
    if not pairs:
        return []
    if stepping == "iteration":
        return [pairs]
    if accumulation > 1:  # whole micro-batches, `accumulation` of them per step
        per = accumulation * sigmas
        return [pairs[i:i + per] for i in range(0, len(pairs), per)]
    per = min(sigmas_per_step or sigmas, sigmas)  # chunks of one micro-batch's sigmas; a short last chunk steps alone
    return [[(b, k) for k in range(start, min(start + per, sigmas))] for b in range(batches) for start in range(0, sigmas, per)]


def step_shares(plan: list[list[tuple[int, int]]]) -> dict[tuple[int, int], tuple[int, bool]]:
    """Per pair: the number of pairs in its step (its loss is divided by it) and whether it closes the step."""
    return {pair: (len(step), i == len(step) - 1) for step in plan for i, pair in enumerate(step)}
