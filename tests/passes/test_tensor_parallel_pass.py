"""tensor_parallel, the pass on its own: user rules on the recipe MLP's captured SGD step, one rank
of a fake ``tp=2`` mesh. Megatron's MLP split (column then row) costs one all-reduce in forward,
and one more in backward when the column layer's input needs a gradient; the layouts are recorded.
The model families' built-in rules and multi-process numerics are tests/tensor_parallel's."""
from __future__ import annotations

import pytest

from cann_passes.pass_manager import PassContext, PassFailure, PassManager
from graph_ir.mesh import MeshDesc
from graph_ir.signature import InputKind, OutputKind
from tests.passes._tiny import c10d, collectives, mlp_step, ops

SHAPES = {"fc1.weight": (32, 12), "fc1.bias": (32,), "fc2.weight": (32, 32), "fc2.bias": (32,),
          "fc3.weight": (5, 32), "fc3.bias": (5,)}


@pytest.fixture(scope="module")
def step():
    return mlp_step()


def _tp(step, rules: str, tp: int = 2, rank: int = 0):
    manager = PassManager(f'cleanup,tensor_parallel{{rules="{rules}"}}', verify_level="deep")
    out = manager.run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(tp=tp, rank=rank)))
    return out, manager.records[-1]


def _shapes(graph, kind, outputs=False):
    pairs = (zip(graph.signature.outputs, graph.output_values()) if outputs
             else zip(graph.signature.inputs, graph.placeholders()))
    return {s.name: tuple(n.meta["val"].shape) for s, n in pairs if s.kind == kind}


@pytest.fixture(scope="module")
def megatron(step):
    """fc1 column-parallel, fc2 row-parallel, fc3 replicated."""
    return _tp(step, "fc1=column;fc2=row")


class TestTensorParallel:
    def test_column_and_row_rules_give_each_rank_its_shard_of_the_weights_and_their_state(self, megatron):
        out, _ = megatron
        local = dict(SHAPES, **{"fc1.weight": (16, 12), "fc1.bias": (16,), "fc2.weight": (32, 16)})
        assert _shapes(out, InputKind.PARAM) == local == _shapes(out, OutputKind.PARAM, outputs=True)
        assert _shapes(out, InputKind.OPT_STATE)["fc2.weight:momentum_buffer"] == (32, 16)

    def test_a_column_then_row_split_all_reduces_once_in_forward_and_never_in_backward(self, megatron):
        out, record = megatron
        (reduce,) = collectives(out)
        assert reduce.target is c10d.all_reduce.default and str(reduce.meta["region"]) == "forward"
        assert reduce.args[1:] == ("sum", MeshDesc.fake(tp=2).group_name("tp"))
        assert tuple(reduce.args[0].meta["val"].shape) == (8, 32)      # fc2's partial output, whole
        assert record.stats == {"forward.all_reduce": 1}

    def test_a_column_layer_whose_input_needs_a_gradient_all_reduces_it_in_backward(self, step):
        out, record = _tp(step, "fc2=column;fc3=row")
        assert [(str(n.meta["region"]), tuple(n.args[0].meta["val"].shape)) for n in collectives(out)] == [
            ("forward", (8, 5)), ("backward", (8, 32))]
        assert record.stats == {"forward.all_reduce": 1, "backward.all_reduce": 1}

    def test_the_layouts_are_recorded_as_placements_and_in_the_graphs_attrs(self, megatron):
        out, _ = megatron
        placements = out.attrs["placements"]
        assert placements["param:fc1.weight"] == {"shape": [32, 12], "axes": {"tp": {"type": "shard", "dim": 0}}}
        assert placements["param:fc2.weight"] == {"shape": [32, 32], "axes": {"tp": {"type": "shard", "dim": 1}}}
        assert placements["opt_state:fc1.bias:momentum_buffer"]["axes"] == {"tp": {"type": "shard", "dim": 0}}
        assert not any(k.endswith(("fc2.bias", "fc3.weight", "fc3.bias")) for k in placements)
        info = out.attrs["tensor_parallel"]
        assert info["tp"] == 2 and info["family"] == "user" and info["rules"] == "fc1=column;fc2=row"
        assert info["params"]["fc2.weight"]["dim"] == 1

    def test_every_rank_gets_the_same_program_on_its_own_shard(self, step, megatron):
        rank0, _ = megatron
        rank1, _ = _tp(step, "fc1=column;fc2=row", rank=1)
        assert rank1.attrs["tensor_parallel"]["rank"] == 1
        assert ops(rank1) == ops(rank0) and _shapes(rank1, InputKind.PARAM) == _shapes(rank0, InputKind.PARAM)

    def test_tp_1_leaves_the_step_unchanged(self, step):
        out, record = _tp(step, "fc1=column;fc2=row", tp=1)
        assert not record.changed and collectives(out) == [] and _shapes(out, InputKind.PARAM) == SHAPES

    @pytest.mark.parametrize("text, tp, words", [
        ('tensor_parallel{rules="nosuch=column"}', 2, "matches no parameter"),
        ('tensor_parallel{rules="fc1=sideways"}', 2, "style one of column, row, vocab"),
        ('tensor_parallel', 2, "no rule applies"),
        ('tensor_parallel{rules="fc1=column;fc2=row"}', 3, "not divisible by tp=3"),
        ('data_parallel,tensor_parallel{rules="fc1=column;fc2=row"}', 2, "must run before data_parallel"),
    ])
    def test_it_refuses_rules_that_match_nothing_or_do_not_divide_and_a_late_place(self, step, text, tp, words):
        with pytest.raises(PassFailure, match=words) as info:
            PassManager(text).run(step.captured.copy(), PassContext(mesh=MeshDesc.fake(tp=tp, dp=2)))
        assert info.value.pass_name == "tensor_parallel"
