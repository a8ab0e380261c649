"""The usage fuzz corpus: unusual-but-legitimate things users do around a compiled step.

Each :class:`Usage` builds a small model, its loss and optimizer, trains ``STEPS`` steps
compiled and eager from the same weights on the same batches, and between steps applies its
``change`` to both sides (a module attribute edited, a global of the loss changed, an optimizer
group's flag set, the model frozen in part, ...). Its expectation is one of:

- ``eager``: every step's loss and every parameter equal to eager PyTorch (``tol``: 0 is
  bitwise; fp32 cases hold 1e-5), and, where ``recompiles`` says so, that many recompiles, each
  with a reason naming what changed (``reason``);
- ``refusal``: the step raises one line matching ``refusal``, and the model's parameters (and
  their identity), buffers, ``p.grad`` and the optimizer's state are exactly as before the call.

``tests/conformance/test_usage_fuzz.py`` runs every entry; a new kind of usage is one entry here.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
LABEL_SMOOTHING = 0.0


class Net(nn.Module):
    """Python state of every kind a forward may read: a float, a flag picking a path, a dropout, a
    plain tensor attribute, a config object, a BatchNorm and a list of scales."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.extra = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(16, 3)
        self.temperature = 1.0
        self.use_extra = False
        self.offset = torch.zeros(3)
        self.config = _Config()
        self.scales = [1.0]

    def forward(self, x):
        h = self.act(self.fc(x)) * self.config.gain
        if self.use_extra:
            h = h + self.extra(h)
        for s in self.scales:
            h = h * s
        return self.head(self.drop(self.norm(h))) / self.temperature + self.offset


class _Config:
    def __init__(self):
        self.gain = 1.0


def loss_global(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], label_smoothing=LABEL_SMOOTHING)


def _batches(n: int = STEPS):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@dataclass
class Usage:
    name: str
    change: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None
    model: Callable[[], nn.Module] = Net
    loss_fn: Callable = loss_global
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: _sgd(m.parameters())
    plan: dict = field(default_factory=dict)
    # Around every call (compiled and eager) from the step at ``around_from`` on.
    around: Callable[[], Any] | None = None
    around_from: int = 1
    tol: float = 0.0
    recompiles: int | None = None
    reason: str = ""
    refusal: str | None = None          # a regex the one-line error matches
    undo: Callable[[], None] | None = None


class _Closure:
    """A loss reading class weights from a closure cell, so a test can edit them in place."""

    def __init__(self):
        self.weights = torch.ones(3)
        weights = self.weights

        def loss_fn(model, batch):
            return F.cross_entropy(model(batch[0]), batch[1], weight=weights)
        self.loss_fn = loss_fn


_closure = _Closure()


def _set_smoothing(value):
    def change(model, optimizer):
        global LABEL_SMOOTHING
        LABEL_SMOOTHING = value
    return change


def _reset_smoothing():
    global LABEL_SMOOTHING
    LABEL_SMOOTHING = 0.0


def _reset_weights():
    _closure.weights.fill_(1.0)


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.b(torch.relu(self.a(x))))


class _WithGenerator(Net):
    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x):
        return super().forward(x + torch.randn(x.shape, generator=self.g))


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return torch.round(x * 8) / 8

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Quantized(Net):
    def forward(self, x):
        return super().forward(_STE.apply(x))


class _Masked(Net):
    def forward(self, x):
        out = super().forward(x)
        return out + out[out.sum(-1) > 0].mean()


def _two_groups_adam(model):
    # Decoupled weight decay in one group only: torch applies it per group.
    return torch.optim.Adam([{"params": [model.fc.weight, model.fc.bias], "decoupled_weight_decay": True,
                              "weight_decay": 0.1},
                             {"params": [p for n, p in model.named_parameters() if not n.startswith("fc.")],
                              "weight_decay": 0.01}], lr=1e-2)


def _freeze_fc(model, optimizer):
    for p in model.fc.parameters():
        p.requires_grad_(False)


def _eval_mode(model, optimizer):
    model.eval()


def _forward_hook(model, optimizer):
    model.head.register_forward_hook(lambda module, args, out: out * 0.5)


def _forward_pre_hook(model, optimizer):
    model.fc.register_forward_pre_hook(lambda module, args: (args[0] * 2,))


def _full_backward_hook(model, optimizer):
    model.head.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))


def _gradient_hook(model, optimizer):
    model.fc.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))


def _post_accumulate_hook(model, optimizer):
    model.fc.weight.register_post_accumulate_grad_hook(lambda p: None)


def _edit_weights_under_no_grad(model, optimizer):
    with torch.no_grad():
        model.fc.weight.mul_(0.5)


def _load_state_dict(model, optimizer):
    model.load_state_dict({k: v * 0.9 if v.is_floating_point() else v for k, v in model.state_dict().items()})


def _replace_parameter(model, optimizer):
    model.head.weight = nn.Parameter(model.head.weight.detach() * 0.5)
    optimizer.param_groups[0]["params"] = list(model.parameters())


def _orphan_parameter(model, optimizer):
    model.head = nn.Linear(16, 3)
    optimizer.add_param_group({"params": list(model.head.parameters())})


def _set_lr(model, optimizer):
    for group in optimizer.param_groups:
        group["lr"] = 0.03


USAGES = [
    Usage("float attribute", lambda m, o: setattr(m, "temperature", 2.0), recompiles=1,
          reason="attribute temperature of the model changed"),
    Usage("flag picking a code path", lambda m, o: setattr(m, "use_extra", True), recompiles=1,
          reason="attribute use_extra of the model changed"),
    Usage("dropout p", lambda m, o: setattr(m.drop, "p", 1e-30), recompiles=1, reason="attribute drop.p"),
    Usage("tensor attribute replaced", lambda m, o: setattr(m, "offset", torch.full((3,), 0.5)), recompiles=1,
          reason="attribute offset of the model changed"),
    Usage("tensor attribute changed in place", lambda m, o: m.offset.add_(0.25), recompiles=1,
          reason="attribute offset of the model changed"),
    Usage("config edited in place", lambda m, o: setattr(m.config, "gain", 0.5), recompiles=1,
          reason="attribute config.gain of the model changed"),
    Usage("list attribute appended to", lambda m, o: m.scales.append(0.5), recompiles=1,
          reason="attribute scales of the model changed"),
    Usage("global of the loss", _set_smoothing(0.1), recompiles=1, reason="global 'LABEL_SMOOTHING' of loss_fn",
          undo=_reset_smoothing),
    Usage("closure tensor of the loss edited in place", lambda m, o: _closure.weights.mul_(
        torch.tensor([1.0, 2.0, 0.5])), loss_fn=_closure.loss_fn, recompiles=1,
        reason="closure 'weights' of loss_fn changed", undo=_reset_weights),
    Usage("learning rate changed (a graph input, no recompile)", _set_lr, recompiles=0),
    Usage("per-group decoupled weight decay", optimizer=_two_groups_adam, tol=1e-6, recompiles=0),
    Usage("training mode switched to eval", _eval_mode, recompiles=1,
          reason="training mode changed for the model, fc, extra and 4 more (the model is now in eval mode)"),
    Usage("part of the model frozen after a step", _freeze_fc, recompiles=1,
          reason="requires_grad changed for fc.weight, fc.bias"),
    Usage("step called inside autocast after an fp32 step", around=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
          tol=2e-2, recompiles=1, reason="the caller's autocast changed (now cpu bfloat16)"),
    Usage("module reachable at two paths", model=_Shared),
    Usage("activation module swapped", lambda m, o: setattr(m, "act", nn.GELU()), recompiles=1,
          reason="the model's submodules or hooks"),
    Usage("forward hook registered after a step", _forward_hook, recompiles=1, reason="the model's submodules or hooks"),
    Usage("forward pre-hook registered after a step", _forward_pre_hook, recompiles=1),
    Usage("gradient hook on a parameter (register_hook)", _gradient_hook, recompiles=1),
    Usage("full backward hook registered after a step", _full_backward_hook,
          refusal=r"^module 'head' has a full backward hook \(register_full_backward_hook"),
    Usage("BatchNorm momentum and eps changed", lambda m, o: (setattr(m.norm, "momentum", 0.5),
                                                        setattr(m.norm, "eps", 1e-2)), recompiles=1),
    Usage("weights edited under no_grad between steps", _edit_weights_under_no_grad, recompiles=0),
    Usage("load_state_dict between steps", _load_state_dict, recompiles=0),
    Usage("a parameter replaced by a new Parameter", _replace_parameter),
    Usage("post-accumulate-grad hook", _post_accumulate_hook, refusal=r"^parameter 'fc\.weight' has a "
          r"post-accumulate-grad hook"),
    Usage("a replaced module's old parameters left in the optimizer", _orphan_parameter,
          refusal=r"^optimizer param group 0 holds a tensor of shape \(3, 16\) that is not a parameter"),
    Usage("straight-through estimator (autograd.Function)", model=_Quantized),
    Usage("generator object in forward", model=_WithGenerator, refusal=r"^a torch\.Generator passed to "
          r"aten\.randn\.generator at usage_fuzz\.py:\d+ "),
    Usage("boolean-mask indexing in forward", model=_Masked,
          refusal=r"^data-dependent shape at usage_fuzz\.py:\d+ \(`return out \+ out\[out\.sum\(-1\) > 0\]\.mean\(\)`\)"),
    Usage("step under inference_mode", around=torch.inference_mode, around_from=0,
          refusal=r"^a training step cannot run under torch\.inference_mode\(\)"),
    Usage("step under torch.no_grad (eager's backward refuses it too)", around=torch.no_grad, around_from=0,
          refusal=r"^element 0 of tensors does not require grad and does not have a grad_fn$"),
    Usage("recompute ban matching nothing", plan={"recompute": "selective", "recompute_bans": ["no_such_module"]},
          refusal=r"recompute_bans"),
]


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer):
    """Everything a failed step must leave as it was, Parameter identity included."""
    return ([(name, id(p), p.detach().clone(), None if p.grad is None else p.grad.clone())
             for name, p in model.named_parameters()],
            [(name, b.clone()) for name, b in model.named_buffers()],
            [(id(p), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()})
             for p, s in optimizer.state.items()])


def same_state(a, b) -> bool:
    (pa, ba, oa), (pb, bb, ob) = a, b

    def eq(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y
    return (len(pa) == len(pb) and all(n == m and i == j and eq(x, y) and eq(g, h)
                                       for (n, i, x, g), (m, j, y, h) in zip(pa, pb))
            and len(ba) == len(bb) and all(n == m and eq(x, y) for (n, x), (m, y) in zip(ba, bb))
            and len(oa) == len(ob) and all(i == j and sa.keys() == sb.keys() and all(eq(sa[k], sb[k]) for k in sa)
                                           for (i, sa), (j, sb) in zip(oa, ob)))


@dataclass
class Outcome:
    compiled: list[float]
    eager: list[float]
    max_param_diff: float
    recompile_reasons: list[str]


def run(usage: Usage) -> Outcome:
    """Train ``usage`` compiled and eager; raise what the compiled step raised (a refusal), after
    checking it left the state alone."""
    from cann_passes import Plan, compile_for_npu
    torch.manual_seed(0)
    model = usage.model()
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = usage.optimizer(model), usage.optimizer(reference)
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off", **usage.plan),
                           optimizer=optimizer, loss_fn=usage.loss_fn)
    compiled, eager = [], []
    try:
        for i, batch in enumerate(_batches()):
            if i == 1 and usage.change is not None:
                usage.change(model, optimizer)
                usage.change(reference, ref_optimizer)
            around = usage.around if usage.around is not None and i >= usage.around_from else contextlib.nullcontext
            before = state_of(model, optimizer)
            try:
                with around():
                    compiled.append(float(step(batch)))
            except Exception as exc:
                if not same_state(before, state_of(model, optimizer)):
                    raise AssertionError(f"{usage.name}: the failed step changed the state ({exc})") from exc
                raise
            ref_optimizer.zero_grad(set_to_none=True)
            with around():
                loss = usage.loss_fn(reference, batch)
            loss.backward()
            ref_optimizer.step()
            eager.append(float(loss))
    finally:
        if usage.undo is not None:
            usage.undo()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return Outcome(compiled, eager, diff, list(step.recompile_reasons))
