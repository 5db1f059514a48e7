"""Reward models as Ray actors (`reward.placement: ray`, with `run.cluster: ray`).

Each registered reward of reward.weights runs in `reward.ray.workers` actors of its own, each
holding the model on the resources `reward.ray.resources` names (a GPU of a reward node, say),
instead of inside every process that samples. The trainer creates them when it builds its
rewards; the rollout workers (and any process of the same Ray job) find them by name, so each
reward model is loaded once per worker, not once per sampling process. A batch is scored on the
next worker in turn as soon as it is decoded (the reward runner's threads, one per worker, so
sampling overlaps scoring and N batches score at once). MultiReward keeps its checks (shapes,
NaN, reward.on_invalid) where the scores arrive.

A worker killed mid-batch is restarted by Ray (reward.ray.max_restarts) and the batch is scored
again: the run goes on with the same scores.
"""

from __future__ import annotations

import itertools
import threading
import traceback
from typing import Any, Sequence

import torch

from flowrl.errors import UserError
from flowrl.quiet import silence_known_messages
from flowrl.runtime.ray_cluster import NAMESPACE, RewardRayOptions, first_line, ray_module
from rewards.options import plan_reward



class RewardWorker:
    """One reward model (its registered factory with its options), scoring what it is sent."""

    def __init__(self, name: str, options: dict[str, Any] | None):
        silence_known_messages()
        self.fn, self.channels = plan_reward(name, options).build()

    def channel_names(self) -> tuple[str, ...]:
        return tuple(self.channels)

    def pid(self) -> int:
        import os

        return os.getpid()

    def score(self, images: torch.Tensor, prompts: list[str], metadata) -> tuple[str, Any]:
        """("scores", the reward's output on the CPU) or ("error", one sentence)."""
        try:
            out = self.fn(images, prompts, metadata)
        except UserError as exc:
            return "error", str(exc)
        except Exception as exc:
            traceback.print_exc()
            return "error", f"{type(exc).__name__}: {first_line(exc)}"
        return "scores", out.detach().cpu() if isinstance(out, torch.Tensor) else out


class PlacedReward:
    """A reward's workers as one callable `(images, prompts, metadata) -> scores`, each call on the
    next worker in turn."""

    def __init__(self, name: str, handles: list):
        self.name, self.handles = name, handles
        self._turn, self._lock = itertools.count(), threading.Lock()

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None):
        ray = ray_module()
        with self._lock:
            handle = self.handles[next(self._turn) % len(self.handles)]
        try:
            kind, out = ray.get(handle.score.remote(images.detach().cpu(), list(prompts), metadata))
        except ray.exceptions.RayError as exc:
            raise UserError(f"reward '{self.name}' on its Ray workers failed ({type(exc).__name__}: {first_line(exc)}); the run "
                            "stopped with its checkpoints intact: `flowrl train --resume RUN` continues it") from None
        if kind == "error":
            raise UserError(f"reward '{self.name}' failed on its Ray worker: {out}")
        return out

    def __reduce__(self):  # the handles travel (to the rollout workers), the lock is made anew
        return PlacedReward, (self.name, self.handles)


def place_reward(name: str, options: dict[str, Any] | None, ray_options: RewardRayOptions) -> tuple[PlacedReward, tuple[str, ...]]:
    """The workers of reward `name` in this Ray job: created by the first process that asks (the
    trainer), found by name by the others. Returns the callable and the reward's channels."""
    ray = ray_module()
    job = ray.get_runtime_context().get_job_id()
    resources = dict(ray_options.resources)
    cpus, gpus = resources.pop("CPU", 0.0), resources.pop("GPU", 0.0)
    actor = ray.remote(RewardWorker)
    handles = [actor.options(name=f"reward-{job}-{name}-{j}", namespace=NAMESPACE, get_if_exists=True, num_cpus=cpus, num_gpus=gpus,
                             resources=resources or None, max_restarts=ray_options.max_restarts,
                             max_task_retries=ray_options.max_restarts).remote(name, options)
               for j in range(ray_options.workers)]
    try:
        channels = ray.get(handles[0].channel_names.remote())
    except ray.exceptions.RayError as exc:
        raise UserError(f"reward '{name}' could not start on a Ray worker ({type(exc).__name__}: {first_line(exc)})") from None
    return PlacedReward(name, handles), channels


def release(placed: list[PlacedReward]) -> None:
    """Stop the workers of `placed` (the trainer, at the run's end)."""
    ray = ray_module()
    for reward in placed:
        for handle in reward.handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # gone already
                pass
