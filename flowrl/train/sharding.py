"""How the trained network is laid out over processes (`run.distributed`, docs/distributed.md), and
the image trainer's launch (`launch_image_run`: its Accelerator, run directory and layout).

`ddp`: every process holds the whole network; accelerate's `prepare` wraps it (DDP across
processes, autocast for trainer.mixed_precision) and gradients are all-reduced.

`fsdp2`: torch's `fully_shard` (FSDP2) splits every weight, its gradient, its optimizer moments
and its EMA over the processes. One shard unit per transformer block (the classes the diffusers
model lists in `_no_split_modules`) plus the root, so a forward all-gathers one block at a time.
accelerate still provides the process group, gathers, trackers and the optimizer wrapper; its
own FSDP plugin is not used because it refuses CPU processes, which the tests run on.

Under fsdp2 every forward is a collective. Training forwards already run in equal numbers on
every process (the objectives pad their micro-batches for DDP); the no-grad forwards of
rollouts and sample grids run inside `gathered()`, where the network's weights are all-gathered
once and stay whole, so processes may make different numbers of them (rank 0 alone draws the
grids). Checkpoints of sharded tensors are written by each process for its own shard with torch
distributed checkpoint in safetensors files, and load onto any number of processes.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch

from flowrl.errors import UserError
from flowrl.runtime.checkpoint import is_sharded, optimizer_from_flat, optimizer_to_flat
from flowrl.runtime.processes import plain_accelerator, start_processes
from flowrl.runtime.run_dir import RunDir

DISTRIBUTED = ("ddp", "fsdp2")


def reference_copy(transformer: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the network as loaded (model.dtype): the reference policy of full
    fine-tuning, made only when a KL term needs one."""
    ref = copy.deepcopy(transformer)
    ref.requires_grad_(False)
    return ref.eval()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


def first_non_finite(groups: dict[str, dict[str, torch.Tensor] | None]) -> str | None:
    """'GROUP tensor NAME' of this process's first tensor (its own shard) holding NaN or inf."""
    for key, tensors in groups.items():
        for n, t in (tensors or {}).items():
            t = local(t)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{key} tensor '{n}'"
    return None


class Replicated:
    """run.distributed ddp (and any single process)."""

    name = "ddp"
    sharded = False

    def __init__(self, accelerator, mixed_precision: str):
        self.accelerator = accelerator

    def shard(self, policy) -> None:
        """Nothing to split: every process keeps the whole network."""

    def prepare(self, policy, optimizer):
        policy.net, optimizer = self.accelerator.prepare(policy.transformer, optimizer)
        return optimizer

    def close(self) -> None:
        """Nothing was started here that outlives the run."""

    @contextlib.contextmanager
    def gathered(self):
        yield

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        return float(self.accelerator.clip_grad_norm_(params, max_norm))

    def non_finite(self, groups: dict[str, dict[str, torch.Tensor] | None]) -> str | None:
        return first_non_finite(groups)

    def full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies on the CPU: `.cpu()` of a CPU tensor is the tensor itself, and a caller may change the
        weights before it writes these (the EMA export swaps its weights in, then back)."""
        return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}


class Sharded(Replicated):
    """run.distributed fsdp2."""

    name = "fsdp2"
    sharded = True

    def __init__(self, accelerator, mixed_precision: str):
        import torch.distributed as dist

        super().__init__(accelerator, mixed_precision)
        self.own_group = not dist.is_initialized()
        if self.own_group:  # one process: FSDP2 still needs a process group (of one)
            backend = "gloo" if accelerator.device.type == "cpu" else "nccl"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self.param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
        self.units: list[torch.nn.Module] = []  # the trained network's shard units, root last

    def close(self) -> None:
        """End the group of one made above, so that a later run in this Python process (flowrl.api) starts clean;
        a launcher's group is the launcher's."""
        import torch.distributed as dist

        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()
        self.own_group = False

    def _fully_shard(self, net: torch.nn.Module) -> list[torch.nn.Module]:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # weights all-gathered (and computed) in the mixed precision, gradients reduced in fp32
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        blocks = set(getattr(net, "_no_split_modules", None) or ())
        if not blocks:
            raise UserError(f"run.distributed fsdp2 shards per transformer block, but {type(net).__name__} names no block "
                            "classes (_no_split_modules); use run.distributed=ddp")
        units = [m for m in net.modules() if type(m).__name__ in blocks]
        for m in units:
            fully_shard(m, mp_policy=mp)
        fully_shard(net, mp_policy=mp)
        return [*units, net]

    def shard(self, policy) -> None:
        self.units = self._fully_shard(policy.transformer)
        if policy._reference_net is not None:  # sharded alike; its forwards run inside the objectives, on every process
            self._fully_shard(policy._reference_net)

    def prepare(self, policy, optimizer):
        policy.net = policy.transformer
        return self.accelerator.prepare(optimizer)

    @contextlib.contextmanager
    def gathered(self):
        """The trained network's weights whole on every process (collective on entry and exit):
        forwards inside need no collectives. The reference copy stays sharded."""
        for m in self.units:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in self.units:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        """The global norm over every shard (the same on every process), then clip."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if is_sharded(norm):
            norm = norm.full_tensor()
        if math.isfinite(float(norm)):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    def non_finite(self, groups: dict[str, dict[str, torch.Tensor] | None]) -> str | None:
        """The first non-finite tensor of any process, the same answer on every process."""
        from accelerate.utils import gather_object

        found = [f for f in gather_object([first_non_finite(groups)]) if f]
        return found[0] if found else None

    def full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors on rank 0's CPU, one at a time (collective: every process calls it; the
        others get an empty dict, so no process but rank 0 ever holds the whole network)."""
        main, out = self.accelerator.is_main_process, {}
        for n, t in tensors.items():
            whole = t.full_tensor() if is_sharded(t) else t
            if main:
                out[n] = whole.detach().to("cpu", copy=True)  # a copy, as Replicated.full's
        return out

    def optimizer_state(self, net: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """The optimizer's state keyed by weight name (sharded moments) and its JSON part."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return optimizer_to_flat(get_optimizer_state_dict(net, getattr(optimizer, "optimizer", optimizer)))

    def load_optimizer_state(self, net: torch.nn.Module, optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(net, getattr(optimizer, "optimizer", optimizer), optimizer_from_flat(tensors, meta))

    # ---- checkpoints ----------------------------------------------------------------
    @staticmethod
    def save(directory: Path, groups: dict[str, dict[str, torch.Tensor]]) -> None:
        """Every process writes its shards of `groups` ({group: {name: tensor}}) under directory
        (collective), in safetensors files with the shard offsets in their headers."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        flat = {f"{g}/{n}": t.detach() for g, tensors in groups.items() for n, t in tensors.items()}
        dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))

    @staticmethod
    def load(directory: Path, groups: dict[str, dict[str, torch.Tensor]], checkpoint: str) -> None:
        """Fill `groups` in place from a directory `save` wrote (collective); the tensors given are
        the templates, sharded as this run shards them, whatever the processes that wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        flat = {f"{g}/{n}": t for g, tensors in groups.items() for n, t in tensors.items()}
        try:
            dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(directory)))
        except Exception as exc:  # missing keys, other shapes, unreadable files
            detail = str(exc).strip().splitlines()
            raise UserError(f"--resume: the sharded state of checkpoint '{checkpoint}' does not load into this run "
                            f"({type(exc).__name__}: {detail[0] if detail else 'no detail'})") from None


def make_layout(name: str, accelerator, mixed_precision: str) -> Replicated:
    return {"ddp": Replicated, "fsdp2": Sharded}[name](accelerator, mixed_precision)


class ImageLaunch(NamedTuple):
    """What the image trainer starts with: accelerate's Accelerator, the run directory (rank 0's),
    the autocast precision accelerate was given, and the layout of the weights (ddp or fsdp2)."""

    accelerator: Any
    run: RunDir
    mixed_precision: str
    layout: Replicated


def launch_image_run(cfg, run_dir: str | Path) -> ImageLaunch:
    """Start the processes and build the image trainer's Accelerator and weight layout for `cfg`."""
    from flowrl.sampling.precision import autocast_precision

    cpu, run_dir = start_processes(cfg.model.device, run_dir)
    run = RunDir(run_dir)
    mixed_precision = autocast_precision(cfg.trainer.mixed_precision, cpu)
    sharded = cfg.run.distributed == "fsdp2"  # mixed precision is then FSDP2's own policy, not accelerate's autocast
    acc = plain_accelerator(cpu, "flowrl shards the network itself (run.distributed=fsdp2)",
                            mixed_precision="no" if sharded else mixed_precision,
                            log_with=None if cfg.run.tracker == "none" else cfg.run.tracker, project_dir=str(run.path))
    return ImageLaunch(acc, run, mixed_precision, make_layout(cfg.run.distributed, acc, mixed_precision))
