"""The tanh_gelu_as_sigmoid pass: tanh-GELU and its gradient through sigmoid, to float32 rounding."""
from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes import Plan
from cann_passes.passes.tanh_gelu_as_sigmoid import tanh_gelu_as_sigmoid
from graph_ir import TrainGraph
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature

aten = torch.ops.aten


def _graph(fn, args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:
        n.meta["region"] = "io" if n.op in ("placeholder", "output") else "forward"
    sig = StepSignature([Spec(InputKind.BATCH, f"batch[{i}]") for i in range(len(args))],
                        [Spec(OutputKind.LOSS, f"out{i}") for i in range(2)])
    return TrainGraph(gm, sig)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-12, 12, 4001)[torch.randperm(4001, generator=g)].reshape(1, -1)
    return [torch.cat([x, torch.randn(3, 4001, generator=g) * 3]), torch.randn(4, 4001, generator=g)]


def _ops(graph):
    return {n.target for n in graph.graph.nodes if n.op == "call_function"}


def test_gelu_and_its_gradient_match_atens_formula_to_float32_rounding():
    def f(x, g):
        return [aten.gelu(x, approximate="tanh"), aten.gelu_backward(g, x, approximate="tanh")]
    args = _inputs()
    graph = _graph(f, args)
    expected = graph.gm(*args)
    assert tanh_gelu_as_sigmoid(graph) == 2
    assert aten.gelu.default not in _ops(graph) and aten.gelu_backward.default not in _ops(graph)
    assert aten.sigmoid.default in _ops(graph)
    got = graph.gm(*args)
    exact = f(*(a.double() for a in args))
    for e, o, ref in zip(expected, got, exact):
        # not bitwise: within a few float32 ulps of the result, and no farther from float64 than ATen's
        torch.testing.assert_close(o, e, rtol=2e-6, atol=2e-6)
        assert (o.double() - ref).abs().max() <= 2 * (e.double() - ref).abs().max() + 1e-7


def test_a_hand_written_gelu_tanh_reads_a_sigmoid_and_other_tanh_uses_are_left_alone():
    k = math.sqrt(2 / math.pi)

    def f(x, g):
        t = torch.tanh(k * (x + 0.044715 * x ** 3))
        gelu = 0.5 * x * (1.0 + t)
        grad = aten.tanh_backward(g, t)             # what autograd saves and calls for it
        return [gelu + torch.tanh(x) * 2, grad]     # a plain tanh: kept (relative precision near 0)
    args = _inputs()
    graph = _graph(f, args)
    expected = graph.gm(*args)
    assert tanh_gelu_as_sigmoid(graph) == 1
    assert sum(n.target is aten.tanh.default for n in graph.graph.nodes) == 1
    assert aten.tanh_backward.default not in _ops(graph)
    for e, o in zip(expected, graph.gm(*args)):
        torch.testing.assert_close(o, e, rtol=2e-6, atol=2e-6)


def test_exact_gelu_and_bfloat16_gelu_are_left_alone():
    def f(x, g):
        return [aten.gelu(x), aten.gelu_backward(g, x),
                aten.gelu(x.to(torch.bfloat16), approximate="tanh")]   # ATen computes it in fp32, rounds once
    graph = _graph(f, _inputs())
    assert tanh_gelu_as_sigmoid(graph) == 0


@pytest.mark.parametrize("model", ["gpt", "gpt2"])
def test_a_step_with_the_pass_stays_within_1e5_of_eager_pytorch(model):
    from tests.zoo import compare
    # recipe GPT: nn.GELU(approximate="tanh"); transformers GPT-2: NewGELUActivation (tanh written out)
    run = compare(model, Plan(backend="eager", extra_passes=("tanh_gelu_as_sigmoid",), verify="deep"), steps=2)
    record = next(r for r in run.step.records if r.name == "tanh_gelu_as_sigmoid")
    assert record.stats["rewritten"] == {"gpt": 4, "gpt2": 2}[model]
    torch.testing.assert_close(torch.tensor(run.compiled_losses), torch.tensor(run.eager_losses),
                               rtol=1e-6, atol=0)
    assert run.max_param_diff() < 1e-5
