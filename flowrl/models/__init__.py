"""Policy adapters over diffusers pipelines."""

from __future__ import annotations


from flowrl.models.base import FlowPolicy
from flowrl.schema import ModelConfig



def policy_class(kind: str) -> type[FlowPolicy]:
    if kind == "sd3":
        from flowrl.models.sd3 import SD3Policy

        return SD3Policy
    if kind == "flux":
        from flowrl.models.flux import FluxPolicy

        return FluxPolicy
    if kind == "flux2_klein":
        from flowrl.models.flux2 import Flux2KleinPolicy

        return Flux2KleinPolicy
    if kind == "qwen_image":
        from flowrl.models.qwen_image import QwenImagePolicy

        return QwenImagePolicy
    if kind == "z_image":
        from flowrl.models.z_image import ZImagePolicy

        return ZImagePolicy
    if kind == "sana":
        from flowrl.models.sana import SanaPolicy

        return SanaPolicy
    raise ValueError(f"model.kind must be sd3, flux, flux2_klein, qwen_image, z_image or sana, got {kind!r}")


def load_policy(cfg: ModelConfig, device=None) -> FlowPolicy:
    return policy_class(cfg.kind).from_config(cfg, device)


__all__ = ["FlowPolicy", "load_policy", "policy_class"]
