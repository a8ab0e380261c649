"""Fixtures the recipe tests share."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread_per_test_process():
    """Small recipe models on one intra-op thread: at hidden sizes of 32-64, a second thread buys no
    speed, and on a shared machine (or beside another pytest worker) its spin-waits cost the most
    CPU time of a recipe test. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def torchair():
    from cann_passes.lowering.ge_offline import TorchairUnavailable, load_torchair
    try:
        return load_torchair()
    except TorchairUnavailable as e:
        pytest.skip(f"torchair (torch_npu wheel) unavailable: {e}")
