"""Fixtures the reference-formula tests share (tests/train/test_reference_objectives.py, test_awm.py)."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import load_config
from flowrl.models import load_policy


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir):
    """The tiny SD3 with a trained-looking LoRA adapter, so the policy and the base network differ."""
    cfg = load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "lora.rank=4", "lora.alpha=8"])
    p = load_policy(cfg.model)
    p.add_lora(cfg.lora, seed=0)
    with torch.no_grad():
        for n, w in p.named_trainable_parameters().items():
            w.copy_(0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(len(n))))
    return p
