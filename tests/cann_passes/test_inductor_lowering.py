"""The spell_out_alpha pass: inductor's guard against torch 2.13 dropping ``alpha`` in its addmm pattern."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes import PassManager, Plan
from cann_passes.compile import with_required_passes
from cann_passes.lowering import get_lowering
from cann_passes.passes.spell_out_alpha import spell_out_alpha
from cann_passes.pass_pipeline import build_pipeline
from graph_ir import TrainGraph
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature


def _graph():
    def f(a, b, p):
        return [torch.ops.aten.add.Tensor(torch.ops.aten.mm.default(a, b), p, alpha=1e-4)]
    args = [torch.randn(8, 8) for _ in range(3)]
    gm = make_fx(f, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:
        n.meta["region"] = "io" if n.op in ("placeholder", "output") else "forward"
    sig = StepSignature([Spec(InputKind.BATCH, f"batch[{i}]") for i in range(3)],
                        [Spec(OutputKind.LOSS, "loss")])
    return TrainGraph(gm, sig), args


def test_alpha_is_spelled_out_as_a_multiply():
    graph, args = _graph()
    expected = graph.gm(*args)[0]
    assert spell_out_alpha(graph) == 1
    assert not any(n.kwargs.get("alpha") for n in graph.graph.nodes if n.op == "call_function")
    torch.testing.assert_close(graph.gm(*args)[0], expected)


@pytest.mark.slow
def test_inductor_keeps_alpha_of_an_add_after_a_matmul():
    graph, args = _graph()
    expected = graph.gm(*args)[0]
    graph = PassManager(with_required_passes(build_pipeline(Plan(pipeline="cleanup"), "inductor"), "inductor"),
                        verify_level="deep").run(graph)
    runner = get_lowering("inductor").compile(graph, args, None)
    torch.testing.assert_close(runner(*args)[0], expected, rtol=1e-5, atol=1e-5)


INDUCTOR_TAIL = "spell_out_alpha,tanh_gelu_as_sigmoid,bool_collectives_as_bytes"


def test_the_inductor_pipeline_names_its_rewrites_even_for_pipeline_text():
    assert str(with_required_passes(build_pipeline(Plan(), "inductor"), "inductor")).endswith(
        "cleanup," + INDUCTOR_TAIL.replace(",", ",linear_on_onednn{choose=measured},", 1))
    assert "spell_out_alpha" not in str(build_pipeline(Plan(), "eager"))
    text = build_pipeline(Plan(pipeline="cleanup"), "inductor")
    assert str(with_required_passes(text, "inductor")) == "cleanup," + INDUCTOR_TAIL
    assert str(with_required_passes(text, "eager")) == \
        "cleanup,wait_for_reductions_first,scalars_on_host,reuse_dead_operands,plan_buffers"


@pytest.mark.slow
def test_inductor_step_of_transformers_gpt2_with_its_rewrites_matches_eager_pytorch():
    from tests.zoo import compare
    # GPT-2's hand-written tanh GELU (sigmoid form) and its Conv1D matmuls on oneDNN, every one
    # (matmul_kernel: onednn; inductor calls the custom op as an extern kernel): not bitwise, to 1e-5
    plan = Plan(backend="inductor", compile_cache="off", matmul_kernel="onednn")
    run = compare("gpt2", plan, steps=2, layers=1)
    stats = {r.name: r.stats.get("rewritten") for r in run.step.records}
    assert stats["tanh_gelu_as_sigmoid"] == 1 and stats["linear_on_onednn"] > 0
    torch.testing.assert_close(torch.tensor(run.compiled_losses), torch.tensor(run.eager_losses),
                               rtol=1e-6, atol=0)
    assert run.max_param_diff() < 1e-5


@pytest.mark.slow
def test_inductor_by_default_times_every_float32_matmul_and_matches_eager_pytorch():
    from tests.zoo import compare
    # LLaMA's bias-free linears (mm): each one moves to oneDNN or stays on MKL by a timing of both,
    # which machine decides; either way the step trains within 1e-5 of eager PyTorch
    run = compare("llama", Plan(backend="inductor", compile_cache="off"), steps=2, layers=1)
    record = next(r for r in run.step.records if r.name == "linear_on_onednn")
    assert record.spec == "linear_on_onednn{choose=measured}"
    # one layer's 7 linears and the head: forward, input gradient and weight gradient each
    assert record.stats["rewritten"] + record.stats["kept_on_mkl"] == 8 * 3
    torch.testing.assert_close(torch.tensor(run.compiled_losses), torch.tensor(run.eager_losses),
                               rtol=1e-6, atol=0)
    assert run.max_param_diff() < 1e-5


# -- parameters and optimizer state updated through input mutation -------------------------------

def test_mutate_inputs_ends_the_graph_with_copies_into_inputs_that_it_returns():
    from cann_passes.lowering.inductor import mutate_inputs

    def update(p, m, g):
        m2 = m * 0.9 + g
        return p * 0.5 - m2, m2, (p * m).sum(0)       # output 2 has another shape than m: not a new m

    args = [torch.randn(4, 4) for _ in range(3)]
    reference = [t.clone() for t in update(*args)]
    gm = make_fx(update, tracing_mode="fake")(*args)
    p, m, g = gm.graph.find_nodes(op="placeholder")
    assert mutate_inputs(gm, {p: 0, m: 1}) == [p, m]
    assert [n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default] == [p, m]
    inputs = [a.clone() for a in args]
    out = gm(*inputs)
    assert out[0] is inputs[0] and out[1] is inputs[1]
    assert all(torch.equal(o, r) for o, r in zip(out, reference))
    assert torch.equal(inputs[2], args[2])
    gm = make_fx(update, tracing_mode="fake")(*args)
    assert mutate_inputs(gm, {gm.graph.find_nodes(op="placeholder")[1]: 2}) == []


@pytest.mark.slow
def test_inductor_step_updates_parameters_and_state_in_place_like_torch_optim():
    from tests.conftest import eager_losses, mlp_batches, tiny_mlp
    from cann_passes import compile_for_npu
    model, loss_fn = tiny_mlp()
    ref, _ = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    batches = mlp_batches(3)
    step = compile_for_npu(model, Plan(backend="inductor", compile_cache="off"), optimizer=opt, loss_fn=loss_fn)
    losses = [step(batches[0]).item()]
    storage = [p.data_ptr() for p in model.parameters()]
    state = {id(t) for s in opt.state.values() for t in s.values()}
    losses += [step(b).item() for b in batches[1:]]
    assert len(step.last.runners["step"].written_inputs) == 4 * len(storage)
    assert [p.data_ptr() for p in model.parameters()] == storage
    assert {id(t) for s in opt.state.values() for t in s.values()} == state
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses(ref, loss_fn, ref_opt, batches)),
                               rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_inductor_is_handed_fake_inputs_of_static_shape(monkeypatch):
    # Real inputs under the compile cache's ShapeEnv would be fakified with a symbol per size:
    # kernels over symbolic sizes, sympy at every fusion decision, and a SymFloat AOTAutograd cannot
    # tensorify on a ResNet's BatchNorm.
    import torch._inductor.compile_fx as inductor
    from torch._subclasses.fake_tensor import FakeTensor

    from cann_passes import compile_cache
    from cann_passes.lowering import LoweringFailed
    from tests.passes._tiny import mlp_step

    seen = []

    def look(gm, inputs, *args, **kwargs):
        seen.extend(inputs)
        raise RuntimeError("looked")
    monkeypatch.setattr(inductor, "compile_fx", look)
    step = mlp_step()
    with compile_cache.lowering_context("inductor"), pytest.raises(LoweringFailed, match="looked"):
        get_lowering("inductor").compile(step.captured, step.inputs(), None)
    tensors = [x for x in seen if isinstance(x, torch.Tensor)]
    assert len(tensors) == len(step.captured.placeholders())
    assert all(isinstance(x, FakeTensor) for x in tensors)
    assert all(isinstance(s, int) for x in tensors for s in x.shape)
    assert [tuple(x.shape) for x in tensors] == [tuple(x.shape) for x in step.inputs()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "bloom"])
def test_inductor_trains_a_resnet_with_batch_norm_and_a_bloom_like_eager_pytorch(name):
    # ResNet: BatchNorm's unbiased-variance factor over convolution sizes; BLOOM: the key/value
    # cache's first ``cat`` of an empty and a strided key, viewed as contiguous after it.
    from tests.zoo import compare
    run = compare(name, Plan(backend="inductor"), steps=2, layers=1)
    assert run.max_param_diff() < 1e-5
    assert run.compiled_losses == pytest.approx(run.eager_losses, rel=1e-5)
