"""model.attention_backend: diffusers' attention dispatcher set once at load; what cannot run is refused in one sentence."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError, UserError
from flowrl.models import load_policy
from flowrl.models.attention import attention_processors, set_attention_backend
from flowrl.schema import ModelConfig

PROMPTS = ["a red circle", "a cat"]


def _velocity(policy) -> torch.Tensor:
    x = torch.randn(2, *policy.latent_shape(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return policy.velocity(x, 0.6, policy.encode(PROMPTS))


@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_a_cpu_backend_matches_the_default_on_a_tiny_flux_forward(tiny_flux_dir, backend):
    default = load_policy(ModelConfig(kind="flux", path=tiny_flux_dir), device="cpu")
    chosen = load_policy(ModelConfig(kind="flux", path=tiny_flux_dir, attention_backend=backend), device="cpu")
    assert {p._attention_backend for p in attention_processors(chosen.transformer)} == {backend}
    assert torch.allclose(_velocity(chosen), _velocity(default), rtol=0, atol=1e-6)


def test_an_unknown_backend_lists_the_names():
    with pytest.raises(ConfigError) as info:
        load_config("tiny_jpeg", ["model.attention_backend=flash_attn"], validate_paths=False)
    message = str(info.value)
    assert message.startswith("model.attention_backend must be one of ") and "native" in message and "xformers" in message
    assert "\n" not in message


def test_a_cuda_backend_on_a_cpu_run_is_refused(tiny_flux_dir):
    with pytest.raises(UserError, match="model.attention_backend flash runs on CUDA GPUs only and this run's device is cpu"):
        load_policy(ModelConfig(kind="flux", path=tiny_flux_dir, attention_backend="flash"), device="cpu")


@pytest.mark.parametrize("backend,package", [("flash", "flash_attn"), ("xformers", "xformers"), ("sage", "sageattention")])
def test_a_backend_whose_package_is_missing_names_what_to_install(tiny_flux_dir, backend, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    policy = load_policy(ModelConfig(kind="flux", path=tiny_flux_dir), device="cpu")
    # a CUDA device as named, to reach diffusers' own check of the package (nothing runs on it)
    with pytest.raises(UserError) as info:
        set_attention_backend(policy.transformer, backend, torch.device("cuda"))
    message = str(info.value)
    assert message.startswith(f"model.attention_backend {backend} needs a package") and "pip install '" in message
    assert "\n" not in message


def test_a_transformer_that_ignores_the_dispatcher_is_refused(tiny_sd3_dir):
    # diffusers 0.42's SD3 processors call torch's SDPA themselves: a backend would be set and never used
    with pytest.raises(UserError, match="would not take effect: SD3Transformer2DModel's attention processors"):
        load_policy(ModelConfig(kind="sd3", path=tiny_sd3_dir, attention_backend="native"), device="cpu")


def test_a_transformer_without_the_setter_is_refused():
    with pytest.raises(UserError, match="Linear has no set_attention_backend"):
        set_attention_backend(torch.nn.Linear(2, 2), "native", torch.device("cpu"))
