"""Work split across processes, here and nowhere else (both trainers): `ProcessShard` pads a list
of items to a multiple of the process count with copies of its last item (copies train at zero
advantage, so every process runs the same number of forwards and backwards, as DDP needs), hands
each process its slice, and `gather_real` brings per-item results back in item order without
the padding. Objectives that need whole groups on one process (allocators spread a group over
several stages, so the even split can cut it) take their groups' owners from `whole_group_owners`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ProcessShard:
    """`n` items split over `num_processes`: padded with copies of the last item to a multiple of
    the process count; this process takes the slice `local`."""

    n: int
    num_processes: int
    process_index: int

    @property
    def per_process(self) -> int:
        return (self.n + (-self.n) % self.num_processes) // self.num_processes

    @property
    def local(self) -> slice:
        return slice(self.process_index * self.per_process, (self.process_index + 1) * self.per_process)

    @property
    def positions(self) -> torch.Tensor:
        """[per_process] this process's positions among the padded items (>= n: a padding copy)."""
        return torch.arange(self.local.start, self.local.stop)

    def take(self, items: list) -> list:
        """This process's share of `items`, padded first with copies of the last item."""
        return (items + items[-1:] * ((-self.n) % self.num_processes))[self.local]


def gather_real(accelerator, local: torch.Tensor, n: int) -> torch.Tensor:
    """Every process's `local` rows, concatenated in process order (= item order), without the
    padding at the end; on the CPU."""
    return accelerator.gather(local.to(accelerator.device)).cpu()[:n]


def whole_group_owners(sizes: dict[int, int], num_processes: int) -> dict[int, int]:
    """Each group's process when groups must stay whole: the largest group first (ties: the lower
    id) onto the process holding the fewest samples so far (ties: the lower index), so the sample
    counts are as even as whole groups allow. The same on every process: they all see `sizes`."""
    load, owner = [0] * num_processes, {}
    for group in sorted(sizes, key=lambda g: (-sizes[g], g)):
        p = min(range(num_processes), key=lambda i: (load[i], i))
        owner[group], load[p] = p, load[p] + sizes[group]
    return owner
