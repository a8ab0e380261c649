"""expert_parallel on a fake mesh (one process): what it rewrites, where the expert gradients are
reduced, what it refuses, the plan field and the ep sub-axes of the mesh."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from cann_passes.pass_manager import PassContext, PassFailure, PassManager, Pipeline
from cann_passes.pass_pipeline import build_pipeline
from cann_passes.passes.expert_parallel import expert_major_order
from cann_passes.plan import PlanError
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from graph_ir.meta import ACCUMULATION_WEIGHT, SHARDING
from graph_ir.placement import FlatShard, Placement, placements
from graph_ir.signature import InputKind
from tests import zoo

c10d = torch.ops._c10d_functional
ROWS = torch.ops.cann.all_to_all_rows.default


def _capture(name="mixtral", optimizer=torch.optim.AdamW, **config):
    entry = zoo.build(name, layers=1, seed=0, **config)
    opt = optimizer(entry.model.parameters(), lr=0.1)
    graph, _ = capture_train_step(entry.model, opt, entry.loss_fn, entry.make_batch(0, pad=False))
    return graph


@pytest.fixture(scope="module")
def mixtral():
    return _capture()


def _run(graph, pipeline="expert_parallel,data_parallel", **mesh):
    ctx = PassContext(mesh=MeshDesc.fake(**mesh))
    return PassManager(Pipeline.parse(pipeline), verify_level="deep").run(graph.copy(), ctx)


def _experts(graph):
    return sorted(n for _, s in graph.signature.inputs_of(InputKind.PARAM)
                  for n in [s.name] if ".experts." in n)


def test_experts_are_split_and_rows_cross_by_all_to_all(mixtral):
    out = _run(mixtral, dp=2, ep=2, rank=1)
    attrs = out.attrs["expert_parallel"]
    assert attrs["ep"] == 2 and attrs["rank"] == 1 and attrs["blocks"] == 1
    names = _experts(mixtral)
    assert sorted(attrs["experts"]) == names and set(attrs["local_experts"].values()) == {zoo.EXPERTS // 2}
    group = MeshDesc.fake(dp=2, ep=2, rank=1).group_name("ep")
    rows = [n for n in out.graph.nodes if n.target is ROWS]
    # rows out and back in forward, the output gradient out and the input gradient back in backward
    assert [str(n.meta["region"]) for n in rows] == ["forward", "forward", "backward", "backward"]
    assert {n.args[-1] for n in rows} == {group}
    counts = [n for n in out.graph.nodes if n.target is c10d.all_to_all_single.default]
    assert len(counts) == 1 and counts[0].args[-1] == group
    for name in names:
        full = mixtral.input_node(InputKind.PARAM, name).meta["val"].shape
        node = out.input_node(InputKind.PARAM, name)
        assert node.meta["val"].shape == (full[0] // 2, *full[1:])
        assert Placement.from_json(node.meta[SHARDING]) == Placement.sharded(tuple(full), 0, "ep")
        # the AdamW moments follow their parameter; the step count stays whole
        for key, p in placements(out).items():
            if key.startswith(f"opt_state:{name}:"):
                assert p == Placement.sharded(tuple(full), 0, "ep")
    dense = [n for n in placements(out) if n.startswith("param:") and ".experts." not in n]
    assert dense == []


def test_expert_gradients_reduce_over_the_expert_data_parallel_group(mixtral):
    # dp=4 x ep=2: dense gradients averaged over dp (4 ranks), expert gradients summed over edp
    # (the 2 ranks holding the same experts) and divided by dp
    out = _run(mixtral, dp=4, ep=2, rank=2)
    mesh = MeshDesc.fake(dp=4, ep=2, rank=2)
    assert (mesh.local_rank("ep"), mesh.local_rank("edp"), mesh.size("edp")) == (0, 1, 2)
    reduces = [n for n in out.graph.nodes if n.target is c10d.all_reduce.default]
    by_group = {}
    for n in reduces:
        by_group.setdefault(n.args[2], []).append(n.args[1])
    assert by_group[mesh.group_name("edp")] == ["sum"]
    assert "avg" in by_group[mesh.group_name("dp")]
    scale = [n for n in out.graph.nodes if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 0.25]
    assert len(scale) == 1
    # dp = ep: no all-reduce of expert gradients at all, only the 1/dp
    two = _run(mixtral, dp=2, ep=2, rank=0)
    groups = {n.args[2] for n in two.graph.nodes if n.target is c10d.all_reduce.default}
    assert groups == {MeshDesc.fake(dp=2, ep=2).group_name("dp")}
    assert out.attrs["data_parallel"]["expert_buckets"] == two.attrs["data_parallel"]["expert_buckets"] == 1


def test_zero_shards_the_experts_state_over_the_expert_data_parallel_group(mixtral):
    out = _run(mixtral, pipeline="expert_parallel,optimizer_shard{stage=1}", dp=4, ep=2, rank=3)
    mesh = MeshDesc.fake(dp=4, ep=2, rank=3)
    name = _experts(mixtral)[0]
    full = tuple(mixtral.input_node(InputKind.PARAM, name).meta["val"].shape)
    state = placements(out)[f"opt_state:{name}:exp_avg"]
    assert state == Placement.sharded(full, 0, "ep").then("edp", FlatShard())
    assert state.local_shape(mesh) == (full[0] // 2 * full[1] * full[2] // 2,)
    scatters = [n for n in out.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert {n.args[-1] for n in scatters} == {mesh.group_name("dp"), mesh.group_name("edp")}
    assert sorted(out.attrs["zero"]["expert_params"]) == _experts(mixtral)


def test_expert_major_order_groups_each_experts_rows_in_rank_order():
    # 2 source ranks x 2 local experts: rank 0 sent 1 row of e0 and 2 of e1, rank 1 2 of e0 and 0 of e1
    counts = torch.tensor([[1, 2], [2, 0]])
    rows = torch.arange(5.0)
    order = expert_major_order(rows, counts)
    assert rows[order].tolist() == [0.0, 3.0, 4.0, 1.0, 2.0]


@pytest.mark.parametrize("fields, rule", [
    (dict(dp=4, ep=3), "ep must divide dp"),
    (dict(dp=2, ep=2, backend="inductor"), "eager backend only"),
])
def test_plan_refuses_what_is_not_built(fields, rule):
    with pytest.raises(PlanError, match=rule) as err:
        Plan(**fields)
    assert err.value.field == "ep"


def test_a_moe_step_pipelines_with_its_load_balancing_loss_in_the_last_stage():
    # The load-balancing loss reads every layer's router logits: cut after the last parameter's
    # reader it would be a cheap cut (a few scalars cross) and leave stage 1 no layer. The stages
    # are cut between layers; the loss and its combination of the logits are the last stage's.
    from cann_passes import compile_program
    from graph_ir.signature import OutputKind, Spec
    entry = zoo.build("mixtral", layers=2, seed=0)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    graph, _ = capture_train_step(entry.model, opt, entry.loss_fn, entry.make_batch(0, pad=False))
    program = compile_program(graph, Plan(dp=2, ep=2, pp=2, microbatches=2, grad_clip_norm=1.0, verify="off"),
                              MeshDesc.fake(dp=2, ep=2, pp=2))
    forward = [program.graphs[f"stage{s}.forward"] for s in (0, 1)]
    assert Spec(OutputKind.LOSS, "loss") in forward[1].signature.outputs
    assert any(n.target is torch.ops.aten.mm.default for n in forward[0].graph.nodes)   # stage 0 has a layer
    # clipping's total: each stage's apply all-reduces its part over the pipeline ranks (stage 0's
    # part of the experts' squares is zero: it holds none), then the experts' over ep
    pp, ep = (MeshDesc.fake(dp=2, ep=2, pp=2).group_name(axis) for axis in ("pp", "ep"))
    for s in (0, 1):
        groups = [n.args[2] for n in program.graphs[f"stage{s}.apply"].graph.nodes
                  if n.target is c10d.all_reduce.default]
        assert pp in groups and ep in groups, (s, groups)


def test_with_cp_each_rank_dispatches_its_own_token_rows(mixtral):
    # context_parallel runs the router's sort, the counts and the grouped matmuls on this rank's
    # half of the tokens; expert_parallel then sends those rows to their experts' ranks of the ep
    # group (the dp ranks at this cp coordinate), and the experts' gradients are all-reduced over cp
    # where backward yields them, before data_parallel sums them over edp.
    mesh = MeshDesc.fake(dp=2, ep=2, cp=2, rank=1)
    out = _run(mixtral, pipeline="context_parallel,expert_parallel,data_parallel", dp=2, ep=2, cp=2, rank=1)
    rows = [n for n in out.graph.nodes if n.target is ROWS]
    tokens = mixtral.input_node(InputKind.BATCH, "batch['input_ids']").meta["val"].numel()
    assert rows and {n.args[0].meta["val"].shape[0] for n in rows} == {tokens * zoo.TOP_K // 2}
    assert {n.args[-1] for n in rows} == {mesh.group_name("ep")}
    assert out.attrs["context_parallel"]["partial_gradients"] is False   # (ep: whole over cp, then edp)
    cp = mesh.group_name("cp")
    reduced = {n.args[0].name for n in out.graph.nodes
               if n.target is c10d.all_reduce.default and n.args[2] == cp and str(n.meta["region"]) == "backward"}
    assert len(reduced) == len(dict(mixtral.signature.inputs_of(InputKind.PARAM)))
    assert Plan(dp=2, ep=2, cp=2).ep == 2
    assert "gradients=partial" not in str(build_pipeline(Plan(dp=2, ep=2, cp=2), "eager"))


def test_plan_puts_the_pass_after_the_sharding_passes():
    text = str(build_pipeline(Plan(dp=2, ep=2, backend="eager", recompute="selective"), "eager"))
    assert text.index("expert_parallel") < text.index("recompute") < text.index("data_parallel")


def test_refused_by_the_rule_it_breaks(mixtral):
    with pytest.raises(PassFailure, match="ep=8 must divide the expert count"):
        _run(mixtral, dp=8, ep=8)
    with pytest.raises(PassFailure, match="no grouped matmul over experts"):
        _run(_capture("llama", optimizer=torch.optim.SGD), dp=2, ep=2)
    with pytest.raises(PassFailure, match="must run before data_parallel"):
        _run(mixtral, pipeline="data_parallel,expert_parallel", dp=2, ep=2)


def test_mesh_sub_axes():
    mesh = MeshDesc.fake(dp=4, tp=2, ep=2, rank=5)   # dp coordinate 2, tp coordinate 1
    assert mesh.world_size == 8 and mesh.axes == ("pp", "dp", "cp", "tp")
    assert (mesh.size("ep"), mesh.local_rank("ep"), mesh.size("edp"), mesh.local_rank("edp")) == (2, 0, 2, 1)
    assert mesh.group_size(mesh.group_name("ep")) == 2
    assert MeshDesc.from_json(mesh.to_json()) == mesh
    assert mesh.for_rank(3).local_rank("ep") == 1
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        MeshDesc.fake(dp=4, ep=3)


def test_dynamic_accumulation_weights_the_seed_not_this_ranks_gradient(mixtral):
    # An expert's gradient sums the losses of every rank of its group; under accumulate_target
    # their microbatch sizes differ, so the samples weight the backward seed on each rank.
    assert "weight=seed" in str(build_pipeline(Plan(dp=2, ep=2, accumulate_target=8, backend="eager"), "eager"))
    assert "weight=seed" not in str(build_pipeline(Plan(dp=2, ep=2, microbatches=2, backend="eager"), "eager"))
    with pytest.raises(PassFailure, match="weight='gradient' with target > 0 on an expert-parallel step"):
        _run(mixtral, pipeline="expert_parallel,grad_accumulation{target=8},data_parallel", dp=2, ep=2)
    out = _run(mixtral, pipeline="expert_parallel,grad_accumulation{target=8,weight=seed},data_parallel",
               dp=2, ep=2)
    seed = next(n for n in out.graph.nodes if n.target is torch.ops.aten.ones_like.default)
    (weighted,) = seed.users
    assert weighted.target is torch.ops.aten.mul.Tensor
    assert weighted.args[1] is out.input_node(InputKind.STEP_STATE, ACCUMULATION_WEIGHT)
    # the reported loss is the samples' mean over ranks: (w * loss, w) summed together
    sums = [n for n in out.graph.nodes if n.target is c10d.all_reduce.default and n.args[1] == "sum"
            and n.args[0].target is torch.ops.aten.stack.default]
    assert len(sums) == 1
