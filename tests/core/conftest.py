"""The core's tests run on tiny tensors: one intra-op thread each (more only add pool overhead,
large on a busy 2-core machine)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
