"""The trainers' optimizer (trainer.optimizer), built here for the image and the text trainer alike.

`adamw` is torch's AdamW. `adamw8bit` and `paged_adamw8bit` are bitsandbytes' AdamW8bit and
PagedAdamW8bit with the same learning rate, betas, eps and weight decay (what flow_grpo's
`use_8bit_adam` builds): the two moments of every tensor of at least MIN_8BIT_SIZE elements are
kept in 8 bits, quantised block-wise (BLOCK_SIZE values per fp32 absmax); smaller tensors keep fp32
moments. bitsandbytes is imported only when asked for (the `memory` extra)."""

from __future__ import annotations

from flowrl.errors import ConfigError, check_choice

OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")
BITSANDBYTES_CLASSES = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit"}
# bitsandbytes' Optimizer2State: tensors under min_8bit_size (its default, which flow_grpo keeps) keep fp32
# moments; the 8-bit ones hold one fp32 absmax per moment per block of 256 values
MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256


def check_optimizer(name: str, distributed: str = "ddp") -> None:
    """trainer.optimizer is one of OPTIMIZERS and can train the run's layout (run.distributed)."""
    check_choice("trainer.optimizer", name, OPTIMIZERS)
    if name in BITSANDBYTES_CLASSES and distributed == "fsdp2":
        # bitsandbytes' update kernels take plain tensors; FSDP2's shards are DTensors, which its step refuses
        raise ConfigError(f"trainer.optimizer {name} cannot step run.distributed fsdp2's sharded weights (bitsandbytes "
                          "takes plain tensors); set trainer.optimizer: adamw or run.distributed: ddp")


def optimizer_class(name: str) -> type:
    """The optimizer class trainer.optimizer names; one sentence when bitsandbytes is missing."""
    check_choice("trainer.optimizer", name, OPTIMIZERS)
    if name == "adamw":
        import torch

        return torch.optim.AdamW
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(f"trainer.optimizer {name} needs bitsandbytes, which is not installed: "
                          "pip install 'flowrl[memory]', or set trainer.optimizer: adamw") from None
    return getattr(bitsandbytes.optim, BITSANDBYTES_CLASSES[name])


def build_optimizer(params, trainer):
    """trainer.optimizer over `params`, with trainer.lr, adam_beta1/2, adam_eps and weight_decay
    (`trainer`: the runtime's TrainerOptions, flowrl/runtime/options.py)."""
    cls = optimizer_class(trainer.optimizer)
    return cls(list(params), lr=trainer.lr, betas=(trainer.adam_beta1, trainer.adam_beta2), eps=trainer.adam_eps,
               weight_decay=trainer.weight_decay)


def optimizer_state_bytes(name: str, numels) -> int:
    """Bytes of the optimizer's two moments for trained tensors of these element counts (flowrl/train/memory_plan.py)."""
    check_choice("trainer.optimizer", name, OPTIMIZERS)
    if name == "adamw":
        return sum(8 * n for n in numels)
    # per 8-bit tensor: two uint8 moments and two fp32 absmax per block; bitsandbytes' two shared 256-entry
    # quantisation maps (2 KiB) are left out
    return sum(8 * n if n < MIN_8BIT_SIZE else 2 * n + 8 * -(-n // BLOCK_SIZE) for n in numels)
