"""wait_for_reductions_first: in a step that updates its inputs, every gradient reduction issued in
backward is waited for before the first update, and nothing is added or dropped; a graph that
updates no input is left as it is. On the recipe MLP's SGD step under data parallelism (fake dp=2)."""
from __future__ import annotations

from cann_passes.pass_manager import PassContext, PassManager
from graph_ir.analysis.collectives import collective_kind, is_communication_op
from graph_ir.meta import Region, region_of
from graph_ir.mesh import MeshDesc
from tests.passes._tiny import mlp_step

MESH = MeshDesc.fake(dp=2)
TEXT = "cleanup,data_parallel{bucket_mb=0.001},wait_for_reductions_first"


def _late_waits(graph):
    """Waits of collectives issued before the optimizer that come after an optimizer update."""
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    start = next(i for i, n in enumerate(calls) if region_of(n) == Region.OPTIMIZER)
    issued = set(calls[:start])
    first = next(i for i in range(start, len(calls)) if not is_communication_op(calls[i]))
    return [n for n in calls[first:] if is_communication_op(n) and collective_kind(n) is None and n.args[0] in issued]


class TestWaitForReductionsFirst:
    def test_bucket_waits_interleaved_with_the_updates_move_before_the_first_update(self):
        step = mlp_step()
        before = PassManager("cleanup,data_parallel{bucket_mb=0.001}").run(step.captured.copy(), PassContext(mesh=MESH))
        assert _late_waits(before), "data parallelism waits for each bucket where the update reads it"
        manager = PassManager(TEXT, verify_level="deep")
        after = manager.run(step.captured.copy(), PassContext(mesh=MESH))
        record = manager.records[-1]
        assert _late_waits(after) == [] and record.stats["moved"] > 0
        assert record.nodes_before == record.nodes_after and record.ops_added == {} == record.ops_removed

    def test_a_graph_that_updates_no_input_is_unchanged(self):
        step = mlp_step()
        graph = step.captured.copy()
        graph.attrs["kind"] = "forward"
        manager = PassManager("wait_for_reductions_first", verify_level="off")
        manager.run(graph, PassContext())
        assert manager.records[-1].stats["moved"] == 0 and not manager.records[-1].changed
