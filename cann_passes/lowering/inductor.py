"""inductor: torch's own compiler (``compile_fx``), C++/OpenMP on CPU, Triton on GPU.

The graph is already functional aten, so inductor's own AOT step has nothing
left to trace and goes straight to fusion and code generation.

One rewrite happens first, on a copy: torch 2.13's post-grad ``addmm``
pattern turns ``add(mm(a, b), c, alpha=k)`` into ``addmm(c, a, b)`` and drops
``alpha`` (a miscompile: the weight-decay term of SGD's update, after
inductor removes the gradient's double transpose, has exactly this shape).
Spelling ``alpha`` out as a multiply keeps the pattern from matching.
"""
from __future__ import annotations

import torch

from graph_ir import TrainGraph

from .base import cxx_compiler_available

aten = torch.ops.aten
_ALPHA_OPS = (aten.add.Tensor, aten.sub.Tensor)


def spell_out_alpha(graph: TrainGraph) -> int:
    """Rewrite ``add/sub(x, y, alpha=k)`` as ``add/sub(x, mul(y, k))``; returns the count."""
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


class InductorLowering:
    name = "inductor"

    def available(self) -> tuple[bool, str]:
        return cxx_compiler_available()

    def compile(self, graph: TrainGraph, example_inputs, plan):
        from torch._inductor.compile_fx import compile_fx
        graph = graph.copy()
        spell_out_alpha(graph)
        return compile_fx(graph.gm, list(example_inputs))
