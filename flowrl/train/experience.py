"""The one batch structure between a rollout and an objective (docs/architecture.md, "The data path").

A rollout's `collect(iteration)` returns an `Experience`: every process's rewards and advantages
(for metrics, allocation and group statistics), and this process's share of what objectives
consume. Two kinds of training data exist, and a rollout fills the ones it can:

- `transitions`: micro-batches of stored transitions with their behaviour log-probs and
  advantages, for policy-gradient objectives (GRPO). Each micro-batch re-evaluates itself under
  the current policy; the objective never sees latents, tokens or schedules.
- `samples`: clean samples with their conditioning (prompts, seeds) and an index into the
  experience's advantages, for flow-matching objectives (DiffusionNFT).

Work is split across processes in one place, flowrl/runtime/shards.py (`ProcessShard`,
`gather_real`); padding copies train at zero advantage (`advantages_at`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

TRANSITIONS = "transitions"  # micro-batches of transitions with behaviour log-probs
SAMPLES = "samples"  # clean samples with their conditioning
# what some options need beyond those two (an objective's `requires`, the config's checks)
STEP_MEANS = "step_means"  # transitions that keep their sampling step's mean and dt (GRPO-Guard)
WHOLE_GROUPS = "whole_groups"  # clean samples batched in whole groups
FIXED_STEPS = "fixed_steps"  # transitions at the same fixed set of steps every iteration
DATA_KINDS = {TRANSITIONS: "transitions with behaviour log-probs", SAMPLES: "clean samples with their conditioning",
              STEP_MEANS: "transitions that keep their sampling step's mean", WHOLE_GROUPS: "clean samples batched in whole groups",
              FIXED_STEPS: "transitions at a fixed set of trained steps"}


class TransitionBatch(NamedTuple):
    """One forward of the policy over stored transitions. `evaluate()` recomputes them under the
    current weights (with grad; under the policy's `reference()` it gives the reference) and
    returns anything with a per-transition `log_prob`; `kl(current, reference, keep)` is the
    per-transition KL between two such evaluations over the kept transitions. `keep` masks the
    transitions that carry gradient (None: all). Flat rollouts also give the step's `dt` (sigma -
    sigma_next) and `behaviour_mean()`, the sampling step's mean (GRPO-Guard needs both)."""

    evaluate: Callable[[], Any]
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    kl: Callable[[Any, Any, Any], torch.Tensor]
    keep: torch.Tensor | None = None
    behaviour_mean: Callable[[], torch.Tensor] | None = None
    dt: float | None = None
    index: torch.Tensor | None = None  # flat rollouts: each row's sample in the per-sample arrays (past their end: padding)
    # the references' KL over the exact one at this step (SamplerSpec.reference_kl_scale; objective.grpo.kl_form), or per
    # row [n] where the rows' steps differ (BranchGRPO's shuffled edges)
    kl_scale: float | torch.Tensor = 1.0
    step: int | None = None  # the denoising step of its transitions (scripts/gradient_signal.py groups gradients by it)

    def kept(self) -> int:
        return len(self.advantages) if self.keep is None else int(self.keep.sum())


@dataclass
class SampleBatch:
    """Clean samples of one sampling batch on this process. `index` points into the experience's
    per-sample arrays; padding copies point past their end (`Experience.advantages_at` gives them 0)."""

    x0: torch.Tensor  # [b, *shape] fp32, the finished samples
    prompts: list[str]
    seeds: torch.Tensor  # [b] long: forward-process noise is keyed by these
    index: torch.Tensor  # [b] long


@dataclass
class Experience:
    """One training iteration's data. Per-sample arrays hold every process's real samples in one
    order (padding never appears in them)."""

    iteration: int
    rewards: torch.Tensor  # [N, K] per reward channel
    prompt_ids: torch.Tensor  # [N] long: index of each sample's prompt (its group)
    valid: torch.Tensor  # [N] bool: False where the reward output was invalid (reward.on_invalid: drop)
    advantages: torch.Tensor  # [N] fp32: 0 for invalid samples
    precision: str  # what the transitions were sampled in (GRPO refuses a ratio across precisions)
    transitions: list[list[TransitionBatch]] | None = None  # accumulation groups of micro-batches
    weigh_by_transition: bool = False  # weigh micro-batches by their kept transitions (trees: sizes differ)
    # False: the accumulation groups are trained in their order every inner epoch (G2RPO's branch steps,
    # increasing, as its reference); True: in an order shuffled per epoch
    shuffle: bool = True
    samples: list[SampleBatch] | None = None
    metrics: dict = field(default_factory=dict)  # the rollout's own columns of the metrics row
    reward_totals: torch.Tensor | None = None  # [N] the channel-weighted rewards the advantages came from
    # updates between the weights that sampled it and the trainer's (run.async_rollouts; 0: on-policy)
    staleness: int = 0

    def advantages_at(self, index: torch.Tensor) -> torch.Tensor:
        return advantages_at(self.advantages, index)


def advantages_at(advantages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """advantages[index], 0 where `index` points past the real samples (padding copies)."""
    out = torch.zeros(len(index))
    real = index < len(advantages)
    out[real] = advantages[index[real]]
    return out
