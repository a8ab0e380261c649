"""Fixtures the recipe tests share."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _recipes_on_one_thread(one_intra_op_thread):
    """Every recipe test module: hidden sizes of 32-64 (see tests/conftest.py)."""
    yield
