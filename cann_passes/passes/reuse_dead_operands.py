"""reuse_dead_operands: mark the pointwise ops that may run in place over a dying operand's buffer.

The captured step is functional: every op allocates its result, and the new
parameters and optimizer state are fresh tensors. Eager PyTorch's optimizer
updates them in place instead, and with ~10 full-size temporaries per
parameter the fresh allocations (page faults on every step) cost more than
the arithmetic. So this pass marks, for the eager lowering to run in place
(``add`` -> ``add_``), a pointwise op whose first operand's buffer dies at
that op: the reuse eager code does by hand. ``aten.copy`` counts as pointwise here (each element its
source's): ZeRO's gathered parameter columns are copied over the parameter inputs in place.

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
updates; so that the writes can start, the pass ``wait_for_reductions_first``
(before this one) moves the wait of every collective issued before the
optimizer to the optimizer's start:
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
asks for it (``reuse_dead_operands{inputs=false}``, and no
``wait_for_reductions_first``).

A gradient bucket's ``all_reduce`` is marked too (to run as ``all_reduce_``) when its input is
a buffer the graph allocated (the flattened bucket) that nothing reads after the collective and
no other collective still reads: the functional op copies its input into a fresh buffer first,
one more pass over every gradient byte and a bucket-sized allocation per step.

A multi-tensor op of ``graph_ir.multi_tensor_ops.IN_PLACE`` (``cann::fused_adam``, the fused
AdamW kernel) is marked by the same rules applied to every tensor of the lists it writes: each
dies there (a buffer the graph allocated, or an updated input past the first-write fence whose
new value the op returns), no two share a buffer, none shares one with its other operands.

The pass only marks (``graph_ir.meta.REUSES_OPERAND``; the placeholders written are listed in
``graph.attrs["written_inputs"]``): the graph stays functional, so it verifies, dumps and
serializes as any other, and the eager lowering switches the marked ops to their in-place
variants (keeping the unmarked graph as the functional fallback for inputs that share storage).
The marks are valid only in the node order they were made in: the pass comes after every pass
that reorders (``wait_for_reductions_first``, ``gloo_all_gathers_alone``). ``inputs=false`` marks
only buffers the graph allocated (the driver asks for it with ``$CANN_PASSES_INPLACE_UPDATES=0``).
The same kernel runs on the same values, so results are bitwise those of the functional graph.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.reinplace import _maybe_get_inplace_op as _match_inplace_op

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import is_collective, is_communication_op, waits_of
from graph_ir.analysis.effects import random_op
from graph_ir.analysis.memory import storage_roots
from graph_ir.analysis.updates import distributes_update, updated_inputs
from graph_ir.meta import HOST_FOLD, REUSE_COPIES, REUSES_OPERAND, GraphAttr, Region, region_of
from graph_ir.multi_tensor_ops import IN_PLACE, InPlaceLists

from ..pass_manager import PassContext, register_pass
from .scalars_on_host import folded_reads


c10d = torch.ops._c10d_functional
# Collectives with an in-place form the eager lowering runs where their input dies.
IN_PLACE_COLLECTIVES = {c10d.all_reduce.default: c10d.all_reduce_.default}
# Ops that compute each element of the result from the same element of their operands, as the
# pointwise-tagged ones do, without the tag: a copy over a dying buffer (ZeRO's gathered parameter
# columns copied over the parameter inputs) is a copy_ into it.
ELEMENTWISE = {torch.ops.aten.copy.default}
# torch's reinplace match of an op to its in-place overload, remembered per op: it compares
# schemas afresh on every call, a third of this pass's time on a 7B-shaped step.
_maybe_get_inplace_op = functools.cache(_match_inplace_op)


def _layout(val) -> tuple | None:
    if not isinstance(val, torch.Tensor):
        return None
    return (tuple(val.shape), val.dtype, tuple(val.stride()), val.device) if val.is_contiguous() else None


@dataclass
class ReusePlan:
    rewrites: dict[torch.fx.Node, object] = field(default_factory=dict)   # node -> its in-place op
    copies: dict[torch.fx.Node, tuple] = field(default_factory=dict)       # multi-tensor op -> entries copied
    written: set[torch.fx.Node] = field(default_factory=set)   # graph inputs written in place


def _waits(collective: torch.fx.Node) -> list[torch.fx.Node]:
    """The waits completing ``collective``, through the ``getitem`` of a coalesced one's list."""
    items = [u for u in collective.users if u.target is operator.getitem]
    return waits_of(collective) + [w for item in items for w in waits_of(item)]


def _plan(graph: torch.fx.Graph, writable: dict[torch.fx.Node, int]) -> ReusePlan:
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    roots = storage_roots(graph)
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        n = roots[n]
        chain = []
        while n in parent:
            chain.append(n)
            n = parent[n]
        # Path compression: a residual stream updated in place layer after layer is a chain as long
        # as the model is deep, walked again by every later op on it.
        for m in chain:
            parent[m] = n
        return n

    never = len(nodes) + 1
    last_use: dict[torch.fx.Node, int] = {}
    read_last: dict[torch.fx.Node, int] = {}    # the last op reading a buffer, collectives' waits aside
    in_flight: dict[torch.fx.Node, list[tuple[torch.fx.Node, int]]] = {}   # buffer -> (collective, its wait)
    # Inputs are written only after this position: the last op that can fail on data or on a peer
    # (a forward or backward op, a collective other than the all-gather of the update).
    fence = -1
    for n in nodes:
        # A node scalars_on_host folds (into addcdiv / addcmul) reads its multiply's and divide's
        # operands where it stands.
        reads = [*n.all_input_nodes, *folded_reads(n)] if n.meta.get(HOST_FOLD) else n.all_input_nodes
        for a in reads:
            r = roots[a]
            last_use[r] = never if n.op == "output" else max(last_use.get(r, -1), position[n])
            read_last[r] = last_use[r] if n.op == "output" else max(read_last.get(r, -1), position[n])
        if n.op == "call_function" and (region_of(n) != Region.OPTIMIZER
                                        or (is_communication_op(n) and not distributes_update(n))):
            fence = position[n]
        if is_collective(n):
            # The peers read (gloo: a worker thread copies) a collective's inputs until its wait,
            # not just at its issue: an op between the two must not write over them.
            done = max((position[w] for w in _waits(n)), default=position[n])
            for a in n.all_input_nodes:
                r = roots[a]
                last_use[r] = max(last_use[r], done)
                in_flight.setdefault(r, []).append((n, done))
    plan = ReusePlan()
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or not n.args:
            continue
        if n.target in IN_PLACE_COLLECTIVES:
            _plan_collective(n, position, read_last, in_flight, roots, find, parent, last_use, plan)
            continue
        if n.target in IN_PLACE:
            _plan_lists(n, IN_PLACE[n.target], writable, position, fence, last_use, roots, find, parent, plan)
            continue
        if (torch.Tag.pointwise not in n.target.tags and n.target not in ELEMENTWISE) or random_op(n.target):
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


def _plan_collective(n, position, read_last, in_flight, roots, find, parent, last_use, plan: ReusePlan) -> None:
    """A gradient bucket's all-reduce in place on its input (the flattened bucket, a buffer the graph
    allocated) when the collective is that buffer's last reader and no other collective still reads
    it: the functional all-reduce copies its input into a fresh buffer first, a second pass over
    every gradient byte. An input of the graph is never reduced in place (before the fence)."""
    x = n.args[0]
    if not isinstance(x, torch.fx.Node) or x.op != "call_function":
        return
    root = find(x)
    if root.op != "call_function" or read_last.get(roots[x]) != position[n]:
        return
    if any(c is not n and done > position[n] for c, done in in_flight.get(roots[x], ())):
        return
    layout = _layout(n.meta.get("val"))
    if layout is None or layout != _layout(x.meta.get("val")):
        return
    plan.rewrites[n] = IN_PLACE_COLLECTIVES[n.target]
    own = roots[n]
    parent[own] = root
    last_use[root] = last_use.get(own, position[n])


def _plan_lists(n, spec: InPlaceLists, writable, position, fence, last_use, roots, find, parent,
                plan: ReusePlan) -> None:
    """A multi-tensor op (``cann::fused_adam``) in place, tensor by tensor: each tensor of the lists
    it writes that dies there (a buffer the graph allocated, or an updated input past the fence),
    shares a buffer with no other operand and has a dense layout is
    written; the others are copied first (a ZeRO shard viewing a whole input parameter)."""
    written = {k: n.args[k] for k in spec.written}
    others = {find(a) for k, a in enumerate(n.args) if k not in written
              for a in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(a, torch.fx.Node)}
    targets: dict[tuple[int, int], torch.fx.Node] = {}
    copies = []
    for k, values in written.items():
        for i, x in enumerate(values):
            root = find(x)
            dies = root not in others and root not in targets.values() and last_use.get(root) == position[n] \
                and _layout(x.meta.get("val")) is not None
            if root.op == "placeholder":
                dies = dies and root in writable and position[n] > fence
            elif root.op != "call_function":
                dies = False
            if dies:
                targets[(k, i)] = root
            else:
                copies.append((k, i))
    if not targets:
        return
    plan.rewrites[n] = spec.run
    plan.copies[n] = tuple(copies)
    plan.written |= {r for r in targets.values() if r.op == "placeholder"}
    result_of = {r: k for k, r in spec.written.items()}
    for lst in n.users:                     # getitem(n, r): a list; getitem(list, i): a tensor
        if lst.target is not operator.getitem or lst.args[1] not in result_of:
            continue
        for item in lst.users:
            root = targets.get((result_of[lst.args[1]], item.args[1]))
            if root is None:
                continue
            own = roots[item]
            parent[own] = root
            last_use[root] = last_use.get(own, position[n])


def mark_reuse(graph: torch.fx.Graph, writable: dict[torch.fx.Node, int] | None = None) -> ReusePlan:
    """Mark ``y = op(x, ...)`` to run as ``op_(x, ...)`` where ``op`` is pointwise, nothing reads ``x``'s
    buffer (through any alias) after this op, and ``x`` has ``y``'s shape, dtype and (contiguous)
    strides; ``x``'s buffer is one the graph allocated, or a placeholder in ``writable`` (placeholder ->
    index of the graph output that is its new value: it is written only if that output ends up
    naming its buffer)."""
    plan = _plan(graph, writable or {})
    for node in graph.nodes:
        node.meta.pop(REUSES_OPERAND, None)
        node.meta.pop(REUSE_COPIES, None)
    for node in plan.rewrites:
        node.meta[REUSES_OPERAND] = True
        if node in plan.copies:
            # Lists, not tuples: the compile cache keeps a node's JSON-stable metadata only.
            node.meta[REUSE_COPIES] = [list(c) for c in plan.copies[node]]
    return plan


def apply_reuse(gm: torch.fx.GraphModule) -> int:
    """Switch every marked op of ``gm`` to its in-place variant; returns how many."""
    marked = [n for n in gm.graph.nodes if n.meta.get(REUSES_OPERAND)]
    for node in marked:
        if node.target in IN_PLACE_COLLECTIVES:
            node.target = IN_PLACE_COLLECTIVES[node.target]
        elif node.target in IN_PLACE:
            node.target = IN_PLACE[node.target].run
            node.kwargs = {**node.kwargs, "copies": node.meta.get(REUSE_COPIES, ())}
        else:
            node.target = _maybe_get_inplace_op(node.target)
    if marked:
        gm.recompile()
    return len(marked)


def reuse_dead_operands(gm: torch.fx.GraphModule, writable: dict[torch.fx.Node, int] | None = None) -> int:
    """Mark and apply at once (a graph outside a pipeline); ``gm.meta['written_inputs']`` lists the
    placeholders written. Returns how many ops now run in place."""
    plan = mark_reuse(gm.graph, writable)
    gm.meta["written_inputs"] = [n.name for n in gm.graph.nodes if n in plan.written]
    return apply_reuse(gm)


@register_pass("reuse_dead_operands", preserves=("cost", "memory", "networkx", "collectives", "state_bytes"))
def reuse_dead_operands_pass(graph: TrainGraph, ctx: PassContext, *, inputs: bool = True) -> TrainGraph:
    """Mark the ops the eager lowering runs in place; with ``inputs``, into updated inputs too."""
    plan = mark_reuse(graph.graph, updated_inputs(graph) if inputs else {})
    graph.attrs[GraphAttr.WRITTEN_INPUTS] = [n.name for n in graph.placeholders() if n in plan.written]
    ctx.stat("marked", len(plan.rewrites))
    ctx.stat("written_inputs", len(plan.written))
    return graph
