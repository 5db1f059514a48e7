"""Several named rewards with weights: separate channels [N, K] plus their weighted sum.

Bad outputs (NaN, inf, a wrong shape or count) either stop the run with one sentence naming
the reward (`on_invalid="error"`), or, with `on_invalid="drop"`, mark the affected samples
invalid: `score_with_mask` returns their rows as 0 with a False in the valid mask, so the
trainer can drop and count them. No NaN ever leaves this module.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from flowrl.errors import UserError
from rewards.options import plan_reward
from rewards.registry import as_reward
from rewards.video import strided_frames

ON_INVALID = ("error", "drop")
log = logging.getLogger("rewards")


def as_score_matrix(name: str, scores, n: int, k: int | None = None) -> torch.Tensor:
    """A reward's output as float [n, k] on the CPU, or UserError for a wrong type or shape.
    Values are not checked: NaN and inf pass (see `check_scores`)."""
    if not isinstance(scores, torch.Tensor):
        try:
            scores = torch.as_tensor(scores, dtype=torch.float32)
        except Exception:
            raise UserError(f"reward '{name}' returned {type(scores).__name__}; it must return a float tensor of shape [N] or [N, K]") from None
    scores = scores.detach().float().cpu()
    if scores.ndim == 1:
        scores = scores[:, None]
    if scores.ndim != 2 or scores.shape[0] != n or (k is not None and scores.shape[1] != k):
        want = f"[{n}]" if k == 1 else f"[{n}, {k}]" if k else f"[N] or [N, K] with N = {n}"
        raise UserError(f"reward '{name}' returned shape {tuple(scores.shape)} for {n} images; it must return {want}")
    return scores


def check_scores(name: str, scores, n: int) -> torch.Tensor:
    """Reward outputs must be finite floats of shape [N] or [N, K]."""
    scores = as_score_matrix(name, scores, n)
    if not torch.isfinite(scores).all():
        bad = int((~torch.isfinite(scores)).any(1).sum())
        raise UserError(f"reward '{name}' returned NaN or inf for {bad} of {n} images; rewards must be finite")
    return scores


def weights_for_channels(channel_names: Sequence[str], weights: dict[str, float],
                         channel_weights: dict[str, float] | None = None) -> torch.Tensor:
    """The weight [K] of each channel ("name" or "name/channel"): its entry in `channel_weights`,
    else its reward's weight in `weights`, else 0 (a channel scored but not trained on, as in a
    group store that keeps every channel)."""
    unknown = sorted(set(channel_weights or {}) - set(channel_names))
    if unknown:
        raise UserError(f"reward.channel_weights names {', '.join(unknown)}, which no reward returns; channels: {', '.join(channel_names)}")
    return torch.tensor([(channel_weights or {}).get(c, weights.get(c.split("/")[0], 0.0)) for c in channel_names], dtype=torch.float32)


class MultiReward:
    """Calls each named reward in batches and returns its channels side by side, [N, K].

    weights: reward name -> weight; `channel_weights` repeats a reward's weight over its channels,
    unless `channel_weights` (channel name such as "shapes/partial" -> weight) says otherwise.
    options: reward name -> options (model path, device, dtype, batch_size, kind, url, ...).
    rewards: name -> plain callable, used instead of the registry for that name.
    placement: None, or a registered reward's workers on Ray (rewards/placement.py `RewardRayOptions`).
    """

    def __init__(
        self,
        weights: dict[str, float],
        batch_size: int = 32,
        rewards: dict[str, Callable] | None = None,
        options: dict[str, dict[str, Any]] | None = None,
        on_invalid: str = "error",
        channel_weights: dict[str, float] | None = None,
        frame_stride: int = 1,
        placement=None,
    ):
        if on_invalid not in ON_INVALID:
            raise UserError(f"reward.on_invalid must be one of {', '.join(ON_INVALID)}; got '{on_invalid}'")
        self.weights = dict(weights)
        self.batch_size = batch_size
        self.frame_stride = frame_stride
        self.on_invalid = on_invalid
        self.fns: dict[str, Callable] = {}
        self.batch_sizes: dict[str, int] = {}
        self.channels: dict[str, tuple[str, ...]] = {}
        self.scores_videos: dict[str, bool] = {}  # registered with video=True: gets videos, not their frames
        self.channel_names: list[str] = []
        self.breakdowns: dict[str, Callable] = {}  # reward name -> its registered breakdown
        self.bucket_fn: Callable[[str], str] | None = None  # the first reward's prompt -> kind, if one has it
        self.placed: list = []  # the rewards scored on Ray workers (reward.placement ray)
        options = options or {}
        for name in self.weights:
            if rewards and name in rewards:  # a plain function passed in directly
                self.fns[name], channels = as_reward(name, rewards[name]), (name,)
                self.scores_videos[name] = bool(getattr(rewards[name], "scores_videos", False))
                self.batch_sizes[name] = batch_size
            else:
                plan = plan_reward(name, options.get(name))
                if placement is not None:
                    from rewards.placement import place_reward

                    self.fns[name], channels = place_reward(name, options.get(name), placement)
                    self.placed.append(self.fns[name])
                else:
                    self.fns[name], channels = plan.build()
                self.scores_videos[name] = plan.spec.video
                if plan.spec.breakdown is not None:
                    self.breakdowns[name] = plan.spec.breakdown
                self.bucket_fn = self.bucket_fn or plan.spec.bucket
                self.batch_sizes[name] = plan.batch_size or batch_size
            self.channels[name] = channels
            self.channel_names += [name if len(channels) == 1 else f"{name}/{c}" for c in channels]
        self.channel_weights = weights_for_channels(self.channel_names, self.weights, channel_weights)

    @classmethod
    def from_config(cls, reward_cfg, rewards: dict[str, Callable] | None = None) -> "MultiReward":
        """Build from a `flowrl.config.RewardConfig`."""
        return cls(reward_cfg.weights, reward_cfg.batch_size, rewards=rewards, options=reward_cfg.options,
                   on_invalid=reward_cfg.on_invalid, channel_weights=reward_cfg.channel_weights,
                   frame_stride=reward_cfg.frame_stride, placement=reward_cfg.ray if reward_cfg.placement == "ray" else None)

    @property
    def concurrency(self) -> int:
        """How many batches can be scored at once: one per Ray worker of the placed rewards, else 1."""
        return max((len(p.handles) for p in self.placed), default=1)

    def close(self) -> None:
        """Stop the rewards' Ray workers (the trainer's, at the run's end); nothing for inline rewards."""
        if self.placed:
            from rewards.placement import release

            release(self.placed)
            self.placed = []

    @classmethod
    def single(cls, name: str, reward_cfg) -> "MultiReward":
        """The registered reward `name` alone (weight 1) with its options from the reward config:
        a judge, or the reward a search looks for."""
        return cls({name: 1.0}, reward_cfg.batch_size, options={k: v for k, v in reward_cfg.options.items() if k == name},
                   on_invalid=reward_cfg.on_invalid, frame_stride=reward_cfg.frame_stride)

    def breakdown(self, prompts: Sequence[str], scores: torch.Tensor) -> dict[str, dict[str, float]] | None:
        """The first breakdown among the rewards (the shapes reward's GenEval categories) of scores
        [N, K] by kind of prompt, with an "overall" row; None when no reward has one."""
        start = 0
        for name, channels in self.channels.items():
            if name in self.breakdowns:
                return self.breakdowns[name](list(prompts), scores[:, start : start + len(channels)])
            start += len(channels)
        return None

    def buckets(self, prompts: Sequence[str]) -> list[str] | None:
        """Each prompt's kind by the first reward that names one (the shapes reward: its GenEval
        category); None when none does."""
        return None if self.bucket_fn is None else [self.bucket_fn(p) for p in prompts]

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        """Scores [N, K]; any invalid output raises UserError, whatever `on_invalid` says
        (a caller that drops samples uses `score_with_mask`)."""
        return self._score(images, prompts, metadata, drop=False)[0]

    def score_with_mask(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [N, K] with invalid rows set to 0, valid [N] bool). With on_invalid="error"
        an invalid output raises UserError instead, so `valid` is all True."""
        return self._score(images, prompts, metadata, drop=self.on_invalid == "drop")

    def _score(self, images, prompts, metadata, drop: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = images.shape[0]
        if len(prompts) != n or (metadata is not None and len(metadata) != n):
            raise UserError(f"rewards got {n} images, {len(prompts)} prompts and {len(metadata) if metadata is not None else 'no'} metadata entries; they must match")
        video = images.dim() == 5
        if video:  # image rewards score every frame_stride-th frame of each video, then average per video
            frames = strided_frames(images, self.frame_stride)
            per = frames.shape[1]
            frames = frames.reshape(n * per, *frames.shape[2:])
            frame_prompts = [p for p in prompts for _ in range(per)]
            frame_meta = [m for m in metadata for _ in range(per)] if metadata is not None else None
        valid = torch.ones(n, dtype=torch.bool)
        cols = []
        for name, fn in self.fns.items():
            k = len(self.channels[name])
            if self.scores_videos[name] and not video:
                raise UserError(f"reward '{name}' scores videos [N, 3, F, H, W]; this model's samples are images")
            if video and not self.scores_videos[name]:
                col, ok = self._score_one(name, fn, frames, frame_prompts, frame_meta, k, drop)
                col, ok = col.view(n, per, k).mean(1), ok.view(n, per).all(1)
            else:
                col, ok = self._score_one(name, fn, images, prompts, metadata, k, drop)
            valid &= ok
            cols.append(col)
        scores = torch.cat(cols, dim=1) if cols else torch.zeros(n, 0)
        scores[~valid] = 0.0
        return scores, valid

    def _score_one(self, name, fn, images, prompts, metadata, k: int, drop: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One reward's scores [N, k] in its batches, invalid rows 0, and which rows are valid [N]."""
        n, bs = images.shape[0], self.batch_sizes[name]
        valid = torch.ones(n, dtype=torch.bool)
        col = torch.zeros(n, k)
        for i in range(0, n, bs):
            j = min(i + bs, n)
            meta = metadata[i:j] if metadata is not None else None
            raw = fn(images[i:j], list(prompts[i:j]), meta)
            try:
                part = as_score_matrix(name, raw, j - i, k)
            except UserError as exc:
                if not drop:
                    raise
                log.warning("%s; dropping samples %d..%d", exc, i, j - 1)
                valid[i:j] = False
                continue
            finite = torch.isfinite(part).all(1)
            if not finite.all():
                bad = int((~finite).sum())
                if not drop:
                    raise UserError(f"reward '{name}' returned NaN or inf for {bad} of {j - i} images; rewards must be finite")
                log.warning("reward '%s' returned NaN or inf for %d of %d images; dropping them", name, bad, j - i)
                valid[i:j] &= finite
            col[i:j] = torch.where(finite[:, None], part, torch.zeros(()))
        return col, valid
