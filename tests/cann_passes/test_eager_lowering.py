"""The eager backend's buffer reuse: in-place only where the functional graph's buffer is dead, and into
parameter and optimizer-state inputs only where the step returns them as their own new value."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pytest

from cann_passes import Plan, compile_for_npu
from cann_passes.passes.reuse_dead_operands import reuse_dead_operands
from tests.conftest import eager_losses, mlp_batches, tiny_mlp

aten = torch.ops.aten


def _traced(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm


def _run_both(fn, *args):
    gm = _traced(fn, *args)
    reference = [t.clone() for t in gm(*args)]
    assert len(reference) > 1
    rewritten = reuse_dead_operands(gm)
    kept = [a.clone() for a in args]
    out = gm(*args)
    assert all(torch.equal(a, k) for a, k in zip(args, kept)), "a graph input was written"
    assert all(torch.equal(o, r) for o, r in zip(out, reference))
    return gm, rewritten


def test_chain_of_temporaries_is_updated_in_place_inputs_are_not():
    def step(p, g, m):
        m2 = m * 0.9 + g * 0.1          # m2's temporaries die at the add
        return p - (m2.sqrt() + 1e-8).reciprocal() * 1e-3, m2

    args = (torch.randn(64), torch.rand(64), torch.rand(64))   # m2 > 0: no NaN from sqrt
    gm, rewritten = _run_both(step, *args)
    assert rewritten >= 3
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.add_.Tensor in targets
    # p and m are inputs: the ops reading them first stay functional.
    first = [n for n in gm.graph.nodes if n.op == "call_function"][0]
    assert first.target is aten.mul.Tensor


def test_buffer_read_later_or_returned_or_viewed_is_not_reused():
    def f(x):
        a = x * 2
        b = a + 1          # a is read again below: must stay
        c = a.view(-1)     # an alias of a, read after the next op
        d = b.exp()        # b is returned: must stay
        return b, d + c.sum()

    gm, _ = _run_both(f, torch.randn(4, 4))
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name["add"].target is aten.add.Tensor
    assert by_name["exp"].target is aten.exp.default


def test_broadcast_and_dtype_change_stay_functional():
    def f(x, y):
        a = x * 2                      # (1, 4)
        b = a + y                      # broadcasts to (4, 4): a cannot hold it
        c = b.to(torch.float64) * 2    # dtype change
        return b.sum() + c.sum(), b

    gm, _ = _run_both(f, torch.randn(1, 4), torch.randn(4, 4))
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name["add"].target is aten.add.Tensor


# -- graph inputs updated in place -----------------------------------------------------------------

def _optimizer_region(gm):
    from graph_ir.meta import REGION, Region
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[REGION] = Region.OPTIMIZER.value
    return gm


def test_an_input_is_written_only_where_the_graph_returns_it_as_its_new_value():
    def update(p, m, g):
        m2 = m * 0.9 + g                 # ends in output 1: m's new value
        p2 = (p * 0.5).cumsum(0)         # cumsum is not pointwise: p's chain ends in a fresh buffer
        return p2, m2

    args = (torch.randn(8), torch.randn(8), torch.randn(8))
    gm = _optimizer_region(_traced(update, *args))
    reference = gm(*[a.clone() for a in args])
    p, m, g = gm.graph.find_nodes(op="placeholder")
    reuse_dead_operands(gm, {p: 0, m: 1})
    assert gm.meta["written_inputs"] == [m.name]
    inputs = [a.clone() for a in args]
    out = gm(*inputs)
    assert out[1] is inputs[1], "m's new value is m itself"
    assert torch.equal(inputs[0], args[0]) and torch.equal(inputs[2], args[2])
    assert all(torch.equal(o, r) for o, r in zip(out, reference))


def test_no_input_is_written_before_the_last_forward_or_backward_op():
    from graph_ir.meta import REGION, Region

    def step(p, g):
        new = p * 0.9 + g
        return new, (g * 2).sum()

    args = (torch.randn(8), torch.randn(8))
    gm = _optimizer_region(_traced(step, *args))
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    last.meta[REGION] = Region.BACKWARD.value      # a backward op after the update: a failure there must find p intact
    p, _ = gm.graph.find_nodes(op="placeholder")
    reuse_dead_operands(gm, {p: 0})
    assert gm.meta["written_inputs"] == []


def _twins(build):
    model, loss_fn = build()
    ref, _ = build()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, opt, ref, ref_opt, loss_fn


def _zoo_gpt2():
    from tests.zoo import build
    entry = build("gpt2", layers=2)      # tied input and output embeddings: one parameter, updated once
    return entry.model, entry.loss_fn


@pytest.mark.parametrize("build", [tiny_mlp, _zoo_gpt2], ids=["mlp", "transformers-gpt2"])
def test_the_step_updates_parameters_and_state_in_place_bitwise_like_torch_optim(build):
    from tests.zoo import causal_lm_batch
    model, opt, ref, ref_opt, loss_fn = _twins(build)
    batches = mlp_batches(3) if build is tiny_mlp else [causal_lm_batch(s) for s in range(3)]
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off"), optimizer=opt, loss_fn=loss_fn)
    step(batches[0])
    storage = [p.data_ptr() for p in model.parameters()]
    state = {id(t) for s in opt.state.values() for t in s.values()}
    for b in batches[1:]:
        step(b)
    runner = step.last.runners["step"]
    n_params = len(list(model.parameters()))
    assert len(runner.written_inputs) == 4 * n_params        # parameter, step, exp_avg, exp_avg_sq
    assert [p.data_ptr() for p in model.parameters()] == storage
    assert {id(t) for s in opt.state.values() for t in s.values()} == state
    eager_losses(ref, loss_fn, ref_opt, batches)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert all(torch.equal(ours[i][k], theirs[i][k]) for i in theirs for k in theirs[i])


def test_inputs_sharing_storage_run_the_functional_copy():
    model, opt, ref, ref_opt, loss_fn = _twins(tiny_mlp)
    batches = mlp_batches(2)
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off"), optimizer=opt, loss_fn=loss_fn)
    step(batches[0])
    eager_losses(ref, loss_fn, ref_opt, batches[:1])
    # A user's state that makes two inputs one tensor: an in-place update of one would change the other.
    first, second = list(model.parameters())[:2]
    shared = opt.state[first]["exp_avg_sq"]
    opt.state[second]["exp_avg_sq"] = shared.view(-1)[: second.numel()].view_as(second)
    runner = step.last.runners["step"]
    from cann_passes.runtime.binding import bind_inputs
    inputs = bind_inputs(step.last.program["step"], model, opt, batches[1], step.step_state)
    assert not runner.safe(inputs)
    kept = [t.clone() for t in inputs]
    outputs = runner(*inputs)
    assert all(torch.equal(t, k) for t, k in zip(inputs, kept)), "the functional copy writes no input"
    functional = runner._functional(*kept)
    assert all(torch.equal(a, b) for a, b in zip(outputs, functional))


# -- data parallelism and ZeRO: where the writes may start ----------------------------------------

@pytest.fixture(scope="module")
def gpt2_capture():
    from graph_ir import capture_train_step
    from tests.zoo import build, causal_lm_batch
    entry = build("gpt2", layers=1)
    opt = torch.optim.AdamW(entry.model.parameters(), lr=1e-3)
    captured, _ = capture_train_step(entry.model, opt, entry.loss_fn, causal_lm_batch(0, pad=False))
    return captured


def _lowered(captured, stage, clip=None):
    from cann_passes import compile_program
    from cann_passes.lowering.eager import EagerLowering
    from graph_ir.mesh import MeshDesc
    plan = Plan(backend="eager", dp=2, zero_stage=stage, bucket_mb=0.005, grad_clip_norm=clip)
    program = compile_program(captured, plan, MeshDesc.fake(dp=2, rank=0), backend="eager")
    graph = program["step"]
    return graph, EagerLowering().compile(graph, None, None), program


@pytest.mark.parametrize("stage,clip", [(0, None), (1, None), (2, None), (3, None), (2, 1.0)],
                         ids=["dp", "zero1", "zero2", "zero3", "zero2-clipped"])
def test_dp_and_zero_steps_write_their_inputs_only_after_every_reduction_and_backward_op(gpt2_capture, stage, clip):
    from graph_ir.analysis.collectives import collective_kind, is_communication_op
    from graph_ir.analysis.memory import storage_roots
    from graph_ir.meta import Region, region_of
    from graph_ir.signature import InputKind
    graph, runner, program = _lowered(gpt2_capture, stage, clip)
    gm = runner.run
    nodes = list(gm.graph.nodes)
    roots = storage_roots(gm.graph)
    written = {p for p in gm.graph.find_nodes(op="placeholder") if p.name in graph.attrs["written_inputs"]}
    first_write = min(i for i, n in enumerate(nodes) if n.op == "call_function" and n.args
                      and isinstance(n.args[0], torch.fx.Node) and roots[n.args[0]] in written
                      and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable)
    kinds = {s.kind for s in graph.signature.inputs}
    n_params = sum(s.kind == InputKind.PARAM for s in graph.signature.inputs)
    n_state = sum(s.kind == InputKind.OPT_STATE for s in graph.signature.inputs)
    # Every state entry in place, and every parameter; under ZeRO-1/2 those whose two flat shards
    # fill their gathered column (no padding), the others a fresh copy of their column.
    filled = sum(s.kind == InputKind.PARAM and p.meta["val"].numel() % 2 == 0
                 for s, p in zip(graph.signature.inputs, graph.placeholders()))
    assert len(written) == n_state + (filled if stage in (1, 2) else n_params), kinds
    for i, n in enumerate(nodes[first_write:], first_write):
        if n.op != "call_function":
            continue
        assert region_of(n) == Region.OPTIMIZER, f"{n.name} ({region_of(n)}) runs after the first write"
        if is_communication_op(n):
            c = n if collective_kind(n) else n.args[0]
            assert collective_kind(c) == "all_gather", f"{n.name}: a {collective_kind(c)} after the first write"
            assert all(region_of(a) == Region.OPTIMIZER for a in c.all_input_nodes), \
                f"{c.name} gathers a value the optimizer did not compute"
    # The functional graph waits for some reductions amid the updates; wait_for_reductions_first moved
    # those waits (and nothing else: no node added or dropped) before the optimizer.
    record = next(r for r in program.records if r.name == "wait_for_reductions_first")
    assert record.stats["moved"] > 0 and record.nodes_before == record.nodes_after



def test_in_place_updates_can_be_switched_off_for_a_functional_step(gpt2_capture, monkeypatch):
    from cann_passes.lowering.base import INPLACE_UPDATES_ENV
    monkeypatch.setenv(INPLACE_UPDATES_ENV, "0")
    graph, runner, program = _lowered(gpt2_capture, 0)
    assert runner.written_inputs == [] and graph.attrs["written_inputs"] == []
    assert "reuse_dead_operands{inputs=false}" in str(program.attrs["pass_pipeline"])
    assert "wait_for_reductions_first" not in str(program.attrs["pass_pipeline"])
