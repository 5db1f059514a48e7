"""The `run` and `trainer` options the runtime reads, one definition for both trainers: the image
config (flowrl/schema.py) and the text config (flowrl/text/config.py) extend these two sections
with the few options only their trainer has. Each field's comment is its description in
`flowrl config show`; each section's RANGES declares its numeric ones' ranges (flowrl.errors.check_fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from flowrl.core.lr_schedule import LR_SCHEDULES
from flowrl.errors import ConfigError, check_choice
from flowrl.runtime.optimizers import check_optimizer
from flowrl.runtime.ray_cluster import STRATEGIES, RayOptions, check_resources


@dataclass
class TrainerOptions:
    # the iteration count, and the length every iteration-based schedule is written for
    iterations: int = 40
    # > 0: time the first budget_probe iterations, then plan the count (at most trainer.iterations, unless budget_fill)
    # that fits this many minutes from the trainer's start, again at every checkpoint from the speed measured so far,
    # with the schedules fitted onto it (flowrl/runtime/budget.py, plan.json)
    budget_minutes: float = 0.0
    budget_probe: int = 5
    # with trainer.budget_minutes: plan past trainer.iterations to fill the budget (a fast machine trains more instead of
    # ending early); every iteration-based schedule (lr decay, progressive window, ...) is stretched onto the plan by the
    # schedule clock, trainer.iterations staying the nominal length they are written for. A run without a budget, or
    # one that ends within its budget_probe iterations, makes no plan: it trains trainer.iterations
    budget_fill: bool = False
    max_minutes: float = 0.0  # > 0: also stop (with a checkpoint) after this much wall time
    # adamw (torch's) | adamw8bit | paged_adamw8bit (bitsandbytes', pip install 'flowrl[memory]'): the same AdamW with
    # both moments of every tensor of 4096+ values in 8 bits, a quarter of adamw's state; paged: evicted to CPU memory
    # under GPU memory pressure (CUDA only: on a CPU it is adamw8bit). The 8-bit ones train with run.distributed ddp only
    optimizer: str = "adamw"
    lr: float = 3e-4
    # constant, or decayed to 0 over the run's iterations (cosine or linear), set at each iteration's start;
    # resuming with more iterations stretches the rest of the curve, and a max_minutes stop cuts it short
    lr_schedule: str = "constant"
    warmup_iterations: int = 0  # the learning rate rises linearly to trainer.lr over this many iterations (times lr_schedule)
    weight_decay: float = 1e-4  # AdamW's
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    inner_epochs: int = 1
    # x the KL to the reference (the network with the adapter off, or a frozen copy): the objective's estimator
    # (grpo: the exact Gaussian KL per step; nft: the mean squared velocity gap; text: k3 per token)
    kl_beta: float = 0.04
    max_grad_norm: float = 1.0
    # an optimizer step whose gradient norm is NaN or inf is skipped (counted in skipped_steps); this many in a row stop the run
    max_skipped_steps: int = 3
    seed: int = 0
    # torch threads on the CPU (the trainer's, and with run.async_rollouts the producer's too); 0: torch's default, or with
    # run.async_rollouts half the cores each
    threads: int = 0

    # each numeric option's range, with why where it helps (checked by flowrl.errors.check_fields, as every section's)
    RANGES: ClassVar[dict] = {
        "iterations": ">= 1", "budget_minutes": ">= 0", "budget_probe": ">= 1", "max_minutes": ">= 0", "lr": "> 0",
        "warmup_iterations": ">= 0", "weight_decay": ">= 0", "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "adam_eps": "> 0",
        "inner_epochs": ">= 1", "kl_beta": ">= 0", "max_grad_norm": "> 0", "max_skipped_steps": ">= 1", "threads": ">= 0"}


@dataclass
class RunOptions:
    output_dir: str = "runs"
    name: Optional[str] = None  # default: a timestamp
    checkpoint_every: int = 10  # iterations between checkpoints (0: only at the end)
    progress: bool = True
    # a CPU run with N > 1 runs as N processes joined by gloo (forked on Linux) that split
    # each iteration's rollouts and the cores: for small models one process per core beats threads
    cpu_processes: int = 1
    # a producer process samples batches ahead of the trainer with the newest weights it has received
    # (docs/usage.md, "Asynchronous rollouts"; every image rollout but offline; several image trainer processes with
    # flat and two_stage)
    async_rollouts: bool = False
    max_staleness: int = 1  # with async_rollouts: no batch is trained more than this many updates after its weights (0: synchronous)
    # with async_rollouts: producers sampling in turn (batch i by producer i mod N; uniform allocator), processes on this
    # machine; N batches sample at once when max_staleness >= N - 1
    producers: int = 1
    producer_devices: list[str] = field(default_factory=list)  # one per producer on this machine (cpu, cuda:N); []: model.device
    # where the producers run: local (processes of this machine) | ray (Ray actors on a placement group, on this machine or
    # a cluster's nodes: run.ray; docs/distributed.md). ray implies async_rollouts, with max_staleness as set
    cluster: str = "local"
    ray: RayOptions = field(default_factory=RayOptions)

    RANGES: ClassVar[dict] = {"checkpoint_every": ">= 0", "cpu_processes": ">= 1", "producers": ">= 1",
                              "max_staleness": (">= 0", "0: every batch sampled with the newest weights")}

    def __post_init__(self):
        if self.cluster == "ray":  # the Ray workers are the producers of asynchronous rollouts
            self.async_rollouts = True


CLUSTERS = ("local", "ray")
# run.producer_port and `flowrl produce` were retired for Ray's workers
RETIRED_KEYS = {"run.producer_port": "run.ray.address", "run.producer_wait_minutes": "run.ray.address"}
# the retired keys' last defaults: a run directory's config.yaml written before they retired holds every key, these
# among them, and still loads (`flowrl eval --run`, --resume); only a value a user set is refused
RETIRED_DEFAULTS = {"run.producer_port": 0, "run.producer_wait_minutes": 10.0}


def validate_runtime(cfg) -> None:
    """The `run` and `trainer` options every trainer shares (a trainer's own are checked by its config)."""
    check_choice("trainer.lr_schedule", cfg.trainer.lr_schedule, LR_SCHEDULES)
    check_optimizer(cfg.trainer.optimizer)
    check_cluster(cfg.run)


def check_cluster(run) -> None:
    """run.cluster and run.ray: one sentence for the first that cannot work."""
    check_choice("run.cluster", run.cluster, CLUSTERS)
    if run.cluster != "ray":
        return
    check_choice("run.ray.placement", run.ray.placement, STRATEGIES)
    check_resources("run.ray.worker_resources", run.ray.worker_resources)
    if run.producers > 1 or run.producer_devices:
        raise ConfigError("run.cluster ray counts its workers with run.ray.rollout_workers and places them with "
                          "run.ray.worker_resources; leave run.producers at 1 and run.producer_devices empty")
