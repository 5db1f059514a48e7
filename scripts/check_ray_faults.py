#!/usr/bin/env python3
"""Faults on Ray, checked: runs whose rollout workers and reward workers are killed (SIGKILL, as an
out-of-memory kill) at random moments must end with the undisturbed run's weights: the synchronous
run's, with the reward inline.

    python scripts/check_ray_faults.py --runs 10       # 10 disturbed runs against one undisturbed run
    python scripts/check_ray_faults.py --smoke         # the code path: one disturbed run

Every disturbed run is tiny_jpeg on a cluster this script starts on 127.0.0.1, at
run.max_staleness 0, two rollout workers taking turns and the reward in two reward workers
(reward.placement ray). In each a thread waits, from the moment the rollout workers are up, a
random time, then kills a random rollout or reward worker, and again until --kills are done; Ray
restarts the worker and its batch is sampled or scored again. A run passes when it finishes, every
column of the synchronous run (tiny_jpeg with no Ray) but the clock's is equal and its trained
weights are bit for bit the same. The table gives each run's kills (what, when) and its verdict; exit 1 if any run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARGS = ["tiny_jpeg", "sampling.num_steps=4", "data.prompts_per_iteration=2", "data.group_size=4", "sampling.batch_size=2",
        "lora.rank=4", "lora.alpha=8", "run.tracker=none", "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0",
        "trainer.threads=1"]
ON_RAY = ["run.cluster=ray", "run.max_staleness=0", "run.ray.rollout_workers=2", "reward.placement=ray", "reward.ray.workers=2"]


class Killer:
    """Kills random workers of the running producer and its reward at random moments."""

    def __init__(self, rng: random.Random, kills: int, window_s: float):
        self.rng, self.kills, self.window_s = rng, kills, window_s
        self.up = time.perf_counter()  # when the rollout workers were up
        self.producers: list = []  # the RayProducer of the run, recorded as it starts
        self.done = threading.Event()
        self.log: list[str] = []
        self.t0 = time.perf_counter()

    def targets(self) -> list[tuple[str, object]]:
        import ray

        rollout = [w["pid"] for p in self.producers for w in getattr(p, "started", [])]
        rewards = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("reward-")]
        return [("rollout", pid) for pid in rollout] + [("reward", name) for name in rewards]

    def run(self) -> None:
        import ray

        while not self.producers:  # the clock starts when the rollout workers have (the reward workers are up before)
            if self.done.wait(0.05):
                return
        self.t0 = self.up = time.perf_counter()
        for _ in range(self.kills):
            if self.done.wait(self.rng.uniform(0.05, 0.5 * self.window_s)):  # in the first half: its batches still to come
                return
            kind, target = self.rng.choice(self.targets())
            try:
                pid = target if kind == "rollout" else ray.get(ray.get_actor(target, namespace="flowrl").pid.remote(), timeout=30)
                os.kill(pid, signal.SIGKILL)
                self.log.append(f"{kind} worker at {time.perf_counter() - self.t0:.1f} s")
            except Exception as exc:  # already restarting, or the run ended
                self.log.append(f"{kind} worker missed ({type(exc).__name__})")


def train(run_dir: Path, killer: Killer | None, iterations: int, ray: bool = True) -> list[dict]:
    from flowrl.cli import main
    from flowrl.runtime.ray_rollouts import RayProducer

    init = RayProducer.__init__

    def recorded(self, *a, **k):
        init(self, *a, **k)
        if killer is not None:
            killer.producers.append(self)

    RayProducer.__init__ = recorded
    thread = threading.Thread(target=killer.run, daemon=True) if killer else None
    try:
        if thread:
            thread.start()
        code = main(["train", *ARGS, *(ON_RAY if ray else []), f"trainer.iterations={iterations}", "--run-dir", str(run_dir)])
    finally:
        RayProducer.__init__ = init
        if killer:
            killer.done.set()
            thread.join()
    if code != 0:
        raise RuntimeError(f"flowrl train exited {code}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same(rows: list[dict], reference: list[dict], run_dir: Path, reference_dir: Path, iterations: int) -> bool:
    from safetensors.torch import load_file

    # every column of the synchronous run but the clock's (the asynchronous run adds its own: staleness, weights by version)
    if [{k: r[k] for k in s if not k.startswith("time")} for s, r in zip(reference, rows)] != \
            [{k: v for k, v in s.items() if not k.startswith("time")} for s in reference] or len(rows) != len(reference):
        return False
    name = f"checkpoints/iter_{iterations:06d}/trainable.safetensors"
    a, b = load_file(run_dir / name), load_file(reference_dir / name)
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--kills", type=int, default=2, help="kills per run, each after a random wait")
    p.add_argument("--window", type=float, default=0.0, help="twice the longest wait before a kill, in seconds (0: the "
                   "synchronous run's training loop time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="one disturbed run of 5 iterations, one kill")
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.iterations, args.kills = 1, 5, 1
    from flowrl.runtime.ray_cluster import RayOptions, connect, leave_cluster

    started = connect(RayOptions(cpus=4))  # 4 logical CPUs: 2 rollout and 2 reward workers on a 2-core box
    rng, failures = random.Random(args.seed), 0
    try:
        with tempfile.TemporaryDirectory(prefix="ray-faults-") as tmp:
            reference_dir = Path(tmp) / "synchronous"
            reference = train(reference_dir, None, args.iterations, ray=False)
            window = args.window or sum(r["time_iteration"] for r in reference)  # its loop's time, about a Ray run's
            print(f"check_ray_faults: {args.runs} runs of {args.iterations} iterations, up to {args.kills} kills each, at "
                  f"random moments of the first half of the {window:.1f} s the synchronous run trains for")
            print("run  verdict  kills")
            for i in range(args.runs):
                killer = Killer(rng, args.kills, window)
                run_dir = Path(tmp) / f"run{i}"
                try:
                    ok = same(train(run_dir, killer, args.iterations), reference, run_dir, reference_dir, args.iterations)
                except RuntimeError as exc:
                    ok, killer.log = False, [*killer.log, str(exc)]
                failures += not ok
                print(f"{i:3d}  {'same' if ok else 'DIFFERENT':8s} {'; '.join(killer.log) or 'none (the run ended first)'}")
    finally:
        if started:
            leave_cluster()
    print(f"{args.runs - failures} of {args.runs} disturbed runs ended with the synchronous run's metrics and weights")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
