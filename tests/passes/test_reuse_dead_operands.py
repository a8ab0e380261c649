"""reuse_dead_operands: marks the pointwise ops that may run in place over a dying operand's buffer,
and the updated inputs the step may write; the graph stays functional (it verifies and runs as
captured) and the eager lowering's in-place run is bitwise the functional one."""
from __future__ import annotations

import torch

from cann_passes.lowering.eager import EagerLowering
from cann_passes.pass_manager import PassContext, PassManager
from graph_ir.meta import REUSES_OPERAND, GraphAttr
from graph_ir.multi_tensor_ops import FUSED_ADAM
from tests.passes._tiny import mlp_step


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _marked(text: str = "cleanup,reuse_dead_operands"):
    step = mlp_step(_adamw)
    manager = PassManager(text, verify_level="deep")
    return step, manager.run(step.captured.copy(), PassContext()), manager.records[-1]


class TestReuseDeadOperands:
    def test_the_pass_only_marks_and_the_graph_stays_functional(self):
        step, graph, record = _marked()
        marked = [n for n in graph.graph.nodes if n.meta.get(REUSES_OPERAND)]
        assert marked and record.stats["marked"] == len(marked)
        assert all(not n.target._schema.is_mutable for n in marked)      # still the functional ops
        inputs = step.inputs()
        kept = [t.clone() for t in inputs]
        expected = step.captured.gm(*[t.clone() for t in inputs])
        got = graph.gm(*inputs)
        assert all(torch.equal(a, b) for a, b in zip(inputs, kept)), "the marked graph wrote an input"
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

    def test_parameters_and_optimizer_state_the_step_returns_are_listed_as_written(self):
        step, graph, record = _marked()
        written = set(graph.attrs[GraphAttr.WRITTEN_INPUTS])
        kinds = {s.kind for s, p in zip(graph.signature.inputs, graph.placeholders()) if p.name in written}
        assert kinds == {"param", "opt_state"} and record.stats["written_inputs"] == len(written)

    def test_without_inputs_no_input_is_written(self):
        _, graph, record = _marked("cleanup,reuse_dead_operands{inputs=false}")
        assert graph.attrs[GraphAttr.WRITTEN_INPUTS] == [] and record.stats["marked"] > 0

    def test_the_eager_lowering_runs_the_marks_in_place_bitwise_like_the_functional_graph(self):
        step, graph, _ = _marked()
        runner = EagerLowering().compile(graph, None, None)
        assert runner.written_inputs and any(isinstance(n.target, torch._ops.OpOverload) and
                                             n.target._schema.is_mutable for n in runner.run.graph.nodes)
        inputs = step.inputs()
        expected = step.captured.gm(*[t.clone() for t in inputs])
        got = runner(*inputs)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

    def test_running_it_again_replaces_the_marks(self):
        _, graph, _ = _marked("cleanup,reuse_dead_operands,reuse_dead_operands{inputs=false}")
        assert graph.attrs[GraphAttr.WRITTEN_INPUTS] == []

    def test_the_fused_adam_kernel_writes_the_parameters_and_state_it_updates_where_they_die(self):
        step, graph, _ = _marked("cleanup,fuse_optimizer{kernel=fused},reuse_dead_operands")
        fused = next(n for n in graph.graph.nodes if n.target is FUSED_ADAM)
        assert fused.meta.get(REUSES_OPERAND)
        written = set(graph.attrs[GraphAttr.WRITTEN_INPUTS])
        updated = {p.name for p in fused.args[0] + fused.args[2] + fused.args[3]}   # params and moments
        assert updated <= written
        runner = EagerLowering().compile(graph, None, None)
        inputs = step.inputs()
        expected = graph.gm(*[t.clone() for t in inputs])       # the functional op on copies
        got = runner(*inputs)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        by_name = dict(zip([p.name for p in graph.placeholders()], inputs))
        outputs = dict(zip([s.name for s in graph.signature.outputs], got))
        param = fused.args[0][0]
        assert outputs[next(s.name for s, p in zip(graph.signature.inputs, graph.placeholders()) if p is param)] \
            is by_name[param.name]                               # the new parameter is the input, written

    def test_without_inputs_the_fused_kernel_runs_on_copies(self):
        _, graph, _ = _marked("cleanup,fuse_optimizer{kernel=fused},reuse_dead_operands{inputs=false}")
        fused = next(n for n in graph.graph.nodes if n.target is FUSED_ADAM)
        assert not fused.meta.get(REUSES_OPERAND) and graph.attrs[GraphAttr.WRITTEN_INPUTS] == []


def test_an_input_of_a_collective_in_flight_is_not_written_before_its_wait():
    """The peers read an all-gather's input until its wait (gloo copies it on a worker thread): a
    pointwise op between the issue and the wait must not run in place over it; after the wait it may."""
    from cann_passes.passes.reuse_dead_operands import mark_reuse
    c10d = torch.ops._c10d_functional

    def graph(read_before_wait: bool) -> torch.fx.Graph:
        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        gathered = g.call_function(c10d.all_gather_into_tensor.default, (y, 2, "0"))
        if read_before_wait:
            z = g.call_function(torch.ops.aten.add.Tensor, (y, 1.0))
            done = g.call_function(c10d.wait_tensor.default, (gathered,))
        else:
            done = g.call_function(c10d.wait_tensor.default, (gathered,))
            z = g.call_function(torch.ops.aten.add.Tensor, (y, 1.0))
        g.output((z, done))
        for n in g.nodes:
            if n.op != "output":
                rows = 8 if n.target in (c10d.all_gather_into_tensor.default, c10d.wait_tensor.default) else 4
                n.meta["val"] = torch.empty(rows, 3)
        return g

    for read_before_wait in (True, False):
        g = graph(read_before_wait)
        add = next(n for n in g.nodes if n.target is torch.ops.aten.add.Tensor)
        assert (add in mark_reuse(g).rewrites) is not read_before_wait


def _bucket_graph(read: str) -> torch.fx.Graph:
    """``cat`` two gradients into a bucket, all-reduce it and read the result; ``read``: where the
    bucket itself is read once more ("none", "between" issue and wait, "after" the wait), or
    "other" for a second collective still in flight on it at the all-reduce."""
    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    bucket = g.call_function(torch.ops.aten.cat.default, ([a, b],))
    if read == "other":
        other = g.call_function(c10d.all_reduce.default, (bucket, "max", "0"))
    reduced = g.call_function(c10d.all_reduce.default, (bucket, "avg", "0"))
    extra = [g.call_function(torch.ops.aten.mul.Tensor, (bucket, 2.0))] if read == "between" else []
    done = g.call_function(c10d.wait_tensor.default, (reduced,))
    if read == "other":
        extra = [g.call_function(c10d.wait_tensor.default, (other,))]
    if read == "after":
        extra = [g.call_function(torch.ops.aten.mul.Tensor, (bucket, 2.0))]
    g.output((g.call_function(torch.ops.aten.mul.Tensor, (done, 0.5)), *extra))
    for n in g.nodes:
        if n.op != "output":
            n.meta["val"] = torch.empty(8 if n.op != "placeholder" else 4)
    return g


def test_a_bucket_all_reduce_runs_in_place_where_the_bucket_dies_there():
    """The functional all-reduce copies its input first; where the flattened bucket has no reader
    after the collective (and no other collective still reads it) the eager lowering reduces it in
    place (``all_reduce_``)."""
    from cann_passes.passes.reuse_dead_operands import apply_reuse, mark_reuse
    c10d = torch.ops._c10d_functional
    for read in ("none", "between", "after", "other"):
        g = _bucket_graph(read)
        reduce = next(n for n in g.nodes if n.target is c10d.all_reduce.default and n.args[1] == "avg")
        assert (reduce in mark_reuse(g).rewrites) is (read == "none"), read
    g = _bucket_graph("none")
    mark_reuse(g)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert apply_reuse(gm) == 2     # the all-reduce and the final mul (over the reduced bucket)
    assert [n.target for n in gm.graph.nodes if "all_reduce" in str(n.target)] == [c10d.all_reduce_.default]
