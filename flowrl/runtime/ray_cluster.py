"""The Ray cluster a run's workers live on (`run.cluster: ray`, docs/distributed.md).

The trainer is Ray's driver. With `run.ray.address` empty it starts a cluster of its own on this
machine, every process of it bound to 127.0.0.1 (a laptop, a test, one GPU box); with an address
(`auto`, or HOST:PORT of a head started by `ray start --head`) it joins that cluster, whose nodes
were started with `ray start` on each machine. Workers are placed on a placement group: one
bundle per worker, each with the resources `run.ray.worker_resources` names (CPU, GPU, or a
custom resource a node was started with, which pins the workers to that node).

Ray is an extra (`pip install 'flowrl[ray]'`): imported here, lazily, and nowhere else.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import ClassVar

from flowrl.errors import ConfigError, UserError

LOOPBACK = "127.0.0.1"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement strategies
REWARD_PLACEMENTS = ("inline", "ray")  # reward.placement
NAMESPACE = "flowrl"  # the Ray namespace of flowrl's named actors (a run's weights board, its reward workers)


@dataclass
class RayOptions:
    # "": a cluster of the trainer's own on this machine, bound to 127.0.0.1; auto or HOST:PORT: join the cluster a
    # `ray start --head` began (the other nodes joined it with `ray start --address HOST:PORT`)
    address: str = ""
    rollout_workers: int = 1  # Ray actors sampling batches in turn (batch i by worker i mod N), as run.producers do locally
    # each rollout worker's bundle, in Ray's resource names: CPU, GPU, or a custom resource a node was started with
    # (`ray start --resources '{"rollout_node": 4}'`), which places the workers on that node
    worker_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    placement: str = "PACK"  # how the bundles spread over nodes: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (Ray's strategies)
    # a worker killed (or its node lost) is restarted by Ray this many times, and its batch redone from its seed
    max_restarts: int = 3
    cpus: int = 0  # the CPUs of a cluster the trainer starts itself (address ""); 0: Ray's count of this machine's

    RANGES: ClassVar[dict] = {"rollout_workers": ">= 1", "max_restarts": ">= 0", "cpus": (">= 0", "0: Ray's count of this machine's CPUs")}


@dataclass
class RewardRayOptions:
    workers: int = 1  # actors per reward model, scoring batches in turn
    # each reward worker's resources, in Ray's names: CPU, GPU, or a custom resource of the nodes that should hold them
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    max_restarts: int = 3  # a killed reward worker is restarted this many times and its batch scored again

    RANGES: ClassVar[dict] = {"workers": ">= 1", "max_restarts": ">= 0"}


def loopback_only() -> None:
    """Keep a cluster of this machine on 127.0.0.1. Ray turns a loopback address (its own default,
    `_node_ip_address`, a bootstrap address) into the machine's network address, so that other
    machines could join; off Linux (macOS, Windows) it keeps loopback, and its switch for that,
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, does the same here: set in this process's environment, which
    the cluster's processes inherit, and in Ray's constants where Ray is imported already."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address answers a TCP connection (ConnectionError if not), so that a cluster that
    is not there is named at once instead of after Ray's minutes of retries; `auto` is Ray's to find."""
    host, _, port = address.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
        pass


def check_resources(key: str, resources: dict) -> None:
    """A worker's Ray resources: names with non-negative amounts, at least one above 0."""
    resources = dict(resources)
    if not resources or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in resources.values()) \
            or not any(resources.values()):
        raise ConfigError(f"{key} must name each worker's Ray resources with non-negative amounts, at least one above 0, "
                          f"such as {{CPU: 1}} or {{GPU: 1, CPU: 4}}; got {resources}")


def ray_module():
    try:
        import ray
    except ImportError:
        raise UserError("run.cluster ray needs Ray: pip install 'flowrl[ray]'") from None
    return ray


def connect(options: RayOptions) -> bool:
    """Ray initialised for this process: joined to `options.address`, or a local cluster of its own
    on 127.0.0.1. True when this call started it (so the run shuts it down at its end); a process
    where Ray is already initialised (a notebook, the test suite) keeps its cluster."""
    if not options.address:
        loopback_only()
    ray = ray_module()
    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, configure_logging=True, logging_level="ERROR", log_to_driver=True)
    try:
        if options.address:
            reachable(options.address)
            ray.init(address=options.address, **kwargs)
        else:
            # a new cluster ("local": not one that runs already), every process of it on loopback, where Ray's default
            # picks the machine's network address
            ray.init(address="local", _node_ip_address=LOOPBACK, num_cpus=options.cpus or os.cpu_count(), **kwargs)
    except Exception as exc:
        where = f"the Ray cluster at run.ray.address '{options.address}'" if options.address else "a local Ray cluster"
        raise UserError(f"could not connect to {where} ({type(exc).__name__}: {first_line(exc)}); start it with "
                        "`ray start --head` (and `ray start --address HEAD:PORT` on the other nodes), or leave run.ray.address "
                        "empty for a cluster on this machine") from None
    return True


def leave_cluster() -> None:
    """Shut down the cluster this process started (its workers with it)."""
    ray = ray_module()
    if ray.is_initialized():
        ray.shutdown()


def placement_group(options: RayOptions, timeout_s: float = 60.0):
    """One bundle per rollout worker, ready; one sentence when the cluster cannot hold them."""
    ray = ray_module()
    from ray.util.placement_group import placement_group as make

    bundles = [dict(options.worker_resources) for _ in range(options.rollout_workers)]
    group = make(bundles, strategy=options.placement)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        have = {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:") and "memory" not in k}
        raise UserError(f"the Ray cluster cannot place {options.rollout_workers} rollout worker(s) of {options.worker_resources} "
                        f"(run.ray.worker_resources, placement {options.placement}) within {timeout_s:g} s; it has {have}")
    return group


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def node_addresses() -> list[str]:
    """The address each live node of the cluster reports (the suite checks they are all loopback)."""
    return sorted(n["NodeManagerAddress"] for n in ray_module().nodes() if n["Alive"])
