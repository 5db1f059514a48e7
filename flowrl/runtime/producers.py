"""Rollouts that run ahead of the trainer (`run.async_rollouts`): AReaL's staleness-bounded
asynchronous RL on one machine. A producer process collects batch after batch with the newest
weights it has received while the trainer updates on the batch before (or N producers in turn,
`run.producers`; as Ray actors on this machine or a cluster's nodes, flowrl/runtime/ray_rollouts.py).

Versions. The trainer's weights have version v, the number of updates made, which is also the
iteration of the batch it trains next. After the update on batch i it publishes its trainable
weights to shared memory as version i + 1. The producer starts batch i only once it holds
weights of version >= i - k (k = run.max_staleness), so no batch is more than k versions old
when it is trained (AReaL's capacity rule with one batch per version). With k = 0 the producer
waits for every update and the run is the synchronous one, draw for draw. Each batch carries
the version that sampled it and the collector's state after it (the allocator's, which the
trainer's checkpoints hold); the behaviour log-probabilities are in the experience itself.

Failures never hang the trainer: an exception in the producer reaches `take` as one sentence,
and a producer that dies (killed, out of memory) is noticed within half a second. Batches travel
as files (in shared memory where the machine has /dev/shm) and only their short names through
the queue: a pipe write under 4 KiB is atomic, so a producer killed mid-batch leaves no partial
message for the trainer to block on, and nothing the trainer holds depends on the producer's life.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flowrl.errors import UserError

POLL_S = 0.5  # how often a waiting trainer checks that the producer is alive
# what torchrun (and flowrl's CPU launcher) tell a process about its group
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                   "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass
class ProducedBatch:
    iteration: int
    version: int  # the weights' version that sampled it (of its oldest token, with partial rollouts)
    experience: Any
    state: dict | None  # the collector's state after this batch (its allocator's)
    producer_idle_s: float  # the producer's wait for weights recent enough to start this batch
    producer_busy_s: float  # its time collecting the batch
    trainer_wait_s: float = 0.0  # the trainer's wait for it (set by `take`)
    weights_bytes: int = 0  # the weights it fetched before this batch (Ray workers; 0 when it held that version)
    weights_fetch_s: float = 0.0  # their fetch from the object store and copy into the worker's policy (Ray workers)


@dataclass
class ProducerFailure:
    message: str


class RolloutProducer:
    """`build()` runs in the producer process and returns a collector: `weights()` (the tensors
    the trainer's updates change, by name), `collect(iteration)`, `state()` and its `allocator`.
    Before each batch the producer sets the collector's `version` to the weights' version it holds;
    a collector whose batches carry older tokens (the text collector's partial rollouts) reports the
    oldest as the experience's `oldest_version`, and the batch counts as that old. `weights` are the
    trainer's tensors of the same names, at version `start_iteration`.

    With `producers` N > 1, producer j samples the batches start_iteration + j, + j + N, ... (each
    once its weights are recent enough), so N batches can be sampled at once when max_staleness
    >= N - 1; `devices` names each one's device (CUDA_VISIBLE_DEVICES in its process, see
    `visible_device`). `fork`: whether a producer on one thread may be forked (not once the
    trainer has started CUDA, which a fork cannot inherit)."""

    def __init__(self, build: Callable[[], Any], weights: dict[str, torch.Tensor], max_staleness: int, start_iteration: int,
                 threads: int = 0, producers: int = 1, devices: Sequence[str] = (), fork: bool = True):
        # a producer on one thread is forked (no second start-up of torch and the model libraries,
        # about 15 s of CPU on a 2-core machine); on several threads it is a fresh interpreter, since
        # OpenMP's threads do not survive a fork (flowrl.runtime.processes.ForkedProcess)
        forked = fork and threads == 1 and not devices and sys.platform.startswith("linux")
        ctx = torch.multiprocessing.get_context("fork" if forked else "spawn")
        self.max_staleness = max_staleness
        self.spool = tempfile.mkdtemp(prefix="flowrl-rollouts-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.shared = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in weights.items()}
        self.version = ctx.Value("q", start_iteration, lock=False)
        self.lock = ctx.Lock()
        self.queue = ctx.Queue()
        self.arrived: dict[int, ProducedBatch | ProducerFailure] = {}  # batches read from the queue ahead of their turn
        # a flag, not an Event: setting an Event waits for its sleepers to wake, and a killed producer never does
        self.stop = ctx.Value("b", 0, lock=False)
        self.processes = [
            ctx.Process(target=produce, daemon=True, name=f"flowrl-rollout-producer-{j}",
                        args=(build, self.shared, self.version, self.lock, self.queue, self.stop, self.spool,
                              start_iteration + j, max_staleness, threads, producers, devices[j] if devices else ""))
            for j in range(producers)]
        for process in self.processes:
            process.start()

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The trainer's weights after an update, as `version`, for the producer's next batch."""
        while not self.lock.acquire(timeout=POLL_S):
            self._check_alive(f"version {version} of the weights was published")
        try:
            with torch.no_grad():
                for name, tensor in weights.items():
                    self.shared[name].copy_(tensor.detach())
            self.version.value = version
        finally:
            self.lock.release()

    def take(self, iteration: int) -> ProducedBatch:
        """Batch `iteration`, waiting for it; checks that it is that batch and within the bound."""
        return take_in_order(self.arrived, iteration, self.max_staleness, self._receive)

    def _receive(self, iteration: int):
        """The next item a producer sent, or None after a short wait (having checked they live)."""
        try:
            name = self.queue.get(timeout=POLL_S)
        except queue.Empty:
            self._check_alive(f"batch {iteration} reached the trainer")
            return None
        path = os.path.join(self.spool, name)
        with open(path, "rb") as f:
            item = pickle.load(f)
        os.remove(path)
        return item

    def _check_alive(self, waiting_for: str) -> None:
        for process in self.processes:
            if not process.is_alive():
                which = f" {process.name.rsplit('-', 1)[1]}" if len(self.processes) > 1 else ""
                raise UserError(f"the rollout producer process{which} stopped (exit code {process.exitcode}) before {waiting_for}; "
                                "the run stopped there with its checkpoints intact: `flowrl train --resume RUN` continues it")

    def close(self) -> None:
        """Stop the producers; what they had collected ahead of the trainer is dropped."""
        self.stop.value = 1
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()
        shutil.rmtree(self.spool, ignore_errors=True)


def send(out, spool: str, item) -> None:
    """`item` into a file of the spool, then its name on the queue (the trainer opens only names it
    was sent, so it never sees a file half written)."""
    name = f"{time.monotonic_ns()}.pkl"
    with open(os.path.join(spool, name), "wb") as f:
        pickle.dump(item, f, protocol=pickle.HIGHEST_PROTOCOL)
    out.put(name)


def take_in_order(arrived: dict, iteration: int, max_staleness: int, receive: Callable[[int], Any]) -> ProducedBatch:
    """Batch `iteration` from `receive(iteration)` (the next item a producer sent, or None after a
    short wait); several producers' batches may arrive out of order, and those ahead of their
    turn wait in `arrived`."""
    t0 = time.perf_counter()
    while iteration not in arrived:
        item = receive(iteration)
        if item is None:
            continue
        if isinstance(item, ProducerFailure):
            raise UserError(item.message)
        arrived[item.iteration] = item
    return checked_batch(arrived.pop(iteration), iteration, max_staleness, t0)


def checked_batch(item, iteration: int, max_staleness: int, waiting_since: float) -> ProducedBatch:
    """`item` as the trainer's batch `iteration`: a producer's failure becomes one sentence, and a
    batch that is not that one or is past the bound stops the run."""
    if isinstance(item, ProducerFailure):
        raise UserError(item.message)
    staleness = iteration - item.version
    if item.iteration != iteration or not 0 <= staleness <= max_staleness:
        raise RuntimeError(f"the rollout producer sent batch {item.iteration} of weights version {item.version} when the trainer "
                           f"expected batch {iteration} within {max_staleness} versions")
    item.trainer_wait_s = time.perf_counter() - waiting_since
    return item


class SharedMemoryChannel:
    """The producer's side of a RolloutProducer: weights from shared memory, batches into the spool."""

    def __init__(self, shared, version, lock, out, stop, spool: str):
        self.shared, self.version, self.lock, self.out, self.stop, self.spool = shared, version, lock, out, stop, spool

    def load_weights(self, need: int, have: int | None, weights: dict[str, torch.Tensor]) -> int | None:
        """Wait for weights of version >= need and load the newest into `weights` unless they are
        `have`; their version, or None when the trainer asks the producer to stop."""
        while self.version.value < need:
            time.sleep(0.002)
            if self.stop.value:
                return None
        if self.stop.value:
            return None
        with self.lock, torch.no_grad():
            if self.version.value != have:
                for name, tensor in weights.items():
                    tensor.copy_(self.shared[name])
            return self.version.value

    def send(self, item) -> None:
        send(self.out, self.spool, item)


def produce(build, shared, version, lock, out, stop, spool: str, iteration: int, max_staleness: int, threads: int,
            stride: int = 1, device: str = "") -> None:
    """A producer process a RolloutProducer starts: one process of its own, even beside several
    trainer processes (whose launcher's variables would make its Accelerator join their group)."""
    for name in DISTRIBUTED_ENV:
        os.environ.pop(name, None)
    if device:  # before anything starts CUDA here; the collector then builds on the one device it sees
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(device, os.environ.get("CUDA_VISIBLE_DEVICES"))
        build = functools.partial(build, device="cpu" if device == "cpu" else "cuda")
    run_producer(build, SharedMemoryChannel(shared, version, lock, out, stop, spool), iteration, max_staleness, threads, stride)


def visible_device(device: str, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a producer on `device` (run.producer_devices: cpu, cuda or cuda:N,
    N counted among the trainer's visible devices `visible`): the one GPU it sees as cuda, or
    none for cpu."""
    if device == "cpu":
        return ""
    index = int(device.partition(":")[2] or 0)
    listed = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if listed is not None and index >= len(listed):
        raise UserError(f"run.producer_devices names {device}, but CUDA_VISIBLE_DEVICES shows the trainer {len(listed)} GPU(s)")
    return listed[index] if listed is not None else str(index)


class ObservationLog:
    """A producer's allocator observations since the last batch (several producers): each producer's
    allocator sees only its own batches, so the trainer replays every batch's observations on its own
    allocator, in batch order (`replay`), as the synchronous run's allocator saw them."""

    def __init__(self, allocator):
        self.entries: list[tuple[torch.Tensor, torch.Tensor]] = []
        observe = allocator.observe

        def logged(prompt_ids, success):
            self.entries.append((prompt_ids.clone(), success.clone()))
            observe(prompt_ids, success)

        allocator.observe = logged

    def take(self) -> dict:
        entries, self.entries = self.entries, []
        return {"observations": entries}


def replay(allocator, state: dict) -> None:
    """A batch's collector state onto the trainer's allocator: the producer's whole state, or with
    several producers the batch's observations."""
    if "observations" in state:
        for prompt_ids, success in state["observations"]:
            allocator.observe(prompt_ids, success)
    else:
        allocator.load_state_dict(state)


def run_producer(build, channel, iteration: int, max_staleness: int, threads: int = 0, stride: int = 1) -> int:
    """Batch after batch (every `stride`-th from `iteration`), each started once weights of version >=
    iteration - max_staleness are at hand (the newest ones, loaded when the version moved), until the
    trainer says stop; returns the next batch's iteration. `channel`: `load_weights(need, have,
    weights)` and `send(item)` (SharedMemoryChannel: over shared memory)."""
    try:
        if threads:
            torch.set_num_threads(threads)
        collector = build()
        weights, have = collector.weights(), None
        log = ObservationLog(collector.allocator) if stride > 1 else None
        while True:
            t0 = time.perf_counter()
            have = channel.load_weights(iteration - max_staleness, have, weights)
            if have is None:
                return iteration
            t1 = time.perf_counter()
            collector.version = have
            experience = collector.collect(iteration)
            # partial rollouts (APRIL) carry tokens of older weights: the batch is as old as its oldest token
            oldest = getattr(experience, "oldest_version", None)
            channel.send(ProducedBatch(iteration, have if oldest is None else min(have, oldest), experience,
                                       collector.state() if log is None else log.take(), t1 - t0, time.perf_counter() - t1))
            iteration += stride
    except UserError as exc:
        channel.send(ProducerFailure(str(exc)))
    except Exception as exc:  # reaches the trainer as one sentence; the traceback stays in the producer's stderr
        import traceback

        traceback.print_exc()
        channel.send(ProducerFailure(f"the rollout producer failed at batch {iteration}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
    return iteration
