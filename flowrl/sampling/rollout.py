"""Flat group rollouts: denoising chains sampled as the rollout of a stochastic policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm.auto import tqdm

from flowrl.sampling.noise import INITIAL, seeded_noise
from flowrl.sampling.steps import STEP_FUNCTIONS, StepOutput, ode_step, reference_kl_scale, transition_std


@dataclass
class SamplerSpec:
    """How one chain is denoised: the sigmas, which steps are SDE steps, and the SDE itself."""

    sigmas: torch.Tensor  # [T + 1] fp32, from 1 to 0
    sde_steps: torch.Tensor  # [T] bool: stochastic (and so trainable) steps
    kind: str = "flow_grpo"
    noise_level: float = 0.7
    reduction: str = "mean"
    cps_logprob: str = "exact"  # cps only: see flowrl.sampling.steps.CPS_LOGPROBS
    # steps from this index on are sampled as sde_steps says but never trained (Flow-GRPO's timestep_fraction); None: all
    trained_before: int | None = None

    @classmethod
    def ode(cls, sigmas: torch.Tensor) -> "SamplerSpec":
        """Deterministic sampling on `sigmas` (sample grids, evaluation, previews)."""
        return cls(sigmas, torch.zeros(sigmas.numel() - 1, dtype=torch.bool), "ode")

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    @property
    def sigma_max(self) -> float:
        return float(self.sigmas[1])  # Flow-GRPO's stand-in for sigma = 1 in its std

    def is_stochastic(self, t: int) -> bool:
        return bool(self.sde_steps[t]) and self.std(t) > 0

    def std(self, t: int) -> float:
        return transition_std(self.kind, float(self.sigmas[t]), float(self.sigmas[t + 1]), self.noise_level, self.sigma_max)

    def reference_kl_scale(self, t: int) -> float:
        """The references' KL of step t over the exact one (flowrl.sampling.steps.reference_kl_scale)."""
        return reference_kl_scale(self.kind, float(self.sigmas[t]), float(self.sigmas[t + 1]))

    def trained_steps(self) -> list[int]:
        """The steps whose transitions carry gradient: the stochastic ones before `trained_before`."""
        end = self.num_steps if self.trained_before is None else min(self.trained_before, self.num_steps)
        return [t for t in range(end) if self.is_stochastic(t)]

    def step(self, t: int, x, v, noise=None, x_next=None) -> StepOutput:
        s, s_next = float(self.sigmas[t]), float(self.sigmas[t + 1])
        if not self.is_stochastic(t):
            return ode_step(x, v, s, s_next)
        fn = STEP_FUNCTIONS[self.kind]
        extra = {"logprob": self.cps_logprob} if self.kind == "cps" else {}
        return fn(x, v, s, s_next, noise=noise, x_next=x_next, noise_level=self.noise_level, reduction=self.reduction,
                  sigma_max=self.sigma_max, **extra)


@dataclass
class Trajectory:
    """A batch of rollouts as tensors (docs/architecture.md, "The data path")."""

    latents: torch.Tensor  # [B, T + 1, *latent] fp32: x at every sigma, latents[:, 0] is the noise
    log_probs: torch.Tensor  # [B, T] fp32 behaviour log-probs (0 on deterministic steps)
    sigmas: torch.Tensor  # [T + 1]
    trained: torch.Tensor  # [T] bool: steps that carry gradient
    prompts: list[str]
    prompt_ids: torch.Tensor  # [B] long
    group_ids: torch.Tensor  # [B] long
    seeds: torch.Tensor  # [B] long: every sample is reproducible from its seed
    parents: torch.Tensor | None = None  # [B] long for tree nodes; None for flat rollouts
    precision: str = "fp32"
    policy_version: int = 0
    extras: dict = field(default_factory=dict)

    @property
    def final(self) -> torch.Tensor:
        return self.latents[:, -1]

    def __len__(self) -> int:
        return self.latents.shape[0]

    def subset(self, rows: Sequence[int]) -> "Trajectory":
        """The rollouts at `rows` (flat rollouts only), in that order."""
        if self.parents is not None:
            raise ValueError("subset() takes rows of flat rollouts; tree nodes depend on their parents")
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        return Trajectory(self.latents[idx], self.log_probs[idx], self.sigmas, self.trained, [self.prompts[i] for i in idx.tolist()],
                          self.prompt_ids[idx], self.group_ids[idx], self.seeds[idx], None, self.precision, self.policy_version)


def policy_precision(policy) -> str:
    """The precision a policy samples in: an exploration copy's label ('nvfp4-emulated', 'fp8',
    see flowrl/sampling/precision.py), else its dtype ('float32', 'bfloat16')."""
    return getattr(policy, "precision", None) or str(policy.dtype).removeprefix("torch.")


@torch.no_grad()
def rollout(
    policy,
    prompts: Sequence[str],
    seeds: Sequence[int],
    spec: SamplerSpec,
    batch_size: int,
    prompt_ids: Sequence[int] | None = None,
    group_ids: Sequence[int] | None = None,
    policy_version: int = 0,
    progress: bool = False,
    desc: str = "sampling",
    on_batch=None,
    initial_seeds: Sequence[int] | None = None,
) -> Trajectory:
    """Sample len(prompts) chains in batches of `batch_size`, recording every latent and the
    behaviour log-prob of every stochastic step. Noise comes from (seed, step) generators.
    `on_batch(batch_slice, final_latents)` is called as each batch finishes (the trainer starts
    scoring it there, while the next batch samples). `initial_seeds`: the seeds of the chains'
    initial noise where they are not their own (sampling.initial_noise per_group)."""
    n, shape = len(prompts), policy.latent_shape()
    latents = torch.empty((n, spec.num_steps + 1, *shape), dtype=torch.float32)
    log_probs = torch.zeros((n, spec.num_steps), dtype=torch.float32)
    bar = tqdm(total=n * spec.num_steps, desc=desc, disable=not progress, leave=False, unit="step")
    for start in range(0, n, batch_size):
        idx = slice(start, min(start + batch_size, n))
        chunk_seeds = list(seeds[idx])
        cond = policy.encode(list(prompts[idx]))
        x = seeded_noise(list((initial_seeds if initial_seeds is not None else seeds)[idx]), INITIAL, shape, policy.device)
        latents[idx, 0] = x.cpu()
        for t in range(spec.num_steps):
            v = policy.velocity(x, float(spec.sigmas[t]), cond)
            noise = seeded_noise(chunk_seeds, t, shape, policy.device) if spec.is_stochastic(t) else None
            out = spec.step(t, x, v, noise=noise)
            x = out.next_x
            latents[idx, t + 1] = x.cpu()
            log_probs[idx, t] = out.log_prob.cpu()
            bar.update(x.shape[0])
        if on_batch is not None:
            on_batch(idx, x)
    bar.close()
    ids = torch.as_tensor(list(prompt_ids) if prompt_ids is not None else range(n), dtype=torch.long)
    return Trajectory(
        latents=latents,
        log_probs=log_probs,
        sigmas=spec.sigmas.clone(),
        trained=torch.isin(torch.arange(spec.num_steps), torch.tensor(spec.trained_steps(), dtype=torch.long)),
        prompts=list(prompts),
        prompt_ids=ids,
        group_ids=torch.as_tensor(list(group_ids), dtype=torch.long) if group_ids is not None else ids.clone(),
        seeds=torch.as_tensor(list(seeds), dtype=torch.long),
        precision=policy_precision(policy),
        policy_version=policy_version,
    )


def batched_velocity(policy, x: torch.Tensor, sigma: float, prompts: Sequence[str], batch_size: int) -> torch.Tensor:
    """v at one sigma for rows x [n, *latent], row i conditioned on prompts[i], through the
    network in batches of `batch_size` rows; fp32 on the policy's device."""
    out = []
    for start in range(0, len(x), batch_size):
        rows = slice(start, start + batch_size)
        out.append(policy.velocity(x[rows].to(policy.device), float(sigma), policy.encode(list(prompts[rows]))).float())
    return torch.cat(out)


def transition(policy, traj: Trajectory, spec: SamplerSpec, idx: slice, t: int, cond) -> StepOutput:
    """Re-evaluate the stored transition latents[idx, t] -> latents[idx, t + 1] under the
    current policy (with grad): the same step function as sampling, given x_next."""
    x = traj.latents[idx, t].to(policy.device)
    x_next = traj.latents[idx, t + 1].to(policy.device)
    v = policy.velocity(x, float(spec.sigmas[t]), cond)
    return spec.step(t, x, v, x_next=x_next)
