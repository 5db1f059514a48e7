"""Several training processes played by threads of this one: each thread holds a FakeAccelerator
whose collectives (reduce, gather) meet the other threads' at a barrier, as accelerate's do over
torch.distributed. Enough to check that code which decides from a collective decides alike on every
process, without launching processes (tests/train/test_distributed.py does that, at a cost)."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import torch


class ProcessGroup:
    """What the threads of one fake world share: a barrier and one slot per process."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's tensor, in rank order, once all have given theirs."""
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # all have read before any writes its next one
        return out


class FakeAccelerator:
    """The collectives of accelerate's Accelerator that the objectives call, for one process of a ProcessGroup."""

    def __init__(self, group: ProcessGroup, rank: int):
        self.group, self.process_index, self.num_processes = group, rank, group.size
        self.device = torch.device("cpu")
        self.state = SimpleNamespace(num_processes=group.size)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        stacked = torch.stack(self.group.exchange(self.process_index, tensor))
        if reduction == "max":
            return stacked.max(0).values
        return stacked.sum(0) / self.num_processes if reduction == "mean" else stacked.sum(0)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.process_index, tensor))

    def backward(self, loss: torch.Tensor) -> None:
        """This process's gradient alone: averaging the processes' gradients (DDP's all-reduce) is the test's to do."""
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self, model):
        yield


def run_processes(size: int, work) -> list:
    """work(accelerator) on `size` threads, one fake process each; their results in rank order (an
    exception in any is raised here)."""
    group = ProcessGroup(size)
    results, errors = [None] * size, []

    def one(rank: int) -> None:
        try:
            results[rank] = work(FakeAccelerator(group, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
