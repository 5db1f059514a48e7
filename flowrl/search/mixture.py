"""A problem with a known answer: a Gaussian mixture as the base model, whose rectified-flow
velocity is exact, and a linear reward, under which the tilted target is again a mixture.

Base p0 = sum_k w_k N(mu_k, s_k^2 I). With x_sigma = (1 - sigma) x0 + sigma eps, component k
gives x_sigma ~ N((1 - sigma) mu_k, ((1 - sigma)^2 s_k^2 + sigma^2) I), so the posterior mean of
x0 is exact and v = E[eps | x] - E[x0 | x]. The reward r(x) = a . x tilts p0 into
sum_k w_k exp(a . mu_k + |a|^2 s_k^2 / 2) N(mu_k + s_k^2 a, s_k^2 I) (times lambda for lambda a).
Used by the tests; small enough to read as an example of a SearchProblem.
"""

from __future__ import annotations

import torch


class MixtureProblem:
    def __init__(self, weights, means, stds, direction, sigmas: torch.Tensor, num_prompts: int = 1):
        self.w = torch.as_tensor(weights, dtype=torch.float64)
        self.mu = torch.as_tensor(means, dtype=torch.float64)  # [K, d]
        self.s = torch.as_tensor(stds, dtype=torch.float64)  # [K]
        self.a = torch.as_tensor(direction, dtype=torch.float64)  # [d]
        self.sigmas, self.num_prompts = sigmas.float(), num_prompts
        self.calls = 0  # rows through velocity, for checking ledgers

    def latent_shape(self):
        return (self.mu.shape[1],)

    def velocity(self, x, t, rows):
        self.calls += x.shape[0]
        sigma = float(self.sigmas[t])
        x = x.double()
        var = (1 - sigma) ** 2 * self.s**2 + sigma**2  # [K]
        centre = (1 - sigma) * self.mu  # [K, d]
        d = x.shape[1]
        sq = ((x[:, None, :] - centre[None]) ** 2).sum(-1)  # [n, K]
        logp = torch.log(self.w) - 0.5 * sq / var - 0.5 * d * torch.log(var)
        post = torch.softmax(logp, dim=1)  # p(k | x)
        gain = (1 - sigma) * self.s**2 / var  # [K]
        x0_k = self.mu[None] + gain[None, :, None] * (x[:, None, :] - centre[None])  # E[x0 | x, k]
        x0 = (post[..., None] * x0_k).sum(1)
        eps = (x - (1 - sigma) * x0) / sigma
        return (eps - x0).float()

    def score(self, x0, rows):
        return (x0.double() @ self.a).float()

    def tilted(self, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights and means of p0 exp(lam r), normalised (the stds are unchanged)."""
        b = lam * self.a
        logw = torch.log(self.w) + self.mu @ b + 0.5 * self.s**2 * (b @ b)
        return torch.softmax(logw, 0), self.mu + self.s[:, None] ** 2 * b[None]

    def sample_tilted(self, lam: float, n: int, generator: torch.Generator) -> torch.Tensor:
        w, mu = self.tilted(lam)
        k = torch.multinomial(w, n, replacement=True, generator=generator)
        return (mu[k] + self.s[k, None] * torch.randn((n, mu.shape[1]), generator=generator, dtype=torch.float64)).float()


def wasserstein_1d(a: torch.Tensor, b: torch.Tensor) -> float:
    """W1 between two 1-D samples of equal size (sorted differences)."""
    return float((torch.sort(a.flatten().double()).values - torch.sort(b.flatten().double()).values).abs().mean())
