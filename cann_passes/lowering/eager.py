"""eager: run the FX graph op by op with PyTorch's own kernels.

The reference backend: no compilation, so every other backend is checked
against it, and the one that runs anywhere torch runs. It runs the graph's
generated Python code (``GraphModule.forward``), not an interpreter.

The captured step is functional: every op allocates its result, and the new
parameters and optimizer state are fresh tensors. Eager PyTorch's optimizer
updates them in place instead, and with ~10 full-size temporaries per
parameter the fresh allocations (page faults on every step) cost more than
the arithmetic. So the lowered copy rewrites a pointwise op whose first
operand's buffer dies at that op into its in-place variant (``add`` ->
``add_``), the reuse eager code does by hand:

- a buffer the graph allocated, when nothing reads it (through any alias)
  later;
- a parameter, buffer or optimizer-state input of a whole-step or apply
  graph, when its last reader is that op and the chain of in-place ops that
  starts there ends in the graph's output for that same value (so the graph
  returns the input itself, holding its new contents, and the runtime has
  nothing to store). At run time the inputs written must not share storage
  with any other input (a user's optimizer state aliasing a parameter, a
  flattened parameter buffer) and must not overlap themselves; a call where
  they do runs the functional copy instead.

When an input may be written: nothing is lost. The first write comes after
everything that can fail on this rank's data or wait on another rank's:
every forward, loss and backward op (bad labels, an index out of range) and
every collective except the all-gathers that distribute the update, in
particular every gradient reduction (all-reduce, reduce-scatter), the
overflow flag and the clipping norm. Data parallelism waits for each
bucket's all-reduce just before the optimizer reads it, interleaved with the
updates; so that the writes can start, the lowered copy first moves the wait
of every collective issued before the optimizer to the optimizer's start:
the step waits for all gradients, as DDP's backward does before
``optimizer.step()`` (the update of an early bucket no longer overlaps the
reduction of a later one). A step that fails on any rank (bad labels on one)
then leaves every rank's parameters and state as they were: the failing rank
raises before its first write, and its peers are blocked in a gradient
reduction, before theirs, until the fault watchdog stops them.

After the first write only the optimizer's pointwise arithmetic runs, and
under ZeRO-1/2 the all-gathers of the updated parameter shards (computed by
the optimizer from the values just written). Nothing there reads the batch
or another rank's gradients; what can fail is the transport alone (a peer
killed or gone mid-update, a timeout). Then this rank holds its optimizer
state shards at the new step and its whole parameters at the old one (no
gathered value arrives), and the fault watchdog stops every rank: the run
resumes from its last checkpoint, as after any peer failure. Eager PyTorch
leaves the same: DeepSpeed's ZeRO-1/2 updates its partitions and their state
in place and then all-gathers; FSDP2 commits the sharded update in
``optimizer.step()`` and gathers in the next forward (our ZeRO-3 writes its
parameter and state shards in place and gathers nothing after them); DDP
updates in place after its backward. Only a fully functional step, which
writes nothing until it returns, would keep the old state there, at the cost
of fresh parameters and state every step; ``CANN_PASSES_INPLACE_UPDATES=0``
asks for it (``base.writable_inputs``; it also keeps the functional
all-reduce).

Data parallelism's gradient buckets are reduced by the functional ``all_reduce``
(a clone of the bucket). Reducing the bucket itself (``all_reduce_``) saved one
bucket copy per step; a heap corruption seen once in a 4-rank gloo DP/ZeRO run
with it was most likely the gloo all-gather fault below, but that is not
confirmed, so it is not done. On a gloo group every all-gather runs alone, with
no other collective in flight (``base.gloo_all_gathers_alone``).

The same kernel runs on the same values, so results are bitwise those of the
functional graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.reinplace import _maybe_get_inplace_op

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import is_communication_op
from graph_ir.analysis.memory import storage_roots
from graph_ir.meta import Region, region_of

from .base import (GuardedRunner, distributes_update, gloo_all_gathers_alone,
                   wait_for_reductions_first, writable_inputs)


def _layout(val) -> tuple | None:
    if not isinstance(val, torch.Tensor):
        return None
    return (tuple(val.shape), val.dtype, tuple(val.stride()), val.device) if val.is_contiguous() else None


@dataclass
class ReusePlan:
    rewrites: dict[torch.fx.Node, torch._ops.OpOverload] = field(default_factory=dict)
    written: set[torch.fx.Node] = field(default_factory=set)   # graph inputs written in place


def _plan(graph: torch.fx.Graph, writable: dict[torch.fx.Node, int]) -> ReusePlan:
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
    # Inputs are written only after this position: the last op that can fail on data or on a peer
    # (a forward or backward op, a collective other than the all-gather of the update).
    fence = -1
    for n in nodes:
        for a in n.all_input_nodes:
            r = roots[a]
            last_use[r] = never if n.op == "output" else max(last_use.get(r, -1), position[n])
        if n.op == "call_function" and (region_of(n) != Region.OPTIMIZER
                                        or (is_communication_op(n) and not distributes_update(n))):
            fence = position[n]
    plan = ReusePlan()
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or not n.args:
            continue
        if torch.Tag.pointwise not in n.target.tags or torch.Tag.nondeterministic_seeded in n.target.tags:
            continue
        x = n.args[0]
        if not isinstance(x, torch.fx.Node):
            continue
        root = find(x)
        if root.op == "placeholder":
            if root not in writable or position[n] <= fence:
                continue
        elif root.op != "call_function" or x.op != "call_function":
            continue
        if last_use.get(root) != position[n]:
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
        plan.rewrites[n] = inplace
        if root.op == "placeholder":
            plan.written.add(root)
        # n now names x's buffer: the buffer lives as long as n's own readers.
        own = roots[n]
        parent[own] = root
        last_use[root] = last_use.get(own, position[n])
    # An input is written only if the graph returns it as its own new value; else it stays untouched.
    outputs = list(graph.output_node().args[0])
    wrong = {p for p in plan.written if find(outputs[writable[p]]) is not p}
    if wrong:
        return _plan(graph, {p: i for p, i in writable.items() if p not in wrong})
    return plan


def reuse_dead_operands(gm: torch.fx.GraphModule, writable: dict[torch.fx.Node, int] | None = None) -> int:
    """Rewrite ``y = op(x, ...)`` to ``y = op_(x, ...)`` where ``op`` is pointwise, nothing reads ``x``'s
    buffer (through any alias) after this op, and ``x`` has ``y``'s shape, dtype and (contiguous)
    strides; ``x``'s buffer is one the graph allocated, or a placeholder in ``writable`` (placeholder ->
    index of the graph output that is its new value: it is written only if that output ends up
    naming its buffer). Returns how many ops were rewritten; ``gm.meta['written_inputs']`` lists the
    placeholders written."""
    plan = _plan(gm.graph, writable or {})
    for node, inplace in plan.rewrites.items():
        node.target = inplace
    gm.meta["written_inputs"] = [n.name for n in gm.graph.nodes if n in plan.written]
    if plan.rewrites:
        gm.recompile()
    return len(plan.rewrites)


class EagerLowering:
    name = "eager"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def compile(self, graph: TrainGraph, example_inputs, plan):
        lowered = graph.copy()
        writable = writable_inputs(lowered)
        lowered.gm.meta["waits_moved"] = wait_for_reductions_first(lowered.gm.graph) if writable else 0
        lowered.gm.meta["gloo_waits_moved"] = gloo_all_gathers_alone(lowered.gm.graph)
        lowered.attrs["reused_buffers"] = reuse_dead_operands(lowered.gm, writable)
        names = set(lowered.gm.meta["written_inputs"])
        lowered.recompile()
        written = [i for i, p in enumerate(lowered.placeholders()) if p.name in names]

        def functional() -> torch.fx.GraphModule:
            copy = graph.copy()
            gloo_all_gathers_alone(copy.gm.graph)
            reuse_dead_operands(copy.gm)
            return copy.gm

        return GuardedRunner(lowered.gm, lowered, written, functional)
