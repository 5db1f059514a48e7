"""Rollouts from other machines (`run.producer_port`): the producers of `run.async_rollouts`
(flowrl/runtime/producers.py) started by hand where they should sample, with
`flowrl produce TRAINER_HOST:PORT`, and connected to the trainer over the network.

The trainer listens on the port with a torch.distributed TCPStore and puts there what a producer
builds its collector with (the config, the allocator's state, the iteration to start from, the
trainable weights' names, run.producers). Each producer takes the next rank as it joins; once
all have, they and the trainer form a Gloo process group (trainer rank 0, producer r samples
batches start + r - 1, + r - 1 + N, ...), and each producer speaks with the trainer in send/recv
pairs, the producer always asking first:

- before each batch the producer asks for weights of version >= iteration - max_staleness, saying
  which version it holds; the trainer answers, when it has them, with the newest version and (if
  that is not the one held) every trainable tensor, in name order: the weights travel once per
  batch, not once per update;
- after each batch it sends the batch, pickled, as a byte tensor.

On the trainer one thread per producer serves these while the loop trains; `take` reads the
batches they received, in iteration order. A producer that dies closes its connection and the trainer hears of it at once (Gloo
reports the closed peer): the run stops with one sentence, its checkpoints intact. The protocol
trusts its peer (both sides unpickle what they receive), as torch.distributed does: run it on a
network you trust.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import queue
import socket
import sys
import threading
import time
from typing import Any, Callable

import torch

from flowrl.errors import UserError
from flowrl.runtime.producers import POLL_S, ProducedBatch, ProducerFailure, run_producer, take_in_order

WANT, BATCH = 1, 2  # what a producer's header announces
STOP = -1  # the version that answers a producer when the trainer has closed
TAG = 0
BUILD_KEY, JOINED_KEY = "flowrl/build", "flowrl/producer"
# a Gloo operation's limit: generous, since the trainer waits a whole batch for the producer's next
# message; a producer that dies closes its connection, which ends any wait at once
OPERATION_TIMEOUT = datetime.timedelta(hours=24)


def _header(kind: int, a: int, b: int) -> torch.Tensor:
    return torch.tensor([kind, a, b], dtype=torch.int64)


def _send_bytes(pg, peer: int, kind: int, payload: memoryview) -> None:
    pg.send([_header(kind, len(payload), 0)], peer, TAG).wait()
    pg.send([torch.frombuffer(payload, dtype=torch.uint8)], peer, TAG).wait()  # no copy of the payload


def _recv_bytes(pg, peer: int, size: int) -> memoryview:
    buf = torch.empty(size, dtype=torch.uint8)
    pg.recv([buf], peer, TAG).wait()
    return memoryview(buf.numpy())  # unpickled in place


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"the trainer's address must be HOST:PORT with the port run.producer_port names (such as "
                        f"trainer-node:29600); got '{address}'")
    return host.strip("[]"), int(port)


class RemoteProducer:
    """The trainer's side: what RolloutProducer offers (`publish`, `take`, `close`) for `producers`
    producers on other machines (producer r, joining r-th, samples the batches start_iteration + r - 1,
    + r - 1 + N, ...). Waits up to `wait_minutes` for all of them to join."""

    def __init__(self, port: int, build: Callable[[], Any], weights: dict[str, torch.Tensor], max_staleness: int,
                 start_iteration: int, wait_minutes: float, producers: int = 1):
        from torch.distributed import ProcessGroupGloo, TCPStore

        self.max_staleness, self.port, self.producers = max_staleness, port, producers
        try:
            message = pickle.dumps((build, start_iteration, max_staleness, sorted(weights), producers),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise UserError(f"run.producer_port sends the producer what it builds with, and that could not be pickled "
                            f"({type(exc).__name__}: {exc}); rewards passed as Python objects cannot travel, register them "
                            "in a module instead") from exc
        try:
            self.store = TCPStore("0.0.0.0", port, producers + 1, is_master=True, wait_for_workers=False, timeout=OPERATION_TIMEOUT)
        except Exception as exc:
            raise UserError(f"run.producer_port {port} could not be listened on ({str(exc).splitlines()[0]}); choose a free port")
        self.store.set(BUILD_KEY, message)
        self.peers = self._wait_for_producers(wait_minutes)
        self.pg = ProcessGroupGloo(self.store, 0, producers + 1, OPERATION_TIMEOUT)
        self.latest = {k: v.detach().to("cpu", copy=True) for k, v in sorted(weights.items())}
        self.version = start_iteration
        self.snapshot: tuple[int, list[torch.Tensor]] = (-1, [])  # (version, a copy of `latest` the serving threads send)
        self.closing = False
        self.changed = threading.Condition()
        self.batches: queue.Queue = queue.Queue()  # what the serving threads receive: batches, failures, a lost rank
        self.arrived: dict[int, ProducedBatch] = {}  # batches received ahead of their turn
        self.threads = [threading.Thread(target=self._serve, args=(rank,), daemon=True, name=f"flowrl-remote-producer-{rank}")
                        for rank in range(1, producers + 1)]
        for thread in self.threads:
            thread.start()

    def _wait_for_producers(self, wait_minutes: float) -> list[str]:
        n, where = self.producers, f"{socket.gethostname()}:{self.port}"
        print(f"flowrl: waiting up to {wait_minutes:g} minutes (run.producer_wait_minutes) for {n} rollout producer(s): run "
              f"`flowrl produce {where}` on each machine (or GPU) that should sample", file=sys.stderr)
        deadline = time.monotonic() + wait_minutes * 60
        while (joined := self.store.add(JOINED_KEY, 0)) < n:
            if time.monotonic() > deadline:
                raise UserError(f"{joined} of {n} rollout producer(s) joined on port {self.port} within {wait_minutes:g} minutes "
                                f"(run.producer_wait_minutes); start them with `flowrl produce {where}`")
            time.sleep(POLL_S)
        peers = [self.store.get(f"{JOINED_KEY}/{rank}").decode() for rank in range(1, n + 1)]
        print(f"flowrl: rollout producer(s) joined: {', '.join(peers)}", file=sys.stderr)
        return peers

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The trainer's weights after an update, as `version`, for the producers' next requests."""
        with self.changed, torch.no_grad():
            for name, tensor in weights.items():
                self.latest[name].copy_(tensor.detach())
            self.version = version
            self.changed.notify_all()

    def take(self, iteration: int) -> ProducedBatch:
        """Batch `iteration`, waiting for it; checks that it is that batch and within the bound."""
        return take_in_order(self.arrived, iteration, self.max_staleness, self._receive)

    def _receive(self, iteration: int):
        """The next item the serving threads received, or None after a short wait (so that Ctrl-C is heard)."""
        try:
            item = self.batches.get(timeout=POLL_S)
        except queue.Empty:
            return None
        if isinstance(item, int):  # a serving thread lost its producer
            raise UserError(f"the rollout producer on {self.peers[item - 1]} disconnected before batch {iteration} reached "
                            "the trainer; the run stopped there with its checkpoints intact: start `flowrl produce` again "
                            "and `flowrl train --resume RUN` continues it")
        return item

    def _serve(self, rank: int) -> None:
        """Answer producer `rank`'s requests until it disconnects (its rank in the batch queue) or
        the trainer closes (STOP in answer to its next request)."""
        header = torch.zeros(3, dtype=torch.int64)
        try:
            while True:
                self.pg.recv([header], rank, TAG).wait()
                kind, a, b = header.tolist()
                if kind == BATCH:
                    self.batches.put(pickle.loads(_recv_bytes(self.pg, rank, a)))
                    continue
                need, have = a, b  # WANT
                with self.changed:
                    self.changed.wait_for(lambda: self.version >= need or self.closing)
                    version = STOP if self.closing else self.version
                    if version not in (STOP, have, self.snapshot[0]):  # sent outside the lock, while publish may write
                        self.snapshot = (version, [t.clone() for t in self.latest.values()])
                    tensors = self.snapshot[1] if version not in (STOP, have) else []
                self.pg.send([torch.tensor([version], dtype=torch.int64)], rank, TAG).wait()
                for t in tensors:
                    self.pg.send([t], rank, TAG).wait()
                if version == STOP:
                    return
        except Exception:
            if not self.closing:
                self.batches.put(rank)

    def close(self) -> None:
        """Tell the producers to stop at their next requests; what they had collected ahead is dropped."""
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        # a producer waiting for weights hears STOP now; one still sampling hears it at its next request
        # (its serving thread, a daemon, receives and drops its batch meanwhile)
        for thread in self.threads:
            thread.join(timeout=POLL_S)


class RemoteChannel:
    """The producer's side of the protocol (`run_producer`'s channel)."""

    def __init__(self, pg, names: list[str]):
        self.pg, self.names, self.gone = pg, names, False
        self.buffers: dict[str, torch.Tensor] | None = None
        self.failure: str | None = None  # what the producer told the trainer when it failed

    def load_weights(self, need: int, have: int | None, weights: dict[str, torch.Tensor]) -> int | None:
        if sorted(weights) != self.names:
            raise UserError("the producer's trainable weights are not the trainer's (its model, adapter or lora settings "
                            "differ); start it from the same flowrl and model files as the trainer")
        if self.buffers is None:
            self.buffers = {k: torch.empty(weights[k].shape, dtype=weights[k].dtype) for k in self.names}
        try:
            self.pg.send([_header(WANT, need, -2 if have is None else have)], 0, TAG).wait()
            version = torch.zeros(1, dtype=torch.int64)
            self.pg.recv([version], 0, TAG).wait()
            v = int(version)
            if v in (STOP, have):
                return None if v == STOP else v
            for name in self.names:
                self.pg.recv([self.buffers[name]], 0, TAG).wait()
        except RuntimeError:
            self.gone = True
            raise
        with torch.no_grad():
            for name in self.names:
                weights[name].copy_(self.buffers[name])
        return v

    def send(self, item) -> None:
        if isinstance(item, ProducerFailure):
            self.failure = item.message
        if self.gone:
            return
        try:
            out = io.BytesIO()
            pickle.dump(item, out, protocol=pickle.HIGHEST_PROTOCOL)
            _send_bytes(self.pg, 0, BATCH, out.getbuffer())
        except RuntimeError:
            self.gone = True
            raise


def produce_remote(address: str, wait_minutes: float, threads: int = 0) -> int:
    """`flowrl produce HOST:PORT`: join the trainer listening there, sample batches for it until it
    stops, and return the exit code (0 when the trainer ended the run)."""
    from torch.distributed import ProcessGroupGloo, TCPStore

    host, port = parse_address(address)
    deadline = time.monotonic() + wait_minutes * 60
    while True:  # a plain connect first: c10d logs every failed attempt of its own
        try:
            socket.create_connection((host, port), timeout=2).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise UserError(f"no trainer listens on {host}:{port} ({exc.strerror or exc}); start `flowrl train` with "
                                f"run.async_rollouts true and run.producer_port {port} there, or check the address")
            time.sleep(POLL_S)
    store = TCPStore(host, port, is_master=False, timeout=OPERATION_TIMEOUT)
    build, start, max_staleness, names, producers = pickle.loads(store.get(BUILD_KEY))
    rank = store.add(JOINED_KEY, 1)
    if rank > producers:
        raise UserError(f"the trainer on {host}:{port} has its {producers} producer(s) (run.producers) already; this one is not needed")
    store.set(f"{JOINED_KEY}/{rank}", f"{socket.gethostname()} (pid {os.getpid()})")
    pg = ProcessGroupGloo(store, rank, producers + 1, OPERATION_TIMEOUT)
    first = start + rank - 1
    print(f"flowrl: producing for the trainer on {host}:{port} from batch {first}"
          f"{f', one batch in {producers}' if producers > 1 else ''} (max_staleness {max_staleness})", file=sys.stderr)
    channel = RemoteChannel(pg, names)
    last = run_producer(build, channel, first, max_staleness, threads, stride=producers)
    if channel.failure is not None:
        print(f"flowrl: error: {channel.failure}", file=sys.stderr)
        return 1
    print(f"flowrl: the trainer {'disconnected' if channel.gone else 'stopped the run'}; the producer stops after "
          f"{(last - first) // producers} batches", file=sys.stderr)
    return 0
