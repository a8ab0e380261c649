"""cleanup: dead code removed, duplicate pure computations merged, and nothing else merged.

The rules are checked on graphs that hold exactly the duplicates in question (``make_fx`` of a
few ops), the effect on a real step on the recipe MLP's captured SGD step.
"""
from __future__ import annotations

import pytest
import torch

from cann_passes.pass_manager import PassContext, PassManager
from graph_ir.meta import RECOMPUTE, REGION
from graph_ir.mesh import MeshDesc
from tests.passes._tiny import aten, c10d, fx_graph, mlp_step, negating_lr_per_parameter, ops, run


def _clean(graph, text: str = "cleanup"):
    manager = PassManager(text, verify_level="deep")
    out = manager.run(graph, PassContext(mesh=MeshDesc.fake()))
    return out, manager.records[-1]


def _two_of_everything(x):
    """Each value twice, from identical arguments: pure ops, random draws and collectives."""
    pure = x.exp() * x.exp()
    draws = torch.rand_like(x) * torch.rand_like(x)
    reduced = (c10d.wait_tensor(c10d.all_reduce(x, "sum", "g")) *
               c10d.wait_tensor(c10d.all_reduce(x, "sum", "g")))
    return [(pure + draws + reduced).sum()]


@pytest.fixture(scope="module")
def step():
    return mlp_step()


class TestCleanup:
    def test_cse_merges_two_identical_pure_ops_into_one(self):
        out, record = _clean(fx_graph(_two_of_everything, torch.randn(4, 4)))
        assert ops(out)["aten.exp.default"] == 1
        assert record.stats["merged"] == 1 and record.ops_removed == {"aten.exp.default": 1}

    def test_cse_never_merges_two_random_draws(self):
        out, _ = _clean(fx_graph(_two_of_everything, torch.randn(4, 4)))
        assert ops(out)["aten.rand_like.default"] == 2

    def test_cse_never_merges_two_collectives_with_the_same_arguments(self):
        out, _ = _clean(fx_graph(_two_of_everything, torch.randn(4, 4)))
        assert ops(out)["_c10d_functional.all_reduce.default"] == 2
        assert ops(out)["_c10d_functional.wait_tensor.default"] == 2

    def test_a_forward_value_computed_again_in_backward_is_left_as_a_recompute(self):
        graph = fx_graph(lambda x: [(x.exp() * x.exp()).sum()], torch.randn(4, 4))
        second = [n for n in graph.graph.nodes if n.target is aten.exp.default][1]
        for node in list(graph.graph.nodes)[list(graph.graph.nodes).index(second):-1]:
            node.meta[REGION] = "backward"     # the second exp and everything after it
        out, record = _clean(graph)
        assert sorted(str(n.meta[REGION]) for n in out.graph.nodes if n.target is aten.exp.default) == [
            "backward", "forward"]
        assert record.stats["merged"] == 0

    def test_two_recomputed_copies_are_not_merged(self):
        graph = fx_graph(lambda x: [(x.exp() * x.exp()).sum()], torch.randn(4, 4))
        for node in graph.graph.nodes:
            if node.target is aten.exp.default:
                node.meta[RECOMPUTE] = True
        out, _ = _clean(graph)
        assert ops(out)["aten.exp.default"] == 2

    def test_dead_nodes_are_removed_with_or_without_cse(self, step):
        graph = step.captured.copy()
        weight = next(n for n in graph.graph.nodes if n.op == "placeholder" and n.name == "param_fc1_weight")
        with graph.graph.inserting_after(weight):
            dead = graph.graph.call_function(aten.cos.default, (weight,))
        dead.meta.update(weight.meta, **{REGION: "forward"})
        out, record = _clean(graph, "cleanup{cse=false}")
        assert ops(out)["aten.cos.default"] == 0
        assert record.stats == {"cat_to_clone": 0, "merged": 0, "removed": 1}

    def test_a_cat_of_one_tensor_and_legacy_empties_becomes_a_contiguous_clone(self):
        # A key/value cache's first update: ``cat`` skips the (0,)-shaped empty and returns a
        # contiguous copy of the strided key, which the view after it relies on.
        def cache_update(x):
            key = x.view(2, 3, 4).transpose(0, 1)
            return [torch.cat([x.new_zeros(0), key], dim=-2).view(6, 4).exp().sum()]

        x = torch.randn(6, 4)
        graph = fx_graph(cache_update, x)
        out, record = _clean(graph)
        assert record.stats["cat_to_clone"] == 1 and ops(out)["aten.cat.default"] == 0
        clone = next(n for n in out.graph.nodes if n.target is aten.clone.default)
        assert clone.kwargs == {"memory_format": torch.contiguous_format}
        empties = [n for n in out.graph.nodes
                   if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].shape == (0,)]
        assert empties == []    # the empty went with its last use
        assert torch.equal(out.gm(x)[0], cache_update(x)[0])

    def test_a_cat_of_two_real_tensors_or_of_a_promoted_dtype_stays(self):
        def joins(x):
            return [torch.cat([x, x], dim=0).sum() +
                    torch.cat([x.new_zeros(0, dtype=torch.float64), x], dim=0).sum()]

        out, record = _clean(fx_graph(joins, torch.randn(3, 4)))
        assert record.stats["cat_to_clone"] == 0 and ops(out)["aten.cat.default"] == 2

    def test_the_captured_step_negates_lr_once_per_group(self, step):
        # torch.optim negates lr for every parameter; capture traces such group-only scalars once.
        assert ops(step.captured)["aten.neg.default"] == 1

    def test_the_step_loses_its_duplicate_lr_negations_and_keeps_every_output(self, step):
        graph = negating_lr_per_parameter(step.captured)
        assert ops(graph)["aten.neg.default"] == 6
        out, record = _clean(graph)
        assert ops(out)["aten.neg.default"] == 1
        assert record.ops_added == {} and record.ops_removed == {"aten.neg.default": 5}
        assert out.signature.outputs == step.captured.signature.outputs

    def test_without_cse_the_duplicates_stay(self, step):
        out, record = _clean(negating_lr_per_parameter(step.captured), "cleanup{cse=false}")
        assert ops(out)["aten.neg.default"] == 6 and not record.changed

    def test_the_cleaned_step_computes_bitwise_what_the_captured_step_computes(self, step):
        out, _ = _clean(negating_lr_per_parameter(step.captured))
        want, got = run(step.captured, step), run(out, step)
        assert list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name

    def test_a_second_cleanup_finds_nothing_to_do(self, step):
        manager = PassManager("cleanup,cleanup", verify_level="deep")
        manager.run(negating_lr_per_parameter(step.captured), PassContext(mesh=MeshDesc.fake()))
        first, second = manager.records
        assert first.changed and not second.changed and second.stats == {"cat_to_clone": 0, "merged": 0, "removed": 0}
