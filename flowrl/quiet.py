"""Silence third-party messages known to be harmless here, so that a user's error is the one line
they see. Each filter drops one known message by its text, from the one logger that logs it;
anything else those libraries say still comes through."""

from __future__ import annotations

import logging
import warnings

# logger name -> fragments of the messages it logs that say nothing about the user's run
KNOWN_MESSAGES = {
    # torchao's CUDA kernels do not load on a machine without CUDA; flowrl loads torchao's FP8 path only on a GPU
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),  # torchao 0.18 on torch 2.13
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    # CLIP's image processor falls back to its PIL version without torchvision: the same images, fine for rewards
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back to",),
    # bitsandbytes (the memory extra) on a CPU without the optional `kernels` package: its slower 4-bit path still works
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # saving a pipeline whose model has no VAE or T5 (the shapes model): those components are saved as null, as intended
    "diffusers.pipelines.pipeline_utils": ("of type <class 'NoneType'> cannot be saved",),
    # load_lora_weights of a flowrl adapter (flowrl check): flowrl trains the transformer's LoRA, never a text encoder's
    "diffusers.loaders.lora_base": ("No LoRA keys associated to",),
}
KNOWN_WARNINGS = (
    # flowrl needs broadcast_buffers=False's behaviour (no buffer sync at init either); see flowrl/train/loop.py
    (FutureWarning, r"`broadcast_buffers` is deprecated"),
)


class _DropKnown(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def silence_known_messages() -> None:
    for name, fragments in KNOWN_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(fragments))
    for category, pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
