"""linear_on_onednn: float32 CPU matmuls through oneDNN where oneDNN runs them faster than MKL.

On CPU, ATen hands every float32 ``mm``/``addmm`` to MKL's ``sgemm``. oneDNN's matmul
(``mkldnn._linear_pointwise``, which inductor itself uses only for frozen, prepacked
inference weights) can be much faster, and by how much depends on the machine: on an
AVX-512 AMD EPYC it ran a training step's linear layers (1024 rows, K and N of
256-1024, one thread) in 0.43-0.49x of MKL's time, forward, input gradient and
weight gradient alike (about 250 GFLOP/s against MKL's 110 on one core);
on another it took 0.73-0.99x forward and 1.2x for the weight gradient, whose left
operand is a transposed view that oneDNN reorders. So the pass measures.

Rewritten, on float32 CPU tensors when oneDNN is built in and not turned off
(``torch.backends.mkldnn.enabled``):

- ``addmm(b, x, m)`` with a 1-D bias ``b`` of the output's width, ``alpha = beta = 1``;
- ``mm(x, m)``;

where ``x`` is 2-D and dense, row-major or a transposed view (a weight gradient's
``g.t()``), as ``cann.onednn_linear(x, m.t(), b)``: ``x @ m + b`` with oneDNN. The op is a
``torch.library`` custom op defined here (inductor's lowering of
``mkldnn._linear_pointwise`` accepts only constant weights), so inductor calls it as an
extern kernel with the operand strides the graph gives it; its fake implementation gives
a contiguous result, as oneDNN writes it.

Option ``choose``:

- ``measured`` (``Plan.matmul_kernel: auto`` on inductor): each distinct matmul (shapes,
  layouts, bias, thread count) is timed once per process on both libraries, on random
  operands of its layout (rows capped so that one call is about 2^27 multiply-adds), and
  moves only where oneDNN takes at most 0.8x MKL's time. The margin keeps a near tie on
  MKL, so that noise does not make two processes choose differently; choices are kept
  for the process, and a compile-cache hit reuses the program the choice was made for.
- ``always`` (``Plan.matmul_kernel: onednn``): every candidate moves.

Numerics: not bitwise. oneDNN sums each dot product in another order than MKL, a
float32 rounding difference (relative 1e-7 to 1e-6 of the result), as inductor's own
fusions round otherwise than eager; steps stay within 1e-5 of eager PyTorch. That is
why the eager backend, bitwise eager PyTorch by default, leaves it to
``matmul_kernel: onednn``.
"""
from __future__ import annotations

import time
from typing import Literal

import torch
import torch.fx
from torch.utils.flop_counter import register_flop_formula

from graph_ir import TrainGraph
from graph_ir.meta import GRADIENT_OF

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten

# oneDNN is chosen where it takes at most this share of MKL's time (see the module's doc).
MARGIN = 0.8
# Multiply-adds of one timed call: rows are cut to about this many (never below MIN_ROWS).
TIMED_MACS = 1 << 27
MIN_ROWS = 64
_REPEATS = 3

# (x shape, x layout, m shape, m layout, bias, threads) -> (MKL seconds, oneDNN seconds)
_measured: dict[tuple, tuple[float, float]] = {}


@torch.library.custom_op("cann::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.t() + bias`` by oneDNN (``weight`` is ``[out, in]``, any strides)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


# torch's FLOP counter, and the cost model that reads its formulas (graph_ir.analysis.cost), price the
# op as the matmul it is.
@register_flop_formula(torch.ops.cann.onednn_linear)
def _onednn_linear_flops(x_shape, weight_shape, bias_shape=None, *args, out_shape=None, **kwargs) -> int:
    (rows, inner), (width, _) = x_shape, weight_shape
    return 2 * rows * inner * width


def _float32_cpu(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype == torch.float32


def _layout(val: torch.Tensor) -> str | None:
    """``row`` (row-major), ``col`` (a transposed row-major tensor) or None, for a 2-D value."""
    if val.dim() != 2:
        return None
    if val.is_contiguous():
        return "row"
    if val.t().is_contiguous():
        return "col"
    return None


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
    if not (_float32_cpu(x) and _float32_cpu(m)) or _layout(x.meta["val"]) is None \
            or _layout(m.meta["val"]) is None:
        return None
    if 0 in x.meta["val"].shape or 0 in m.meta["val"].shape:
        return None     # nothing to compute, and oneDNN refuses empty operands
    return x, m, bias


def _operand(shape: tuple[int, int], layout: str, generator: torch.Generator) -> torch.Tensor:
    if layout == "row":
        return torch.randn(shape, generator=generator)
    return torch.randn(shape[::-1], generator=generator).t()


def _best(fn) -> float:
    fn()   # oneDNN builds its primitive on the first call
    best = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(x: torch.Tensor, m: torch.Tensor, bias: bool) -> tuple[float, float]:
    """Seconds of one ``x @ m (+ bias)`` by MKL (ATen's ``mm``/``addmm``) and by oneDNN, for
    operands of ``x``'s and ``m``'s shapes and layouts (fake values do), rows cut to about
    :data:`TIMED_MACS` multiply-adds. Kept for the process."""
    (rows, inner), (_, width) = x.shape, m.shape
    rows = min(rows, max(MIN_ROWS, TIMED_MACS // max(1, inner * width)))
    key = ((rows, inner), _layout(x), tuple(m.shape), _layout(m), bias, torch.get_num_threads())
    if key not in _measured:
        g = torch.Generator().manual_seed(0)
        a = _operand((rows, inner), _layout(x), g)
        b = _operand(tuple(m.shape), _layout(m), g)
        c = torch.randn(width, generator=g) if bias else None
        weight = b.t()
        mkl = _best((lambda: torch.addmm(c, a, b)) if bias else (lambda: torch.mm(a, b)))
        dnn = _best(lambda: onednn_linear(a, weight, c))
        _measured[key] = (mkl, dnn)
    return _measured[key]


def _faster_on_onednn(x: torch.Tensor, m: torch.Tensor, bias: bool, rows: dict) -> bool:
    """The measured choice for ``x @ m (+ bias)``, counted in ``rows`` (the explanation's row of its
    distinct matmul)."""
    mkl, dnn = measure(x, m, bias)
    moved = dnn <= MARGIN * mkl
    key = (tuple(x.shape), _layout(x), tuple(m.shape), _layout(m), bias)
    row = rows.setdefault(key, {"x": f"{list(key[0])} {key[1]}", "m": f"{list(key[2])} {key[3]}",
                                "bias": bias, "nodes": 0, "mkl_us": round(mkl * 1e6, 1),
                                "onednn_us": round(dnn * 1e6, 1), "runs_on": "onednn" if moved else "mkl"})
    row["nodes"] += 1
    return moved


def linear_on_onednn(graph: TrainGraph, choose: str = "always", timings: list | None = None) -> tuple[int, int]:
    """Rewrite in place; returns ``(rewritten, left on MKL because measured no faster there)``.
    ``timings`` (``measured``) gets one row per distinct matmul: its operands, how many nodes,
    both libraries' microseconds and where they run."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return 0, 0     # not built in, or turned off by the user
    g = graph.graph
    count = kept = 0
    rows: dict[tuple, dict] = {}
    for node in list(g.nodes):
        operands = _operands(node)
        if operands is None:
            continue
        x, m, bias = operands
        if choose == "measured" and not _faster_on_onednn(x.meta["val"], m.meta["val"], bias is not None, rows):
            kept += 1
            continue
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
    if timings is not None:
        timings.extend(rows.values())
    return count, kept


@register_pass("linear_on_onednn")
def linear_on_onednn_pass(graph: TrainGraph, ctx: PassContext, *,
                          choose: Literal["measured", "always"] = "always") -> TrainGraph:
    """float32 CPU ``mm``/``addmm`` through oneDNN: every one (``always``) or where a timing of both
    libraries on the matmul's shapes finds oneDNN faster (``measured``)."""
    timings: list = []
    rewritten, kept = linear_on_onednn(graph, choose, timings)
    ctx.stat("rewritten", rewritten)
    ctx.stat("kept_on_mkl", kept)
    if timings:
        ctx.explain({"margin": MARGIN, "matmuls": timings})
    return graph
