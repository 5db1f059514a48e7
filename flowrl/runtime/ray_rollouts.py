"""Rollout workers on Ray (`run.cluster: ray`): the producers of asynchronous rollouts
(flowrl/runtime/producers.py) as Ray actors on a placement group, on this machine or on the
nodes of a cluster (flowrl/runtime/ray_cluster.py).

The same batches as the local producers: worker j of N samples the batches start + j, + j + N,
... with the collector the trainer hands over (its policy, reward and allocator state), each
started once weights of version >= iteration - run.max_staleness are at hand, with the newest such
version. So at max_staleness 0 the run is the synchronous one, draw for draw.

Weights by version. After each update the trainer puts its trainable tensors (the adapter's,
when the base is frozen) into Ray's object store once, as version v, and tells a small board
actor; before each batch a worker asks the board for the newest version its batch may use and
fetches the tensors only when the version moved. The batch's row reports the bytes it fetched.

Faults. A worker killed mid-batch (its process, or its node) is restarted by Ray up to
run.ray.max_restarts times, and its batch is sampled again from the same seed with the same
weights' version rule; a worker that lost its allocator in the restart takes the one the batch
before left (a single worker's allocator evolves with its batches; several workers' is uniform).
So a run whose workers were killed ends with the undisturbed run's weights at staleness 0. A
worker that cannot be restarted, or a cluster that is lost, stops the run with one sentence, its
checkpoints intact.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import traceback
import uuid
from typing import Any, Callable

import torch

from flowrl.errors import UserError
from flowrl.quiet import silence_known_messages
from flowrl.runtime.producers import DISTRIBUTED_ENV, POLL_S, ObservationLog, ProducedBatch, ProducerFailure, checked_batch
from flowrl.runtime.ray_cluster import NAMESPACE, RayOptions, first_line, placement_group, ray_module

STOP = -1  # the version the board answers once the trainer has closed


class WeightsBoard:
    """The newest published version of the weights: its number and (in a list, so that Ray hands
    the reference over instead of the tensors) the object holding them. An async actor: a worker
    asking for a version not yet published waits here without holding a thread."""

    def __init__(self, build: list):
        self.version, self.holder = STOP, []
        self.changed: asyncio.Condition | None = None
        # [the reference of what the workers build with]: asked for by each worker as it starts (a restarted one too), so
        # that no worker's constructor argument lives in the object store, where Ray cannot promise a restart its arguments
        self.build_holder = build

    async def build(self) -> list:
        return self.build_holder

    def _condition(self) -> asyncio.Condition:
        if self.changed is None:  # made in the actor's event loop
            self.changed = asyncio.Condition()
        return self.changed

    async def publish(self, version: int, holder: list) -> None:
        async with self._condition():
            self.version, self.holder = version, holder
            self.changed.notify_all()

    async def newest(self, need: int) -> tuple[int, list]:
        async with self._condition():
            await self.changed.wait_for(lambda: self.holder is None or self.version >= need)
            return (STOP, []) if self.holder is None else (self.version, self.holder)

    async def close(self) -> None:
        async with self._condition():
            self.version, self.holder = STOP, None
            self.changed.notify_all()


class RolloutWorker:
    """One rollout worker: the collector `build()` returns (as a local producer builds it), and a
    batch per call of `collect`."""

    def __init__(self, board: str, max_staleness: int, threads: int, stride: int):
        for name in DISTRIBUTED_ENV:  # one process of its own, whatever launched the trainer
            os.environ.pop(name, None)
        silence_known_messages()  # as the CLI does for the trainer: the driver shows what the worker logs
        if threads:
            torch.set_num_threads(threads)
        # the board by its name: an actor handle among the arguments would count as an object Ray must keep for a restart
        self.board = ray_module().get_actor(board, namespace=NAMESPACE)
        self.max_staleness, self.stride = max_staleness, stride
        self.next_iteration: int | None = None  # the batch it samples next in turn; None when fresh (or restarted)
        self.failure: str | None = None  # what stopped its build, told to the trainer by `ready` (Ray would only say it died)
        try:
            ray = ray_module()
            self.collector = ray.get(ray.get(self.board.build.remote())[0])()
        except UserError as exc:
            self.failure = str(exc)
            return
        except Exception as exc:
            traceback.print_exc()
            self.failure = f"the Ray rollout worker could not build its collector: {type(exc).__name__}: {first_line(exc)}"
            return
        self.weights, self.have = self.collector.weights(), None
        self.log = ObservationLog(self.collector.allocator) if stride > 1 else None

    def ready(self) -> dict:
        """Where it runs (its process and node), and None or the sentence that stopped its build."""
        ray = ray_module()
        return {"failure": self.failure, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def collect(self, iteration: int, previous_state: list) -> tuple[dict | None, ProducedBatch | ProducerFailure | None]:
        """Batch `iteration` (and the allocator's state after it), once the board has weights its
        staleness bound allows; None once the trainer has closed. `previous_state`: [the state the
        batch before left], read only by a worker that restarted since."""
        ray = ray_module()
        try:
            t0 = time.perf_counter()
            version, holder = ray.get(self.board.newest.remote(iteration - self.max_staleness))
            if version == STOP:
                return None, None
            fetched, t_fetch = 0, time.perf_counter()
            if version != self.have:
                tensors = ray.get(holder[0])
                with torch.no_grad():
                    for name, tensor in self.weights.items():
                        tensor.copy_(tensors[name])
                fetched = nbytes(tensors)
                self.have = version
            t1 = time.perf_counter()  # t1 - t_fetch: the weights' fetch alone, without the wait for their version
            if self.next_iteration != iteration and previous_state and self.log is None:
                self.collector.allocator.load_state_dict(ray.get(previous_state[0]))
            self.collector.version = version
            experience = self.collector.collect(iteration)
            self.next_iteration = iteration + self.stride
            oldest = getattr(experience, "oldest_version", None)
            state = self.collector.state() if self.log is None else self.log.take()
            batch = ProducedBatch(iteration, version if oldest is None else min(version, oldest), experience, state, t1 - t0,
                                  time.perf_counter() - t1, weights_bytes=fetched, weights_fetch_s=t1 - t_fetch)
            return state, batch
        except UserError as exc:
            return None, ProducerFailure(str(exc))
        except Exception as exc:  # one sentence for the trainer; the traceback in the worker's log (shown by the driver)
            traceback.print_exc()
            return None, ProducerFailure(f"the Ray rollout worker failed at batch {iteration}: {type(exc).__name__}: {first_line(exc)}")


class RayProducer:
    """What RolloutProducer offers (`publish`, `take`, `close`), with `options.rollout_workers`
    Ray actors sampling in turn. `weights` are the trainer's trainable tensors at version
    `start_iteration`; `threads`: torch threads per worker (0: its bundle's CPUs)."""

    def __init__(self, build: Callable[..., Any], weights: dict[str, torch.Tensor], max_staleness: int, start_iteration: int,
                 options: RayOptions, threads: int = 0):
        ray = ray_module()  # connected already: the run manager joins the cluster first (RunManager.join_cluster)
        self.max_staleness, self.options = max_staleness, options
        self.group = None
        try:
            self._start(ray, build, weights, start_iteration, threads)
        except BaseException:
            self.close()
            raise

    def _start(self, ray, build, weights, start_iteration: int, threads: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        o = self.options
        self.group = placement_group(o)
        self.publish_bytes, self.publish_s = 0, 0.0
        bundle = dict(o.worker_resources)
        cpus, gpus = bundle.pop("CPU", 0.0), bundle.pop("GPU", 0.0)
        threads = threads or max(1, int(cpus))
        device = "cuda" if gpus else "cpu"  # Ray shows a worker only the GPUs of its bundle, as cuda
        actor = ray.remote(RolloutWorker)
        self.build_ref = ray.put(functools.partial(build, device=device))  # the collectors take `device`, as locally  # what each worker builds with, once in the object store
        board = f"rollout-board-{uuid.uuid4().hex[:12]}"
        self.board = ray.remote(WeightsBoard).options(num_cpus=0, name=board, namespace=NAMESPACE).remote([self.build_ref])
        self.publish(weights, start_iteration)
        n = o.rollout_workers
        self.workers = [
            actor.options(num_cpus=cpus, num_gpus=gpus, resources=bundle or None, max_restarts=o.max_restarts,
                          max_task_retries=o.max_restarts, name=None,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=j))
            .remote(board, self.max_staleness, threads, n)
            for j in range(n)]
        self.start = start_iteration
        self.batches: dict[int, Any] = {}  # iteration -> its batch's reference, until the trainer takes it
        self.states: dict[int, Any] = {}  # iteration -> the reference of its allocator state, until the next batch of its worker is sent
        self.next_submit = start_iteration
        # where each worker started (its process and node); a build that failed is its own sentence
        self.started = self._get(lambda: [w.ready.remote() for w in self.workers], "the Ray rollout workers started")
        failures = [w["failure"] for w in self.started if w["failure"]]
        if failures:
            raise UserError(failures[0])
        self._submit_up_to(start_iteration + self.max_staleness + n)

    def worker_of(self, iteration: int) -> int:
        return (iteration - self.start) % len(self.workers)

    def _submit_up_to(self, end: int) -> None:
        """Each worker's next batches, up to batch `end` (exclusive): a batch its weights do not allow
        yet waits at the board, in the worker's queue, as a local producer waits."""
        while self.next_submit < end:
            i = self.next_submit
            before = self.states.pop(i - len(self.workers), None)  # Ray keeps it for the batch it is handed to
            self.states[i], self.batches[i] = self.workers[self.worker_of(i)].collect.options(num_returns=2).remote(
                i, [before] if before is not None else [])
            self.next_submit += 1

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The trainer's weights after an update, as `version`: into the object store once."""
        ray = ray_module()
        t0 = time.perf_counter()
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        holder = [ray.put(tensors)]
        self.board.publish.remote(version, holder)
        self.publish_bytes = nbytes(tensors)
        self.publish_s = time.perf_counter() - t0

    def take(self, iteration: int) -> ProducedBatch:
        """Batch `iteration`, waiting for it; checks that it is that batch and within the bound."""
        ray = ray_module()
        self._submit_up_to(iteration + self.max_staleness + len(self.workers))
        t0 = time.perf_counter()
        batch_ref = self.batches.pop(iteration)
        while not ray.wait([batch_ref], timeout=POLL_S)[0]:  # short waits, so that Ctrl-C is heard
            pass
        item = self._get(lambda: batch_ref, f"batch {iteration} reached the trainer", worker=self.worker_of(iteration))
        return checked_batch(item, iteration, self.max_staleness, t0)

    def _get(self, refs: Callable[[], Any], waiting_for: str, worker: int | None = None):
        ray = ray_module()
        try:
            return ray.get(refs())
        except ray.exceptions.ActorDiedError as exc:
            which = f" {worker}" if worker is not None and len(self.workers) > 1 else ""
            raise UserError(f"the Ray rollout worker{which} died and was not restarted (run.ray.max_restarts "
                            f"{self.options.max_restarts}) before {waiting_for} ({first_line(exc)}); the run stopped there with "
                            "its checkpoints intact: `flowrl train --resume RUN` continues it") from None
        except ray.exceptions.RayError as exc:
            raise UserError(f"the Ray cluster failed before {waiting_for} ({type(exc).__name__}: {first_line(exc)}); the run "
                            "stopped there with its checkpoints intact: `flowrl train --resume RUN` continues it") from None

    def close(self) -> None:
        """Stop the workers; what they had sampled ahead of the trainer is dropped."""
        ray = ray_module()
        try:
            if getattr(self, "board", None) is not None:
                ray.get(self.board.close.remote(), timeout=POLL_S)
                # the batches waiting for weights end now, so that Ray kills no task it would offer to retry
                pending = list(getattr(self, "batches", {}).values())
                ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for worker in getattr(self, "workers", []):
                ray.kill(worker, no_restart=True)
            if getattr(self, "board", None) is not None:
                ray.kill(self.board)
            if self.group is not None:
                ray.util.remove_placement_group(self.group)
        except Exception:  # a cluster already gone has nothing left to stop
            pass
        self.batches, self.states, self.workers, self.board, self.group, self.build_ref = {}, {}, [], None, None, None


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
