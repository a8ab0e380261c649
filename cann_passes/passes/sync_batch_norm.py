"""sync_batch_norm: BatchNorm's batch statistics over the whole data-parallel batch, as
``torch.nn.SyncBatchNorm`` computes them, rather than over each rank's rows.

Each training-mode ``_native_batch_norm_legit_functional`` becomes: per channel the sum and the
sum of squares of this rank's rows, and its element count, summed over the dp group in one
all-reduce; the mean and the (biased) variance of the global batch from them; the normalisation
with those; the running statistics updated with them (the running variance unbiased by the global
count), so every rank holds the same buffers. Its ``native_batch_norm_backward`` becomes
SyncBatchNorm's backward: the sums over the rows of the output gradient and of the gradient times
the centred input are all-reduced too, the input gradient is computed from the global sums, and
the weight and bias gradients stay this rank's (``data_parallel`` averages them like any other
gradient). With equal rows per rank, training is the single-process step on the global batch.
The running statistics it updates (``attrs['sync_batch_norm']['buffers']``) are then the same on
every rank, so ``data_parallel`` does not broadcast them; ``num_batches_tracked`` still is.

The statistics come from E[x^2] - E[x]^2 in float32 (torch's kernel on one process uses
Welford's update): within about 1e-6 of it for activations of order one. Under mixed precision
the sums are taken in float32. Evaluation-mode batch norms (``training=False``) are left alone.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.meta import GraphAttr, Region, region_of
from graph_ir.signature import InputKind

from ..pass_manager import PassContext, register_pass
from ._distributed import DistributedRewriteError, NodeBuilder, aten, c10d, mesh_dim

ORIGIN = "sync_batch_norm"
_FORWARD = aten._native_batch_norm_legit_functional.default
_BACKWARD = aten.native_batch_norm_backward.default


@register_pass("sync_batch_norm", preserves=())
def sync_batch_norm_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Every training-mode batch norm's statistics over the dp group."""
    group = mesh_dim(ctx, "dp", ORIGIN)
    forwards = [n for n in graph.graph.nodes if n.target is _FORWARD and _training(n)]
    if not forwards:
        raise DistributedRewriteError("sync_batch_norm: the step has no training-mode batch norm "
                                      "(aten._native_batch_norm_legit_functional with training=True)")
    if group.size == 1:
        return graph
    # Their running statistics are the same on every rank: data_parallel need not broadcast them.
    names = {n: s.name for s, n in zip(graph.signature.inputs, graph.placeholders()) if s.kind == InputKind.BUFFER}
    held = sorted({names[_source(a)] for node in forwards for a in node.args[3:5]
                   if a is not None and _source(a) in names})
    stats = {}
    for node in forwards:
        stats[node] = _forward(graph, node, group)
    backwards = [n for n in graph.graph.nodes if n.target is _BACKWARD]
    for node in backwards:
        source = _forward_of(node, stats)
        if source is None:
            raise DistributedRewriteError(
                f"sync_batch_norm: {node.name} ({node.target}) is the backward of no batch norm this pass "
                "rewrote (rule: its saved mean and inverse std are a training-mode batch norm's outputs)")
        _backward(graph, node, stats[source], group)
    for node in backwards + forwards:   # (their getitems now read by nothing)
        for user in list(node.users):
            graph.graph.erase_node(user)
        graph.graph.erase_node(node)
    graph.attrs[GraphAttr.SYNC_BATCH_NORM] = {"dp": group.size, "batch_norms": len(forwards), "buffers": held}
    ctx.stat("batch_norms", len(forwards))
    return graph


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """The placeholder a running statistic is a copy of (functionalization clones the buffer)."""
    while node.op == "call_function" and node.target in (aten.clone.default, aten.alias.default,
                                                          aten._to_copy.default) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _training(node: torch.fx.Node) -> bool:
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("training"))


def _dims(x: torch.fx.Node) -> list[int]:
    return [d for d in range(x.meta["val"].ndim) if d != 1]


def _per_channel(build: NodeBuilder, t: torch.fx.Node, ndim: int) -> torch.fx.Node:
    """A [C] value viewed [1, C, 1, ...] to broadcast over an input of ``ndim`` dims."""
    return build(aten.view.default, t, [1, -1] + [1] * (ndim - 2))


class _Stats:
    def __init__(self, x32, mean, invstd, count):
        self.x32, self.mean, self.invstd, self.count = x32, mean, invstd, count


def _forward(graph: TrainGraph, node: torch.fx.Node, group) -> _Stats:
    x, weight, bias, running_mean, running_var = node.args[:5]
    momentum, eps = node.args[6], node.args[7]
    val = x.meta["val"]
    ndim, dims, dtype = val.ndim, _dims(x), val.dtype
    build = NodeBuilder(graph, node, Region.FORWARD, ORIGIN)
    x32 = build(aten._to_copy.default, x, dtype=torch.float32) if dtype != torch.float32 else x
    local = val.numel() // val.shape[1]
    total = build(aten.sum.dim_IntList, x32, dims)
    squares = build(aten.sum.dim_IntList, build(aten.mul.Tensor, x32, x32), dims)
    count = build(aten.full.default, [1], float(local), dtype=torch.float32, device=val.device)
    packed = build(aten.cat.default, [total, squares, count])
    summed = build(c10d.wait_tensor.default, build(c10d.all_reduce.default, packed, "sum", group.group_name))
    channels = val.shape[1]
    n = build(aten.select.int, summed, 0, 2 * channels)
    mean = build(aten.div.Tensor, build(aten.slice.Tensor, summed, 0, 0, channels), n)
    square_mean = build(aten.div.Tensor, build(aten.slice.Tensor, summed, 0, channels, 2 * channels), n)
    var = build(aten.clamp_min.default, build(aten.sub.Tensor, square_mean, build(aten.mul.Tensor, mean, mean)), 0.0)
    invstd = build(aten.rsqrt.default, build(aten.add.Tensor, var, eps))
    out = build(aten.mul.Tensor, build(aten.sub.Tensor, x32, _per_channel(build, mean, ndim)),
                _per_channel(build, invstd, ndim))
    if weight is not None:
        out = build(aten.mul.Tensor, out, _per_channel(build, weight, ndim))
    if bias is not None:
        out = build(aten.add.Tensor, out, _per_channel(build, bias, ndim))
    if out.meta["val"].dtype != dtype:
        out = build(aten._to_copy.default, out, dtype=dtype)
    unbiased = build(aten.mul.Tensor, var, build(aten.div.Tensor, n, build(aten.sub.Tensor, n, 1.0)))
    new_mean = _running(build, running_mean, mean, momentum)
    new_var = _running(build, running_var, unbiased, momentum)
    outputs = {0: out, 1: mean, 2: invstd, 3: new_mean, 4: new_var}
    for user in list(node.users):
        if user.target is not operator.getitem or user.args[1] not in outputs:
            raise DistributedRewriteError(f"sync_batch_norm: {user.name} reads {node.name} otherwise than by one "
                                          "of its five outputs")
        replacement = outputs[user.args[1]]
        if replacement is None:
            raise DistributedRewriteError(f"sync_batch_norm: {user.name} reads the running statistics of "
                                          f"{node.name}, which has none")
        user.replace_all_uses_with(replacement)
    return _Stats(x32, mean, invstd, n)


def _running(build: NodeBuilder, running, batch, momentum) -> torch.fx.Node | None:
    if running is None:
        return None
    kept = build(aten.mul.Tensor, running, 1.0 - momentum)
    moved = build(aten.mul.Tensor, batch, momentum)
    if moved.meta["val"].dtype != running.meta["val"].dtype:
        moved = build(aten._to_copy.default, moved, dtype=running.meta["val"].dtype)
    return build(aten.add.Tensor, kept, moved)


def _forward_of(node: torch.fx.Node, stats: dict) -> torch.fx.Node | None:
    """The rewritten forward whose saved mean this backward reads (now its ``_Stats.mean``)."""
    mean = node.args[5]
    return next((f for f, s in stats.items() if s.mean is mean), None)


def _backward(graph: TrainGraph, node: torch.fx.Node, stats: _Stats, group) -> None:
    grad, x, weight = node.args[:3]
    mask = node.args[9] if len(node.args) > 9 else [True, True, True]
    val = x.meta["val"]
    ndim, dims, dtype = val.ndim, _dims(x), grad.meta["val"].dtype
    build = NodeBuilder(graph, node, region_of(node), ORIGIN)
    grad32 = build(aten._to_copy.default, grad, dtype=torch.float32) if dtype != torch.float32 else grad
    x32 = build(aten._to_copy.default, x, dtype=torch.float32) if val.dtype != torch.float32 else x
    centred = build(aten.sub.Tensor, x32, _per_channel(build, stats.mean, ndim))
    sum_dy = build(aten.sum.dim_IntList, grad32, dims)
    sum_dy_xmu = build(aten.sum.dim_IntList, build(aten.mul.Tensor, grad32, centred), dims)
    channels = val.shape[1]
    packed = build(aten.cat.default, [sum_dy, sum_dy_xmu])
    summed = build(c10d.wait_tensor.default, build(c10d.all_reduce.default, packed, "sum", group.group_name))
    mean_dy = build(aten.div.Tensor, build(aten.slice.Tensor, summed, 0, 0, channels), stats.count)
    mean_dy_xmu = build(aten.div.Tensor, build(aten.slice.Tensor, summed, 0, channels, 2 * channels), stats.count)
    invstd = stats.invstd
    # dx = w * invstd * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean))), the sums global
    correction = build(aten.mul.Tensor, centred, _per_channel(
        build, build(aten.mul.Tensor, build(aten.mul.Tensor, invstd, invstd), mean_dy_xmu), ndim))
    inner = build(aten.sub.Tensor, build(aten.sub.Tensor, grad32, _per_channel(build, mean_dy, ndim)), correction)
    scale = invstd if weight is None else build(aten.mul.Tensor, invstd, weight)
    grad_input = build(aten.mul.Tensor, inner, _per_channel(build, scale, ndim))
    if grad_input.meta["val"].dtype != val.dtype:
        grad_input = build(aten._to_copy.default, grad_input, dtype=val.dtype)
    grad_weight = build(aten.mul.Tensor, sum_dy_xmu, invstd)
    outputs = {0: grad_input if mask[0] else None, 1: grad_weight if mask[1] else None,
               2: sum_dy if mask[2] else None}
    for i, out in ((1, grad_weight), (2, sum_dy)):
        if weight is not None and out.meta["val"].dtype != weight.meta["val"].dtype:
            outputs[i] = build(aten._to_copy.default, out, dtype=weight.meta["val"].dtype) if mask[i] else None
    for user in list(node.users):
        replacement = outputs.get(user.args[1]) if user.target is operator.getitem else None
        if replacement is None:
            raise DistributedRewriteError(f"sync_batch_norm: {user.name} reads {node.name} otherwise than by one "
                                          "of the gradients it computes")
        user.replace_all_uses_with(replacement)
