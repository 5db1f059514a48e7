"""Shared fixtures: tiny SD3, FLUX.1, FLUX.2 [klein], Qwen-Image, Z-Image and SANA pipelines saved once per session and loaded back
through the real `from_pretrained` path."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs one worker per core: each computes on one thread
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    from flowrl.models.tiny import build_tiny_sd3

    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3") / "pipe"))


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    from flowrl.models.tiny import build_tiny_flux

    return str(build_tiny_flux(tmp_path_factory.mktemp("tiny-flux") / "pipe"))


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory):
    from flowrl.models.tiny import build_tiny_qwen_image

    return str(build_tiny_qwen_image(tmp_path_factory.mktemp("tiny-qwen-image") / "pipe"))


@pytest.fixture(scope="session")
def tiny_z_image_dir(tmp_path_factory):
    from flowrl.models.tiny import build_tiny_z_image

    return str(build_tiny_z_image(tmp_path_factory.mktemp("tiny-z-image") / "pipe"))


@pytest.fixture(scope="session")
def tiny_flux2_klein_dir(tmp_path_factory):
    from flowrl.models.tiny import build_tiny_flux2_klein

    return str(build_tiny_flux2_klein(tmp_path_factory.mktemp("tiny-flux2-klein") / "pipe"))


@pytest.fixture(scope="session")
def tiny_sana_dir(tmp_path_factory):
    from flowrl.models.tiny import build_tiny_sana

    return str(build_tiny_sana(tmp_path_factory.mktemp("tiny-sana") / "pipe"))


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    # built-in models materialise into a private cache, never the user's home
    os.environ["FLOWRL_CACHE"] = str(tmp_path_factory.mktemp("flowrl-cache"))


def pytest_collection_modifyitems(config, items):
    # the longest tests first: pytest-xdist hands out the first tests alternately to its workers,
    # so the long ones run side by side from the start instead of one of them ending the suite alone
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
