"""tanh_gelu_as_sigmoid: compute tanh-approximated GELU and its gradient through ``sigmoid``.

GELU's tanh form is ``0.5 x (1 + tanh(u))`` with ``u = k (x + c x^3)``, and
``1 + tanh(u) = 2 sigmoid(2u)``, so ``gelu(x) = x sigmoid(2u)``; its gradient's
``1 - tanh(u)^2`` is ``4 s (1 - s)`` with ``s = sigmoid(2u)``. On CPU the
vectorised ``tanh`` that inductor's C++ kernels (and ATen) call is six times
the cost of ``sigmoid`` (a 1M-element tensor, one thread: 2.8 ms against
0.44 ms), and a GPT's GELU is the largest elementwise op of its step: inductor's
fused GELU kernels take 2.0 ms forward and 2.2 ms backward per 1024x1024
activation, 0.76 and 0.97 ms once spelled with ``sigmoid``.

Rewritten, on float32 CPU tensors only (elsewhere ``tanh`` is no dearer than ``sigmoid``):

- ``gelu(x, approximate="tanh")`` and ``gelu_backward(g, x, approximate="tanh")``
  (``nn.GELU(approximate="tanh")``, ``F.gelu``): spelled out with ``sigmoid``;
- a ``tanh`` whose every use is ``tanh + 1`` or ``tanh_backward`` (GELU written
  out by hand, as transformers' ``NewGELUActivation`` of GPT-2 does): those uses
  read ``s = sigmoid(2u)`` instead (``2 s`` and ``g * 4 s (1 - s)``, the backward
  keeping ``u`` where it kept ``tanh(u)``); a ``tanh``
  used any other way is left alone, since ``2 sigmoid(2u) - 1`` would lose
  ``tanh``'s relative precision near 0.

The gradients take ``s (1 - s)`` as ``e / (1 + e)^2`` with ``e = exp(-|2u|)``
(one ``exp``, as ``sigmoid`` itself costs), which does not cancel where ``s``
is near 1.

Numerics: not bitwise. The sigmoid form rounds differently from ATen's
formula, by a few float32 ulps of the result, and is no farther from the
float64 value than ATen's (closer where ``1 + tanh(u)`` cancels, x << 0);
tests hold a step to 1e-5 of eager PyTorch.
"""
from __future__ import annotations

import math

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.meta import GRADIENT_OF

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten
_K = math.sqrt(2.0 / math.pi)   # ATen's kBeta: M_SQRT2 * M_2_SQRTPI * 0.5
_C = 0.044715                   # ATen's kKappa


def _val(a):
    return a.meta["val"] if isinstance(a, torch.fx.Node) else a


class _Emitter:
    """Emits aten nodes before ``anchor`` carrying its metadata (region, module path) and a fake value."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node):
        self.graph, self.anchor = graph, anchor

    def __call__(self, op, *args) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, args)
        node.meta = {k: v for k, v in self.anchor.meta.items() if k not in ("val", "tensor_meta", GRADIENT_OF)}
        node.meta["val"] = op(*(_val(a) for a in args))
        return node


def _two_u(emit: _Emitter, x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``(2k (x + c x^3), x^2)``."""
    x2 = emit(aten.mul.Tensor, x, x)
    inner = emit(aten.add.Tensor, x, emit(aten.mul.Tensor, emit(aten.mul.Tensor, x2, x), _C))
    return emit(aten.mul.Tensor, inner, 2.0 * _K), x2


def _sigmoid_and_slope(emit: _Emitter, z: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``(sigmoid(z), sigmoid(z) sigmoid(-z))`` from one ``exp``: with ``e = exp(-|z|)``,
    ``sigmoid(z) sigmoid(-z) = e / (1 + e)^2`` exactly and stays accurate where ``s (1 - s)`` would
    cancel (s near 1: a float32 ``1 - s`` is 0 or 6e-8, off by up to 3x ATen's error in the gradient)."""
    e = emit(aten.exp.default, emit(aten.neg.default, emit(aten.abs.default, z)))
    r = emit(aten.reciprocal.default, emit(aten.add.Tensor, e, 1.0))
    er = emit(aten.mul.Tensor, e, r)
    s = emit(aten.where.self, emit(aten.ge.Scalar, z, 0.0), r, er)
    return s, emit(aten.mul.Tensor, er, r)


def _is_tanh_gelu(node: torch.fx.Node, target) -> bool:
    return node.op == "call_function" and node.target is target and node.kwargs.get("approximate") == "tanh"


def _on_cpu(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    # float32 only: in bf16/fp16 the spelled-out chain would round at every op where ATen's gelu
    # computes in float32 and rounds once
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype == torch.float32


def _is_plus_one(use: torch.fx.Node, t: torch.fx.Node) -> bool:
    if use.op != "call_function" or use.target is not aten.add.Tensor or use.kwargs.get("alpha", 1) != 1:
        return False
    a, b = use.args
    return (a is t and b == 1) or (b is t and a == 1)


def _is_tanh_backward_of(use: torch.fx.Node, t: torch.fx.Node) -> bool:
    return use.op == "call_function" and use.target is aten.tanh_backward.default and use.args[1] is t \
        and use.args[0] is not t


def _rewrite_gelu(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    emit = _Emitter(graph, node)
    x = node.args[0]
    z, _ = _two_u(emit, x)
    node.replace_all_uses_with(emit(aten.mul.Tensor, x, emit(aten.sigmoid.default, z)))
    graph.erase_node(node)


def _rewrite_gelu_backward(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    # d/dx x sigmoid(2u) = s + 2 x s (1 - s) k (1 + 3 c x^2)
    emit = _Emitter(graph, node)
    g, x = node.args[:2]
    z, x2 = _two_u(emit, x)
    s, p = _sigmoid_and_slope(emit, z)
    slope = emit(aten.add.Tensor, emit(aten.mul.Tensor, x2, 3.0 * _C), 1.0)
    right = emit(aten.mul.Tensor, emit(aten.mul.Tensor, x, p), emit(aten.mul.Tensor, slope, 2.0 * _K))
    node.replace_all_uses_with(emit(aten.mul.Tensor, g, emit(aten.add.Tensor, s, right)))
    graph.erase_node(node)


def _rewrite_tanh(graph: torch.fx.Graph, t: torch.fx.Node) -> None:
    emit = _Emitter(graph, t)
    z = emit(aten.mul.Tensor, t.args[0], 2.0)
    s = emit(aten.sigmoid.default, z)
    for use in list(t.users):
        at = _Emitter(graph, use)
        if _is_plus_one(use, t):
            new = at(aten.mul.Tensor, s, 2.0)
        else:   # tanh_backward(g, t) = g (1 - t^2) = g 4 s (1 - s), in the backward from z
            _, p = _sigmoid_and_slope(at, z)
            new = at(aten.mul.Tensor, use.args[0], at(aten.mul.Tensor, p, 4.0))
        use.replace_all_uses_with(new)
        graph.erase_node(use)
    graph.erase_node(t)


def tanh_gelu_as_sigmoid(graph: TrainGraph) -> int:
    """Rewrite in place; returns the count of rewritten ops (gelu, gelu_backward, tanh)."""
    count = 0
    for node in list(graph.graph.nodes):
        if not _on_cpu(node):
            continue
        if _is_tanh_gelu(node, aten.gelu.default):
            _rewrite_gelu(graph.graph, node)
        elif _is_tanh_gelu(node, aten.gelu_backward.default):
            _rewrite_gelu_backward(graph.graph, node)
        elif node.op == "call_function" and node.target is aten.tanh.default and node.users and all(
                _is_plus_one(u, node) or _is_tanh_backward_of(u, node) for u in node.users):
            _rewrite_tanh(graph.graph, node)
        else:
            continue
        count += 1
    if count:
        graph.recompile()
    return count


@register_pass("tanh_gelu_as_sigmoid")
def tanh_gelu_as_sigmoid_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """tanh-GELU and its gradient through ``sigmoid`` on CPU (``tanh`` costs six ``sigmoid``s there)."""
    ctx.stat("rewritten", tanh_gelu_as_sigmoid(graph))
    return graph
