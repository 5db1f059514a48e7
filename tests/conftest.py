"""Shared fixtures: tiny SD3, FLUX.1, FLUX.2 [dev] and [klein], Qwen-Image, Z-Image, SANA and Wan2.1 pipelines saved once per session and loaded back
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


@pytest.fixture
def restore_threads():
    """For tests whose runs set torch's thread count (trainer.threads, a producer): put it back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _tiny_pipeline(builder: str):
    """A session fixture: the tiny pipeline flowrl.models.tiny.`builder` saves, its directory."""

    @pytest.fixture(scope="session")
    def directory(tmp_path_factory):
        from flowrl.models import tiny

        return str(getattr(tiny, builder)(tmp_path_factory.mktemp(builder) / "pipe"))

    return directory


tiny_sd3_dir = _tiny_pipeline("build_tiny_sd3")
tiny_flux_dir = _tiny_pipeline("build_tiny_flux")
tiny_flux_kontext_dir = _tiny_pipeline("build_tiny_flux_kontext")
tiny_shapes_edit_dir = _tiny_pipeline("build_tiny_shapes_edit")
tiny_flux2_dir = _tiny_pipeline("build_tiny_flux2")
tiny_flux2_klein_dir = _tiny_pipeline("build_tiny_flux2_klein")
tiny_qwen_image_dir = _tiny_pipeline("build_tiny_qwen_image")
tiny_qwen_image_edit_dir = _tiny_pipeline("build_tiny_qwen_image_edit")
tiny_z_image_dir = _tiny_pipeline("build_tiny_z_image")
tiny_sana_dir = _tiny_pipeline("build_tiny_sana")
tiny_wan_dir = _tiny_pipeline("build_tiny_wan")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    # built-in models materialise into a private cache, never the user's home
    os.environ["FLOWRL_CACHE"] = str(tmp_path_factory.mktemp("flowrl-cache"))


def pytest_collection_modifyitems(config, items):
    # the longest tests first: pytest-xdist hands out the first tests alternately to its workers,
    # so the long ones run side by side from the start instead of one of them ending the suite alone
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if getattr(config.option, "loadgroup", False):
        _name_xdist_groups(items)


def _name_xdist_groups(items) -> None:
    """`--dist loadgroup` on pytest 9.2: pytest-xdist 3.8 names a test's group by writing `item._nodeid`,
    which pytest 9.2 no longer reads (a node's id is `item._id`), so every group was split over the
    workers and its module fixtures built on each (the README quickstart trained twice). This writes
    the same "NODEID@GROUP" id that xdist's scheduler reads, where xdist's own write did not land."""
    from _pytest.nodeid import NodeId

    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")
