"""Offline FX -> GE lowering through torchair's own converters (CPU only, no torch_npu)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes.lowering.ge_offline import (
    loader_info,
    lower_to_ge,
    supported_ops,
)

# Only "could not obtain the wheel/protobuf" skips (the torchair fixture, tests/conftest.py); loader bugs fail.
pytestmark = pytest.mark.usefixtures("torchair")


# --------------------------------------------------------------------------- graphs


def _block_train_step(x, y, ln_w, ln_b, wqkv, bqkv, wo, bo, w1, b1, w2, b2, wh, bh):
    """One pre-LN attention + MLP block, LM-style loss, plain SGD update; functional."""
    params = (ln_w, ln_b, wqkv, bqkv, wo, bo, w1, b1, w2, b2, wh, bh)
    B, T, D = x.shape
    H = 2

    def loss_fn(ln_w, ln_b, wqkv, bqkv, wo, bo, w1, b1, w2, b2, wh, bh):
        with fx_traceback.annotate({"module_path": "block.attn"}):
            h = F.layer_norm(x, (D,), ln_w, ln_b).reshape(B * T, D)
            qkv = torch.addmm(bqkv, h, wqkv).reshape(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // H), dim=-1)
            o = (att @ v).transpose(1, 2).reshape(B * T, D)
            r = x.reshape(B * T, D) + torch.addmm(bo, o, wo)
        with fx_traceback.annotate({"module_path": "block.mlp"}):
            r = r + torch.addmm(b2, F.gelu(torch.addmm(b1, r, w1)), w2)
        with fx_traceback.annotate({"module_path": "lm_head"}):
            logits = torch.addmm(bh, r, wh)
            return F.nll_loss(torch.log_softmax(logits, dim=-1), y.reshape(B * T))

    loss = loss_fn(*params)
    grads = torch.autograd.grad(loss, params)
    return (loss, *(p - 0.1 * g for p, g in zip(params, grads)))


def _block_args(B=2, T=4, D=8, V=16):
    def p(*shape):
        return torch.randn(*shape, requires_grad=True)

    return (
        torch.randn(B, T, D), torch.randint(0, V, (B, T)),
        p(D), p(D), p(D, 3 * D), p(3 * D), p(D, D), p(D), p(D, 4 * D), p(4 * D), p(4 * D, D), p(D), p(D, V), p(V),
    )


def _trace(fn, args):
    with fx_traceback.preserve_node_meta():
        return make_fx(fn, tracing_mode="fake")(*args)


@pytest.fixture(scope="module")
def block_gm():
    return _trace(_block_train_step, _block_args())


# --------------------------------------------------------------------------- tests


def test_loader_does_not_import_torch_npu():
    assert "torch_npu" not in sys.modules
    assert importlib.util.find_spec("torch_npu") is None  # nothing named torch_npu is importable
    assert not any(m == "torch_npu" or m.startswith("torch_npu.") for m in sys.modules)
    info = loader_info()
    assert info["version"] and (info["root"] / "torchair").is_dir()
    # torchair's own top-level __init__ (global torch.distributed patches) was not executed
    assert getattr(sys.modules["torchair"], "__cann_passes_offline__", False) or not info["standin"]


def test_supported_ops_registry():
    ops = supported_ops()
    assert 200 < len(ops) < 1000
    for op in ("aten.addmm.default", "aten.gelu.default", "aten.native_layer_norm.default",
               "aten._softmax.default", "aten._log_softmax.default", "aten.nll_loss_forward.default",
               "aten.gelu_backward.default", "aten.native_layer_norm_backward.default",
               "aten._softmax_backward_data.default", "aten.nll_loss_backward.default",
               "_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"):
        assert op in ops, op
    assert "aten.silu_backward.default" not in ops  # NotImplementedError stub
    assert "aten.amax.default" not in ops


def test_training_step_lowers(block_gm):
    targets = {str(n.target) for n in block_gm.graph.nodes if n.op == "call_function"}
    for op in ("aten.addmm.default", "aten.gelu.default", "aten.native_layer_norm.default",
               "aten._softmax.default", "aten._log_softmax.default", "aten.nll_loss_forward.default",
               "aten.gelu_backward.default", "aten.native_layer_norm_backward.default",
               "aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default",
               "aten.nll_loss_backward.default"):
        assert op in targets, op

    r = lower_to_ge(block_gm, name="block_step")
    assert r.unsupported == [], r.summary()
    assert r.ok, r.summary()
    assert r.notes == [], r.notes
    h = r.op_histogram
    assert h.get("MatMul", 0) + h.get("MatMulV2", 0) + h.get("BatchMatMul", 0) + h.get("BatchMatMulV2", 0) >= 4
    assert h.get("SoftmaxV2", 0) >= 1 and h.get("SoftmaxGrad", 0) >= 1
    assert h.get("LayerNormV4", 0) + h.get("LayerNorm", 0) + h.get("LayerNormV3", 0) >= 1
    assert h.get("Gelu", 0) >= 1 and h.get("GeluGrad", 0) >= 1
    assert h.get("LogSoftmaxV2", 0) >= 1 and h.get("NLLLoss", 0) >= 1 and h.get("NLLLossGrad", 0) >= 1
    assert h["NetOutput"] == 1
    n_inputs = sum(1 for n in block_gm.graph.nodes if n.op == "placeholder")
    assert h["Data"] == n_inputs
    # a real GE GraphDef: text format round-trips and every input is device-resident
    assert r.graph_text.startswith('name: "block_step"')
    from google.protobuf import text_format

    proto = type(r.graph_def)()
    text_format.Parse(r.graph_text, proto)
    assert len(proto.op) == sum(h.values())
    for op in proto.op:
        if op.type == "Data":
            assert op.output_desc[0].device_type == "NPU"


def test_stubbed_ops_reported_not_raised():
    def f(x, g):
        with fx_traceback.annotate({"module_path": "model.layers.3.mlp.act"}):
            a = torch.ops.aten.amax.default(x, [1], True)
            s = torch.ops.aten.silu_backward.default(g, x - a)
        return (s * 2,)

    gm = _trace(f, (torch.randn(4, 8), torch.randn(4, 8)))
    r = lower_to_ge(gm, name="stubs")
    assert not r.ok
    by_target = {u.target: u for u in r.unsupported}
    assert set(by_target) == {"aten.amax.default", "aten.silu_backward.default"}
    for u in r.unsupported:
        assert u.node in {"amax", "silu_backward"}
        assert u.module_path == "model.layers.3.mlp.act"
        assert "stub" in u.reason
    # lowering continued past the gaps: placeholder ops named after the aten overload
    assert r.op_histogram["aten.silu_backward.default"] == 1
    assert r.op_histogram["Mul"] >= 1 and r.op_histogram["NetOutput"] == 1


def test_module_path_fallback_meta_key():
    def f(x):
        return (torch.ops.aten.amax.default(x, [0]),)

    gm = _trace(f, (torch.randn(3, 3),))
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["module_path"] = "enc.head"
    (u,) = lower_to_ge(gm, name="mp").unsupported
    assert (u.node, u.target, u.module_path) == ("amax", "aten.amax.default", "enc.head")


@pytest.fixture()
def gloo_world():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_collectives_lower_to_hcom(gloo_world):
    group_name = gloo_world.group_name

    def f(x, y):
        a = torch.ops._c10d_functional.all_reduce.default(x, "sum", group_name)
        a = torch.ops._c10d_functional.wait_tensor.default(a)
        g = torch.ops._c10d_functional.all_gather_into_tensor.default(y, 1, group_name)
        g = torch.ops._c10d_functional.wait_tensor.default(g)
        s = torch.ops._c10d_functional.reduce_scatter_tensor.default(g, "sum", 1, group_name)
        s = torch.ops._c10d_functional.wait_tensor.default(s)
        return (a * 2, s)

    gm = _trace(f, (torch.randn(4, 8), torch.randn(2, 8)))
    r = lower_to_ge(gm, name="collectives")
    assert r.ok, r.summary()
    h = r.op_histogram
    assert h["HcomAllReduce"] == 1
    assert h["HcomAllGather"] == 1
    assert h["HcomReduceScatter"] == 1
    assert h["Identity"] >= 3  # wait_tensor
    assert 'type: "HcomAllReduce"' in r.graph_text


def test_lower_check_cli(tmp_path, capsys):
    from tools.lower_check import main

    rc = main(["demo", "--out", str(tmp_path), "--name", "demo_step"])
    assert rc == 0
    assert (tmp_path / "demo_step.ge.txt").read_text().startswith('name: "demo_step"')
    data = json.loads((tmp_path / "demo_step.ge_ops.json").read_text())
    assert data["ok"] is True and data["unsupported"] == []
    assert data["op_histogram"]["Gelu"] == 1
    assert "GeluGrad" in capsys.readouterr().out


def test_failing_converter_is_reported_and_rolled_back(monkeypatch):
    op = torch.ops.aten.gelu.default

    def broken(self, approximate="none", meta_outputs=None):
        from torchair._ge_concrete_graph import ge_apis as ge

        ge.Relu(self)  # emits an op, then fails: the partial op must be rolled back
        raise ValueError("boom")

    broken.require_meta = True
    monkeypatch.setattr(op, "_ge_converter", broken)

    def f(x):
        with fx_traceback.annotate({"module_path": "mlp.act"}):
            return (F.gelu(x) + 1,)

    r = lower_to_ge(_trace(f, (torch.randn(2, 3),)), name="broken")
    (u,) = r.unsupported
    assert (u.node, u.target, u.module_path) == ("gelu", "aten.gelu.default", "mlp.act")
    assert "ValueError: boom" in u.reason
    assert "Relu" not in r.op_histogram
    assert r.op_histogram["aten.gelu.default"] == 1 and r.op_histogram["Add"] == 1


_NO_TORCH_NPU_SCRIPT = r"""
import sys, torch
from cann_passes import Plan, compile_for_npu
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny
idx = torch.randint(0, 256, (2, 8))
for pipeline in (None, "cleanup,npu_legalize,cleanup"):  # default plan, then the torchair passes
    model = GPT(gpt_tiny(attention="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_for_npu(model, Plan(backend="eager", pipeline=pipeline), optimizer=opt, loss_fn=gpt_loss)
    assert torch.isfinite(step((idx, idx))), "loss"
    assert "torch_npu" not in sys.modules, pipeline
assert "torchair" in sys.modules and getattr(sys.modules["torchair"], "__cann_passes_offline__", False)
print("OK")
"""


def test_fresh_process_never_imports_torch_npu():
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH_NPU_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-2000:]
