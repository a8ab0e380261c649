"""The slots the eager backend's planned buffers live in (``plan_buffers``), and the lowered graph
that writes them.

One arena per process: slot ``i`` of every lowered graph is the arena's tensor ``i`` on that
device, grown to the largest size any graph asked for. A planned buffer is live only during its
graph's call, so graphs may share the slots as long as their calls do not overlap: every call of
a graph holding slots takes the arena's lock. When a new graph grows a slot, the tensor is
replaced, and each graph holding views of the old one binds its views afresh before its next call
(one integer compared per call when nothing grew).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.fx

from graph_ir.meta import HELD_BUFFER

from ..passes.plan_buffers import CLONE, out_overload, writes_into, written_out


class HeldArena:
    def __init__(self):
        self._slots: dict[tuple[str, int], torch.Tensor] = {}
        self.generation = 0
        self.lock = threading.RLock()

    def reserve(self, device: torch.device, sizes: list[int]) -> None:
        """Grow the arena's slots on ``device`` to at least ``sizes`` (bytes, by slot index)."""
        with self.lock:
            for index, nbytes in enumerate(sizes):
                key = (str(device), index)
                held = self._slots.get(key)
                if held is None or held.numel() < nbytes:
                    self._slots[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
                    self.generation += 1

    def slot(self, device: torch.device, index: int) -> torch.Tensor:
        return self._slots[(str(device), index)]

    def held_bytes(self) -> int:
        """Bytes the arena holds, every device together."""
        with self.lock:
            return sum(t.numel() for t in self._slots.values())


ARENA = HeldArena()


@dataclass(frozen=True)
class _View:
    name: str                 # the graph module's attribute the planned op writes into
    device: torch.device
    slot: int
    dtype: torch.dtype
    shape: tuple
    stride: tuple

    def of(self, arena: HeldArena) -> torch.Tensor:
        nbytes = max(1, torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()
        held = arena.slot(self.device, self.slot)[:nbytes]
        return held.view(self.dtype).as_strided(self.shape, self.stride)


class HeldRun:
    """A lowered graph module whose planned ops write views of the arena's slots: each call takes
    the arena's lock and first binds the views again if a slot was replaced since the last call."""

    def __init__(self, gm: torch.fx.GraphModule, views: list[_View], arena: HeldArena = ARENA):
        self.gm, self.views, self.arena = gm, views, arena
        self.generation = -1

    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    def __getattr__(self, name):
        if name in ("gm", "views", "arena", "generation"):
            raise AttributeError(name)
        return getattr(self.gm, name)

    def __call__(self, *inputs):
        with self.arena.lock:
            if self.generation != self.arena.generation:
                for view in self.views:
                    setattr(self.gm, view.name, view.of(self.arena))
                self.generation = self.arena.generation
            return self.gm(*inputs)


def apply_buffer_plan(gm: torch.fx.GraphModule, sizes: list[int] | None, arena: HeldArena = ARENA):
    """Switch every planned node of ``gm`` to its ``out=`` overload writing a view of its slot (a
    clone to ``copy_`` into the view) and reserve the slots in ``arena``. Returns the graph module
    to call: ``gm`` itself when nothing is planned, else a :class:`HeldRun`."""
    marked = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(HELD_BUFFER) is not None
              and isinstance(n.target, torch._ops.OpOverload)]
    views: list[_View] = []
    devices: dict[str, torch.device] = {}
    for n in marked:
        val, slot = n.meta["val"], n.meta[HELD_BUFFER]
        if not sizes or slot >= len(sizes) or not writes_into(n):
            continue
        view = _View(f"_held_{n.name}", val.device, slot, val.dtype, tuple(val.shape), tuple(val.stride()))
        devices[str(val.device)] = val.device
        gm.register_buffer(view.name, torch.empty(0, dtype=val.dtype, device=val.device), persistent=False)
        with gm.graph.inserting_before(n):
            out = gm.graph.get_attr(view.name)
        if n.target is CLONE:
            n.target, n.args, n.kwargs = torch.ops.aten.copy_.default, (out, n.args[0]), {}
        else:
            op = out_overload(n.target, val.device.type)
            n.target = op
            n.kwargs = {**n.kwargs, written_out(op._schema)[0].name: out}
        views.append(view)
    if not views:
        return gm
    for device in devices.values():
        arena.reserve(device, sizes)
    gm.recompile()
    return HeldRun(gm, views, arena)
