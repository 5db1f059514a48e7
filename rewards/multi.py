"""Several named rewards with weights: separate channels [N, K] plus their weighted sum."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from flowrl.errors import UserError
from rewards.registry import get_reward


def check_scores(name: str, scores, n: int) -> torch.Tensor:
    """Reward outputs must be finite floats of shape [N] or [N, K]."""
    if not isinstance(scores, torch.Tensor):
        try:
            scores = torch.as_tensor(scores, dtype=torch.float32)
        except Exception:
            raise UserError(f"reward '{name}' returned {type(scores).__name__}; it must return a float tensor of shape [N] or [N, K]") from None
    scores = scores.detach().float().cpu()
    if scores.ndim == 1:
        scores = scores[:, None]
    if scores.ndim != 2 or scores.shape[0] != n:
        raise UserError(f"reward '{name}' returned shape {tuple(scores.shape)} for {n} images; it must return [N] or [N, K] with N = {n}")
    if not torch.isfinite(scores).all():
        bad = int((~torch.isfinite(scores)).any(1).sum())
        raise UserError(f"reward '{name}' returned NaN or inf for {bad} of {n} images; rewards must be finite")
    return scores


class MultiReward:
    """Calls each named reward in batches and returns (channels [N, K], channel names)."""

    def __init__(self, weights: dict[str, float], batch_size: int = 32, rewards: dict[str, Callable] | None = None):
        self.weights = dict(weights)
        self.batch_size = batch_size
        self.fns: dict[str, Callable] = {}
        self.channel_names: list[str] = []
        weights_per_channel: list[float] = []
        for name, weight in self.weights.items():
            if rewards and name in rewards:  # a plain function passed in directly
                self.fns[name], channels = rewards[name], (name,)
            else:
                spec = get_reward(name)
                self.fns[name], channels = spec.factory(), spec.channels
            self.channel_names += [name if len(channels) == 1 else f"{name}/{c}" for c in channels]
            weights_per_channel += [weight] * len(channels)
        self.channel_weights = torch.tensor(weights_per_channel, dtype=torch.float32)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        n = images.shape[0]
        cols = []
        for name, fn in self.fns.items():
            parts = []
            for i in range(0, n, self.batch_size):
                j = min(i + self.batch_size, n)
                meta = metadata[i:j] if metadata is not None else None
                parts.append(check_scores(name, fn(images[i:j], list(prompts[i:j]), meta), j - i))
            cols.append(torch.cat(parts))
        return torch.cat(cols, dim=1) if cols else torch.zeros(n, 0)

