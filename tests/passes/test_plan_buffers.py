"""plan_buffers: the eager backend's buffers held across steps, packed into shared slots; the graph
stays functional, the lowered step calls the kernels' out= overloads and computes bitwise the same."""
from __future__ import annotations

import pytest
import torch

from cann_passes.compile import with_required_passes
from cann_passes.lowering.base import BUFFER_PLAN_ENV
from cann_passes.lowering.eager import EagerLowering
from cann_passes.pass_manager import PassContext, PassManager, Pipeline
from cann_passes.lowering.held_buffers import apply_buffer_plan
from cann_passes.passes.plan_buffers import out_overload, plan_buffers
from graph_ir.analysis.memory import buffer_bytes, storage_roots
from graph_ir.meta import HELD_BUFFER, GraphAttr
from tests.passes._tiny import mlp_step

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
PIPELINE = "cleanup,wait_for_reductions_first,scalars_on_host,reuse_dead_operands,plan_buffers{min_bytes=0}"


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1)


def _planned():
    step = mlp_step(_adam)
    manager = PassManager(PIPELINE, verify_level="deep")
    return step, manager.run(step.captured.copy(), PassContext()), manager.records[-1]


def test_out_overloads_are_the_devices_own_kernels_or_none():
    assert out_overload(aten.mm.default, "cpu") is aten.mm.out
    assert out_overload(aten.add.Tensor, "cpu") is aten.add.out
    assert out_overload(aten.sum.dim_IntList, "cpu") is aten.sum.IntList_out
    assert out_overload(aten.gelu_backward.default, "cpu") is aten.gelu_backward.grad_input
    assert out_overload(c10d.all_gather_into_tensor.default, "cpu") is c10d.all_gather_into_tensor_out.default
    # torch generates these as "the functional op, then a copy": no buffer saved, not used
    assert out_overload(aten.mul.Scalar, "cpu") is None
    assert out_overload(aten.embedding_dense_backward.default, "cpu") is None
    assert out_overload(aten.native_layer_norm.default, "cpu") is None      # three results


def test_the_pass_only_marks_and_buffers_share_slots():
    step, graph, record = _planned()
    marked = [n for n in graph.graph.nodes if n.meta.get(HELD_BUFFER) is not None]
    sizes = graph.attrs[GraphAttr.BUFFER_PLAN]
    assert record.stats["planned"] == len(marked) > 0
    assert record.stats["slots"] == len(sizes) < len(marked), "no slot was reused"
    assert record.stats["held_bytes"] == sum(sizes) < sum(buffer_bytes(n) for n in marked)
    assert record.stats["peak_planned_bytes"] <= record.stats["held_bytes"]
    inputs = step.inputs()
    expected = step.captured.gm(*[t.clone() for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(graph.gm(*[t.clone() for t in inputs]), expected))


def test_nothing_the_step_returns_or_is_given_is_held():
    _, graph, _ = _planned()
    roots = storage_roots(graph.graph)
    returned = {roots[a] for a in graph.graph.output_node().all_input_nodes}
    assert not any(r.meta.get(HELD_BUFFER) is not None for r in returned)
    assert not any(p.meta.get(HELD_BUFFER) is not None for p in graph.placeholders())


def test_the_lowered_step_writes_slots_and_steps_bitwise_like_the_functional_graph():
    step, graph, _ = _planned()
    runner = EagerLowering().compile(graph, None, None)
    held = [n for n in runner.run.graph.nodes if n.op == "get_attr" and n.target.startswith("_held_")]
    assert held and all(len(n.users) == 1 for n in held)
    inputs = step.inputs()
    expected = step.captured.gm(*[t.clone() for t in inputs])
    for _ in range(3):       # the second and third calls find the slots holding the last call's values
        got = runner(*[t.clone() for t in inputs])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    slots = {getattr(runner.run, n.target).untyped_storage().data_ptr() for n in held}
    assert len(slots) <= len(graph.attrs[GraphAttr.BUFFER_PLAN]) and len(slots) < len(held)


def _graph_with_a_collective_in_flight() -> tuple[torch.fx.Graph, dict]:
    """x = a @ b is all-reduced; y = c @ d, the same size, is made while the reduction is in flight."""
    g = torch.fx.Graph()
    val = torch.empty(64, 64)
    a, b, c, d = (g.placeholder(n) for n in "abcd")
    x = g.call_function(aten.mm.default, (a, b))
    reduced = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    y = g.call_function(aten.mm.default, (c, d))
    done = g.call_function(c10d.wait_tensor.default, (reduced,))
    z = g.call_function(aten.add.Tensor, (done, y))
    g.output([z])
    for n in g.nodes:
        if n.op != "output":
            n.meta["val"] = val
    return g, {"x": x, "y": y, "z": z}


def test_a_buffer_a_collective_reads_is_held_until_its_wait():
    g, nodes = _graph_with_a_collective_in_flight()
    slot_of, sizes, _ = plan_buffers(g, min_bytes=0)
    assert nodes["x"] in slot_of and nodes["y"] in slot_of and nodes["z"] not in slot_of   # z is returned
    assert slot_of[nodes["x"]] != slot_of[nodes["y"]], "y would overwrite x while the peers read it"
    # Without the collective, x dies at its last reader and y takes its slot.
    g2 = torch.fx.Graph()
    val = torch.empty(64, 64)
    a, b, c, d = (g2.placeholder(n) for n in "abcd")
    x = g2.call_function(aten.mm.default, (a, b))
    s = g2.call_function(aten.sum.default, (x,))
    y = g2.call_function(aten.mm.default, (c, d))
    z = g2.call_function(aten.add.Tensor, (y, s))
    g2.output([z])
    for n in g2.nodes:
        if n.op != "output":
            n.meta["val"] = val if n is not s else torch.empty(())
    slot_of, sizes, _ = plan_buffers(g2, min_bytes=0)
    assert slot_of[x] == slot_of[y] and len(sizes) == 1


def test_the_slots_views_follow_the_graphs_values():
    g, nodes = _graph_with_a_collective_in_flight()
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    slot_of, sizes, _ = plan_buffers(g, min_bytes=0)
    for n, slot in slot_of.items():
        n.meta[HELD_BUFFER] = slot
    assert apply_buffer_plan(gm, sizes) == 2
    mms = [n for n in gm.graph.nodes if n.target is aten.mm.out]
    assert len(mms) == 2 and all(n.kwargs["out"].op == "get_attr" for n in mms)
    held = {getattr(gm, n.kwargs["out"].target).untyped_storage().data_ptr() for n in mms}
    assert len(held) == len(sizes) == 2


def test_the_eager_backend_plans_its_buffers_unless_told_not_to(monkeypatch):
    names = lambda p: [s.name for s in p.passes]   # noqa: E731
    assert names(with_required_passes(Pipeline.parse("cleanup"), "eager"))[-2:] == \
        ["reuse_dead_operands", "plan_buffers"]
    # a text that names it earlier, with options, gets it last, its options kept
    moved = with_required_passes(Pipeline.parse("plan_buffers{min_bytes=0},cleanup"), "eager")
    assert str(moved).endswith("reuse_dead_operands,plan_buffers{min_bytes=0}")
    assert "plan_buffers" not in names(with_required_passes(Pipeline.parse("cleanup"), "inductor"))
    monkeypatch.setenv(BUFFER_PLAN_ENV, "0")
    assert "plan_buffers" not in names(with_required_passes(Pipeline.parse("cleanup"), "eager"))
    # named by the text though the backend does not ask for it: still after the in-place marks it reads
    assert names(with_required_passes(Pipeline.parse("plan_buffers,cleanup"), "eager"))[-2:] == \
        ["reuse_dead_operands", "plan_buffers"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_compiled_step_with_held_buffers_trains_bitwise_like_eager(optimizer):
    from cann_passes import Plan, compile_for_npu
    from tests.eager_reference import eager_steps
    from recipes.models.gpt import GPT, GPTConfig, gpt_loss
    torch.manual_seed(0)
    make = lambda: GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16, dropout=0.0))  # noqa: E731
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    opt_of = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)) if optimizer == "adamw" else \
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        idx = torch.randint(0, 64, (4, 17), generator=g)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    expected = eager_steps(reference, opt_of(reference.parameters()), gpt_loss, batches).losses
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off", extra_passes=("plan_buffers{min_bytes=0}",)),
                           optimizer=opt_of(model.parameters()), loss_fn=gpt_loss)
    got = [float(step(b)) for b in batches]
    assert got == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
