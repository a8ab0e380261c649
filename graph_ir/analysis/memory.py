"""Liveness and memory of a graph under its node order.

A value is live from the node that allocates it to its last use. Views
allocate nothing: their bytes belong to the value they alias, whose life
they extend. Inputs (parameters, optimizer state, the batch) are resident for
the whole step, since the runtime owns them; graph outputs live to the end.
The estimate assumes an allocator that frees a buffer right after its last
use — what eager PyTorch's caching allocator and GE's memory planner both
approximate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..meta import Region, nbytes, region_of
from .cost import is_view_op


def storage_roots(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each node -> the node that allocated the storage it reads through."""
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if is_view_op(node) and node.all_input_nodes:
            root[node] = root[node.all_input_nodes[0]]
        else:
            root[node] = node
    return root


@dataclass
class MemoryProfile:
    resident_bytes: int                    # inputs, live all step
    live_bytes: list[int]                  # intermediates live after each node, in node order
    node_names: list[str]
    peak_bytes: int                        # resident + peak of intermediates
    peak_node: str
    saved_bytes: int                       # forward values read by backward
    saved_values: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"resident_bytes": self.resident_bytes, "peak_bytes": self.peak_bytes,
                "peak_node": self.peak_node, "saved_bytes": self.saved_bytes,
                "live_bytes": self.live_bytes, "nodes": self.node_names}


def saved_activations(graph: torch.fx.Graph) -> dict[str, int]:
    """Forward-allocated values that a backward node reads: name -> bytes.

    This is what a partitioner must keep from forward to backward; inputs
    (parameters, the batch) are resident anyway and are not counted.
    """
    root = storage_roots(graph)
    saved: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "call_function" or region_of(node) != Region.BACKWARD:
            continue
        for arg in node.all_input_nodes:
            base = root[arg]
            if base.op == "call_function" and region_of(base) == Region.FORWARD:
                saved[base.name] = nbytes(base.meta.get("val"))
    return saved


def memory_profile(graph: torch.fx.Graph) -> MemoryProfile:
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    root = storage_roots(graph)
    last_use: dict[torch.fx.Node, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            base = root[arg]
            last_use[base] = max(last_use.get(base, 0), index[node])
    end = len(nodes) - 1
    for out in graph.output_node().all_input_nodes:
        last_use[root[out]] = end

    resident = sum(nbytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    frees: dict[int, int] = {}
    live, timeline, peak, peak_at = 0, [], 0, ""
    for i, node in enumerate(nodes):
        if node.op == "call_function" and root[node] is node:
            size = nbytes(node.meta.get("val"))
            live += size
            # A value nobody reads dies right after it is made.
            frees[last_use.get(node, i)] = frees.get(last_use.get(node, i), 0) + size
        if live > peak:
            peak, peak_at = live, node.name
        live -= frees.pop(i, 0)
        timeline.append(live)
    saved = saved_activations(graph)
    return MemoryProfile(resident, timeline, [n.name for n in nodes], resident + peak, peak_at,
                         sum(saved.values()), sorted(saved))
