"""optimizer_shard (ZeRO 1-3): every parameter flat-sharded over dp, gradients reduce-scattered,
updated shards all-gathered; what each stage shards and where its collectives sit. On the recipe
MLP's captured SGD step, compiled for a rank of a fake ``dp=2`` mesh (no process group)."""
from __future__ import annotations

import math

import pytest
import torch

from cann_passes import Plan
from cann_passes.compile import compile_program
from cann_passes.pass_manager import PassContext, PassFailure, PassManager
from graph_ir.meta import ORIGIN_PASS, REGION, GraphAttr
from graph_ir.mesh import MeshDesc
from graph_ir.signature import InputKind, OutputKind
from tests.passes._tiny import c10d, collectives, mlp_step

SHAPES = {"fc1.weight": (32, 12), "fc1.bias": (32,), "fc2.weight": (32, 32), "fc2.bias": (32,),
          "fc3.weight": (5, 32), "fc3.bias": (5,)}
SHARD = {n: math.ceil(math.prod(s) / 2) for n, s in SHAPES.items()}      # fc3.bias: 3 of 5, one padded


@pytest.fixture(scope="module")
def step():
    return mlp_step()


def _zero(step, options: str, rank: int = 0, before: str = "cleanup"):
    manager = PassManager(f"{before},optimizer_shard{{{options}}}", verify_level="deep")
    out = manager.run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(dp=2, rank=rank)))
    return out, manager.records[-1]


def _input_shapes(graph, kind):
    return {s.name: tuple(n.meta["val"].shape) for s, n in zip(graph.signature.inputs, graph.placeholders())
            if s.kind == kind}


def _output_shapes(graph, kind):
    return {s.name: tuple(v.meta["val"].shape) for s, v in zip(graph.signature.outputs, graph.output_values())
            if s.kind == kind}


def _of(graph, target):
    return [n for n in collectives(graph) if n.target is target]


def _last_own_backward(graph) -> int:
    """The position of the step's last backward node (not one the pass added)."""
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    return max(order[n] for n in graph.compute_nodes()
               if str(n.meta[REGION]) == "backward" and n.meta.get(ORIGIN_PASS) != "optimizer_shard")


class TestOptimizerShard:
    def test_stage_1_shards_the_optimizer_state_and_keeps_whole_parameters(self, step):
        out, _ = _zero(step, "stage=1,bucket_mb=1")
        assert _input_shapes(out, InputKind.OPT_STATE) == {f"{n}:momentum_buffer": (SHARD[n],) for n in SHAPES}
        assert _input_shapes(out, InputKind.PARAM) == SHAPES == _output_shapes(out, OutputKind.PARAM)
        assert out.attrs[GraphAttr.PLACEMENTS]["opt_state:fc3.bias:momentum_buffer"] == {
            "shape": [5], "axes": {"dp": {"type": "flat_shard"}}}
        assert out.attrs[GraphAttr.SHARDED_STATE] is True

    def test_stage_1_reduce_scatters_after_backward_and_gathers_the_updated_parameters(self, step):
        out, record = _zero(step, "stage=1,bucket_mb=0.001")
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        scatters, gathers = _of(out, c10d.reduce_scatter_tensor.default), _of(out, c10d.all_gather_into_tensor.default)
        assert len(scatters) == len(gathers) == record.stats["buckets"] == 4
        assert all(n.args[1:] == ("avg", 2, MeshDesc.fake(dp=2).group_name("dp")) for n in scatters)
        assert all(order[n] > _last_own_backward(out) for n in scatters)
        assert all(str(n.meta[REGION]) == "optimizer" for n in gathers)

    def test_stage_1_copies_the_gathered_columns_over_the_parameters_they_fill(self, step):
        # fc3.bias (5 elements, a padded shard) comes fresh from its column; every other parameter's
        # new value is its column copied over its own input, which the eager backend writes in place.
        out, _ = _zero(step, "stage=1,bucket_mb=1", before="cleanup")
        outputs = dict(zip([s.name for s in out.signature.outputs], out.output_values()))
        for name in SHAPES:
            copy = outputs[name].args[0]
            if name == "fc3.bias":
                assert copy.target is not torch.ops.aten.copy.default
                continue
            assert copy.target is torch.ops.aten.copy.default, name
            assert copy.args[0].args[0] is out.input_node(InputKind.PARAM, name), name
        marked = PassManager("reuse_dead_operands", verify_level="deep").run(out.copy(), PassContext(
            mesh=MeshDesc.fake(dp=2, rank=0)))
        assert {f"param:{n}" for n in SHAPES if n != "fc3.bias"} <= {
            f"param:{s.name}" for s, p in zip(marked.signature.inputs, marked.placeholders())
            if p.name in marked.attrs[GraphAttr.WRITTEN_INPUTS]}

    def test_stage_2_reduce_scatters_each_bucket_as_soon_as_its_last_gradient_exists(self, step):
        out, _ = _zero(step, "stage=2,bucket_mb=0.001")
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        scatters = _of(out, c10d.reduce_scatter_tensor.default)
        assert len(scatters) == 4 and order[scatters[0]] < _last_own_backward(out)
        assert _input_shapes(out, InputKind.PARAM) == SHAPES

    def test_a_small_first_bucket_starts_reducing_early_and_the_gathers_keep_whole_buckets(self, step):
        # As DDP's: the first bucket of the gradients backward makes first, capped small, is
        # reduced while backward goes on; the updated parameters are gathered in bucket_mb buckets.
        out, record = _zero(step, "stage=2,bucket_mb=1,first_bucket_mb=0.001")
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        scatters = _of(out, c10d.reduce_scatter_tensor.default)
        assert len(scatters) == record.stats["buckets"] == 2 and order[scatters[0]] < _last_own_backward(out)
        assert len(_of(out, c10d.all_gather_into_tensor.default)) == 1
        # Stage 1 reduces after backward: a first bucket there would only add a collective.
        out, record = _zero(step, "stage=1,bucket_mb=1,first_bucket_mb=0.001")
        assert len(_of(out, c10d.reduce_scatter_tensor.default)) == record.stats["buckets"] == 1

    def test_stage_3_shards_parameters_and_gathers_them_for_forward_and_again_for_backward(self, step):
        out, _ = _zero(step, "stage=3,bucket_mb=1", rank=1)
        shards = {n: (SHARD[n],) for n in SHAPES}
        assert _input_shapes(out, InputKind.PARAM) == shards == _output_shapes(out, OutputKind.PARAM)
        gathers = _of(out, c10d.all_gather_into_tensor.default)
        assert [str(n.meta[REGION]) for n in gathers] == ["forward", "backward"]
        assert out.attrs[GraphAttr.ZERO]["rank"] == 1 and out.attrs[GraphAttr.ZERO]["master"] == "sharded"

    def test_sharded_master_weights_are_gathered_once_for_the_step_and_not_after_the_update(self, step):
        out, _ = _zero(step, "stage=1,bucket_mb=1,master=sharded")
        assert _input_shapes(out, InputKind.PARAM) == {n: (SHARD[n],) for n in SHAPES}
        gathers = _of(out, c10d.all_gather_into_tensor.default)
        assert [str(n.meta[REGION]) for n in gathers] == ["forward"]
        assert out.attrs[GraphAttr.ZERO]["gathered_for_step"] == {"float32": sum(SHARD.values()) * 2}

    def test_a_parameter_the_ranks_do_not_divide_is_padded_and_the_padding_reported(self, step):
        out, record = _zero(step, "stage=1,bucket_mb=1")
        params = out.attrs[GraphAttr.ZERO]["params"]
        assert params["fc3.bias"] == {"shape": [5], "numel": 5, "shard": 3, "padding": 1,
                                      "placement": "[5] dp:S(flat)"}
        assert all(params[n]["padding"] == 0 for n in SHAPES if n != "fc3.bias")
        assert record.stats["padding_elements"] == 1
        # Every gradient element and the one padding element are reduce-scattered, once.
        assert record.stats["reduce_scatter_elements"] == sum(math.prod(s) for s in SHAPES.values()) + 1

    def test_with_accumulation_the_gradients_are_summed_not_averaged(self, step):
        out, _ = _zero(step, "stage=1,bucket_mb=1", before="cleanup,grad_accumulation{microbatches=2}")
        (scatter,) = _of(out, c10d.reduce_scatter_tensor.default)
        assert scatter.args[1] == "sum"

    def test_the_plans_zero_stage_compiles_through_compile_program(self, step):
        program = compile_program(step.captured, Plan(dp=2, zero_stage=2, backend="eager", verify="deep"),
                                  MeshDesc.fake(dp=2))
        assert "optimizer_shard{" in program.attrs[GraphAttr.PASS_PIPELINE]
        assert program.main.attrs[GraphAttr.ZERO]["stage"] == 2
        assert len(_of(program.main, c10d.all_reduce.default)) == 1     # only the loss is all-reduced

    def test_an_unknown_master_is_refused_when_the_pipeline_is_parsed(self):
        from cann_passes.pass_manager import PipelineError
        with pytest.raises(PipelineError, match="option 'master' = 'halves': must be one of 'whole', 'sharded'"):
            PassManager("optimizer_shard{master=halves}")

    @pytest.mark.parametrize("text, dp, words", [
        ("optimizer_shard{stage=4}", 2, "stage=4 must be 1, 2 or 3"),
        ("optimizer_shard{first_bucket_mb=0}", 2, "first_bucket_mb=0.0 must be > 0"),
        ("optimizer_shard", 1, "needs a dp dimension of 2 or more"),
        ("data_parallel,optimizer_shard", 2, "already synchronizes gradients"),
        ("grad_accumulation{microbatches=2},optimizer_shard{master=sharded}", 2, "gradient accumulation is not built"),
    ])
    def test_it_refuses_what_it_does_not_build(self, step, text, dp, words):
        with pytest.raises(PassFailure, match=words) as info:
            PassManager(text).run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(dp=dp)))
        assert info.value.pass_name == "optimizer_shard"
