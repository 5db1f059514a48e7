"""torch.compile of the policy's transformer (`model.compile`).

none    eager, as loaded.
blocks  regional compilation: every transformer block is compiled in place (`module.compile()`
        on the modules whose class the diffusers model lists in `_repeated_blocks`, else in
        `_no_split_modules`), what diffusers recommends (`compile_repeated_blocks`). The blocks
        of one class share one compiled code object, so a model compiles about as fast as one block.
full    the whole transformer compiled in place (`transformer.compile()`).

Compiling in place keeps the module objects, so the LoRA adapter (peft), the state dict names,
accelerate's DDP wrapper and checkpoints see the same network as eager.

The batch dimension is dynamic, every other dimension static: each compiled forward runs on
between MIN_ROWS and `sampling.batch_size` rows (`FlowPolicy.velocity` pads a single row with a
copy of itself and splits a longer batch), and the graphs mark the rows of their batch-first
inputs dynamic from the first call (`torch._dynamo.maybe_mark_dynamic`). A tree's levels (1, 2,
4, ... nodes), a granular rollout's anchors and a short last batch then run on their own rows,
not padded to a full batch, through the graphs compiled in the first iteration: padding every
forward to the batch size cost trees their speed (BENCHMARKS.md, bench_tree), and a graph per
row count (static shapes) would recompile whenever a sliding SDE window reached a level of a new
size. A single row is padded because dynamo specialises sizes 0 and 1; the doubled batch of
classifier-free guidance is only more rows. Dynamo still specialises on what differs between the
calls of one run, and compiles each combination once: grad mode (rollouts vs training forwards),
inputs that do or do not require grad (the first block vs the later ones), the last block of SD3
(no context output), and peft's adapter-disabled flag (`FlowPolicy.reference()`: the reference
pass is its own graph, compiled the first time and reused after, not recompiled at every toggle).
That is about 8 to 16 graphs per block class, above dynamo's default `recompile_limit` of 8, past which it would fall
back to eager silently; `configure_dynamo` raises the limit to RECOMPILE_LIMIT.

Recompiles are detected by counting the graphs dynamo builds (`torch._dynamo.utils.counters
["stats"]["unique_graphs"]`, `compiled_graphs()`): the trainer reads the count after every
iteration, logs it as the metrics column `compiled_graphs`, and prints one warning line when an
iteration after the first compiled anything (TORCH_LOGS=recompiles then says why).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable

import torch

from flowrl.errors import UserError

COMPILE_MODES = ("none", "blocks", "full")  # model.compile
# Inductor settings that torchao's quantisation configs turn on for the whole process unless built with
# set_inductor_config=False: coordinate-descent tuning makes compiles 5-10x slower, even from a warm cache
SLOW_INDUCTOR_FLAGS = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions")
RECOMPILE_LIMIT = 64  # graphs per compiled code object (dynamo's default, 8, is too few for one run's variants)
MIN_ROWS = 2  # the fewest rows a compiled forward runs on: dynamo specialises a dimension of size 1


def configure_dynamo(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's per-code-object cache limit to at least `limit` (never lower it)."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    setattr(cfg, name, max(getattr(cfg, name), limit))
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * limit)


def slow_inductor_flags() -> list[str]:
    """The SLOW_INDUCTOR_FLAGS that are on in this process."""
    import torch._inductor.config as inductor

    return [f for f in SLOW_INDUCTOR_FLAGS if getattr(inductor, f, False)]


def cpu_compiler() -> str | None:
    """The C++ compiler Inductor would build CPU kernels with ($CXX, else g++, clang++ or c++), or None."""
    return next((name for name in (os.environ.get("CXX"), "g++", "clang++", "c++") if name and shutil.which(name)), None)


def block_modules(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a diffusers model: the classes it names in `_repeated_blocks`
    (diffusers' regional compilation), else in `_no_split_modules`; subclasses too (fsdp2's
    `fully_shard` swaps each block's class for an FSDP subclass)."""
    names = set(getattr(net, "_repeated_blocks", None) or getattr(net, "_no_split_modules", None) or ())
    return [m for m in net.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def compile_network(net: torch.nn.Module, mode: str) -> bool:
    """Compile `net` in place under `mode` (COMPILE_MODES); none leaves it eager. On a CPU without a
    C++ compiler (Inductor builds its CPU kernels with one) it warns in one line and stays eager,
    so the default preset still runs there. Returns whether it compiled."""
    if mode not in COMPILE_MODES:
        raise UserError(f"model.compile must be one of {', '.join(COMPILE_MODES)}; got '{mode}'")
    if mode == "none":
        return False
    on_cpu = next(net.parameters(), torch.empty(0)).device.type == "cpu"
    if on_cpu and cpu_compiler() is None:
        warnings.warn(f"model.compile {mode} needs a C++ compiler on the CPU (Inductor builds its kernels with one) and none was "
                      "found ($CXX, g++, clang++, c++): the transformer runs eager", stacklevel=2)
        return False
    configure_dynamo()
    if slow := slow_inductor_flags():
        warnings.warn(f"model.compile: Inductor's {' and '.join(slow)} {'is' if len(slow) == 1 else 'are'} on (torchao's quantisation "
                      "configs set it unless built with set_inductor_config=False), which makes compiling 5-10x slower", stacklevel=2)
    blocks = [net] if mode == "full" else block_modules(net)
    if not blocks:
        raise UserError(f"model.compile blocks compiles each transformer block, but {type(net).__name__} names no block "
                        "classes (_repeated_blocks or _no_split_modules); use model.compile=full")
    for module in blocks:
        compile_rows_dynamic(module)
    return True


def compile_rows_dynamic(module: torch.nn.Module) -> None:
    """`module.compile()` with the rows of its batch-first inputs dynamic and every other size
    static: one graph serves every batch of MIN_ROWS rows or more."""
    compiled = torch.compile(module._call_impl, dynamic=False)

    def call(*args, **kwargs):
        mark_rows_dynamic(args, kwargs)
        return compiled(*args, **kwargs)

    module._compiled_call_impl = call  # what nn.Module.compile sets: __call__ runs it, state dicts and hooks are unchanged


def mark_rows_dynamic(args: tuple, kwargs: dict) -> None:
    """Mark dimension 0 dynamic on the tensors (top-level arguments) whose first dimension is the
    batch's, the first tensor argument's (hidden states). `maybe_`: a tensor that is not batch-first
    but happens to share the size (rotary tables of as many tokens as rows) is specialised, not refused."""
    tensors = [v for v in (*args, *kwargs.values()) if torch.is_tensor(v) and v.dim() > 0]
    if not tensors or tensors[0].shape[0] < MIN_ROWS:
        return
    rows = tensors[0].shape[0]
    for t in tensors:
        if t.shape[0] == rows:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _pad_rows(value, start: int, stop: int, rows: int, n: int):
    """Rows [start, stop) of a batch-first tensor of n rows, padded to `rows` with copies of the
    last; anything else (a float sigma, a tensor not batch-first) passes through unchanged."""
    if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != n:
        return value
    part = value[start:stop]
    if stop - start < rows:
        part = torch.cat([part, part[-1:].expand(rows - (stop - start), *part.shape[1:])])
    return part


def padded_velocity(velocity: Callable, x: torch.Tensor, sigma, cond: dict[str, torch.Tensor], max_rows: int,
                    min_rows: int = MIN_ROWS) -> torch.Tensor:
    """velocity(x, sigma, cond) through forwards of `min_rows` to `max_rows` rows: x (with a
    per-row sigma and the conditioning) split into chunks of `max_rows`, a chunk shorter than
    `min_rows` padded with copies of its last row; the padding's outputs are dropped. Rows do not
    interact in the network, so every real row gets what an unpadded forward gives it (up to the
    kernels' rounding), and the dropped rows pass no gradient back."""
    n = x.shape[0]
    out = []
    for start in range(0, n, max_rows):
        stop = min(start + max_rows, n)
        rows = max(stop - start, min_rows)
        part_cond = {k: _pad_rows(v, start, stop, rows, n) for k, v in cond.items()}
        v = velocity(_pad_rows(x, start, stop, rows, n), _pad_rows(sigma, start, stop, rows, n), part_cond)
        out.append(v[: stop - start])
    return out[0] if len(out) == 1 else torch.cat(out)


class CompileWatch:
    """Counts the graphs dynamo compiles between calls of `after_iteration`. The first iteration of
    a process compiles (warm-up); any later one that compiles more prints one warning line through
    `say` (the trainer's tqdm.write), not dynamo's multi-line guard report."""

    def __init__(self) -> None:
        self.seen = compiled_graphs()
        self.iterations = 0

    def after_iteration(self, iteration: int, say: Callable[[str], None] | None = None) -> int:
        """Graphs compiled since the last call (the sample grid before the first iteration counts
        toward it); warns when this is not the process's first iteration."""
        now = compiled_graphs()
        new, self.seen = now - self.seen, now
        self.iterations += 1
        if new and self.iterations > 1 and say is not None:
            say(f"warning: model.compile recompiled at iteration {iteration} ({new} new graph{'s' if new > 1 else ''} after "
                "warm-up, each a slow step); run with TORCH_LOGS=recompiles to see which guard changed")
        return new
