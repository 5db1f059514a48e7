"""The one reward path of every rollout: decode a finished batch, score it on the reward runner's
worker thread (while the next batch samples), and gather every process's rewards and validity
(reward.on_invalid: drop marks a sample invalid instead of stopping the run)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from flowrl.runtime.shards import gather_real


@dataclass
class Scores:
    rewards: torch.Tensor  # [n, K] every process's real samples, in item order
    valid: torch.Tensor  # [n] bool
    local_rewards: torch.Tensor  # [n_local, K] this process's samples (padding copies included)
    local_valid: torch.Tensor  # [n_local] bool
    reward_time: float  # seconds inside reward calls (overlapping the sampling of later batches)
    reward_wait: float  # seconds spent waiting for rewards after the last batch was sampled


class Scoring:
    def __init__(self, policy, reward_runner, accelerator):
        self.policy, self.runner, self.accelerator = policy, reward_runner, accelerator
        self._busy_before = 0.0

    def start(self, prompts: list[str]) -> Callable[[slice, torch.Tensor], None]:
        """Begin scoring samples of `prompts` (this process's, in order); returns the callback
        `on_batch(batch_slice, final_latents)` that decodes a finished batch and submits it."""
        self._busy_before = self.runner.reward_seconds

        def on_batch(batch: slice, final: torch.Tensor) -> None:
            self.runner.submit_with_mask(self.policy.decode(final), prompts[batch])

        return on_batch

    def finish(self, n: int) -> Scores:
        """Wait for every submitted batch and gather the rewards of the `n` real samples."""
        t_sampled = time.perf_counter()
        results = self.runner.wait_all()
        wait = time.perf_counter() - t_sampled
        local_rewards = torch.cat([r[0] for r in results])
        local_valid = torch.cat([r[1] for r in results])
        return Scores(gather_real(self.accelerator, local_rewards, n), gather_real(self.accelerator, local_valid, n),
                      local_rewards, local_valid, self.runner.reward_seconds - self._busy_before, wait)
