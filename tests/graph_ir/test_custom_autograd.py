"""User-defined autograd in a captured step (graph_ir/custom_autograd.py): new- and old-style
``torch.autograd.Function`` and ``torch.library.custom_op`` with ``register_autograd`` train with
their own backward, exactly like eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cann_passes import Plan, compile_for_npu
from tests.zoo import causal_lm_batch, hf_loss


class RoundSTE(torch.autograd.Function):
    """New style: a straight-through estimator (the forward's gradient is zero almost everywhere)."""

    @staticmethod
    def forward(x):
        return torch.round(x * 4) / 4

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledGelu(torch.autograd.Function):
    """Old style: forward(ctx, ...) saving an input and a Python attribute, with a hand-written backward
    that differs from autograd's own (the tanh approximation's derivative, scaled by 2)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return F.gelu(x, approximate="tanh") * scale

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        t = torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608 * (1 + 3 * 0.044715 * x * x)
        return 2 * grad * d * ctx.scale, None


class TwoOutputs(torch.autograd.Function):
    """Old style with a non-differentiable second output and a function applied inside its forward."""

    @staticmethod
    def forward(ctx, x):
        y = RoundSTE.apply(x)
        index = x.argmax(-1)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(y)
        return y * 3, index

    @staticmethod
    def backward(ctx, grad, _grad_index):
        y, = ctx.saved_tensors
        return grad * 3 + 0 * y


@torch.library.custom_op("cann_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.tanh(x) * s


@scaled_tanh.register_fake
def _(x, s):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.s = inputs[1]


def _backward(ctx, grad):
    y, = ctx.saved_tensors
    return grad * (ctx.s - y * y / ctx.s), None


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if self.kind == "new":
            h = RoundSTE.apply(h)
        elif self.kind == "old":
            h = ScaledGelu.apply(h, 1.5)
        elif self.kind == "nested":
            h, index = TwoOutputs.apply(h)
            h = h + index.unsqueeze(-1).to(h.dtype)
        elif self.kind == "custom_op":
            h = scaled_tanh(h, 2.0)
        return self.b(h)


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _train_both(model, loss_fn, batches, plan, lr=0.1):
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    step = compile_for_npu(model, plan, optimizer=opt, loss_fn=loss_fn)
    ours, eager = [], []
    for batch in batches:
        ours.append(float(step(batch)))
        ref_opt.zero_grad()
        loss = loss_fn(ref, batch)
        loss.backward()
        ref_opt.step()
        eager.append(float(loss))
    return ours, eager, ref, step


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("kind", ["new", "old", "nested", "custom_op"])
def test_user_autograd_trains_with_its_own_backward_bitwise_like_eager(kind):
    torch.manual_seed(0)
    model = Net(kind)
    ours, eager, ref, step = _train_both(model, _loss, _batches(), Plan(backend="eager"))
    assert ours == eager
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert step.recompile_reasons == []


def test_the_registered_backward_is_what_runs_not_autograds_own():
    # ScaledGelu's backward is twice the true derivative: a step that differentiated the forward's
    # ops itself would give other gradients than eager.
    torch.manual_seed(0)
    model = Net("old")
    x, y = _batches(1)[0]
    ref = copy.deepcopy(model)
    h = ref.a(x).detach().requires_grad_()
    ScaledGelu.apply(h, 1.5).sum().backward()
    true = torch.autograd.grad((F.gelu(h, approximate="tanh") * 1.5).sum(), h)[0]
    assert torch.allclose(h.grad, 2 * true, rtol=1e-5, atol=1e-6)
    ours, eager, ref, _ = _train_both(model, _loss, [(x, y)], Plan(backend="eager"))
    assert ours == eager and all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_a_custom_op_stays_one_node_of_the_graph():
    torch.manual_seed(0)
    model = Net("custom_op")
    _, _, _, step = _train_both(model, _loss, _batches(1), Plan(backend="eager"))
    targets = {str(n.target) for g in step.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "cann_test.scaled_tanh.default" in targets


@pytest.mark.parametrize("plan", [dict(backend="inductor"), dict(backend="eager", microbatches=2),
                                  dict(backend="eager", precision="bf16")], ids=["inductor", "microbatches", "bf16"])
def test_user_autograd_under_other_plans(plan):
    torch.manual_seed(0)
    model = Net("old")
    ref_model = copy.deepcopy(model)
    ours, eager, ref, _ = _train_both(model, _loss, _batches(), Plan(**plan))
    if plan.get("precision") == "bf16":
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        autocast = []
        for batch in _batches():
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(ref_model, batch)
            loss.backward()
            ref_opt.step()
            autocast.append(float(loss))
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(ours, autocast))
        return
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, eager))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-5)


def test_bloom_trains_through_its_gelu_function_like_eager():
    # transformers' Bloom applies an old-style autograd.Function (GeLUFunction) in training.
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(0)
    cfg = BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                      attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = BloomForCausalLM(cfg).train()
    batches = [causal_lm_batch(1000 + i) for i in range(3)]
    ours, eager, ref, step = _train_both(model, hf_loss, batches, Plan(backend="eager"), lr=1e-2)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, eager)), (ours, eager)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-5), name


def test_function_apply_is_restored_after_capture_even_when_it_fails():
    original = torch.autograd.Function.__dict__["apply"]

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return ScaledGelu.apply(self.a(x), 1.0).reshape(3, -1)   # 2x4 does not reshape to 3 rows

    model = Broken()
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           loss_fn=lambda m, x: m(x).sum())
    with pytest.raises(RuntimeError, match="shape"):
        step(torch.randn(2, 4))
    assert torch.autograd.Function.__dict__["apply"] is original
    # Outside capture an old-style function runs as torch runs it.
    x = torch.randn(3, requires_grad=True)
    ScaledGelu.apply(x, 1.0).sum().backward()
    assert x.grad is not None
