"""Policy adapters over diffusers pipelines."""

from __future__ import annotations

from importlib import import_module

from flowrl.models.base import FlowPolicy
from flowrl.schema import ModelConfig



# model.kind -> (module, adapter class), imported on first use: each family pulls in its own diffusers pipeline
POLICY_CLASSES = {
    "sd3": ("flowrl.models.sd3", "SD3Policy"),
    "flux": ("flowrl.models.flux", "FluxPolicy"),
    "flux2": ("flowrl.models.flux2", "Flux2Policy"),
    "flux2_klein": ("flowrl.models.flux2", "Flux2KleinPolicy"),
    "qwen_image": ("flowrl.models.qwen_image", "QwenImagePolicy"),
    "z_image": ("flowrl.models.z_image", "ZImagePolicy"),
    "sana": ("flowrl.models.sana", "SanaPolicy"),
    "wan": ("flowrl.models.wan", "WanPolicy"),
}
VIDEO_KINDS = ("wan",)  # families whose samples are videos [B, 3, F, H, W] (model.num_frames)


def policy_class(kind: str) -> type[FlowPolicy]:
    if kind not in POLICY_CLASSES:
        raise ValueError(f"model.kind must be one of {', '.join(POLICY_CLASSES)}, got {kind!r}")
    module, name = POLICY_CLASSES[kind]
    return getattr(import_module(module), name)


def load_policy(cfg: ModelConfig, device=None) -> FlowPolicy:
    return policy_class(cfg.kind).from_config(cfg, device)


__all__ = ["FlowPolicy", "VIDEO_KINDS", "load_policy", "policy_class"]
