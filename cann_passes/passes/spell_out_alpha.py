"""spell_out_alpha: write ``add/sub(x, y, alpha=k)`` as ``add/sub(x, mul(y, k))``.

Inductor's backend needs it: torch 2.13's post-grad ``addmm`` pattern turns
``add(mm(a, b), c, alpha=k)`` into ``addmm(c, a, b)`` and drops ``alpha`` (a
miscompile: the weight-decay term of SGD's update, after inductor removes the
gradient's double transpose, has exactly this shape). Spelling ``alpha`` out
keeps the pattern from matching. The pipeline runs it last for the inductor
backend; the numerics are those of eager's own ``add(alpha=)`` up to the
rounding of one multiply.
"""
from __future__ import annotations

import torch

from graph_ir import TrainGraph

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten
_ALPHA_OPS = (aten.add.Tensor, aten.sub.Tensor)


def spell_out_alpha(graph: TrainGraph) -> int:
    """Rewrite in place; returns the count of rewritten nodes."""
    count = 0
    for node in list(graph.graph.nodes):
        alpha = node.kwargs.get("alpha", 1) if node.op == "call_function" else 1
        if node.target not in _ALPHA_OPS or alpha == 1:
            continue
        x, y = node.args
        with graph.graph.inserting_before(node):
            scaled = graph.graph.call_function(aten.mul.Tensor, (y, alpha))
        scaled.meta = dict(node.meta)
        scaled.meta["val"] = y.meta["val"] * alpha if isinstance(y, torch.fx.Node) else None
        node.args, node.kwargs = (x, scaled), {}
        count += 1
    if count:
        graph.recompile()
    return count


@register_pass("spell_out_alpha")
def spell_out_alpha_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """``add/sub(x, y, alpha=k)`` as ``add/sub(x, mul(y, k))`` (inductor's addmm pattern drops alpha)."""
    ctx.stat("rewritten", spell_out_alpha(graph))
    return graph
