"""gloo_all_gathers_alone: on a gloo process group, every all-gather runs with no other collective in flight.

torch 2.13's gloo backend now and then corrupts the heap when an all-gather runs beside other
collectives on its worker threads (``AsyncAllgatherCoalescedWork``, about one call in a
thousand under load; docs/distributed.md). All-reduces and reduce-scatters alone in flight do
not, so they keep their overlap; HCCL and NCCL groups keep all of it. Only where the step blocks
changes: results are bitwise the same.

The backend of each collective's group comes from the mesh description (``MeshDesc.backends``,
one per axis); the compile driver appends this pass where the mesh has a gloo axis.
"""
from __future__ import annotations

from typing import Callable

import torch.fx

from graph_ir import TrainGraph
from graph_ir.meta import GraphAttr
from graph_ir.analysis.collectives import collective_kind, collective_of, group_name_of, is_communication_op, waits_of

from ..pass_manager import PassContext, register_pass


def gloo_all_gathers_alone(graph: torch.fx.Graph, backend_of: Callable[[str | None], str | None]) -> int:
    """Run every all-gather on a gloo process group alone: first wait for each collective still in
    flight on gloo, then issue the all-gather and wait for it at once.

    ``backend_of`` maps a group name to its backend. Returns how many waits moved."""
    moved = 0
    in_flight: dict[torch.fx.Node, None] = {}     # gloo collectives issued and not yet waited for
    for node in list(graph.nodes):
        if collective_kind(node) is None:
            if is_communication_op(node):          # a wait
                in_flight.pop(collective_of(node), None)
            continue
        if backend_of(group_name_of(node)) != "gloo":
            continue
        if collective_kind(node) != "all_gather":
            in_flight[node] = None
            continue
        for c in in_flight:
            for wait in waits_of(c):
                node.prepend(wait)
                moved += 1
        in_flight.clear()
        at = node
        for wait in waits_of(node):
            if at.next is not wait:
                at.append(wait)
                moved += 1
            at = wait
    return moved


@register_pass("gloo_all_gathers_alone", preserves=("cost", "state_bytes"))
def gloo_all_gathers_alone_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Wait for every gloo collective in flight before each gloo all-gather, and for the all-gather at once."""
    mesh = ctx.mesh
    backend_of = mesh.backend_of_group if mesh is not None and hasattr(mesh, "backend_of_group") else \
        (lambda name: None)
    ctx.stat("waits_moved", gloo_all_gathers_alone(graph.graph, backend_of))
    if any(collective_kind(n) and backend_of(group_name_of(n)) == "gloo" for n in graph.graph.nodes):
        graph.attrs[GraphAttr.GLOO_ORDERED] = True
    return graph
