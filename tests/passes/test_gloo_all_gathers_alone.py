"""On gloo, every all-gather runs with no other collective in flight (the ``gloo_all_gathers_alone``
pass); on other backends the order is left as it is, and the compile driver appends the pass only
where the mesh has a gloo axis. The distributed tests run the result on gloo ranks, bitwise
against the functional step (tests/distributed/test_inplace_updates.py)."""
from __future__ import annotations

import torch
import torch.fx

import dataclasses

from cann_passes.compile import with_required_passes
from cann_passes.pass_manager import PassContext, PassManager, Pipeline
from cann_passes.passes.gloo_all_gathers_alone import gloo_all_gathers_alone
from graph_ir.mesh import MeshDesc

F = torch.ops._c10d_functional
aten = torch.ops.aten


def _zero_like_step():
    """Two reduce-scatters in flight, an update, its all-gather, a second all-gather, the waits late."""
    g = torch.fx.Graph()
    a, b = g.placeholder("grad_a"), g.placeholder("grad_b")
    rs_a = g.call_function(F.reduce_scatter_tensor.default, (a, "avg", 2, "0"))
    rs_b = g.call_function(F.reduce_scatter_tensor.default, (b, "avg", 2, "0"))
    wa = g.call_function(F.wait_tensor.default, (rs_a,))
    upd = g.call_function(aten.mul.Tensor, (wa, 0.5))
    ag1 = g.call_function(F.all_gather_into_tensor.default, (upd, 2, "0"))
    ag2 = g.call_function(F.all_gather_into_tensor.default, (upd, 2, "0"))
    other = g.call_function(aten.add.Tensor, (upd, 1.0))
    wb = g.call_function(F.wait_tensor.default, (rs_b,))
    w1 = g.call_function(F.wait_tensor.default, (ag1,))
    w2 = g.call_function(F.wait_tensor.default, (ag2,))
    g.output((wb, w1, w2, other))
    return g


def _order(g):
    return [n.name for n in g.nodes if n.op == "call_function"]


def test_each_gloo_all_gather_waits_for_what_is_in_flight_and_is_waited_at_once():
    g = _zero_like_step()
    moved = gloo_all_gathers_alone(g, backend_of=lambda name: "gloo")
    g.lint()
    order = _order(g)
    # rs_b's wait moves before the first all-gather, each all-gather's wait right behind it.
    assert order == ["reduce_scatter_tensor_default", "reduce_scatter_tensor_default_1", "wait_tensor_default",
                     "mul_tensor", "wait_tensor_default_1", "all_gather_into_tensor_default", "wait_tensor_default_2",
                     "all_gather_into_tensor_default_1", "wait_tensor_default_3", "add_tensor"], order
    assert moved == 3
    assert gloo_all_gathers_alone(g, backend_of=lambda name: "gloo") == 0   # already in that order


def test_groups_of_other_backends_keep_their_overlap():
    g = _zero_like_step()
    before = _order(g)
    assert gloo_all_gathers_alone(g, backend_of=lambda name: "hccl") == 0
    assert gloo_all_gathers_alone(g, backend_of=lambda name: None) == 0   # a fake mesh: no backend known
    assert _order(g) == before


def _live(mesh: MeshDesc, backend: str) -> MeshDesc:
    return dataclasses.replace(mesh, fake=False, backends=(backend,) * len(mesh.axes))


def test_the_driver_appends_the_pass_for_a_mesh_with_a_gloo_axis_only():
    mesh = MeshDesc.fake(dp=2)
    names = lambda p: [s.name for s in p.passes]   # noqa: E731
    assert "gloo_all_gathers_alone" not in names(with_required_passes(Pipeline.parse("cleanup"), "eager", mesh))
    assert "gloo_all_gathers_alone" not in names(
        with_required_passes(Pipeline.parse("cleanup"), "eager", _live(mesh, "hccl")))
    eager = names(with_required_passes(Pipeline.parse("cleanup"), "eager", _live(mesh, "gloo")))
    # before the in-place marks, which are valid only in the final node order
    assert eager[-3:] == ["gloo_all_gathers_alone", "reuse_dead_operands", "plan_buffers"]


def test_the_pass_reads_each_group_backend_from_the_mesh():
    from graph_ir import TrainGraph
    from graph_ir.meta import GraphAttr
    from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature
    g = _zero_like_step()
    for n in g.nodes:
        if n.op == "call_function" and n.args and "0" in n.args:
            n.args = tuple(MeshDesc.fake(dp=2).group_name("dp") if a == "0" else a for a in n.args)
    outputs = g.output_node().args[0]
    sig = StepSignature([Spec(InputKind.BATCH.value, f"batch[{i}]") for i in range(2)],
                        [Spec(OutputKind.METRIC.value, f"m{i}") for i in range(len(outputs))])
    graph = TrainGraph(torch.fx.GraphModule(torch.nn.Module(), g), sig)
    manager = PassManager("gloo_all_gathers_alone", verify_level="off")
    manager.run(graph, PassContext(mesh=_live(MeshDesc.fake(dp=2), "gloo")))
    assert manager.records[0].stats["waits_moved"] == 3 and graph.attrs[GraphAttr.GLOO_ORDERED]
