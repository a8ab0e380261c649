"""A tensor-parallel LLaMA step lowers to GE offline: Hcom collectives, zero unsupported ops."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cann_passes.lowering.ge_offline import lower_to_ge
from cann_passes.pass_manager import PassContext, PassManager
from graph_ir import capture_train_step
from tests import zoo


pytestmark = pytest.mark.usefixtures("torchair")  # skips the module where torchair cannot be had


@pytest.fixture(scope="module")
def llama_step():
    entry = zoo.build("llama", layers=2)
    optimizer = torch.optim.AdamW(entry.model.parameters(), lr=1e-3)
    graph, _ = capture_train_step(entry.model, optimizer, entry.loss_fn, entry.make_batch(1))
    return graph


@pytest.fixture()
def two_rank_group():
    """A fake two-rank world: the Hcom converters resolve the group the collectives name."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class GroupMesh:
    def __init__(self, group):
        self.group = group

    def size(self, axis):
        return dist.get_world_size(self.group)

    def local_rank(self, axis):
        return dist.get_rank(self.group)

    def group_name(self, axis):
        return self.group.group_name


@pytest.mark.parametrize("options,collectives", [
    ("", {"HcomAllReduce": 10, "HcomAllGather": 1}),
    ("{sequence_parallel=true,vocab_parallel_loss=true}", {"HcomReduceScatter": 10, "HcomAllGather": 9})])
def test_tp2_llama_step_lowers_to_ge_with_hcom_collectives(llama_step, two_rank_group, options, collectives):
    pipeline = f"cleanup,tensor_parallel{options},npu_legalize,cleanup"
    graph = PassManager(pipeline, verify_level="deep").run(llama_step.copy(),
                                                           PassContext(mesh=GroupMesh(two_rank_group)))
    report = lower_to_ge(graph.gm, name="llama_tp2")
    assert report.unsupported == [] and report.ok
    hcom = {k: v for k, v in report.op_histogram.items() if k.startswith("Hcom")}
    for op, n in collectives.items():
        assert hcom.get(op, 0) >= n, hcom
