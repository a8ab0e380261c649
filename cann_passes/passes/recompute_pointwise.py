"""recompute_pointwise: recompute in backward the pointwise values a fusing compiler gets for free.

A forward value backward reads is written once in forward and read back in
backward. Where the value is one pointwise op of inputs backward keeps anyway
(a SwiGLU's ``silu(gate)``: backward keeps ``gate`` for SiLU's own gradient and
``silu(gate)`` for the product's), its forward readers are pointwise, and its
backward readers are pointwise, a compiler that fuses pointwise chains (inductor)
computes it inside the kernels that read it on both sides: forward no longer
writes it, backward no longer reads it back, and backward keeps one value less.
Torch's own partitioner (``min_cut_rematerialization_partition``) makes the same
choice for cheap pointwise values; this pass makes it on the whole step's graph,
so that the backward region reads what the partitioner would have saved.

What is recomputed, all of:

- a forward op tagged ``torch.Tag.pointwise`` with one tensor result, drawing no
  random numbers;
- every reader a pointwise op of forward or backward (a matmul or the step's
  outputs reading it would have the compiler write it anyway, in forward and
  again in backward; a reduction reader is left out too, although inductor
  may fuse into it: a narrower rule than the fusion itself);
- every input a step input or a forward value backward reads already, at most
  the value's own bytes (the copy, placed before the first backward reader, may
  keep that input alive longer, never more bytes than the value it replaces).

Only the inductor pipeline runs it: the eager backend would run the op twice,
and GE's fusion of the backward is not known here. The copy is the same op on
the same inputs, so the step's numbers do not change (bitwise on the eager
interpreter; inductor rounds one fused kernel as it rounds the other).
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.effects import communicates, draws_random
from graph_ir.meta import ORIGIN_PASS, RECOMPUTE, RECOMPUTE_OF, REGION, Region, nbytes, region_of

from ..pass_manager import PassContext, register_pass


def _pointwise(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and torch.Tag.pointwise in node.target.tags


def _read_by_backward(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in node.users if region_of(u) == Region.BACKWARD]


def _recomputable(node: torch.fx.Node, kept: set[torch.fx.Node]) -> bool:
    val = node.meta.get("val")
    if not (_pointwise(node) and isinstance(val, torch.Tensor)) or draws_random(node) or communicates(node):
        return False
    # (a reader elsewhere, the step's outputs among them, would have forward write it anyway)
    if not all(_pointwise(u) and region_of(u) in (Region.FORWARD, Region.BACKWARD) for u in node.users):
        return False
    size = nbytes(val)
    for arg in node.all_input_nodes:
        if arg.op == "placeholder" or arg.op == "get_attr":
            continue
        if region_of(arg) != Region.FORWARD or arg not in kept or nbytes(arg.meta.get("val")) > size:
            return False
    return True


def recompute_pointwise(graph: TrainGraph) -> int:
    """Rewrite in place; returns the count of forward values no longer kept for backward."""
    g = graph.graph
    position = {n: i for i, n in enumerate(g.nodes)}
    kept = {n for n in g.nodes if n.op == "call_function" and region_of(n) == Region.FORWARD
            and _read_by_backward(n)}
    chosen: list[torch.fx.Node] = []
    for node in g.nodes:
        if node in kept and _recomputable(node, kept):
            chosen.append(node)
            # backward stops reading it: a copy reading it would have forward write it after all
            kept.discard(node)
    for node in chosen:
        readers = sorted(_read_by_backward(node), key=position.__getitem__)
        with g.inserting_before(readers[0]):
            copy = g.call_function(node.target, node.args, node.kwargs)
        copy.meta.update({k: v for k, v in node.meta.items() if k != ORIGIN_PASS})
        copy.meta.update({REGION: Region.BACKWARD.value, RECOMPUTE: True, RECOMPUTE_OF: node.name,
                          ORIGIN_PASS: "recompute_pointwise"})
        for reader in readers:
            reader.replace_input_with(node, copy)
    if chosen:
        graph.recompile()
    return len(chosen)


@register_pass("recompute_pointwise")
def recompute_pointwise_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Pointwise forward values of kept inputs, read only by pointwise ops, recomputed in backward."""
    ctx.stat("recomputed", recompute_pointwise(graph))
    return graph
