"""Shared fixtures: small models, batches, the torchair skip; the eager reference trainer
(tests/eager_reference.py) re-exported."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from recipes.models.mlp import MLP, mlp_loss
# The eager reference trainer lives in tests/eager_reference.py; tests import eager_losses from here too.
from tests.eager_reference import eager_losses, eager_steps  # noqa: F401

# Each test compiles what it checks: a compile-cache hit (from an earlier run on this machine, or
# another test with the same model and plan) would skip the passes the test is about. The cache's
# own tests name their directory in the plan. Processes a test spawns inherit this.
os.environ.setdefault("CANN_PASSES_COMPILE_CACHE", "off")
# Priced choices (pipeline cuts, recompute selections) are made from a pinned CPU measurement (one
# thread, taken on a quiet 2-core x86 machine), not this machine's: a measurement taken beside the
# suite's other worker is inflated unevenly (softmax 25x, one op 4x) and would move the cuts the
# tests check. The cost model's own tests measure for themselves.
os.environ.setdefault("CANN_PASSES_CPU_PROFILE", os.path.join(os.path.dirname(__file__), "data", "cpu_profile.json"))

# The suite runs one pytest worker per core (``-n 2``) beside the ranks the gloo tests spawn: a
# second intra-op thread per worker buys tiny models no speed, and its OpenMP spin-waits take the
# other worker's core.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= torch.get_num_threads():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_lowering_outlives_its_test():
    """A background lowering's child process (plan.background_lowering) still compiling when its
    test ends would take a core from the next tests: each test's children are waited for."""
    yield
    from cann_passes.background_lowering import wait_for_children
    wait_for_children()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny models' ops take microseconds: on a shared machine (the suite runs one pytest worker
    per core) a second intra-op thread buys no speed and its spin-waits cost the most CPU time.
    Use with ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``; restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def torchair():
    """torchair, loaded offline from the torch_npu wheel; skips where the wheel cannot be had.

    The one torchair skip of the suite: take it as an argument (or build a fixture on it), or mark
    a module with ``pytestmark = pytest.mark.usefixtures("torchair")``."""
    from cann_passes.lowering.ge_offline import TorchairUnavailable, load_torchair
    try:
        return load_torchair()
    except TorchairUnavailable as e:
        pytest.skip(f"torchair (torch_npu wheel) unavailable: {e}")


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(kind)


def tiny_gpt(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return GPT(gpt_tiny(**overrides)), gpt_loss


def tiny_mlp(seed: int = 0):
    torch.manual_seed(seed)
    return MLP([12, 32, 32, 5]), mlp_loss


def gpt_batches(n: int, batch: int = 4, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 256, (batch, seq + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def mlp_batches(n: int, batch: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g))
            for _ in range(n)]


@pytest.fixture
def twin():
    """Two identical copies of a model: one for the compiled step, one for eager reference."""
    def make(factory, **kw):
        model, loss_fn = factory(**kw)
        return model, copy.deepcopy(model), loss_fn
    return make


@pytest.fixture()
def gloo_group():
    """A one-process gloo group, for graphs that name a real process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
