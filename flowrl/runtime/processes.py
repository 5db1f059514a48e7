"""Processes: `run.cpu_processes`' launcher (`flowrl train` run as that many processes joined
by gloo, forked from the command on Linux), and what every trainer does first when it may run as several processes
(accelerate's launcher, the relaunch, or one process alone): start the process group and agree on
rank 0's values, and build a plain Accelerator (`plain_accelerator`)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable


def start_processes(device: str, run_dir: str | Path) -> tuple[bool, Path]:
    """Start accelerate's process group (gloo between CPU processes) and return whether this is a
    CPU run and rank 0's run directory (a default directory carries a timestamp, which the
    processes would otherwise each draw for themselves)."""
    from accelerate import PartialState

    from flowrl.devices import pick_device

    cpu = pick_device(device).type == "cpu"  # refuses a device that is not there
    PartialState(cpu=cpu)
    return cpu, Path(rank0(run_dir if isinstance(run_dir, str) else str(run_dir)))


def rank0(value: Any) -> Any:
    """Rank 0's `value` on every process (a picklable object); the value itself when alone."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return value
    return broadcast_object_list([value])[0]


def plain_accelerator(cpu: bool, refusal: str, **kwargs):
    """accelerate's Accelerator for one process or plain data parallelism (DDP), with `kwargs`;
    a launch under accelerate's FSDP, DeepSpeed or Megatron config is refused, `refusal` saying why."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    from flowrl.errors import UserError

    # DDP would broadcast the transformer's buffers (constant position embeddings) in every
    # forward: a collective that hangs when only rank 0 samples (grids, evals)
    acc = Accelerator(cpu=cpu, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)], **kwargs)
    if acc.distributed_type.value in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):  # its prepare would wrap the network its own way
        raise UserError(f"{refusal}; launch with a plain multi-GPU accelerate config such as configs/accelerate/multi_gpu.yaml, "
                        f"not distributed_type {acc.distributed_type.value}")
    return acc


# ---- `run.cpu_processes`: flowrl train relaunches itself as that many processes -------------------------
LAUNCHED_ENV = "FLOWRL_LAUNCHED"  # set for the processes a relaunch starts, so they never relaunch again
LAUNCHER_PID_ENV = "FLOWRL_LAUNCHER_PID"  # the launcher's pid: its processes end when it does
EXIT_INTERRUPTED = 130


def interrupted_message(run_dir: Path) -> str:
    return (f"flowrl: interrupted; `flowrl train --resume {run_dir}` continues from its last checkpoint "
            "(or trains it again from the start if it has none yet)")


def launches_cpu_processes(cfg) -> bool:
    """Whether this `flowrl train` should start `run.cpu_processes` copies of itself: a CPU run,
    not itself one of the processes of a launcher."""
    import torch

    from flowrl.devices import pick_device

    inside = LAUNCHED_ENV in os.environ or "WORLD_SIZE" in os.environ
    return cfg.run.cpu_processes > 1 and not inside and pick_device(cfg.model.device) == torch.device("cpu")


def relaunch(processes: int, argv: list[str], run_dir: Path, main: Callable[[list[str]], int],
             warm_up: Callable[[], object] | None = None) -> int:
    """`main(argv)` (the CLI's) as `processes` processes joined by gloo (`run_cpu_processes`).
    Started here rather than by a launcher so that a user error keeps its one sentence and exit
    code 2.

    Where each process gets one core (a small machine, where start-up costs most), they are forked
    from this one after `warm_up()` has imported what they train with: torch, diffusers and
    transformers cost about 15 s of CPU to import on a 2-core machine, paid once here instead of
    once per process. Otherwise (several threads each, or not Linux) each is a fresh interpreter
    running `python -m flowrl.cli ARGV` (see ForkedProcess for why)."""
    threads = _threads_each(processes)
    forked = threads == 1 and ForkedProcess.possible()
    print(f"flowrl: launching {processes} CPU processes of {threads} thread(s) each (run.cpu_processes)", file=sys.stderr)
    if forked and warm_up is not None:
        warm_up()
    try:
        return run_cpu_processes(processes, (lambda: main(argv)) if forked else argv)
    except KeyboardInterrupt:  # the processes got the same Ctrl-C and stopped on their own
        print(interrupted_message(run_dir), file=sys.stderr)
        return EXIT_INTERRUPTED


def run_cpu_processes(processes: int, command: Callable[[], int] | list[str]) -> int:
    """Run `command` as `processes` CPU processes in torchrun's environment (accelerate reads it)
    and wait for them: a callable in children forked from this process (one thread each), or the
    arguments of `flowrl` in fresh interpreters (the cores split between them). When one fails,
    the others are stopped and its exit code is returned."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = 1 if callable(command) else _threads_each(processes)
    env = {LAUNCHED_ENV: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes), "OMP_NUM_THREADS": str(threads),
           "CUDA_VISIBLE_DEVICES": "", LAUNCHER_PID_ENV: str(os.getpid())}  # a CPU run
    start = ForkedProcess if callable(command) else _interpreter
    procs = [start(command, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(processes)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait()
                return failed[0] if failed else 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            p.wait()
        raise


def _threads_each(processes: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // processes)


def _interpreter(argv: list[str], env: dict[str, str]):
    """`python -m flowrl.cli ARGV` in a fresh interpreter with `env` added to this one's."""
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "flowrl.cli", *argv], env={**os.environ, **env})


class ForkedProcess:
    """`command()` in a child forked from this process, with `env` added to its environment;
    polled and stopped as a `subprocess.Popen` is. The child never returns into the parent's code:
    it ends with `os._exit` and the command's exit code.

    The child computes on one thread. GNU OpenMP's thread team does not survive a fork: once the
    parent has run a parallel region on several threads (a 20x20 matmul is enough), a child that
    starts one on several threads hangs (measured with torch 2.13 on Linux); on one thread torch
    never starts a region. A parent holding a process group cannot fork a new one."""

    @staticmethod
    def possible() -> bool:
        import torch.distributed as dist

        return sys.platform.startswith("linux") and not (dist.is_available() and dist.is_initialized())

    def __init__(self, command: Callable[[], int], env: dict[str, str]):
        if not self.possible():
            raise RuntimeError("processes are forked on Linux from a process without a torch.distributed process group")
        sys.stdout.flush()
        sys.stderr.flush()  # or the child would write the parent's buffered text a second time
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            os._exit(self._child(command, env))

    @staticmethod
    def _child(command: Callable[[], int], env: dict[str, str]) -> int:
        code = 1
        try:
            import torch

            os.environ.update(env)
            die_with_launcher()
            torch.set_num_threads(1)  # the environment's OMP_NUM_THREADS comes too late: torch is loaded
            _forget_accelerate_state()
            code = command() or 0  # None ends as sys.exit(None) does
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except BaseException:  # noqa: BLE001 - printed as a fresh interpreter would, then the exit code
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
        return code

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def terminate(self) -> None:
        import signal

        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)


def _forget_accelerate_state() -> None:
    """A process that trained alone before it forked (a test, a notebook) holds accelerate's
    one-process state; the child must read its own rank from the environment instead."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def die_with_launcher() -> None:
    """In a process a relaunch started: end when the launcher ends, however it ends (kill -9
    included), instead of training on alone. Linux's parent-death signal; elsewhere a no-op."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # the launcher died before the signal was armed
        os._exit(EXIT_INTERRUPTED)


def is_first_process() -> bool:
    return os.environ.get("RANK", "0") == "0"
