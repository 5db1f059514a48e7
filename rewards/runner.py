"""Rewards concurrent with sampling: score batch b on a worker thread while batch b+1 samples.

    runner = AsyncRewardRunner(multi_reward)
    for batch in batches:
        images = decode(sample(batch))
        runner.submit_with_mask(images, batch.prompts)   # returns at once
    results = runner.wait_all()                          # [(scores, valid), ...] in submit order

One worker by default: reward models are not assumed thread-safe, and the point is to overlap
scoring with sampling, not rewards with each other. Images are used as given, not copied:
do not modify them in place before their future is done.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch


class AsyncRewardRunner:
    def __init__(self, reward, max_workers: int = 1):
        """reward: a MultiReward (or any callable `(images, prompts, metadata) -> [n, K]`;
        `submit_with_mask` needs MultiReward's `score_with_mask`)."""
        self.reward = reward
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._busy_s = 0.0

    @property
    def reward_seconds(self) -> float:
        """Total wall time spent inside reward calls so far (summed over calls)."""
        with self._lock:
            return self._busy_s

    def submit(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> Future:
        """Future of the scores [n, K]; invalid outputs raise UserError from `result()`."""
        return self._submit(self.reward, images, prompts, metadata)

    def submit_with_mask(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> Future:
        """Future of (scores [n, K] with invalid rows 0, valid [n] bool), per `on_invalid`."""
        return self._submit(self.reward.score_with_mask, images, prompts, metadata)

    def wait_all(self) -> list:
        """Results of every submit since the last wait_all, in submission order. Waits for
        all of them before raising the first failure, so no call is left running."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in pending]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "AsyncRewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _submit(self, fn: Callable, images, prompts, metadata) -> Future:
        prompts = list(prompts)
        metadata = list(metadata) if metadata is not None else None
        future = self._pool.submit(self._timed, fn, images.detach(), prompts, metadata)
        with self._lock:
            self._pending.append(future)
        return future

    def _timed(self, fn: Callable, images, prompts, metadata):
        start = time.perf_counter()
        try:
            return fn(images, prompts, metadata)
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._busy_s += elapsed
