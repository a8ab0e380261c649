"""On gloo, a gradient reduce-scatter runs as an all-reduce of which each rank keeps its own chunk
(gloo reduce-scatters slower than it all-reduces; ``bench.gloo_collectives``); other backends and
fake meshes keep the reduce-scatter."""
from __future__ import annotations

import dataclasses

import torch

from cann_passes.compile import with_required_passes
from cann_passes.pass_manager import PassContext, PassManager, Pipeline
from cann_passes.passes.gloo_reduce_scatter_as_all_reduce import gloo_reduce_scatters_as_all_reduces
from graph_ir.mesh import MeshDesc
from tests.passes._tiny import c10d, collectives, fx_graph, mlp_step


def _live(mesh: MeshDesc, backend: str) -> MeshDesc:
    return dataclasses.replace(mesh, fake=False, backends=(backend,) * len(mesh.axes))


def _emulated(gm: torch.fx.GraphModule, rank: int) -> torch.fx.GraphModule:
    """``gm`` with its collectives run as in a world of two ranks that hold the same tensors:
    a sum over them is twice the value, a reduce-scatter this rank's chunk of it."""
    emulate = {c10d.reduce_scatter_tensor.default: lambda x, op, n, g: x.chunk(n)[rank] * (n if op == "sum" else 1),
               c10d.all_reduce.default: lambda x, op, g: x * (2 if op == "sum" else 1),
               c10d.wait_tensor.default: lambda x: x}
    gm = torch.fx.GraphModule(gm, gm.graph.__deepcopy__({}))
    for node in gm.graph.nodes:
        node.target = emulate.get(node.target, node.target)
    gm.recompile()
    return gm


def test_each_rank_keeps_its_own_chunk_of_the_all_reduced_buffer():
    name = MeshDesc.fake(dp=2).group_name("dp")

    def step(x):
        scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(x.view(-1) * 3.0, "sum", 2, name))
        return [(scattered * scattered).sum()]

    x = torch.arange(8, dtype=torch.float32) + 0.25
    for rank in (0, 1):
        graph = fx_graph(step, x, region="optimizer")      # a gradient's: waited in the optimizer
        expected = _emulated(graph.gm, rank)(x)
        mesh = _live(MeshDesc.fake(dp=2, rank=rank), "gloo")
        assert gloo_reduce_scatters_as_all_reduces(graph, mesh) == 1
        assert [n.target for n in collectives(graph)] == [c10d.all_reduce.default]
        # the chunk is a view of the reduced buffer: no shard-sized copy per step
        assert not [n for n in graph.graph.nodes if n.target is torch.ops.aten.clone.default]
        got = _emulated(graph.gm, rank)(x)
        assert torch.equal(got[0], expected[0]), rank


def test_zero_steps_on_gloo_reduce_no_gradient_by_reduce_scatter_and_verify():
    step = mlp_step()
    for stage in (1, 2, 3):
        pipeline = f"cleanup,optimizer_shard{{stage={stage},bucket_mb=0.001}},gloo_reduce_scatter_as_all_reduce"
        before = PassManager(pipeline.rsplit(",", 1)[0]).run(step.captured.copy(),
                                                          PassContext(mesh=MeshDesc.fake(dp=2, rank=1)))
        scatters = [n for n in collectives(before) if n.target is c10d.reduce_scatter_tensor.default]
        manager = PassManager(pipeline, verify_level="deep")
        out = manager.run(step.captured.copy(), PassContext(mesh=_live(MeshDesc.fake(dp=2, rank=1), "gloo")))
        kinds = [n.target for n in collectives(out)]
        assert scatters and c10d.reduce_scatter_tensor.default not in kinds
        assert manager.records[-1].stats["rewritten"] == len(scatters), stage


def test_hccl_groups_and_fake_meshes_keep_the_reduce_scatter():
    step = mlp_step()
    for mesh in (MeshDesc.fake(dp=2), _live(MeshDesc.fake(dp=2), "hccl")):
        manager = PassManager("cleanup,optimizer_shard{stage=1},gloo_reduce_scatter_as_all_reduce")
        out = manager.run(step.captured.copy(), PassContext(mesh=mesh))
        assert manager.records[-1].stats["rewritten"] == 0
        assert c10d.reduce_scatter_tensor.default in [n.target for n in collectives(out)]


def test_the_driver_appends_it_for_a_gloo_mesh_before_the_in_place_marks():
    names = lambda p: [s.name for s in p.passes]   # noqa: E731
    mesh = MeshDesc.fake(dp=2)
    assert "gloo_reduce_scatter_as_all_reduce" not in names(
        with_required_passes(Pipeline.parse("cleanup"), "eager", _live(mesh, "hccl")))
    eager = names(with_required_passes(Pipeline.parse("cleanup"), "eager", _live(mesh, "gloo")))
    assert eager[-4:] == ["gloo_reduce_scatter_as_all_reduce", "gloo_all_gathers_alone", "reuse_dead_operands",
                          "plan_buffers"]
