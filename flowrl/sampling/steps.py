"""One denoising step of a rectified flow, as a Gaussian policy.

Convention (docs/algorithms.md section 1): x_sigma = (1 - sigma) x0 + sigma eps, the network
predicts v = eps - x0, sampling runs from sigma = 1 to 0 and dt = sigma_next - sigma < 0.

Every step function is pure: (x, v, sigma, sigma_next, noise or x_next) -> StepOutput with
the transition's Gaussian mean and std and the log-density of x_next under it. The same
function computes the behaviour log-prob while sampling (given `noise`) and the new
policy's log-prob while training (given the stored `x_next`), always in fp32.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

SAMPLERS = ("ode", "flow_grpo", "dance_grpo", "cps")
LOGPROB_REDUCTIONS = ("mean", "sum")
# cps: the exact Gaussian log-density, or Flow-GRPO's CPS code's -mean((x' - mean)^2), which drops
# the 1 / (2 std^2) and the constants: its ratios are exp(2 std^2) times flatter in log space, so
# clip ranges tuned for one do not carry over to the other
CPS_LOGPROBS = ("exact", "reference")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def forward_noise(x0: torch.Tensor, eps: torch.Tensor, sigma) -> torch.Tensor:
    """The forward process of a rectified flow: x_sigma = (1 - sigma) x0 + sigma eps."""
    return (1 - sigma) * x0 + sigma * eps


def predicted_x0(x: torch.Tensor, v: torch.Tensor, sigma) -> torch.Tensor:
    """The network's guess of the clean sample from x_sigma: x - sigma v."""
    return x - sigma * v


def flow_matching_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The velocity the network learns at every sigma: d x_sigma / d sigma = eps - x0."""
    return eps - x0


class StepOutput(NamedTuple):
    next_x: torch.Tensor  # [B, ...] fp32
    mean: torch.Tensor  # [B, ...] fp32
    std: torch.Tensor  # scalar or broadcastable fp32: the std of the transition itself
    log_prob: torch.Tensor  # [B] fp32, reduced over all non-batch dimensions


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """log N(x; mean, std^2 I), reduced over non-batch dims ('sum' is exact; 'mean' is what
    Flow-GRPO's reference code uses, which keeps ratios on the same scale at any resolution)."""
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    per_dim = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    dims = tuple(range(1, per_dim.ndim))
    return per_dim.sum(dims) if reduction == "sum" else per_dim.mean(dims)


def _finish(x_next, mean, std, noise, reduction) -> StepOutput:
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
    if x_next is None:
        if noise is None:
            raise ValueError("a stochastic step needs either `noise` (sampling) or `x_next` (training)")
        x_next = mean + std * noise.float()
    else:
        x_next = x_next.float()
    if bool((std > 0).all()):
        log_prob = gaussian_log_prob(x_next, mean, std, reduction)
    else:  # a deterministic step has no density; it is never trained
        log_prob = torch.zeros(mean.shape[0], dtype=torch.float32, device=mean.device)
    return StepOutput(x_next, mean, std, log_prob)


def _as_f32(x, v, sigma, sigma_next):
    return x.float(), v.float(), float(sigma), float(sigma_next)


def ode_step(x, v, sigma, sigma_next, noise=None, x_next=None, noise_level=0.0, reduction="mean", sigma_max=None):
    """Euler step of the probability-flow ODE: x' = x + dt v (deterministic)."""
    x, v, sigma, sigma_next = _as_f32(x, v, sigma, sigma_next)
    mean = x + (sigma_next - sigma) * v
    return StepOutput(mean, mean, torch.zeros((), device=x.device), torch.zeros(x.shape[0], device=x.device))


def flow_grpo_std(sigma: float, noise_level: float, sigma_max: float | None) -> float:
    """Flow-GRPO's diffusion coefficient a * sqrt(sigma / (1 - sigma)); at sigma = 1 the
    denominator uses `sigma_max` (the schedule's first sigma below 1), as the reference does."""
    denom_sigma = sigma if sigma < 1.0 else (sigma_max if sigma_max is not None else 0.999)
    return noise_level * math.sqrt(sigma / (1.0 - denom_sigma))


def flow_grpo_step(x, v, sigma, sigma_next, noise=None, x_next=None, noise_level=0.7, reduction="mean", sigma_max=None):
    """Flow-GRPO SDE step (Liu et al., "Flow-GRPO", eq. 9-12):
    mean = x (1 + s^2 dt / (2 sigma)) + v (1 + s^2 (1 - sigma) / (2 sigma)) dt, std = s sqrt(-dt)."""
    x, v, sigma, sigma_next = _as_f32(x, v, sigma, sigma_next)
    dt = sigma_next - sigma
    s = flow_grpo_std(sigma, noise_level, sigma_max)
    mean = x * (1 + s**2 * dt / (2 * sigma)) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    return _finish(x_next, mean, s * math.sqrt(-dt), noise, reduction)


def dance_grpo_step(x, v, sigma, sigma_next, noise=None, x_next=None, noise_level=0.3, reduction="mean", sigma_max=None):
    """DanceGRPO SDE step (Xue et al., "DanceGRPO"): mean = x + dt v - 0.5 eta^2 score dt,
    std = eta sqrt(sigma - sigma_next), with the score of x_sigma = (1 - sigma) x0 + sigma eps.
    The reference computes it as -(x - (1 - sigma) x0_hat) / sigma^2 with x0_hat = x - sigma v,
    which cancels as sigma -> 0; substituting x0_hat gives -(x + (1 - sigma) v) / sigma, the same
    quantity without the cancellation."""
    x, v, sigma, sigma_next = _as_f32(x, v, sigma, sigma_next)
    dt = sigma_next - sigma
    score = -(x + (1 - sigma) * v) / sigma
    mean = x + dt * v - 0.5 * noise_level**2 * score * dt
    return _finish(x_next, mean, noise_level * math.sqrt(-dt), noise, reduction)


def cps_step(x, v, sigma, sigma_next, noise=None, x_next=None, noise_level=0.3, reduction="mean", sigma_max=None,
             logprob="exact"):
    """Coefficients-preserving sampling (Wang & Yu, "CPS"): std = sigma' sin(a pi / 2),
    mean = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) x1_hat. Deterministic at sigma' = 0.
    logprob "reference": Flow-GRPO's CPS log-prob -mean((x' - mean)^2) instead of the density."""
    x, v, sigma, sigma_next = _as_f32(x, v, sigma, sigma_next)
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0_hat = predicted_x0(x, v, sigma)
    x1_hat = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0_hat + math.sqrt(max(sigma_next**2 - std**2, 0.0)) * x1_hat
    out = _finish(x_next, mean, std, noise, reduction)
    if logprob == "reference" and std > 0:
        return out._replace(log_prob=-((out.next_x - mean) ** 2).mean(dim=tuple(range(1, mean.ndim))))
    return out


STEP_FUNCTIONS: dict[str, Callable[..., StepOutput]] = {
    "ode": ode_step,
    "flow_grpo": flow_grpo_step,
    "dance_grpo": dance_grpo_step,
    "cps": cps_step,
}


def reference_kl_scale(kind: str, sigma: float, sigma_next: float) -> float:
    """The factor between the KL the references' code computes and the exact Gaussian KL of one
    transition, ||mean - ref_mean||^2 / (2 std^2). Flow-GRPO's training loop divides by the square of
    the `std_dev_t` its step returns: for the Flow-SDE that is the noise scale s without sqrt(-dt), so
    its KL is |dt| times the exact one (about 1 / T of it); for CPS it is the transition's std itself
    (factor 1). DanceGRPO's and BranchGRPO's code have no KL: the exact form (factor 1)."""
    return sigma - sigma_next if kind == "flow_grpo" else 1.0


def transition_std(kind: str, sigma: float, sigma_next: float, noise_level: float, sigma_max: float | None) -> float:
    """The std of one transition without running it: used to decide which steps can be trained."""
    dt = sigma_next - sigma
    if kind == "ode" or noise_level == 0:
        return 0.0
    if kind == "flow_grpo":
        return flow_grpo_std(sigma, noise_level, sigma_max) * math.sqrt(-dt)
    if kind == "dance_grpo":
        return noise_level * math.sqrt(-dt)
    if kind == "cps":
        return sigma_next * math.sin(noise_level * math.pi / 2)
    raise ValueError(f"sampling.sampler must be one of {SAMPLERS}, got {kind!r}")
