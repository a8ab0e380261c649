"""Fixtures the recipe tests share."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _recipes_on_one_thread(one_intra_op_thread):
    """Every recipe test module: hidden sizes of 32-64 (see tests/conftest.py)."""
    yield


@pytest.fixture(scope="module")
def torchair():
    from cann_passes.lowering.ge_offline import TorchairUnavailable, load_torchair
    try:
        return load_torchair()
    except TorchairUnavailable as e:
        pytest.skip(f"torchair (torch_npu wheel) unavailable: {e}")
