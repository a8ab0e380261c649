"""grad_clip: the gradients the update reads scaled to a global 2-norm, with clip_grad_norm_'s own
ops (bitwise eager in one process), the norm reported, sharded gradients' norms all-reduced, no
update left before the norm. On the recipe MLP's captured SGD step."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from cann_passes import Plan
from cann_passes.compile import compile_program
from cann_passes.pass_manager import PassContext, PassFailure, PassManager
from graph_ir.meta import ORIGIN_PASS, REGION, GraphAttr
from graph_ir.mesh import MeshDesc
from graph_ir.signature import OutputKind, Spec
from tests.eager_reference import eager_steps
from tests.passes._tiny import aten, c10d, collectives, mlp_step, ops, run

NORM = "grad_clip:grad_norm"


@pytest.fixture(scope="module")
def step():
    return mlp_step()


def _clip(step, text: str, mesh=None):
    manager = PassManager(text, verify_level="deep")
    out = manager.run(step.captured.copy(), PassContext(mesh=mesh or MeshDesc.fake()))
    return out, manager.records


def _eager(step, max_norm: float):
    model, optimizer = step.fresh()
    return model, optimizer, eager_steps(model, optimizer, step.loss_fn, [step.batch], grad_clip=max_norm)


class TestGradClip:
    def test_it_adds_clip_grad_norm_s_ops_and_the_norm_as_a_metric(self, step):
        out, records = _clip(step, "cleanup,grad_clip{max_norm=0.05}")
        assert records[-1].ops_added == {
            "aten.linalg_vector_norm.default": 7, "aten.stack.default": 1, "aten.add.Tensor": 1,
            "aten.reciprocal.default": 1, "aten.mul.Tensor": 7, "aten.clamp.default": 1, "aten.clone.default": 1}
        assert out.signature.outputs[-1] == Spec(OutputKind.METRIC, NORM)
        added = {str(n.meta[REGION]) for n in out.compute_nodes() if n.meta.get(ORIGIN_PASS) == "grad_clip"}
        assert added == {"optimizer"} and records[-1].stats["gradients"] == 6

    def test_a_clipped_step_is_bitwise_eager_clip_grad_norm_and_reports_its_norm(self, step):
        out, _ = _clip(step, "cleanup,grad_clip{max_norm=0.05}")
        got = run(out, step)
        model, optimizer, eager = _eager(step, 0.05)
        assert got[NORM].item() == eager.grad_norms[0] > 0.05       # the clip acted
        assert got["loss"].item() == eager.losses[0]
        for name, p in model.named_parameters():
            assert torch.equal(got[name], p), name
            assert torch.equal(got[f"{name}:momentum_buffer"], optimizer.state[p]["momentum_buffer"]), name

    def test_a_max_norm_above_the_norm_leaves_the_update_bitwise_unclipped(self, step):
        out, _ = _clip(step, "cleanup,grad_clip{max_norm=1e6}")
        clipped, plain = run(out, step), run(step.captured, step)
        for name in plain:
            assert torch.equal(clipped[name], plain[name]), name

    def test_after_data_parallel_the_local_norm_is_global_and_nothing_more_is_communicated(self, step):
        dp, _ = _clip(step, "cleanup,data_parallel{bucket_mb=1}", MeshDesc.fake(dp=2))
        out, records = _clip(step, "cleanup,data_parallel{bucket_mb=1},grad_clip", MeshDesc.fake(dp=2))
        assert len(collectives(out)) == len(collectives(dp)) and records[-1].stats["sharded_gradients"] == 0

    def test_with_zero_the_squared_shard_norms_are_summed_over_dp(self, step):
        out, records = _clip(step, "cleanup,optimizer_shard{stage=1,bucket_mb=1},grad_clip", MeshDesc.fake(dp=2))
        (reduce,) = [n for n in collectives(out) if n.meta.get(ORIGIN_PASS) == "grad_clip"]
        assert reduce.target is c10d.all_reduce.default and str(reduce.meta[REGION]) == "optimizer"
        assert reduce.args[1:] == ("sum", MeshDesc.fake(dp=2).group_name("dp"))
        assert records[-1].stats["sharded_gradients"] == 6 and ops(out)["aten.sqrt.default"] == 1

    def test_no_update_of_an_early_zero_bucket_is_left_before_the_norm(self, step):
        out, records = _clip(step, "cleanup,optimizer_shard{stage=2,bucket_mb=0.001},grad_clip{max_norm=0.5}",
                             MeshDesc.fake(dp=2))
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        (coef,) = [n for n in out.graph.nodes
                   if n.target is aten.clamp.default and n.meta.get(ORIGIN_PASS) == "grad_clip"]
        gradients = [m.args[0] for m in coef.users if m.target is aten.mul.Tensor]
        assert len(gradients) == 6 and records[-1].stats["moved_nodes"] > 0
        # The coefficient comes after the last (reduce-scattered) gradient, and the update reads
        # each gradient only through its clipped copy: nothing is updated with an unclipped one.
        assert order[coef] > max(order[g] for g in gradients)
        for g in gradients:
            assert {u.meta.get(ORIGIN_PASS) for u in g.users if str(u.meta[REGION]) == "optimizer"} == {"grad_clip"}

    def test_with_accumulation_it_clips_once_per_optimizer_step_in_the_apply_graph(self, step):
        program, _ = _clip(step, "cleanup,grad_accumulation{microbatches=2},grad_clip,cleanup,split_grad_apply")
        norms = {name: ops(g)["aten.linalg_vector_norm.default"] for name, g in program.graphs.items()}
        assert norms == {"grad": 0, "apply": 7}
        assert Spec(OutputKind.METRIC, NORM) in program.graphs["apply"].signature.outputs

    def test_the_plans_grad_clip_norm_sets_max_norm(self, step):
        program = compile_program(step.captured, Plan(backend="eager", grad_clip_norm=0.25, verify="deep"))
        assert "grad_clip{max_norm=0.25}" in program.attrs[GraphAttr.PASS_PIPELINE]
        (clamp,) = [n for n in program.main.graph.nodes if n.target is aten.clamp.default]
        assert Counter(a for a in clamp.args[0].args if isinstance(a, float)) == {0.25: 1}

    @pytest.mark.parametrize("text, words", [
        ("grad_clip{max_norm=0}", "must be a finite number > 0"),
        ("grad_clip{max_norm=inf}", "must be a finite number > 0"),
        ("grad_clip,grad_clip", "already ran on this graph"),
    ])
    def test_it_refuses_a_norm_that_is_not_positive_and_finite_or_a_second_run(self, step, text, words):
        with pytest.raises(PassFailure, match=words) as info:
            PassManager(text).run(step.captured.copy(), PassContext(mesh=MeshDesc.fake()))
        assert info.value.pass_name == "grad_clip"
