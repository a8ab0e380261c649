"""wait_for_reductions_first: the optimizer waits for every gradient reduction before its first update.

Data parallelism waits for each bucket's all-reduce just before the optimizer reads it,
interleaved with the updates. A lowering that writes parameters and optimizer state in place
(the eager backend, ``reuse_dead_operands``) may start writing only once nothing left can fail
on this rank's data or wait on a peer; this pass makes that point the optimizer's start: it
moves there the wait of every collective issued before the optimizer, and each collective of
the optimizer's own but the all-gathers of the update (the clipping norm's all-reduce, an
overflow flag) together with the optimizer ops it reads. The step then waits for all gradients,
as DDP's backward does before ``optimizer.step()``. Waits and collectives move nothing by
themselves: only where the step blocks changes, so results are bitwise the same. Applies to the
step and apply graphs that update inputs (``graph_ir.analysis.updates``).
"""
from __future__ import annotations

import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import is_communication_op
from graph_ir.analysis.updates import distributes_update, updated_inputs
from graph_ir.meta import Region, region_of

from ..pass_manager import PassContext, register_pass


def wait_for_reductions_first(graph: torch.fx.Graph) -> int:
    """Move to the optimizer region's start what the optimizer must finish before it may write an
    input: the wait of every collective issued before the region (the gradient reductions), and each
    collective of the region's own but the all-gathers of the update (the clipping norm's all-reduce,
    an overflow flag) together with the region's ops it reads. Waits and collectives move nothing
    by themselves; only where the step blocks changes, so a lowering can write inputs from there on
    with every reduction done (the eager lowering does; another lowering that orders its writes
    after the waits can). Returns how many nodes moved."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    start = next((i for i, n in enumerate(nodes) if region_of(n) == Region.OPTIMIZER), None)
    if start is None:
        return 0
    before = set(nodes[:start])
    first: set[torch.fx.Node] = set()
    for n in nodes[start:]:
        if not is_communication_op(n) or distributes_update(n):
            continue
        stack = [n]
        while stack:
            m = stack.pop()
            if m not in first and m not in before and m.op == "call_function":
                first.add(m)
                stack.extend(m.all_input_nodes)
    moving = [n for n in nodes[start:] if n in first]
    anchor = next((n for n in nodes[start:] if n not in first), None)
    if anchor is None or nodes[start:start + len(moving)] == moving:
        return 0
    for n in moving:
        anchor.prepend(n)
    return len(moving)


@register_pass("wait_for_reductions_first", preserves=("cost", "state_bytes"))
def wait_for_reductions_first_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Move the gradient reductions' waits (and the optimizer's own reductions) to the optimizer's start."""
    ctx.stat("moved", wait_for_reductions_first(graph.graph) if updated_inputs(graph) else 0)
    return graph
