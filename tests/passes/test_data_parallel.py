"""data_parallel: bucketed gradient all-reduces over the mesh's dp axis, sent in backward and waited
for where the update first reads them, and the loss averaged over ranks; on the recipe MLP's
captured SGD step, compiled for rank 0 of a fake ``dp=2`` mesh (no process group)."""
from __future__ import annotations

import pytest

from cann_passes import Plan
from cann_passes.compile import compile_program
from cann_passes.pass_manager import PassContext, PassFailure, PassManager
from graph_ir.meta import GRADIENT_OF, REGION, GraphAttr
from graph_ir.mesh import MeshDesc
from graph_ir.signature import OutputKind
from tests.passes._tiny import c10d, collectives, mlp_step

MESH = MeshDesc.fake(dp=2)
GRADIENT_ELEMENTS = 12 * 32 + 32 + 32 * 32 + 32 + 32 * 5 + 5      # every parameter of MLP([12, 32, 32, 5])


@pytest.fixture(scope="module")
def step():
    return mlp_step()


def _dp(step, text="cleanup,data_parallel{bucket_mb=1}", mesh=MESH):
    manager = PassManager(text, verify_level="deep")
    out = manager.run(step.captured.copy(), PassContext(mesh=mesh))
    return out, manager.records[-1]


def _gradient_reduces(graph):
    loss = graph.output_values()[graph.signature.output_index(OutputKind.LOSS, "loss")]
    loss_reduce = loss.args[0]
    return [n for n in collectives(graph) if n is not loss_reduce]


class TestDataParallel:
    def test_gradients_that_fit_one_bucket_are_all_reduced_once_averaged_over_the_dp_group(self, step):
        out, record = _dp(step)
        reduces = _gradient_reduces(out)
        assert len(reduces) == 1 and reduces[0].target is c10d.all_reduce.default
        assert reduces[0].args[1:] == ("avg", MESH.group_name("dp"))
        assert reduces[0].args[0].meta["val"].numel() == GRADIENT_ELEMENTS
        assert record.stats["buckets"] == 1
        assert out.attrs[GraphAttr.DATA_PARALLEL] == {"dp": 2, "buckets": 1, "algo": "auto"}

    def test_small_buckets_split_the_gradients_in_backward_order_and_move_the_same_elements(self, step):
        one, one_record = _dp(step)
        out, record = _dp(step, "cleanup,data_parallel{bucket_mb=0.001}")     # 1 KiB: a few gradients each
        sizes = [n.args[0].meta["val"].numel() for n in _gradient_reduces(out)]
        # fc3's and fc2's bias first (backward produces the last layer's gradients first), then one each.
        assert sizes == [5 + 160 + 32, 1024, 32, 384] and record.stats["buckets"] == 4
        assert record.stats["all_reduce_elements"] == one_record.stats["all_reduce_elements"]

    def test_the_first_bucket_is_capped_at_first_bucket_mb_as_ddp_caps_its_first(self, step):
        one, _ = _dp(step)
        out, record = _dp(step, "cleanup,data_parallel{bucket_mb=1,first_bucket_mb=0.001}")
        sizes = [n.args[0].meta["val"].numel() for n in _gradient_reduces(out)]
        # 1 KiB first (the gradients backward produces first), the rest in one bucket of 1 MiB.
        assert sizes == [5 + 160 + 32, GRADIENT_ELEMENTS - 197] and record.stats["buckets"] == 2
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        last_backward = max((n for n in out.compute_nodes() if str(n.meta[REGION]) == "backward"),
                            key=order.__getitem__)
        assert order[_gradient_reduces(out)[0]] < order[last_backward]
        with pytest.raises(PassFailure, match="first_bucket_mb=0.0 must be > 0"):
            _dp(step, "cleanup,data_parallel{first_bucket_mb=0.0}")

    def test_each_bucket_is_sent_in_backward_and_waited_for_in_the_optimizer_region(self, step):
        out, _ = _dp(step, "cleanup,data_parallel{bucket_mb=0.001}")
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        last_backward = max((n for n in out.compute_nodes() if str(n.meta[REGION]) == "backward"),
                            key=order.__getitem__)
        first_update = min((n for n in out.compute_nodes() if str(n.meta[REGION]) == "optimizer"),
                           key=order.__getitem__)
        for reduce in _gradient_reduces(out):
            (wait,) = reduce.users
            assert str(reduce.meta[REGION]) == "backward" and str(wait.meta[REGION]) == "optimizer"
            assert wait.target is c10d.wait_tensor.default and order[wait] >= order[first_update]
        # The first bucket goes out while backward still runs: it can overlap with the rest.
        assert order[_gradient_reduces(out)[0]] < order[last_backward]

    def test_the_update_reads_only_synchronized_gradients(self, step):
        out, _ = _dp(step)
        reads = {i for n in out.compute_nodes() if str(n.meta[REGION]) == "optimizer" for i in n.all_input_nodes
                 if i.op != "placeholder" and str(i.meta[REGION]) == "backward"}
        assert reads == set(_gradient_reduces(out))         # only through the all-reduce's wait
        marked = [n for n in out.graph.nodes if GRADIENT_OF in n.meta]
        assert len(marked) == 6 and all(str(n.meta[REGION]) == "optimizer" for n in marked)

    def test_the_loss_output_is_the_mean_over_ranks(self, step):
        out, _ = _dp(step)
        loss = out.output_values()[out.signature.output_index(OutputKind.LOSS, "loss")]
        assert loss.target is c10d.wait_tensor.default
        assert loss.args[0].target is c10d.all_reduce.default and loss.args[0].args[1] == "avg"

    def test_with_accumulation_gradients_are_summed_once_at_the_start_of_the_optimizer(self, step):
        out, _ = _dp(step, "cleanup,grad_accumulation{microbatches=2},data_parallel{bucket_mb=1}")
        (reduce,) = _gradient_reduces(out)
        assert reduce.args[1] == "sum" and str(reduce.meta[REGION]) == "optimizer"

    def test_the_plans_pipeline_gives_rank_1_the_same_collectives(self, step):
        programs = [compile_program(step.captured, Plan(dp=2, backend="eager", verify="deep"),
                                    MeshDesc.fake(dp=2, rank=r)) for r in (0, 1)]
        shapes = [[(n.target, n.args[1], n.args[0].meta["val"].numel()) for n in collectives(p.main)]
                  for p in programs]
        assert shapes[0] == shapes[1] and len(shapes[0]) == 2
        assert "data_parallel{" in programs[0].attrs[GraphAttr.PASS_PIPELINE]

    def test_an_unknown_algo_is_refused_when_the_pipeline_is_parsed(self):
        from cann_passes.pass_manager import PipelineError
        with pytest.raises(PipelineError, match="option 'algo' = 'butterfly': must be one of 'auto', 'ring', 'tree'"):
            PassManager("data_parallel{algo=butterfly}")

    @pytest.mark.parametrize("text, mesh, words", [
        ("data_parallel{bucket_mb=0}", MESH, "bucket_mb=0.0 must be > 0"),
        ("optimizer_shard,data_parallel", MESH, "reduce gradients twice"),
        ("data_parallel", None, "needs ctx.mesh"),
    ])
    def test_it_refuses_a_bad_option_a_second_synchronization_or_no_mesh(self, step, text, mesh, words):
        with pytest.raises(PassFailure, match=words) as info:
            PassManager(text).run(step.captured.copy(), PassContext(mesh=mesh))
        assert info.value.pass_name == "data_parallel"
