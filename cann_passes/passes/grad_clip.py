"""grad_clip: global gradient-norm clipping before the optimizer, as torch.nn.utils.clip_grad_norm_.

Every gradient the optimizer reads is multiplied by
``clamp(max_norm / (total_norm + 1e-6), max=1)``, where ``total_norm`` is the
2-norm of all gradients viewed as one vector: ``vector_norm(stack([vector_norm(g)
for g in grads]))``, the same ops in the same order as ``clip_grad_norm_``, so a
single-process step is bitwise equal to eager clipping.

It clips the gradients the update reads, found from the graph's semantics
(:func:`graph_ir.analysis.gradients.find_gradients`), so it must run after every
pass that changes what the update reads:

- ``loss_scale``: the update reads unscaled gradients, which are clipped; on an
  overflowing step the norm is inf/NaN and the step is skipped as before (its
  outputs are selected from the inputs).
- ``grad_accumulation``: the update reads the accumulated mean, which is
  clipped once per optimizer step (the clip is in the optimizer region, so it
  lands in the apply graph).
- ``data_parallel``: gradients are all-reduced, every rank holds all of them,
  the local norm is the global one.
- ``optimizer_shard`` (ZeRO 1-3): each rank holds a shard of each gradient
  (its placement, ``meta[SHARDING]``, says along which mesh axis). The squared
  norms of the shards are summed, all-reduced over that axis, and added to
  those of whole gradients; padding is zero and adds nothing.

Nodes that read a gradient and sit before the last gradient (an update of an
early ZeRO bucket) are moved after the norm, with everything that depends on
them, so no parameter is updated with an unclipped gradient.

Metric: ``grad_clip:grad_norm``, the total norm before clipping (what
``clip_grad_norm_`` returns).
"""
from __future__ import annotations

import math

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.gradients import GradientNotFound, find_gradients, optimizer_ancestors
from graph_ir.build import add_node
from graph_ir.meta import GRADIENT_OF, SHARDING, Region, region_of
from graph_ir.placement import FlatShard, Partial, Placement, Shard, placement_of
from graph_ir.signature import InputKind, OutputKind, Spec

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ORIGIN = "grad_clip"
GRAD_NORM = "grad_clip:grad_norm"


class GradClipError(ValueError):
    pass


def _sharded_axes(node: torch.fx.Node, name: str, tg: TrainGraph | None = None) -> tuple[str, ...]:
    """Mesh axes along which this rank holds only a piece of the gradient ``name``: those of its
    own placement and, where it is smaller than the whole parameter, those of the parameter
    (tensor parallelism gives a split weight's gradient as this rank's shard without marking the
    node, and its squared norm is only this rank's part of the whole)."""
    pieces = []
    data = node.meta.get(SHARDING)
    if data is not None:
        pieces.append(Placement.from_json(data))
    param = None if tg is None else placement_of(tg, InputKind.PARAM, name)
    val = node.meta.get("val")
    if param is not None and isinstance(val, torch.Tensor) and val.numel() < param.numel:
        pieces.append(param)
    axes = []
    for placement in pieces:
        for axis, how in placement.axes:
            if isinstance(how, Partial):
                raise GradClipError(
                    f"grad_clip: the gradient of '{name}' is a partial sum over mesh axis '{axis}' where "
                    "the update reads it (rule: clipping needs synchronized gradients; run grad_clip "
                    "after data_parallel / optimizer_shard)")
            if isinstance(how, (Shard, FlatShard)) and axis not in axes:
                axes.append(axis)
    return tuple(axes)


def _group_name(ctx: PassContext, axis: str) -> str:
    mesh = getattr(ctx, "mesh", None)
    if mesh is None:
        raise GradClipError(f"grad_clip: gradients are sharded over mesh axis '{axis}' but the pass has "
                            "no ctx.mesh to name its process group")
    return mesh.group_name(axis)


class _Emit:
    def __init__(self, tg: TrainGraph):
        self.graph, self.mode = tg.graph, tg.fake_mode()
        self.made: list[torch.fx.Node] = []

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        node = add_node(self.graph, target, args, kwargs, region=Region.OPTIMIZER, module_path="",
                        origin=ORIGIN, mode=self.mode)
        self.made.append(node)
        return node


def _total_norm(tg: TrainGraph, ctx: PassContext, emit: _Emit, grads: dict[str, torch.fx.Node]):
    norms = {n: emit(aten.linalg_vector_norm.default, g, 2.0) for n, g in grads.items()}
    by_axes: dict[tuple[str, ...], list[str]] = {}
    for name, g in grads.items():
        by_axes.setdefault(_sharded_axes(g, name, tg), []).append(name)
    if list(by_axes) == [()]:
        # Whole gradients on every rank: clip_grad_norm_'s own ops, bitwise.
        return emit(aten.linalg_vector_norm.default, emit(aten.stack.default, list(norms.values())), 2.0)
    squares = None
    for axes, names in by_axes.items():
        stacked = emit(aten.stack.default, [norms[n] for n in names])
        part = emit(aten.sum.default, emit(aten.mul.Tensor, stacked, stacked))
        for axis in axes:
            part = emit(c10d.wait_tensor.default,
                        emit(c10d.all_reduce.default, part, "sum", _group_name(ctx, axis)))
        squares = part if squares is None else emit(aten.add.Tensor, squares, part)
    return emit(aten.sqrt.default, squares)


def _move_after(tg: TrainGraph, anchor: torch.fx.Node, start: set[torch.fx.Node]) -> int:
    """Move ``start`` and every node depending on it that precedes ``anchor`` to after ``anchor``."""
    order = {n: i for i, n in enumerate(tg.graph.nodes)}
    limit = order[anchor]
    moving: set[torch.fx.Node] = set()
    stack = [n for n in start if order[n] < limit]
    while stack:
        node = stack.pop()
        if node in moving:
            continue
        moving.add(node)
        stack.extend(u for u in node.users if u.op != "output" and order[u] < limit)
    last = anchor
    for node in sorted(moving, key=order.__getitem__):
        last.append(node)
        last = node
    return len(moving)


def _gradients(tg: TrainGraph) -> dict[str, torch.fx.Node]:
    """Parameter -> the gradient its update reads. Where the update also reads a flag from
    backward (loss_scale's overflow select reads a boolean), the gradient is the one floating
    value it reads."""
    # A mark on a node the update no longer reads is stale (a pass that redirected the update to
    # a synchronized copy left it): the semantic search below finds the value read now.
    for node in tg.graph.nodes:
        if GRADIENT_OF in node.meta and not any(region_of(u) == Region.OPTIMIZER for u in node.users):
            node.meta.pop(GRADIENT_OF)
    try:
        return find_gradients(tg)
    except GradientNotFound as exc:
        first_error = exc
    outputs = tg.output_values()
    found = {}
    for i, spec in tg.signature.outputs_of(OutputKind.PARAM):
        reads = {a for n in optimizer_ancestors(outputs[i]) for a in n.all_input_nodes
                 if a.op != "placeholder" and region_of(a) != Region.OPTIMIZER
                 and getattr(a.meta.get("val"), "is_floating_point", lambda: False)()}
        if len(reads) != 1:
            raise GradClipError(f"grad_clip: {first_error}")
        found[spec.name] = reads.pop()
    return found


@register_pass("grad_clip", preserves=())
def grad_clip_pass(graph: TrainGraph, ctx: PassContext, *, max_norm: float = 1.0) -> TrainGraph:
    """Clip the gradients the optimizer reads to a global 2-norm of ``max_norm``."""
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise GradClipError(f"grad_clip option max_norm={max_norm!r} must be a finite number > 0")
    if any(s.name == GRAD_NORM for s in graph.signature.outputs):
        raise GradClipError("grad_clip already ran on this graph (it has a grad_clip:grad_norm output)")
    found = _gradients(graph)
    if not found:
        raise GradClipError("grad_clip found no gradient read by the optimizer")
    order = [s.name for _, s in graph.signature.outputs_of(OutputKind.PARAM) if s.name in found]
    grads = {n: found[n] for n in order}
    position = {n: i for i, n in enumerate(graph.graph.nodes)}
    last_grad = max(grads.values(), key=position.__getitem__)
    # The update's reads; other readers (a pass's metrics) keep the unclipped gradient.
    readers = {n: [u for u in g.users if region_of(u) == Region.OPTIMIZER] for n, g in grads.items()}
    emit = _Emit(graph)
    # Before the node after the last gradient: new nodes follow each other in creation order.
    with graph.graph.inserting_before(last_grad.next):
        total = _total_norm(graph, ctx, emit, grads)
        coef = emit(aten.clamp.default,
                    emit(aten.mul.Tensor, emit(aten.reciprocal.default, emit(aten.add.Tensor, total, 1e-6)),
                         float(max_norm)), None, 1.0)
        clipped = {n: emit(aten.mul.Tensor, g, coef) for n, g in grads.items()}
        metric = emit(aten.clone.default, total)
    for name, g in grads.items():
        for user in readers[name]:
            user.replace_input_with(g, clipped[name])
        # The update reads the clipped value now: that is its gradient for later passes.
        g.meta.pop(GRADIENT_OF, None)
        clipped[name].meta[GRADIENT_OF] = name
    moved = _move_after(graph, emit.made[-1], {u for rs in readers.values() for u in rs})
    graph.add_output(Spec(OutputKind.METRIC, GRAD_NORM), metric)
    ctx.stat("gradients", len(grads))
    ctx.stat("moved_nodes", moved)
    ctx.stat("sharded_gradients", sum(bool(_sharded_axes(g, n, graph)) for n, g in grads.items()))
    return graph

