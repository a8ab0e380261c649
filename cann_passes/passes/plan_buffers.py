"""plan_buffers: the eager backend's buffer plan, allocated once and reused by every step.

Run op by op, a step allocates every intermediate afresh: a 6-layer model's step makes a few
hundred buffers of 64 KiB to tens of MiB. glibc serves the large ones with fresh ``mmap`` pages,
or from a heap top it trims between steps, so each step pays their page faults again (3-4% of a
6-layer LLaMA's step on a 2-core CPU: ``bench.step_time``'s ``ours-eager-unplanned`` row). Sizes
are known when the step compiles, so this pass plans them as a compiler's memory planner does:

- a *buffer* is what an op allocates, followed through its views, ``wait_tensor`` (which returns
  the collective's own result) and the ops ``reuse_dead_operands`` runs in place over it (one
  buffer then carries the chain); it lives from its op to the last op reading any of these,
  and to the wait of every collective reading it (a peer reads until then);
- a buffer is *planned* when its op has an ``out=`` overload with a kernel of its own for the
  device (``mm.out``, ``add.out``, ``cat.out``, ``_softmax.out``...: the kernel the functional op
  runs, so the result is bitwise the same; an overload torch generates as "call the functional op,
  then copy" is no gain and is left alone; a clone is a ``copy_`` into the slot, an all-gather
  ``all_gather_into_tensor_out``), its value is one dense tensor of static shape of at
  least ``min_bytes``, it draws no random numbers, and nothing outside the step sees it: not an
  input, not an output or a view of one, not a list a multi-tensor op writes;
- planned buffers are packed into *slots* in node order, best fit: a buffer takes the smallest
  free slot it fits in (a slot is free once its last buffer's life has ended: strictly before
  the op that writes the new one, which may read the old one), or grows the largest free one,
  or opens a new one. ``graph.attrs["buffer_plan"]`` holds the slot sizes; each planned node
  holds its slot (``graph_ir.meta.HELD_BUFFER``).

The pass only marks, as ``reuse_dead_operands`` does, and comes after it (its in-place chains
decide the lives) and after every pass that reorders. The eager lowering
(``cann_passes.lowering.held_buffers``) allocates the slots once per lowered graph and calls each
planned op's ``out=`` overload on a view of its slot, so two calls of one graph must not run at
once (the runtime never does). The slots stay allocated between steps, as a caching allocator
keeps its blocks: the peak of the planned buffers' live bytes plus best fit's slack (the pass's
``held_bytes`` and ``peak_planned_bytes`` statistics), per lowered graph: a step recompiled for
another shape, or a pipeline stage's forward, backward and apply graphs, each hold their own.
"""
from __future__ import annotations

import functools
import heapq
import operator

import torch
import torch.fx
from networkx.utils import UnionFind
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import is_collective, waits_of
from graph_ir.analysis.effects import random_op
from graph_ir.analysis.memory import storage_roots
from graph_ir.meta import HELD_BUFFER, HOST_FOLD, ON_HOST, REUSES_OPERAND, GraphAttr
from graph_ir.multi_tensor_ops import IN_PLACE

from ..pass_manager import PassContext, register_pass
from .scalars_on_host import folded_reads

CLONE = torch.ops.aten.clone.default
_c10d = torch.ops._c10d_functional
_WAIT = _c10d.wait_tensor.default
# out= forms the schema match cannot find (another op's name), registered for every device: the
# functional collective's own implementation, given the tensor to write instead of allocating it.
_OUT_OPS = {_c10d.all_gather_into_tensor.default: _c10d.all_gather_into_tensor_out.default}
# The dispatch key an op's own kernel for a device type is registered under.
_DEVICE_KEY = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU"}


def written_out(schema) -> list:
    return [a for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]


@functools.cache
def out_overload(op: torch._ops.OpOverload, device_type: str):
    """``op``'s ``out=`` overload (one written keyword argument, one result, the same other
    arguments), where the device has a kernel of its own for it; else None."""
    if op in _OUT_OPS:
        return _OUT_OPS[op]
    schema = op._schema
    if schema.is_mutable or len(schema.returns) != 1 or not hasattr(op, "overloadpacket"):
        return None
    signature = [(a.name, str(a.type)) for a in schema.arguments]
    key = _DEVICE_KEY.get(device_type, "PrivateUse1")
    for name in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, name)
        cs = candidate._schema
        written = written_out(cs)
        if len(written) != 1 or len(cs.returns) != 1:
            continue
        if [(a.name, str(a.type)) for a in cs.arguments if a not in written] != signature:
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(candidate.name(), key):
            return candidate
        return None
    return None


def writes_into(node: torch.fx.Node) -> bool:
    """Whether the lowering can make ``node`` write its result into a held tensor of its layout."""
    if node.target is CLONE:            # torch generates clone.out as clone-then-copy: copy_ is the kernel
        return node.kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format)
    return out_overload(node.target, node.meta["val"].device.type) is not None


def _plannable_value(node: torch.fx.Node, min_bytes: int) -> bool:
    """One dense tensor of static layout; laid out other than contiguously only where an
    elementwise op computes each element alone (the result's strides change no arithmetic)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or any(not isinstance(s, int) for s in (*val.shape, *val.stride())):
        return False
    if not val.is_contiguous() and not (is_non_overlapping_and_dense(val)
                                        and (torch.Tag.pointwise in node.target.tags or node.target is CLONE)):
        return False
    return val.numel() * val.element_size() >= min_bytes


def plan_buffers(graph: torch.fx.Graph, min_bytes: int = 65536) -> tuple[dict[torch.fx.Node, int], list[int], int]:
    """Slots for the buffers of ``graph`` that can be held across steps (the module docstring has
    the rules). Returns (planned node -> slot, slot sizes in bytes, the peak of the planned
    buffers' live bytes)."""
    nodes = list(graph.nodes)
    if not any(isinstance(v, torch.Tensor) and v.device.type != "meta"
               for v in (n.meta.get("val") for n in nodes if n.op == "placeholder")):
        return _pack([])                 # a step traced on meta (costing, planning) never runs
    position = {n: i for i, n in enumerate(nodes)}
    roots = storage_roots(graph)
    for n in nodes:                      # wait_tensor returns the collective's result itself
        roots[n] = roots[n.args[0]] if n.target is _WAIT and isinstance(n.args[0], torch.fx.Node) \
            else roots[roots[n]]
    groups = UnionFind()                 # buffers one chain of in-place ops carries
    excluded: set[torch.fx.Node] = set()
    for n in nodes:
        if not n.meta.get(REUSES_OPERAND):
            continue
        if n.target in IN_PLACE:         # a multi-tensor op writing lists: none of its tensors is planned
            for a in n.all_input_nodes:
                excluded.add(roots[a])
            for item in n.users:
                excluded.add(roots[item])
                excluded.update(roots[u] for u in item.users)
        elif n.args and isinstance(n.args[0], torch.fx.Node):
            groups.union(roots[n], roots[n.args[0]])
    end: dict[torch.fx.Node, int] = {}
    for n in nodes:
        reads = [*n.all_input_nodes, *folded_reads(n)] if n.meta.get(HOST_FOLD) else n.all_input_nodes
        if n.op == "output":
            excluded.update(groups[roots[a]] for a in reads)
            continue
        done = position[n]
        if is_collective(n):
            done = max((position[w] for w in waits_of(n)), default=done)
            items = [u for u in n.users if u.target is operator.getitem]
            done = max([done, *(position[w] for i in items for w in waits_of(i))])
        for a in reads:
            g = groups[roots[a]]
            end[g] = max(end.get(g, -1), done)
        g = groups[roots[n]]
        end[g] = max(end.get(g, -1), position[n])
        if n.op != "call_function":
            excluded.add(g)
    excluded = {groups[r] for r in excluded}
    # The node allocating each group's buffer: its root that is not itself an in-place op.
    allocators: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        if roots[n] is n and not n.meta.get(REUSES_OPERAND):
            allocators.setdefault(groups[n], []).append(n)
    planned: list[tuple[torch.fx.Node, int, int, int]] = []   # node, start, end, bytes
    for g, members in allocators.items():
        if g in excluded or len(members) != 1:
            continue
        n = members[0]
        val = n.meta.get("val")
        # (an op scalars_on_host hands a Python number keeps its target: its out= overload takes it too)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or any(k in n.meta for k in (ON_HOST, HOST_FOLD)) or random_op(n.target) \
                or not _plannable_value(n, min_bytes) or not writes_into(n):
            continue
        planned.append((n, position[n], end.get(g, position[n]), val.numel() * val.element_size()))
    return _pack(planned)


def _pack(planned: list[tuple[torch.fx.Node, int, int, int]]) -> tuple[dict[torch.fx.Node, int], list[int], int]:
    planned.sort(key=lambda p: p[1])
    sizes: list[int] = []
    busy_until: list[int] = []
    slot_of: dict[torch.fx.Node, int] = {}
    live: list[tuple[int, int]] = []      # heap of (end, bytes) of planned buffers, for the peak
    live_bytes = peak = 0
    for node, start, stop, nbytes in planned:
        while live and live[0][0] < start:
            live_bytes -= heapq.heappop(live)[1]
        heapq.heappush(live, (stop, nbytes))
        live_bytes += nbytes
        peak = max(peak, live_bytes)
        free = [s for s in range(len(sizes)) if busy_until[s] < start]
        fits = [s for s in free if sizes[s] >= nbytes]
        if fits:
            slot = min(fits, key=lambda s: sizes[s])
        elif free:
            slot = max(free, key=lambda s: sizes[s])
            sizes[slot] = nbytes
        else:
            slot = len(sizes)
            sizes.append(nbytes)
            busy_until.append(-1)
        busy_until[slot] = stop
        slot_of[node] = slot
    return slot_of, sizes, peak


@register_pass("plan_buffers", preserves=("cost", "memory", "networkx", "collectives", "state_bytes"))
def plan_buffers_pass(graph: TrainGraph, ctx: PassContext, *, min_bytes: int = 65536) -> TrainGraph:
    """Mark the buffers the eager lowering allocates once and reuses every step."""
    slot_of, sizes, peak = plan_buffers(graph.graph, min_bytes)
    for node in graph.graph.nodes:
        node.meta.pop(HELD_BUFFER, None)
    for node, slot in slot_of.items():
        node.meta[HELD_BUFFER] = slot
    graph.attrs[GraphAttr.BUFFER_PLAN] = sizes
    ctx.stat("planned", len(slot_of))
    ctx.stat("slots", len(sizes))
    ctx.stat("held_bytes", sum(sizes))
    ctx.stat("peak_planned_bytes", peak)
    return graph
