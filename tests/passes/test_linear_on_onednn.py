"""The linear_on_onednn pass: float32 CPU matmuls through oneDNN, within BLAS rounding of MKL's."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes import Plan
from cann_passes.passes.linear_on_onednn import linear_on_onednn
from graph_ir import TrainGraph
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _graph(fn, args, outputs):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:
        n.meta["region"] = "io" if n.op in ("placeholder", "output") else "forward"
    sig = StepSignature([Spec(InputKind.BATCH, f"batch[{i}]") for i in range(len(args))],
                        [Spec(OutputKind.LOSS, f"out{i}") for i in range(outputs)])
    return TrainGraph(gm, sig)


def _linears(graph):
    return sum(n.target is torch.ops.cann.onednn_linear.default for n in graph.graph.nodes)


def test_forward_input_gradient_weight_gradient_and_conv1d_layouts_move():
    def f(x, w, b, g, w_in_out):
        return [aten.addmm(b, x, aten.t(w)),        # nn.Linear forward: x @ W.t() + b
                aten.mm(g, w),                      # its input gradient: g @ W
                aten.mm(aten.t(g), x),              # its weight gradient: g.t() @ x (transposed left)
                aten.addmm(b, x, w_in_out),         # transformers' Conv1D: x @ W + b, W [in, out]
                aten.addmm(b, x, aten.t(w), beta=0.5)]
    g_ = torch.Generator().manual_seed(0)
    args = [torch.randn(64, 48, generator=g_), torch.randn(40, 48, generator=g_), torch.randn(40, generator=g_),
            torch.randn(64, 40, generator=g_), torch.randn(48, 40, generator=g_)]
    graph = _graph(f, args, 5)
    expected = graph.gm(*args)
    assert linear_on_onednn(graph) == (4, 0)
    kept = [n.target for n in graph.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert kept == [aten.addmm.default]     # beta != 1
    got = graph.gm(*args)
    for e, o in zip(expected, got):
        # not bitwise in general: oneDNN sums the dot products in its own order (BLAS rounding)
        torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-5)
        assert o.shape == e.shape and o.is_contiguous()


def test_the_cost_model_prices_the_oneDNN_matmul_as_a_matmul():
    from graph_ir.analysis.cost import node_cost
    graph = _graph(lambda x, w: [aten.mm(x, aten.t(w))], [torch.randn(64, 48), torch.randn(40, 48)], 1)
    before = next(node_cost(n) for n in graph.graph.nodes if n.target is aten.mm.default)
    linear_on_onednn(graph)
    after = next(node_cost(n) for n in graph.graph.nodes if n.target is torch.ops.cann.onednn_linear.default)
    assert after.matmul and after.flops == before.flops == 2 * 64 * 48 * 40


def test_other_dtypes_batched_and_empty_matmuls_are_left_alone():
    def f(x, w, a, b, e, v):
        return [aten.mm(x, w), aten.bmm(a, b), aten.mm(e, v)]
    args = [torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64),
            torch.randn(2, 8, 8), torch.randn(2, 8, 8),
            torch.randn(4, 0), torch.randn(0, 3)]   # an empty inner dimension: oneDNN refuses it
    graph = _graph(f, args, 3)
    assert linear_on_onednn(graph) == (0, 0)


def test_nothing_moves_while_the_user_has_turned_onednn_off():
    args = [torch.randn(16, 8), torch.randn(4, 8)]
    graph = _graph(lambda x, w: [aten.mm(x, aten.t(w))], args, 1)
    torch.backends.mkldnn.enabled = False
    try:
        assert linear_on_onednn(graph) == (0, 0)
    finally:
        torch.backends.mkldnn.enabled = True
    assert linear_on_onednn(graph) == (1, 0)


def test_measured_moves_only_the_matmuls_onednn_runs_in_at_most_0_8x_mkls_time(monkeypatch):
    import cann_passes.passes.linear_on_onednn as pass_module

    def f(x, w, v, g):
        return [aten.mm(x, aten.t(w)), aten.mm(x, aten.t(v)), aten.mm(aten.t(g), x)]
    g_ = torch.Generator().manual_seed(0)
    args = [torch.randn(64, 48, generator=g_), torch.randn(40, 48, generator=g_),
            torch.randn(24, 48, generator=g_), torch.randn(64, 40, generator=g_)]
    graph = _graph(f, args, 3)
    expected = graph.gm(*args)
    timed = []

    def measure(x, m, bias):   # oneDNN wins on the 40-wide forward only; 0.85x is within the margin
        timed.append((tuple(x.shape), tuple(m.shape)))
        return (1.0, 0.5) if m.shape[1] == 40 and x.is_contiguous() else (1.0, 0.85)
    monkeypatch.setattr(pass_module, "measure", measure)
    timings = []
    assert linear_on_onednn(graph, "measured", timings) == (1, 2)
    assert timed == [((64, 48), (48, 40)), ((64, 48), (48, 24)), ((40, 64), (64, 48))]
    # the dump's explanation: one row per distinct matmul, with both times and the choice
    assert [(t["x"], t["m"], t["runs_on"], t["mkl_us"], t["onednn_us"]) for t in timings] == [
        ("[64, 48] row", "[48, 40] col", "onednn", 1e6, 5e5), ("[64, 48] row", "[48, 24] col", "mkl", 1e6, 8.5e5),
        ("[40, 64] col", "[64, 48] row", "mkl", 1e6, 8.5e5)]
    moved = [n for n in graph.graph.nodes if n.target is torch.ops.cann.onednn_linear.default]
    assert moved[0].args[1].args[0].meta["val"].shape == (48, 40)
    for e, o in zip(expected, graph.gm(*args)):
        torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-5)


def test_measure_times_both_libraries_on_the_layouts_once_per_process():
    import cann_passes.passes.linear_on_onednn as pass_module
    x = torch.empty(4096, 256)
    m = torch.empty(1024, 256).t()          # nn.Linear's weight, transposed: column-major
    mkl, dnn = pass_module.measure(x, m, False)
    assert mkl > 0 and dnn > 0
    assert pass_module.measure(x, m, False) == (mkl, dnn)      # kept, not timed again
    # rows cut to about 2^27 multiply-adds: 4096 x 256 x 1024 is 2^30
    key = next(k for k in pass_module._measured if k[0] == (512, 256) and k[2] == (256, 1024))
    assert key[1] == "row" and key[3] == "col" and key[4] is False


def test_the_plan_chooses_the_pass_per_backend():
    from cann_passes.pass_pipeline import build_pipeline
    from cann_passes.plan import PlanError

    def option(plan, backend):
        found = [p for p in build_pipeline(plan, backend).passes if p.name == "linear_on_onednn"]
        return dict(found[0].options).get("choose") if found else None
    assert option(Plan(), "inductor") == "measured"
    assert option(Plan(), "eager") is None                       # eager stays bitwise eager PyTorch
    assert option(Plan(matmul_kernel="onednn"), "eager") == "always"
    assert option(Plan(matmul_kernel="aten"), "inductor") is None
    with pytest.raises(PlanError, match="matmul_kernel"):
        Plan(backend="torchair", matmul_kernel="onednn")
    with pytest.raises(PlanError, match="matmul_kernel"):
        Plan(matmul_kernel="mkl")
    # with pipeline text the text decides: a field that disagrees with it is refused, by name
    assert Plan(pipeline="cleanup,linear_on_onednn", matmul_kernel="onednn").matmul_kernel == "onednn"
    with pytest.raises(PlanError, match="matmul_kernel.*linear_on_onednn"):
        Plan(pipeline="cleanup,linear_on_onednn{choose=measured}", matmul_kernel="onednn")
    with pytest.raises(PlanError, match="matmul_kernel.*'aten' but there is a 'linear_on_onednn' pass"):
        Plan(pipeline="cleanup,linear_on_onednn", matmul_kernel="aten")


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_step_with_the_pass_stays_within_1e5_of_eager_pytorch(model):
    from tests.zoo import compare
    # LLaMA: bias-free nn.Linear (mm); GPT-2: Conv1D (addmm with an [in, out] weight)
    run = compare(model, Plan(backend="eager", matmul_kernel="onednn", verify="deep"), steps=2)
    record = next(r for r in run.step.records if r.name == "linear_on_onednn")
    assert record.stats["rewritten"] > 0
    torch.testing.assert_close(torch.tensor(run.compiled_losses), torch.tensor(run.eager_losses),
                               rtol=1e-6, atol=0)
    assert run.max_param_diff() < 1e-5
