"""What a search runs on: a denoiser with a reward, for a batch of prompts.

A problem answers two questions for rows of states, each row belonging to one prompt: the
velocity at step t, and the reward of finished samples. The search methods own the sampler (the
SDE proposal p_theta(x' | x) of flowrl.sampling), the noise and the ledger.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from flowrl.sampling.noise import seeded_noise
from flowrl.sampling.rollout import SamplerSpec, batched_velocity


class SearchProblem(Protocol):
    sigmas: torch.Tensor  # [T + 1] from 1 to 0
    num_prompts: int

    def latent_shape(self) -> tuple[int, ...]: ...

    def velocity(self, x: torch.Tensor, t: int, rows: Sequence[int]) -> torch.Tensor:
        """v at step t for states x [n, *latent]; rows[i] is the prompt of x[i]."""

    def score(self, x0: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The searched reward [n] of finished samples x0 [n, *latent]."""


def proposal(sigmas: torch.Tensor, sampler: str, noise_level: float) -> SamplerSpec:
    """The transition every method draws from: the sampler's SDE on every step."""
    return SamplerSpec(sigmas, torch.ones(sigmas.numel() - 1, dtype=torch.bool), sampler, noise_level)


class PolicyProblem:
    """A flowrl policy (SD3, FLUX, the shapes model) with a MultiReward whose weighted channel sum
    is the searched reward. Velocities and rewards run in batches of `batch_size` rows."""

    def __init__(self, policy, prompts: Sequence[str], reward, sigmas: torch.Tensor, batch_size: int):
        self.policy, self.prompts, self.reward = policy, list(prompts), reward
        self.sigmas, self.batch_size = sigmas.float(), batch_size
        self.num_prompts = len(self.prompts)
        for p in dict.fromkeys(self.prompts):  # each prompt encoded alone (see FlowPolicy.encode)
            policy.encode([p])

    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.policy.latent_shape())

    def velocity(self, x, t, rows):
        return batched_velocity(self.policy, x, float(self.sigmas[t]), [self.prompts[r] for r in rows], self.batch_size).cpu()

    @torch.no_grad()
    def images(self, x0: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.policy.decode(x0[i : i + self.batch_size].to(self.policy.device)).float().cpu()
                          for i in range(0, len(x0), self.batch_size)])

    def score(self, x0, rows):
        rows = list(rows)
        scores = self.reward(self.images(x0), [self.prompts[r] for r in rows])
        return scores.float() @ self.reward.channel_weights.float()


def advance(spec: SamplerSpec, x: torch.Tensor, v: torch.Tensor, t: int, seeds: Sequence[int]) -> torch.Tensor:
    """One proposal step from x at step t with velocity v; row i's noise is keyed by (seeds[i], t),
    as in every flowrl rollout, so a sample is reproducible from its seed."""
    noise = seeded_noise(list(seeds), t, x.shape[1:]) if spec.is_stochastic(t) else None
    return spec.step(t, x, v, noise=noise).next_x


def charge(ledgers, rows: Sequence[int], nfe: int = 0, decodes: int = 0, reward_calls: int = 0) -> None:
    """Charge each row's prompt's ledger for that row."""
    for r in rows:
        ledgers[r].charge(nfe=nfe, decodes=decodes, reward_calls=reward_calls)
