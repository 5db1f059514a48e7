#!/usr/bin/env python3
"""What the transport of asynchronous rollouts costs per iteration: a producer on another machine
(run.producer_port: a Gloo process group over TCP, here over localhost) against one on this
machine (shared memory for the weights, a spool file for the batch), measured side by side.

    python scripts/bench_remote.py                                  # the default preset and SD3.5-Medium's
    python scripts/bench_remote.py --presets default --rounds 20
    python scripts/bench_remote.py --smoke                          # the code path: the default preset, 2 rounds

For each preset the producer samples nothing: a stand-in collector holds the preset's trainable
LoRA tensors (shapes from its transformer's config on the meta device, rank and targets from the
preset, fp32 as flowrl trains them) and hands out a batch of its size at once (every chain's
latents at every step, fp32, as a flat rollout stores them). With max_staleness 0 each iteration
is then the transport alone: the weights of an update to the producer, a batch back to the
trainer, pickling included. The table gives the median seconds per iteration of each transport
and their ratio. Over a real network add the bytes over its bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


class StandIn:
    """A collector that samples nothing: the weights' shapes, and one batch of the preset's size."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], batch_shape: tuple[int, ...]):
        self.w = {k: torch.zeros(s) for k, s in shapes.items()}
        self.batch = torch.randn(batch_shape)

    def weights(self):
        return self.w

    def collect(self, iteration: int):
        return {"iteration": iteration, "latents": self.batch}

    def state(self):
        return {}


def stand_in(shapes, batch_shape) -> StandIn:
    return StandIn(shapes, batch_shape)


def workload(preset: str) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...]]:
    """The preset's LoRA tensor shapes (peft's names need not match: only sizes travel) and the
    shape of one iteration's latents [chains, steps + 1, channels, h, w]."""
    from flowrl.config import load_config
    from flowrl.models.base import resolve_model_path
    from flowrl.train.memory_plan import load_model, lora_shapes

    cfg = load_config(preset, validate_paths=False)
    model = load_model(resolve_model_path(cfg.model.path))  # builtin:shapes is a directory of the package
    shapes = lora_shapes(model.transformer, cfg.lora.rank, cfg.lora.target_modules)
    c = model.transformer.config
    chains = cfg.data.prompts_per_iteration * cfg.data.group_size
    batch = (chains, cfg.sampling.num_steps + 1, c.in_channels, cfg.model.height // 8, cfg.model.width // 8)
    return shapes, batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remote_child(address: str) -> None:
    from flowrl.runtime.remote_producers import produce_remote

    produce_remote(address, 1.0, threads=1)


def time_rounds(producer, weights: dict[str, torch.Tensor], rounds: int) -> list[float]:
    """Seconds of each iteration: take batch i, publish version i + 1 (the first, a warm-up, dropped)."""
    times = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        batch = producer.take(i)
        assert batch.experience["iteration"] == i
        producer.publish(weights, i + 1)
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure(preset: str, rounds: int) -> dict:
    from flowrl.runtime.producers import RolloutProducer
    from flowrl.runtime.remote_producers import RemoteProducer

    shapes, batch_shape = workload(preset)
    weights = {k: torch.randn(s) for k, s in shapes.items()}
    build = functools.partial(stand_in, shapes, batch_shape)
    local = RolloutProducer(build, weights, 0, 0, threads=1)
    try:
        local_s = time_rounds(local, weights, rounds)
    finally:
        local.close()
    port = free_port()
    child = multiprocessing.get_context("fork").Process(target=remote_child, args=(f"127.0.0.1:{port}",), daemon=True)
    child.start()
    remote = RemoteProducer(port, build, weights, 0, 0, wait_minutes=1.0)
    try:
        remote_s = time_rounds(remote, weights, rounds)
    finally:
        remote.close()
        child.join(timeout=30)
    mb = lambda n: n * 4 / 2**20  # noqa: E731
    return {"preset": preset, "weight_tensors": len(shapes), "weights_mb": mb(sum(torch.Size(s).numel() for s in shapes.values())),
            "batch_mb": mb(torch.Size(batch_shape).numel()), "local_s": statistics.median(local_s),
            "remote_s": statistics.median(remote_s), "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["default", "sd35_medium_pickscore_1gpu"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="the code path in seconds: the default preset's transport, 2 rounds")
    args = p.parse_args(argv)
    if args.smoke:
        args.presets, args.rounds = ["default"], 2
    from flowrl.quiet import silence_known_messages

    silence_known_messages()
    torch.set_num_threads(1)
    rows = [measure(preset, args.rounds) for preset in args.presets]
    print(f"{'preset':<28} {'tensors':>7} {'weights MB':>10} {'batch MB':>9} {'local s/it':>10} {'remote s/it':>11} {'remote/local':>12}")
    for r in rows:
        print(f"{r['preset']:<28} {r['weight_tensors']:>7} {r['weights_mb']:>10.1f} {r['batch_mb']:>9.1f} {r['local_s']:>10.3f} "
              f"{r['remote_s']:>11.3f} {r['remote_s'] / r['local_s']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
