"""An expert-parallel MoE step lowers to GE offline (torchair's converters and ours): the grouped
matmuls as GroupedMatmul, the all-to-alls as HcomAllToAllV, zero unsupported ops; and the
decompositions npu_legalize uses for the routing's ops are bitwise the ops they replace."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cann_passes import Plan, compile_program
from cann_passes.passes.expert_parallel import expert_major_order
from cann_passes.passes.npu_legalize import decomposition_for
from graph_ir.mesh import MeshDesc

PLAN = Path(__file__).resolve().parents[2] / "recipes" / "moe" / "plans" / "ep2_zero1_dp4.yaml"
LAYERS = 2


def test_histc_decomposition_is_atens_cpu_histc():
    histc = decomposition_for(torch.ops.aten.histc.default)
    torch.manual_seed(0)
    for experts in (2, 3, 8, 60, 64):      # transformers' routing counts: integer ids, min 0, max E - 1
        ids = torch.randint(0, experts, (4096,)).float()
        assert torch.equal(histc(ids, experts, 0, experts - 1), torch.histc(ids, experts, 0, experts - 1))
        # on an accelerator transformers counts int32 ids (CPU's kernel takes floats only)
        got = histc(ids.int(), experts, 0, experts - 1)
        assert got.dtype == torch.int32 and torch.equal(got, torch.histc(ids, experts, 0, experts - 1).int())
    for bins, lo, hi in ((7, -1.3, 2.9), (100, 0.0, 1.0), (13, -5, 5)):
        x = torch.cat([torch.randn(10000) * 3, torch.linspace(lo, hi, bins + 1),
                       torch.tensor([float("nan"), lo, hi, float("inf")])])
        assert torch.equal(histc(x, bins, lo, hi), torch.histc(x, bins, lo, hi)), (bins, lo, hi)


def test_expert_order_and_argsort_decompositions_are_the_ops():
    order = decomposition_for(torch.ops.cann.expert_major_order.default)
    argsort = decomposition_for(torch.ops.aten.argsort.default)
    torch.manual_seed(0)
    for sources, experts in ((2, 4), (4, 2), (2, 1), (8, 16)):
        counts = torch.randint(0, 5, (sources, experts))
        counts[0, 0] = 0                     # an empty (rank, expert) segment
        rows = torch.randn(int(counts.sum()), 3)
        expected = expert_major_order(rows, counts)
        assert torch.equal(order(rows, counts), expected)
        assert torch.equal(argsort(expected), torch.argsort(expected))


@pytest.fixture(scope="module")
def ep_program(torchair):
    from recipes.moe.model import build, moe_loss
    from tests.recipes._helpers import capture
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 32))
    captured = capture(build("moe", num_hidden_layers=LAYERS), moe_loss, (ids, torch.roll(ids, -1, 1)))
    plan = Plan.load(PLAN).replace(verify="shallow")
    assert plan.precision == "bf16" and plan.ep == 2 and plan.dp == 4
    return compile_program(captured, plan, MeshDesc.fake(dp=plan.dp, ep=plan.ep), backend="torchair")


def test_moe_recipe_ep_plan_lowers_with_grouped_matmul_and_all_to_all_v(ep_program, tmp_path):
    from cann_passes.lowering.ge_offline import lower_graph_to_files
    legalize = next(r for r in ep_program.records if r.name == "npu_legalize")
    assert legalize.stats["unsupported_left"] == 0
    assert {"aten.histc.default", "cann.expert_major_order.default"} <= set(legalize.stats["rewritten"])
    report = lower_graph_to_files(ep_program.graphs["step"].gm, "step", tmp_path)
    assert report.unsupported == [] and report.ok, report.summary()
    h = report.op_histogram
    # per layer: the counts' all-to-all, rows there and back in forward, gradients there and back
    assert h["HcomAllToAllV"] == 5 * LAYERS, h
    # per layer: up/gate and down forward, and each one's input and weight gradients
    assert h["GroupedMatmul"] == 6 * LAYERS, h
    text = (tmp_path / "step.ge.txt").read_text()
    assert "DT_BF16" in text
    # the weight gradients are the K-split form (group_type 2), the rest split rows (group_type 0)
    types = [int(t.split("i: ")[1].split()[0])
             for t in text.split('key: "group_type"')[1:]]
    assert sorted(types) == [0] * 4 * LAYERS + [2] * 2 * LAYERS, types
