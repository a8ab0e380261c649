"""Models users bring, in bf16 through the Ascend pipeline: offline GE lowering with no unsupported op."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from cann_passes.lowering.ge_offline import lower_to_ge
from cann_passes.pass_manager import PassContext, PassManager
from cann_passes.passes.npu_legalize import _index_put
from graph_ir import capture_train_step
from tests.zoo import build

PIPELINE = "cleanup,autocast{dtype=bf16,policy=npu},npu_legalize,cleanup"


pytestmark = pytest.mark.usefixtures("torchair")  # skips the module where torchair cannot be had


@pytest.mark.parametrize("name", ["llama", "bert", "gpt2", "clip"])
def test_bf16_step_lowers_to_ge_with_zero_unsupported_ops(name):
    entry = build(name, layers=1)
    opt = torch.optim.AdamW(entry.model.parameters(), lr=1e-3)
    tg, _ = capture_train_step(entry.model, opt, entry.loss_fn, entry.make_batch(0))
    graph = PassManager(PIPELINE, verify_level="deep").run(tg, PassContext())
    report = lower_to_ge(graph.gm, name=name, optimize=False)
    assert report.unsupported == [] and report.ok, report.summary()
    h = report.op_histogram
    assert sum(h.get(op, 0) for op in ("MatMul", "MatMulV2", "BatchMatMul", "BatchMatMulV2")) >= 6
    assert h.get("Cast", 0) > 0 and h.get("NetOutput") == 1


@pytest.mark.parametrize("accumulate", [True, False])
def test_index_put_rewrite_equals_index_put(accumulate):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, generator=g)
    rows = torch.tensor([0, 2, 2, -1])
    cols = torch.tensor([1, 4, 4, 0]) if accumulate else torch.tensor([1, 4, 3, 0])
    values = torch.randn(4, 4, generator=g)
    expected = torch.ops.aten.index_put.default(x, [rows, cols], values, accumulate)
    assert torch.allclose(_index_put(x, [rows, cols], values, accumulate), expected, atol=1e-6)
