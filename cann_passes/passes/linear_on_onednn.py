"""linear_on_onednn: run the float32 CPU matmuls that oneDNN does faster than MKL through oneDNN.

On CPU, ATen hands every float32 ``mm``/``addmm`` to MKL's ``sgemm``; oneDNN's
matmul (``mkldnn._linear_pointwise``, what inductor uses only for frozen,
prepacked inference weights) is faster for a training step's linear
layers: on this project's AMD EPYC machine, one thread, a GPT's shapes
(1024 rows, K and N of 256-1024) take 0.73-0.99x of MKL's time for
``x @ W.t() + b`` (the forward) and ``g @ W`` (the input gradient). It is
slower where the left operand is a transposed view (the weight gradient
``g.t() @ x``: oneDNN reorders it, 1.2x), so those stay on MKL.

Rewritten, on float32 CPU tensors when oneDNN is built in:

- ``addmm(b, x, m)`` with a 1-D bias ``b`` of the output's width, ``alpha = beta = 1``;
- ``mm(x, m)``;

where ``x`` is 2-D and row-major (its fake value is contiguous), as
``cann.onednn_linear(x, m.t(), b)``: ``x @ m + b`` with oneDNN. The op is a
``torch.library`` custom op defined here (inductor's lowering of
``mkldnn._linear_pointwise`` accepts only constant weights), so inductor calls
it as an extern kernel with the operand strides the graph gives it; its fake
implementation gives a contiguous result, as oneDNN writes it.

Numerics: not bitwise. oneDNN sums each dot product in another order than
MKL, a float32 rounding difference (relative 1e-7 to 1e-6 of the result);
tests hold steps to 1e-5 of eager PyTorch.

Opt-in (``Plan(extra_passes=("linear_on_onednn",))``), not one of inductor's
required passes: in a whole step it gains about 1% (the recipe GPT,
``bench.step_time`` row ``ours-inductor+onednn``), less than the 10% the
same matmuls gain alone, and the rounding noise it adds is what Adam turns
into a full step on a parameter whose gradient is all cancellation: the
inductor parity test (bias-free GPT, Adam, 10 steps, 1% of a step allowed)
then sees 1.2% on one element.
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.meta import GRADIENT_OF

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten


@torch.library.custom_op("cann::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.t() + bias`` by oneDNN (``weight`` is ``[out, in]``, any strides)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _float32_cpu(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype == torch.float32


def _row_major_2d(node) -> bool:
    return _float32_cpu(node) and node.meta["val"].dim() == 2 and node.meta["val"].is_contiguous()


def _operands(node: torch.fx.Node):
    """``(x, m, bias)`` of a rewritable ``mm``/``addmm``, else None."""
    if node.op != "call_function" or not _float32_cpu(node):
        return None
    if node.target is aten.mm.default:
        x, m = node.args
        bias = None
    elif node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
            return None
        bias, x, m = node.args
        width = node.meta["val"].shape[1]
        if not _float32_cpu(bias) or tuple(bias.meta["val"].shape) != (width,):
            return None
    else:
        return None
    if not _row_major_2d(x) or not _float32_cpu(m):
        return None
    return x, m, bias


def linear_on_onednn(graph: TrainGraph) -> int:
    """Rewrite in place; returns the count of rewritten matmuls."""
    if not torch.backends.mkldnn.is_available():
        return 0
    g = graph.graph
    count = 0
    for node in list(g.nodes):
        operands = _operands(node)
        if operands is None:
            continue
        x, m, bias = operands
        meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        with g.inserting_before(node):
            weight = g.call_function(aten.t.default, (m,))
            linear = g.call_function(torch.ops.cann.onednn_linear.default, (x, weight, bias))
        weight.meta = {k: v for k, v in meta.items() if k != GRADIENT_OF}
        weight.meta["val"] = aten.t.default(m.meta["val"])
        linear.meta = meta
        linear.meta["val"] = node.meta["val"].new_empty(node.meta["val"].shape)
        node.replace_all_uses_with(linear)
        g.erase_node(node)
        count += 1
    if count:
        graph.recompile()
    return count


@register_pass("linear_on_onednn")
def linear_on_onednn_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """float32 CPU ``mm``/``addmm`` with a row-major left operand through oneDNN (faster than MKL there)."""
    ctx.stat("rewritten", linear_on_onednn(graph))
    return graph
