"""eager: run the FX graph op by op with PyTorch's own kernels.

The reference backend: no compilation, so every other backend is checked
against it, and the one that runs anywhere torch runs. It runs the graph's
generated Python code (``GraphModule.forward``), not an interpreter.

The captured step is functional: every op allocates its result. Eager
PyTorch's optimizer updates its temporaries in place instead, and with ~10
full-size temporaries per parameter the fresh allocations (page faults on
every step) cost more than the arithmetic. So the lowered copy rewrites a
pointwise op whose first operand's buffer dies at that op into its in-place
variant (``add`` -> ``add_``), the reuse eager code does by hand. Graph
inputs are never written (the step stays atomic: the model and optimizer
keep their old values until the runtime stores the outputs), nor is any
buffer still read later through any alias; the same kernel runs on the same
values, so results are bitwise those of the functional graph.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.reinplace import _maybe_get_inplace_op

from graph_ir import TrainGraph
from graph_ir.analysis.memory import storage_roots


def _layout(val) -> tuple | None:
    if not isinstance(val, torch.Tensor):
        return None
    return (tuple(val.shape), val.dtype, tuple(val.stride()), val.device) if val.is_contiguous() else None


def reuse_dead_operands(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``y = op(x, ...)`` to ``y = op_(x, ...)`` where ``op`` is pointwise, ``x`` is a buffer
    the graph allocated, nothing reads it (through any alias) after this op, and ``x`` has ``y``'s
    shape, dtype and (contiguous) strides. Returns how many ops were rewritten."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    roots = storage_roots(graph)
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        n = roots[n]
        while n in parent:
            n = parent[n]
        return n

    never = len(nodes) + 1
    last_use: dict[torch.fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            r = roots[a]
            last_use[r] = never if n.op == "output" else max(last_use.get(r, -1), position[n])
    rewritten = 0
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or not n.args:
            continue
        if torch.Tag.pointwise not in n.target.tags or torch.Tag.nondeterministic_seeded in n.target.tags:
            continue
        x = n.args[0]
        if not isinstance(x, torch.fx.Node) or x.op != "call_function":
            continue
        root = find(x)
        if root.op != "call_function" or last_use.get(root) != position[n]:
            continue
        others = [a for a in n.all_input_nodes if a is not x]
        if x in (n.args[1:] + tuple(n.kwargs.values())) or any(find(a) is root for a in others):
            continue
        layout = _layout(n.meta.get("val"))
        if layout is None or layout != _layout(x.meta.get("val")):
            continue
        inplace = _maybe_get_inplace_op(n.target)
        if inplace is None:
            continue
        n.target = inplace
        # y now names x's buffer: the buffer lives as long as y's own readers.
        own = roots[n]
        parent[own] = root
        last_use[root] = last_use.get(own, position[n])
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


class EagerLowering:
    name = "eager"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def compile(self, graph: TrainGraph, example_inputs, plan):
        lowered = graph.copy()
        lowered.attrs["reused_buffers"] = reuse_dead_operands(lowered.gm)
        lowered.recompile()
        return lowered.gm
