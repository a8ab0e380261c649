"""Liveness and memory of a graph under its node order.

A *buffer* is what an allocating node writes: one per tensor output. Views
allocate nothing: they read through the buffer they alias and extend its
life. A multi-output node (``native_layer_norm``, ``nll_loss_forward``)
allocates one buffer per output at once; each ``getitem`` of it names one of
those buffers, and an output no ``getitem`` reads dies right after the node.
``getitem`` of an aliasing multi-output op (``split``, ``unbind``) is a view of
that op's input. Inputs (parameters, optimizer state, the batch) are resident
for the whole step, since the runtime owns them; graph outputs live to the end.
The estimate assumes an allocator that frees a buffer right after its last
use — what eager PyTorch's caching allocator and GE's memory planner both
approximate.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..meta import Region, nbytes, region_of
from .cost import is_view_op

aten = torch.ops.aten

# Ops whose schema does not declare an alias but whose result shares its
# input's storage in eager PyTorch (and in GE's memory planner).
_UNDECLARED_ALIASES = {aten._unsafe_view.default, aten._reshape_alias.default}


def _is_multi_output(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def aliases_input(node: torch.fx.Node) -> bool:
    """True when the node's value shares the storage of its first input (allocates nothing)."""
    if node.op != "call_function" or not node.all_input_nodes:
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and aliases_input(source)
    return node.target in _UNDECLARED_ALIASES or is_view_op(node)


def storage_roots(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each node -> the node that names the buffer it reads through.

    A buffer is named by its allocating node, except for the outputs of a
    multi-output node, which are named by their (first) ``getitem``.
    """
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    first_item: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}
    for node in graph.nodes:
        if aliases_input(node):
            root[node] = root[node.all_input_nodes[0]]
        elif node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            root[node] = first_item.setdefault((node.args[0], node.args[1]), node)
        else:
            root[node] = node
    return root


def buffer_bytes(node: torch.fx.Node) -> int:
    """Bytes of the buffer a root node names (0 for a multi-output node: its items own them)."""
    if node.op != "call_function" or _is_multi_output(node) or aliases_input(node):
        return 0
    return nbytes(node.meta.get("val"))


@dataclass
class MemoryProfile:
    resident_bytes: int                    # inputs, live all step
    live_bytes: list[int]                  # intermediates live after each node, in node order
    node_names: list[str]
    peak_bytes: int                        # resident + peak of intermediates
    peak_node: str
    saved_bytes: int                       # forward buffers read by backward
    saved_values: list[str] = field(default_factory=list)
    peak_by_region: dict[str, int] = field(default_factory=dict)  # resident + region's peak

    def to_json(self) -> dict:
        return {"resident_bytes": self.resident_bytes, "peak_bytes": self.peak_bytes,
                "peak_node": self.peak_node, "saved_bytes": self.saved_bytes,
                "saved_values": self.saved_values, "peak_by_region": self.peak_by_region,
                "live_bytes": self.live_bytes, "nodes": self.node_names}


def saved_activations(graph: torch.fx.Graph, root: dict | None = None) -> dict[str, int]:
    """Forward-allocated buffers that a backward node reads: buffer name -> bytes.

    This is what must stay alive from forward to backward; inputs
    (parameters, the batch) are resident anyway and are not counted.
    ``root``: the graph's :func:`storage_roots`, where the caller has them.
    """
    root = root if root is not None else storage_roots(graph)
    saved: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "call_function" or region_of(node) != Region.BACKWARD:
            continue
        for arg in node.all_input_nodes:
            base = root[arg]
            if base.op == "call_function" and region_of(base) == Region.FORWARD:
                saved[base.name] = buffer_bytes(base)
    return saved


def _last_uses(nodes: list[torch.fx.Node], root: dict) -> dict[torch.fx.Node, int]:
    index = {n: i for i, n in enumerate(nodes)}
    last_use: dict[torch.fx.Node, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            base = root[arg]
            last_use[base] = max(last_use.get(base, index[base]), index[node])
    return last_use


def _allocations(node: torch.fx.Node, root: dict, items: dict) -> list[tuple[torch.fx.Node | None, int]]:
    """(buffer name node or None when nothing reads it, bytes) allocated by ``node``."""
    # root[node] is another node exactly where the node aliases its input (or is a getitem)
    if node.op != "call_function" or root[node] is not node or node.target is operator.getitem:
        return []
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [(items.get((node, i)), nbytes(v)) for i, v in enumerate(val)]
    return [(node, nbytes(val))]


def memory_profile(graph: torch.fx.Graph) -> MemoryProfile:
    nodes = list(graph.nodes)
    root = storage_roots(graph)
    items = {(n.args[0], n.args[1]): root[n] for n in nodes
             if n.target is operator.getitem and root[n] is n}
    last_use = _last_uses(nodes, root)
    end = len(nodes) - 1
    for out in graph.output_node().all_input_nodes:
        last_use[root[out]] = end

    resident = sum(nbytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    frees: dict[int, int] = {}
    live, timeline, peak, peak_at = 0, [], 0, ""
    by_region: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for buffer, size in _allocations(node, root, items):
            live += size
            # A buffer nobody reads dies right after it is made.
            dies = last_use.get(buffer, i) if buffer is not None else i
            frees[dies] = frees.get(dies, 0) + size
        if live > peak:
            peak, peak_at = live, node.name
        region = str(region_of(node))
        by_region[region] = max(by_region.get(region, 0), live)
        live -= frees.pop(i, 0)
        timeline.append(live)
    saved = saved_activations(graph, root)
    return MemoryProfile(resident, timeline, [n.name for n in nodes], resident + peak, peak_at,
                         sum(saved.values()), sorted(saved),
                         {r: resident + b for r, b in by_region.items()})


@dataclass
class StateBytes:
    """Per-rank bytes of one graph by what they hold (read from the graph: shards count as shards).

    ``params``, ``optimizer_state``, ``buffers``, ``step_state``: the graph's inputs of those kinds
    (resident all step); ``grads``: the values the optimizer update reads as gradients (a shard each
    under ZeRO-2/3); ``activations``: forward buffers that backward reads (after recompute).
    """

    params: int
    grads: int
    optimizer_state: int
    activations: int
    buffers: int = 0
    step_state: int = 0

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer_state

    def to_json(self) -> dict:
        return dict(self.__dict__, model_state=self.model_state)


def state_bytes(tg) -> StateBytes:
    from ..signature import InputKind
    from .gradients import GradientNotFound, find_gradients
    by_kind: dict[str, int] = {}
    for spec, node in zip(tg.signature.inputs, tg.placeholders()):
        by_kind[spec.kind] = by_kind.get(spec.kind, 0) + nbytes(node.meta.get("val"))
    try:     # the marks the update still reads, and the analysis for the rest
        marked = list(find_gradients(tg, mark=False).values())
    except GradientNotFound:   # no optimizer update in this graph (a grad graph, a forward half)
        marked = []
    return StateBytes(by_kind.get(InputKind.PARAM.value, 0), sum(nbytes(n.meta.get("val")) for n in marked),
                      by_kind.get(InputKind.OPT_STATE.value, 0), sum(saved_activations(tg.graph).values()),
                      by_kind.get(InputKind.BUFFER.value, 0), by_kind.get(InputKind.STEP_STATE.value, 0))
