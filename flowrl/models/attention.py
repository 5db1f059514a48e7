"""model.attention_backend: the kernel the transformer's attention runs, chosen through diffusers'
attention dispatcher (`ModelMixin.set_attention_backend`, diffusers >= 0.35).

It is set once, when the policy loads, so rollouts and training forwards (behaviour and trained
log-probs) run the same kernel. Unset (null) leaves diffusers' default: torch's
scaled_dot_product_attention, or the backend the DIFFUSERS_ATTN_BACKEND variable names. The
backends' packages (flash-attn, xformers, sageattention, kernels for the *_hub ones) are GPU-only
and never required: diffusers imports one only when it is chosen.
"""

from __future__ import annotations

import re

import torch

from flowrl.errors import ConfigError, UserError, check_choice

# the backends that run without CUDA (torch's own kernels); every other one needs a CUDA GPU
CPU_BACKENDS = ("native", "_native_math", "flex")


def backend_names() -> tuple[str, ...]:
    """The names diffusers' dispatcher knows (AttentionBackendName); () before diffusers 0.35."""
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName
    except ImportError:
        return ()
    return tuple(b.value for b in AttentionBackendName)


def check_backend_name(name: str | None) -> None:
    """Config time: an unset backend, or one the installed diffusers names."""
    if name is None:
        return
    names = backend_names()
    if not names:
        raise ConfigError(f"model.attention_backend {name} needs diffusers >= 0.35 (its attention dispatcher); upgrade "
                          "diffusers or leave model.attention_backend unset")
    check_choice("model.attention_backend", name, names)


def set_attention_backend(transformer: torch.nn.Module, name: str, device: torch.device) -> None:
    """Route every attention of `transformer` through backend `name`, or refuse in one sentence: a CUDA
    backend on a CPU, a transformer that ignores the dispatcher, a backend whose package is missing."""
    check_backend_name(name)
    if name not in CPU_BACKENDS and device.type != "cuda":
        raise UserError(f"model.attention_backend {name} runs on CUDA GPUs only and this run's device is {device}; on a CPU "
                        f"choose {', '.join(CPU_BACKENDS)} or leave it unset")
    cls = type(transformer).__name__
    if not hasattr(transformer, "set_attention_backend"):
        raise UserError(f"model.attention_backend: {cls} has no set_attention_backend (diffusers >= 0.35); leave it unset")
    processors = attention_processors(transformer)
    if not any(hasattr(p, "_attention_backend") for p in processors):
        # diffusers would set nothing and say nothing: the model's processors call torch's SDPA themselves
        names = ", ".join(sorted({type(p).__name__ for p in processors}))
        raise UserError(f"model.attention_backend {name} would not take effect: {cls}'s attention processors ({names}) call "
                        "torch's scaled_dot_product_attention directly, not diffusers' dispatcher; leave model.attention_backend "
                        "unset for this model")
    try:
        transformer.set_attention_backend(name)
    except (RuntimeError, ValueError) as exc:  # its package missing or too old (diffusers checks, and names it)
        raise UserError(f"model.attention_backend {name} needs a package that is missing here or too old "
                        f"({install_hint(str(exc))}); install it or leave model.attention_backend unset") from None


def attention_processors(transformer: torch.nn.Module) -> list:
    """The processors of the attention modules set_attention_backend walks."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m.processor for m in transformer.modules() if isinstance(m, (Attention, AttentionModuleMixin))
            and getattr(m, "processor", None) is not None]


def install_hint(message: str) -> str:
    """diffusers' requirement error as what to install: `pip install 'flash-attn>=2.6.3'`, else its first sentence."""
    found = re.search(r"`pip install (?:-U )?([^`]+)`", message) or re.search(r"install `([^`]+)`", message)
    return f"pip install '{found[1]}'" if found else message.split(". ")[0]
