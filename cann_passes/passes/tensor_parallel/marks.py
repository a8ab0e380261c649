"""What the later passes and the runtime read off the per-rank graph: where each split value
lives, which value is a parameter's local gradient, which piece of a random draw a rank keeps."""
from __future__ import annotations

import operator

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.effects import random_op
from graph_ir.analysis.gradients import GradientNotFound, find_gradients
from graph_ir.meta import GRADIENT_OF, REGION, Region, region_of
from graph_ir.placement import RANDOM_PIECE, Placement, set_placement
from graph_ir.signature import InputKind, OutputKind, Spec

from .common import TensorParallelError, aten
from .layouts import ParamLayout, layout_for

_CUT_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.narrow.default,
            aten.clone.default, aten.alias.default, aten.view.default, aten.chunk.default)


def mark_random_pieces(graph: torch.fx.Graph) -> None:
    """Tag the end of each cut of a whole random draw to this rank's shard (``Rewriter._shard_random``)
    with ``RANDOM_PIECE``: the piece is what backward needs and what is kept for it."""
    for draw in graph.nodes:
        val = draw.meta.get("val")
        if not (random_op(draw.target)
                and isinstance(val, torch.Tensor) and val.ndim > 0 and region_of(draw) == Region.FORWARD):
            continue
        stack = [draw]
        while stack:
            node = stack.pop()
            cuts = [u for u in node.users if (u.target in _CUT_OPS or u.target is operator.getitem)
                    and u.all_input_nodes == [node]]
            stack.extend(cuts)
            piece = node.meta.get("val")
            if node is not draw and len(cuts) < len(node.users) and isinstance(piece, torch.Tensor) \
                    and piece.numel() < val.numel():
                node.meta[RANDOM_PIECE] = draw.name


def record_placements(out: TrainGraph, captured: TrainGraph, layouts: dict[str, ParamLayout]) -> None:
    """Where each split input and output lives, in graph_ir's placement vocabulary (the runtime's
    binding and checkpoints cut and gather by it); a fused projection's per-part split is a
    ``Shard(dim, parts)``."""
    full = {spec: n.meta["val"] for spec, n in zip(captured.signature.inputs, captured.placeholders())}
    nodes = dict(zip(out.signature.inputs, out.placeholders()))
    for spec in list(out.signature.inputs) + list(out.signature.outputs):
        layout = layout_for(spec, layouts)
        if layout is None or layout.dim is None:
            continue
        source = Spec(InputKind.PARAM if spec.kind == OutputKind.PARAM else spec.kind, spec.name)
        placement = Placement.sharded(tuple(full[source].shape), layout.dim, "tp", layout.parts)
        set_placement(out, spec.kind, spec.name, placement, nodes.get(spec))


def mark_local_gradients(graph: TrainGraph, layouts: dict[str, ParamLayout]) -> None:
    """Mark, for each split parameter, the value holding this rank's shard of its gradient.

    Where backward yields a gradient whole on every rank (a vocab-parallel embedding's dense
    backward) DTensor cuts it to the parameter's shard at the first optimizer op that reads it,
    so the cut is traced in the optimizer region. The data-parallel passes that follow reduce
    what the update reads: the shard, moved into backward, is the gradient."""
    try:
        found = find_gradients(graph, mark=False)
    except GradientNotFound:
        return  # nothing trains (or a shape the data-parallel passes refuse on their own)
    for name, grad in found.items():
        layout = layouts.get(name)
        local = tuple(graph.input_node(InputKind.PARAM, name).meta["val"].shape)
        if layout is None or layout.dim is None or tuple(grad.meta["val"].shape) == local:
            continue
        _merge_repeated_cuts(graph, grad)
        shard, chain = _cut_to_shard(grad, local)
        if shard is None:
            raise TensorParallelError(f"tensor_parallel: the gradient of '{name}' ({grad.name}, shape "
                                      f"{list(grad.meta['val'].shape)}) is never cut to the parameter's shard "
                                      f"{list(local)} before its update")
        _move_to_backward(shard, chain)
        shard.meta[GRADIENT_OF] = name


def _cut_to_shard(grad: torch.fx.Node, local: tuple) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """The first optimizer op on the way from the whole gradient that has the shard's shape, and
    every optimizer op the search passed (breadth first) to reach it."""
    chain, frontier = [], [grad]
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if region_of(user) != Region.OPTIMIZER or user.all_input_nodes != [node]:
                continue   # (a split's pieces are read through getitem)
            chain.append(user)
            val = user.meta.get("val")
            if isinstance(val, torch.Tensor) and tuple(val.shape) == local:
                return user, chain
            frontier.append(user)
    return None, chain


def _move_to_backward(shard: torch.fx.Node, chain: list[torch.fx.Node]) -> None:
    """The cut and its inputs up to the whole gradient belong to backward."""
    keep, stack = set(), [shard]
    while stack:
        n = stack.pop()
        if n in chain and n not in keep:
            keep.add(n)
            stack.extend(n.all_input_nodes)
    for n in keep:
        n.meta[REGION] = Region.BACKWARD.value


def _merge_repeated_cuts(graph: TrainGraph, grad: torch.fx.Node) -> None:
    """Each optimizer op that reads a whole gradient as a shard traced its own cut of it: one cut
    (the first) serves them all, so there is one value to reduce."""
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    seen: dict[tuple, torch.fx.Node] = {}
    frontier = [grad]
    while frontier:
        node = frontier.pop(0)
        for user in sorted(node.users, key=order.__getitem__):
            if region_of(user) != Region.OPTIMIZER or user.all_input_nodes != [node] \
                    or user.op != "call_function":
                continue
            key = (user.target, repr(user.args), repr(sorted(user.kwargs.items())))
            if key in seen and seen[key] is not user:
                user.replace_all_uses_with(seen[key])
                graph.graph.erase_node(user)
                continue
            seen[key] = user
            frontier.append(user)
