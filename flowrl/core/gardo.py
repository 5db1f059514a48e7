"""GARDO's pieces (He et al., arXiv 2512.24138, read from the authors' code
tinnerhrhe/GARDO): the diversity-aware advantage, the uncertainty gate that decides which samples the
KL regularises, the adaptive gate fraction kappa, and the reference reset rule. Tensors in, tensors out.

The gate's sign (docs/monitor.md, "GARDO"): the reference code regularises the samples its main reward
ranks *worse* than the auxiliary rewards do (u = rank_main - mean rank_aux > threshold, rank 1 the best);
the paper regularises where the proxy reward is least trustworthy, the samples it over-rates, i.e. ranks
*better* than the auxiliaries. GATE_SIGNS names both; "paper" negates the code's u."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GATE_SIGNS = ("paper", "reference_code")


def nearest_neighbour_novelty(features: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """n_a = min over b != a in a's group of the cosine distance 1 - clip(e_a . e_b, -1, 1) of the
    L2-normalised features [N, D]; 0 for a sample alone in its group."""
    e = features.float() / features.float().norm(dim=1, keepdim=True).clamp_min(1e-12)
    novelty = torch.zeros(len(e))
    for g in group_ids.unique():
        members = (group_ids == g).nonzero().flatten()
        if len(members) < 2:
            continue
        d = 1 - (e[members] @ e[members].T).clamp(-1, 1)
        d.fill_diagonal_(float("inf"))
        novelty[members] = d.min(1).values.cpu()
    return novelty


def diversity_aware_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, novelty: torch.Tensor,
                               clip: float = 5.0) -> torch.Tensor:
    """A_a = (r_a - mean_group r) w_a, w_a = n_a / mean_group n where r_a >= the group mean, else 1; no
    division by the std (GARDO's `type='gardo'`); clamped to +-clip. A group whose novelty is all 0
    (identical features) keeps w = 1."""
    r, n = rewards.float(), novelty.float()
    adv = torch.zeros_like(r)
    for g in group_ids.unique():
        m = group_ids == g
        centred = r[m] - r[m].mean()
        mean_novelty = n[m].mean()
        w = n[m] / mean_novelty if mean_novelty > 0 else torch.ones_like(centred)
        adv[m] = centred * torch.where(centred >= 0, w, torch.ones_like(w))
    return adv.clamp(-clip, clip)


def descending_ranks(x: torch.Tensor) -> torch.Tensor:
    """Rank 1 for the largest value, N for the smallest (ties in order of appearance), as floats."""
    ranks = torch.empty(len(x))
    ranks[torch.argsort(x.float(), descending=True, stable=True)] = torch.arange(1, len(x) + 1, dtype=torch.float32)
    return ranks


def uncertainty(main: torch.Tensor, auxiliary: torch.Tensor, sign: str = "paper") -> torch.Tensor:
    """u [N] over the whole batch from the main reward [N] and the auxiliary rewards [N, M]:
    reference_code: rank_main - mean_m rank_aux_m; paper: its negation (large where the main reward
    ranks a sample better than the auxiliaries)."""
    aux_rank = torch.stack([descending_ranks(auxiliary[:, m]) for m in range(auxiliary.shape[1])], 1).mean(1)
    u = descending_ranks(main) - aux_rank
    return -u if sign == "paper" else u


def uncertainty_gate(u: torch.Tensor, kappa: float) -> torch.Tensor:
    """g_a = 1[u_a > T], T the 100 (1 - kappa) percentile (linear interpolation) of the u >= 0; all False
    when no u is >= 0."""
    nonneg = u[u >= 0].float()
    if len(nonneg) == 0:
        return torch.zeros(len(u), dtype=torch.bool)
    return u > torch.quantile(nonneg, 1 - kappa)


@dataclass
class KappaController:
    """GARDO's RiskCompensator: after each iteration, with mu the mean of that iteration's u >= 0, kappa
    grows by `rate` when mu is above every mean of the last `window`, shrinks by it when below every
    one, and stays within [low, high]; the first update sets it to kappa0."""

    kappa0: float = 0.1
    low: float = 0.02
    high: float = 0.2
    rate: float = 0.1
    window: int = 20
    kappa: float = 0.1
    history: list[float] = field(default_factory=list)

    def update(self, mu: float) -> float:
        if not self.history:
            self.kappa = self.kappa0
        elif mu > max(self.history):
            self.kappa *= 1 + self.rate
        elif mu < min(self.history):
            self.kappa *= 1 - self.rate
        self.kappa = min(max(self.kappa, self.low), self.high)
        self.history = (self.history + [mu])[-self.window:]
        return self.kappa


def gated_kl(kl: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The KL term over the gated rows only: mean of kl[gate], 0 (still in the graph) when none is gated."""
    return kl[gate].mean() if bool(gate.any()) else kl.sum() * 0.0


def reference_reset_due(kl_exceeded: bool, iterations_since_reset: int, reset_every: int) -> bool:
    """The reference becomes a copy of the policy when an optimizer step's mean KL passed the
    threshold since the last reset, or after more than `reset_every` iterations without one."""
    return kl_exceeded or iterations_since_reset > reset_every
