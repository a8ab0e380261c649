"""The eager lowering computes the optimizer's step-count arithmetic as Python floats, as
torch.optim does: the same numbers at every step, without a 0-dim tensor op per parameter."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from cann_passes import Plan, compile_for_npu
from cann_passes.passes.scalars_on_host import apply_scalars_on_host, is_host, mark_scalars_on_host
from graph_ir.meta import REGION, Region

aten = torch.ops.aten
F64 = torch.float64


def differing_steps(want: int = 4, limit: int = 20000) -> list[int]:
    """Steps of Adam (beta2 0.999) whose bias correction sqrt(1 - beta2 ** step) torch's 0-dim float64
    pow(x, 0.5) rounds differently from Python's ``** 0.5`` (which torch.optim computes). Which steps
    depends on the vectorized sqrt torch dispatches to on this CPU (AVX2 and AVX512 differ)."""
    beta2, found = torch.tensor(0.999, dtype=F64), []
    for k in range(1, limit + 1):
        if torch.pow(1 - torch.pow(beta2, torch.tensor(float(k)).to(F64)), 0.5).item() != (1 - 0.999 ** k) ** 0.5:
            found.append(k)
            if len(found) == want:
                break
    return found


def _optimizer_graph(fn, *args) -> torch.fx.GraphModule:
    gm = make_fx(fn)(*args)
    for node in gm.graph.nodes:
        node.meta[REGION] = Region.OPTIMIZER.value
    return gm


def host_scalars(gm: torch.fx.GraphModule) -> int:
    """The pass's marks, applied as the eager lowering applies them."""
    mark_scalars_on_host(gm.graph)
    return apply_scalars_on_host(gm)


def _zero_dim_ops(fn, *args) -> int:
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            Count.n += isinstance(out, torch.Tensor) and out.dim() == 0
            return out
    with Count():
        fn(*args)
    return Count.n


def _bias_corrected(beta2, step, x):
    step = step + 1
    bias_correction2_sqrt = torch.pow(1 - torch.pow(beta2, step.to(F64)), 0.5)
    return x / bias_correction2_sqrt, step


def test_bias_corrections_are_python_floats_at_every_step():
    beta2 = torch.tensor(0.999, dtype=F64)
    x = torch.linspace(1, 2, 5, dtype=F64)         # float64: a last-bit difference of the scalar shows
    gm = _optimizer_graph(_bias_corrected, beta2, torch.tensor(1.0), x)
    reference = _optimizer_graph(_bias_corrected, beta2, torch.tensor(1.0), x)
    assert host_scalars(gm) == 4      # to float64, pow, rsub, pow 0.5; the step's own add stays
    steps = differing_steps()
    if not steps:
        pytest.skip("torch's 0-dim float64 pow rounds like Python for Adam's first 20000 steps on this CPU")
    tensor_differs = False
    for k in steps:
        step = torch.tensor(float(k - 1))
        out, new_step = gm(beta2, step, x)
        python = x / ((1 - 0.999 ** k) ** 0.5)       # torch.optim's single-tensor Adam
        assert torch.equal(out, python), k
        assert new_step.item() == k and new_step.dtype == torch.float32
        tensor_differs |= not torch.equal(reference(beta2, step, x)[0], python)
    assert tensor_differs, "the 0-dim tensor arithmetic no longer differs: pick other steps"
    assert _zero_dim_ops(gm, beta2, torch.tensor(3.0), x) == 1       # the step count's increment


def test_a_consumer_that_takes_no_number_keeps_the_tensor_value():
    def f(beta1, x, y):
        weight = 1 - beta1
        return torch.lerp(x, y, weight), x * weight     # lerp's weight must be a tensor; mul takes a number

    args = (torch.tensor(0.9, dtype=F64), torch.randn(8), torch.randn(8))
    gm, reference = _optimizer_graph(f, *args), _optimizer_graph(f, *args)
    host_scalars(gm)
    assert any(n.target is aten.rsub.Scalar for n in gm.graph.nodes)
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert is_host(mul.args[1])
    for got, want in zip(gm(*args), reference(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_consumer_whose_dtype_a_number_would_change_keeps_the_tensor_value():
    def f(beta, s32, counts):
        # int64 counts times a 0-dim float64 tensor is float64; times a Python float, float32.
        return counts * (s32 * (1 - beta))

    args = (torch.tensor(0.9, dtype=F64), torch.tensor(3.0), torch.arange(4))
    gm, reference = _optimizer_graph(f, *args), _optimizer_graph(f, *args)
    host_scalars(gm)
    consumer = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert consumer.target is aten.mul.Tensor
    assert all(isinstance(a, torch.fx.Node) and not is_host(a) for a in consumer.args)
    got, want = gm(*args), reference(*args)
    assert got.dtype == want.dtype == F64 and torch.equal(got, want)


@pytest.mark.parametrize("base,exponent", [(-2.0, 0.5), (0.0, -1.0), (1e300, 3.0)],
                         ids=["negative-sqrt", "zero-reciprocal", "overflow"])
def test_what_python_refuses_is_computed_by_the_aten_op(base, exponent):
    def f(b, x):
        return x * torch.pow(b * 1.0, exponent)

    args = (torch.tensor(base, dtype=F64), torch.ones(3, dtype=F64))
    gm, reference = _optimizer_graph(f, *args), _optimizer_graph(f, *args)
    assert host_scalars(gm) >= 1
    got, want = gm(*args), reference(*args)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not math.isfinite(got[0].item())


def test_only_the_optimizer_region_is_rewritten():
    def f(beta, x):
        return x * (1 - beta)

    args = (torch.tensor(0.5, dtype=F64), torch.randn(3))
    gm = make_fx(f)(*args)
    for node in gm.graph.nodes:
        node.meta[REGION] = Region.FORWARD.value
    assert host_scalars(gm) == 0


def test_a_transformers_step_runs_no_zero_dim_chains_and_updates_as_before(monkeypatch):
    """LLaMA with AdamW: the same parameters after three steps as the lowering without the rewrite
    (torch.optim's own numbers are checked bitwise in tests/conformance/test_optimizers.py), with one
    0-dim op per parameter (its step count's increment) where there were about nine."""
    from cann_passes.lowering.base import HOST_SCALARS_ENV
    from tests.zoo import build
    zoo = build("llama", layers=1)
    models = {"host": zoo.model, "tensor": copy.deepcopy(zoo.model)}
    steps, zero_dim = {}, {}
    for name, model in models.items():
        if name == "tensor":
            monkeypatch.setenv(HOST_SCALARS_ENV, "0")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        steps[name] = compile_for_npu(model, Plan(backend="eager"), optimizer=opt, loss_fn=zoo.loss_fn)
        steps[name](zoo.make_batch(0))
    for i in (1, 2):
        for name, step in steps.items():
            zero_dim[name] = _zero_dim_ops(step, zoo.make_batch(i))
    for (name, p), q in zip(models["host"].named_parameters(), models["tensor"].parameters()):
        assert torch.equal(p, q), name
    n_params = sum(1 for _ in zoo.model.parameters())
    assert zero_dim["tensor"] > 8 * n_params
    assert zero_dim["host"] < n_params + 20, (zero_dim, n_params)


def test_the_update_folds_into_addcdiv_and_addcmul_bitwise():
    """AdamW's last lines as the captured rule spells them (a 0-dim step size times a moment, over
    the denominator, added to the parameter; the second moment's scaled square added by addcmul):
    one addcdiv and one addcmul with the float as ``value``, as torch.optim calls them."""
    def f(lr, beta2, step, param, exp_avg, exp_avg_sq, grad):
        step = step + 1
        s = step.to(F64)
        exp_avg_sq = torch.addcmul(exp_avg_sq * beta2, grad * (1 - beta2), grad)
        denom = exp_avg_sq.sqrt() / torch.pow(1 - torch.pow(beta2, s), 0.5) + 1e-8
        return param + (-(lr / (1 - torch.pow(0.9, s))) * exp_avg) / denom, exp_avg_sq, step

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 32, generator=g) for _ in range(4)]
    tensors[2] = tensors[2].abs()
    args = (torch.tensor(1e-3, dtype=F64), torch.tensor(0.999, dtype=F64), torch.tensor(6.0), *tensors)
    gm, reference = _optimizer_graph(f, *args), _optimizer_graph(f, *args)
    host_scalars(gm)
    folded = {n.target: n for n in gm.graph.nodes if n.target in (aten.addcdiv.default, aten.addcmul.default)}
    assert set(folded) == {aten.addcdiv.default, aten.addcmul.default}
    assert all(isinstance(n.kwargs["value"], torch.fx.Node) and is_host(n.kwargs["value"]) for n in folded.values())
    full_size = [n for n in gm.graph.nodes if n.op == "call_function" and not is_host(n)
                 and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 2]
    assert len(full_size) == 6     # mul, addcmul, sqrt, div, add (eps), addcdiv: torch.optim's passes
    for got, want in zip(gm(*args), reference(*args)):
        assert torch.equal(got, want)


def test_a_low_precision_update_is_not_folded():
    # A bfloat16 addcdiv computes in float32 and rounds once; the three ops round three times.
    def f(lr, param, exp_avg, denom):
        return param + ((lr * 1.0) * exp_avg) / denom

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(16, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    args = (torch.tensor(1e-3, dtype=F64), *tensors)
    gm, reference = _optimizer_graph(f, *args), _optimizer_graph(f, *args)
    host_scalars(gm)
    assert not any(n.target is aten.addcdiv.default for n in gm.graph.nodes)
    assert torch.equal(gm(*args), reference(*args))


def test_the_marks_survive_the_compile_cache(tmp_path):
    """A cached program is the JSON of its graphs: every mark the eager lowering reads must come back
    as it was, or a cache hit would run the tensor chains (or write in place what it must copy)."""
    from graph_ir.meta import HOST_FOLD, HOST_OPERANDS, ON_HOST, REUSE_COPIES, REUSES_OPERAND
    from graph_ir.serialize import from_json, to_json
    from tests.conftest import mlp_batches, tiny_mlp
    model, loss_fn = tiny_mlp()
    step = compile_for_npu(model, Plan(backend="eager", compile_cache=str(tmp_path)),
                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=loss_fn)
    step(mlp_batches(1)[0])
    graph = step.last.program["step"]
    loaded = from_json(to_json(graph, with_cost=False, layouts=True), recorded_values=True)
    keys = (ON_HOST, HOST_OPERANDS, HOST_FOLD, REUSES_OPERAND, REUSE_COPIES)
    marks = [{k: n.meta[k] for k in keys if k in n.meta} for n in graph.graph.nodes]
    assert sum(ON_HOST in m for m in marks) > 0 and sum(HOST_OPERANDS in m for m in marks) > 0
    assert sum(HOST_FOLD in m for m in marks) > 0
    assert marks == [{k: n.meta[k] for k in keys if k in n.meta} for n in loaded.graph.nodes]


def test_a_folded_operand_is_not_overwritten_before_the_fold_reads_it():
    """Folded, ``x + (h * t1) / t2`` reads ``t1`` where the add stands: an op between the multiply and
    the add that was t1's last reader must not run in place over t1's buffer."""
    from cann_passes.passes.reuse_dead_operands import apply_reuse, mark_reuse

    def f(lr, x, base, t2):
        t1 = base * 2.0
        d = ((lr * 1.0) * t1) / t2
        z = t1 + 1.0           # t1's last reader before the fold, in the graph as captured
        return x + d, z

    g = torch.Generator().manual_seed(0)
    args = (torch.tensor(1e-3, dtype=F64), *(torch.randn(8, 4, generator=g) for _ in range(3)))
    gm, reference = _optimizer_graph(f, *args), _optimizer_graph(f, *args)
    mark_scalars_on_host(gm.graph)
    mark_reuse(gm.graph, {})
    apply_scalars_on_host(gm)
    apply_reuse(gm)
    assert any(n.target is aten.addcdiv.default for n in gm.graph.nodes)
    z = next(n for n in gm.graph.nodes if n.target in (aten.add.Tensor, aten.add_.Tensor)
             and isinstance(n.args[1], float))
    assert z.target is aten.add.Tensor           # t1 is read later, by the fold
    for got, want in zip(gm(*args), reference(*args)):
        assert torch.equal(got, want)
