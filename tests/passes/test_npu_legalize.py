"""npu_legalize: every op left in the graph has a real torchair converter, and numerics hold on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes import Plan, compile_for_npu
from cann_passes.lowering.ge_offline import lower_to_ge, supported_ops
from cann_passes.pass_manager import PassContext, get_pass
from graph_ir import TrainGraph
from graph_ir.meta import MODULE_PATH, ORIGIN_PASS, REGION
from graph_ir.signature import Spec, StepSignature
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
from tests.conftest import gpt_batches

LEGALIZE = "cleanup,npu_legalize,cleanup"


@pytest.fixture(scope="module")
def supported(torchair):   # torchair (tests/conftest.py) skips where the wheel cannot be had
    return supported_ops()


def _unsupported(gm: torch.fx.GraphModule, supported: set[str]) -> list[str]:
    return sorted({str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                   and str(n.target) not in supported})


def _batches(n):
    return gpt_batches(n, batch=2)


def _train(model, pipeline, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    step = compile_for_npu(model, Plan(backend="eager", verify="deep", pipeline=pipeline),
                           optimizer=opt, loss_fn=gpt_loss)
    return step, torch.stack([step(b) for b in batches])


class TestGptTraining:
    @pytest.mark.parametrize("attention", ["explicit", "sdpa"])
    def test_legalized_step_trains_like_the_unlegalized_one(self, supported, attention):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(attention=attention))
        ref = copy.deepcopy(model)
        batches = _batches(6)
        step, losses = _train(model, LEGALIZE, batches)
        ref_step, ref_losses = _train(ref, "cleanup", batches)

        # AdamW's moment update is torch.optim's lerp, which has no real converter either.
        assert _unsupported(ref_step.last.graph.gm, supported) == sorted(
            ["aten.lerp.Tensor"] + ([] if attention == "explicit" else
                                    ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                                     "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]))
        assert _unsupported(step.last.graph.gm, supported) == []
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")

    def test_attention_nodes_keep_region_and_module_path(self, supported):
        torch.manual_seed(0)
        step, _ = _train(GPT(gpt_tiny(attention="sdpa")), LEGALIZE, _batches(1))
        made = [n for n in step.last.graph.graph.nodes if n.meta.get(ORIGIN_PASS) == "npu_legalize"]
        softmax = [n for n in made if n.target is torch.ops.aten._softmax.default]
        assert {n.meta[MODULE_PATH] for n in softmax} == {"layers.0.attn", "layers.1.attn"}
        attention = [n for n in made if n.meta[MODULE_PATH].endswith(".attn")]
        assert {n.meta[REGION] for n in attention} == {"forward", "backward"}
        assert all("val" in n.meta for n in made)
        stats = next(r for r in step.last.records if r.name == "npu_legalize").stats
        rewritten = stats["rewritten"]
        assert rewritten.pop("aten.lerp.Tensor", 0) == len(list(step.model.parameters()))  # AdamW's lerp
        assert rewritten == {"aten._scaled_dot_product_flash_attention_for_cpu.default": 2,
                             "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": 2}
        assert stats["unsupported_left"] == 0 and stats["npu_kernels"] is False


class _OddOpsNet(nn.Module):
    """amax and var (no real converter), SiLU and RMSNorm in one small model."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 5)
        self.norm = nn.RMSNorm(16)

    def forward(self, x):
        h = self.norm(F.silu(self.fc1(x)))
        h = h * torch.rsqrt(h.var(-1, keepdim=True) + 1.0)
        logits = self.fc2(h)
        return logits - logits.amax(-1, keepdim=True).detach()


def _odd_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_amax_var_rmsnorm_model_matches_eager_pytorch(supported):
    torch.manual_seed(0)
    model = _OddOpsNet()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(5)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = compile_for_npu(model, Plan(backend="eager", verify="deep", pipeline=LEGALIZE),
                           optimizer=opt, loss_fn=_odd_loss)
    losses = [step(b) for b in batches]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for b in batches:
        ref_opt.zero_grad()
        loss = _odd_loss(ref, b)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=0, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    captured = {str(n.target) for n in step.last.captured.graph.nodes}
    assert {"aten.var.correction", "aten.amax.default"} <= captured
    assert _unsupported(step.last.graph.gm, supported) == []


# --------------------------------------------------------------------------- single graphs

def _train_graph(fn, *args) -> TrainGraph:
    with fx_traceback.preserve_node_meta():
        gm = make_fx(fn, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:  # as capture does: the annotated module path becomes MODULE_PATH
        if (n.meta.get("custom") or {}).get(MODULE_PATH):
            n.meta[MODULE_PATH] = n.meta["custom"][MODULE_PATH]
    n_out = len(gm.graph.output_node().args[0])
    sig = StepSignature([Spec("batch", f"batch[{i}]") for i in range(len(args))],
                        [Spec("metric", f"out{i}") for i in range(n_out)])
    return TrainGraph(gm, sig)


def _legalize(tg: TrainGraph) -> TrainGraph:
    return get_pass("npu_legalize").fn(tg, PassContext())


def test_stub_ops_are_decomposed_with_module_path_kept(supported):
    def f(x, g):
        with fx_traceback.annotate({MODULE_PATH: "mlp.act"}):
            a = torch.ops.aten.amax.default(x, [1], True)
            s = torch.ops.aten.silu_backward.default(g, x - a)
            w = torch.ops.aten.lerp.Tensor(x, g, torch.sigmoid(x))
        return (s * 2, w)

    args = (torch.randn(4, 8), torch.randn(4, 8))
    tg = _train_graph(f, *args)
    expected = tg.gm(*args)
    before = lower_to_ge(tg.gm, name="before")
    assert {u.target for u in before.unsupported} == {"aten.amax.default", "aten.silu_backward.default",
                                                      "aten.lerp.Tensor"}
    tg = _legalize(tg)
    tg.recompile()
    for got, want in zip(tg.gm(*args), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    after = lower_to_ge(tg.gm, name="after")
    assert after.ok, after.summary()
    assert after.op_histogram["ArgMaxWithValue"] == 1 and after.op_histogram["Sigmoid"] >= 1
    made = [n for n in tg.graph.nodes if n.meta.get(ORIGIN_PASS) == "npu_legalize"]
    assert made and all(n.meta.get(MODULE_PATH) == "mlp.act" for n in made)


def test_foreach_and_prims_casts_become_per_tensor_ops(supported):
    def f(a, b):
        xs = torch.ops.aten._foreach_sqrt.default([a.abs(), b.abs()])
        ys = torch.ops.aten._foreach_addcdiv.Scalar([a, b], xs, [b, a], 0.5)
        c = torch.ops.prims.convert_element_type.default(ys[0], torch.bfloat16)
        return (ys[1], c)

    assert "aten._foreach_sqrt.default" not in supported
    args = (torch.randn(3, 4), torch.randn(3, 4))
    tg = _train_graph(f, *args)
    expected = tg.gm(*args)
    tg = _legalize(tg)
    tg.recompile()
    assert _unsupported(tg.gm, supported) == []
    for got, want in zip(tg.gm(*args), expected):
        torch.testing.assert_close(got, want)


def test_coalesced_collectives_become_one_plain_collective(supported, gloo_group):
    name = gloo_group.group_name
    c10d = torch.ops._c10d_functional

    def f(a, b):
        r = c10d.all_reduce_coalesced.default([a, b], "sum", name)
        g = c10d.all_gather_into_tensor_coalesced.default([a, b], 1, name)
        s = c10d.reduce_scatter_tensor_coalesced.default([a, b], "sum", 1, name)
        return tuple(c10d.wait_tensor.default(t) for t in (*r, *g, *s))

    args = (torch.randn(2, 3), torch.randn(4))
    tg = _train_graph(f, *args)
    expected = tg.gm(*args)
    tg = _legalize(tg)
    tg.recompile()
    targets = [str(n.target) for n in tg.graph.nodes if n.op == "call_function"]
    assert targets.count("_c10d_functional.all_reduce.default") == 1
    assert targets.count("_c10d_functional.all_gather_into_tensor.default") == 1
    assert targets.count("_c10d_functional.reduce_scatter_tensor.default") == 1
    assert _unsupported(tg.gm, supported) == []
    for got, want in zip(tg.gm(*args), expected):
        torch.testing.assert_close(got, want)
    report = lower_to_ge(tg.gm, name="collectives")
    assert report.ok, report.summary()
    assert report.op_histogram["HcomAllReduce"] == 1


def test_all_reduce_average_becomes_sum_then_divide(supported, gloo_group):
    name = gloo_group.group_name
    c10d = torch.ops._c10d_functional

    def f(a):
        return (c10d.wait_tensor.default(c10d.all_reduce.default(a, "avg", name)) * 3,)

    tg = _legalize(_train_graph(f, torch.randn(4)))
    (ar,) = [n for n in tg.graph.nodes if n.target is c10d.all_reduce.default]
    assert ar.args[1] == "sum"
    (div,) = [n for n in tg.graph.nodes if n.target is torch.ops.aten.div.Scalar]
    assert div.args == (next(iter(ar.users)), 1)
    assert lower_to_ge(tg.gm, name="avg").ok


def test_reduce_scatter_average_becomes_sum_then_divide(supported, gloo_group):
    name = gloo_group.group_name
    c10d = torch.ops._c10d_functional

    def f(a):
        return (c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(a, "avg", 1, name)) + 1,)

    args = (torch.randn(4, 3),)
    tg = _train_graph(f, *args)
    expected = tg.gm(*args)
    tg = _legalize(tg)
    tg.recompile()
    (rs,) = [n for n in tg.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert rs.args[1:3] == ("sum", 1)                       # HcomReduceScatter has no "avg"
    (div,) = [n for n in tg.graph.nodes if n.target is torch.ops.aten.div.Scalar]
    assert div.args == (next(iter(rs.users)), 1)
    torch.testing.assert_close(tg.gm(*args)[0], expected[0], rtol=0, atol=0)
    assert lower_to_ge(tg.gm, name="rs_avg").ok


def _integer_operands(dtype):
    """Every edge case of a shift: extreme and sign-changing values, shifts below 0, up to and past the width."""
    info = torch.iinfo(dtype)
    values = sorted({v for v in (info.min, info.min + 1, -5, -1, 0, 1, 5, 77, 200, info.max - 1, info.max)
                     if info.min <= v <= info.max})
    shifts = list(range(-2 if dtype.is_signed else 0, info.bits + 2))
    x, s = torch.meshgrid(torch.tensor(values, dtype=dtype), torch.tensor(shifts, dtype=dtype), indexing="ij")
    return x.contiguous(), s.contiguous()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64], ids=str)
def test_integer_shifts_and_bitwise_prims_become_supported_ops_bit_for_bit(supported, dtype):
    """Recompute stores dropout masks bit-packed (a left shift and a sum; a right shift and an and
    to unpack); torch's decompositions turn those into prims torchair has no converter for. The
    rewrites (multiply / floor-divide by 2**s, with torch's out-of-range rules) equal torch's own
    ops on every value and shift."""
    prims, aten = torch.ops.prims, torch.ops.aten

    def f(x, s):
        return (aten.bitwise_left_shift.Tensor(x, s), aten.bitwise_right_shift.Tensor(x, s),
                prims.shift_left.default(x, s), prims.shift_right_arithmetic.default(x, s),
                aten.bitwise_and.Scalar(x, 1), aten.bitwise_or.Scalar(x, 4), prims.bitwise_and.default(x, s),
                aten.bitwise_right_shift.Tensor_Scalar(x, 3))

    for name in ("aten.bitwise_left_shift.Tensor", "aten.bitwise_right_shift.Tensor", "prims.shift_left.default",
                 "prims.shift_right_arithmetic.default", "prims.bitwise_and.default"):
        assert name not in supported
    args = _integer_operands(dtype)
    tg = _train_graph(f, *args)
    expected = tg.gm(*args)
    tg = _legalize(tg)
    tg.recompile()
    assert _unsupported(tg.gm, supported) == []
    for got, want in zip(tg.gm(*args), expected):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    report = lower_to_ge(tg.gm, name="shifts")
    assert report.ok, report.summary()
    assert report.op_histogram.get("FloorDiv", 0) >= 3 and report.op_histogram.get("Pow", 0) >= 5


def test_op_without_any_rewrite_is_listed_not_raised(supported):
    def f(x):
        # index_put is rewritten for integer indices on leading dims; not with a None index.
        return (torch.ops.aten.index_put.default(x, [None, torch.tensor([0])], torch.ones(3)),)

    tg = _train_graph(f, torch.randn(3, 4))
    ctx = PassContext()
    get_pass("npu_legalize").fn(tg, ctx)
    (why,) = ctx.explanation["unsupported"].values()
    assert "aten.index_put.default" in why
    assert ctx.stats["unsupported_left"] == 1
