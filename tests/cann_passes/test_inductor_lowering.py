"""The spell_out_alpha pass: inductor's guard against torch 2.13 dropping ``alpha`` in its addmm pattern."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes import PassManager, Plan
from cann_passes.compile import with_required_passes
from cann_passes.lowering import get_lowering
from cann_passes.passes.spell_out_alpha import spell_out_alpha
from cann_passes.pipeline import build_pipeline
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


def test_the_inductor_pipeline_names_the_spell_out_even_for_pipeline_text():
    assert str(build_pipeline(Plan(), "inductor")).endswith("cleanup,spell_out_alpha")
    assert "spell_out_alpha" not in str(build_pipeline(Plan(), "eager"))
    text = build_pipeline(Plan(pipeline="cleanup"), "inductor")
    assert str(with_required_passes(text, "inductor")) == "cleanup,spell_out_alpha"
    assert str(with_required_passes(text, "eager")) == "cleanup"
