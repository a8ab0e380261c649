"""The slots the eager backend's planned buffers live in (``plan_buffers``), allocated once per
lowered graph: each planned op calls its ``out=`` overload on a view of its slot.

A lowered graph holds its own slots, for as long as the graph lives (a compiled step keeps its
graphs): a step recompiled for another shape, or a pipeline stage's forward, backward and apply
graphs, each hold theirs. Slots shared between the graphs of a process would hold less, but would
then be sized by every graph the process ever lowered and tie the calls of unrelated steps
together (a lock, rebinding on growth); one owner per slot keeps a graph's memory its own.
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir.meta import HELD_BUFFER

from ..passes.plan_buffers import CLONE, out_overload, writes_into, written_out


def apply_buffer_plan(gm: torch.fx.GraphModule, sizes: list[int] | None) -> int:
    """Allocate the slots of ``sizes`` (bytes) and switch every planned node of ``gm`` to its ``out=``
    overload writing a view of its slot (a clone to ``copy_`` into the view); ``gm`` holds the views
    as non-persistent buffers. Returns how many nodes now write a slot."""
    marked = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(HELD_BUFFER) is not None
              and isinstance(n.target, torch._ops.OpOverload)]
    slots: dict[tuple[str, int], torch.Tensor] = {}
    count = 0
    for n in marked:
        val, slot = n.meta["val"], n.meta[HELD_BUFFER]
        if not sizes or slot >= len(sizes) or not writes_into(n):
            continue
        key = (str(val.device), slot)
        if key not in slots:
            slots[key] = torch.empty(sizes[slot], dtype=torch.uint8, device=val.device)
        held = slots[key][: val.numel() * val.element_size()].view(val.dtype).as_strided(val.shape, val.stride())
        name = f"_held_{n.name}"
        gm.register_buffer(name, held, persistent=False)
        with gm.graph.inserting_before(n):
            out = gm.graph.get_attr(name)
        if n.target is CLONE:
            n.target, n.args, n.kwargs = torch.ops.aten.copy_.default, (out, n.args[0]), {}
        else:
            op = out_overload(n.target, val.device.type)
            n.target = op
            n.kwargs = {**n.kwargs, written_out(op._schema)[0].name: out}
        count += 1
    if count:
        gm.recompile()
    return count
