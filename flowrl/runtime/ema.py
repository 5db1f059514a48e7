"""Exponential moving average of the trainable weights, keyed by parameter name."""

from __future__ import annotations

import contextlib

import torch


class EMA:
    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        self.decay = decay
        self.shadow = {n: p.detach().clone().float() for n, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, torch.nn.Parameter], decay: float | None = None) -> None:
        """shadow <- d shadow + (1 - d) params, with d = `decay` or the fixed one."""
        d = self.decay if decay is None else decay
        for n, p in params.items():
            self.shadow[n].lerp_(p.detach().float(), 1.0 - d)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self, params: dict[str, torch.nn.Parameter]):
        """Temporarily load the averaged weights into `params` (for samples and exports)."""
        saved = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.copy_(self.shadow[n])
        try:
            yield
        finally:
            for n, p in params.items():
                p.copy_(saved[n])
