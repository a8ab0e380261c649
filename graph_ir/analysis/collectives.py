"""The one collectives analysis: which nodes communicate, what kind, over which group, how much.

Collectives are torch's functional ones (``torch.ops._c10d_functional``, and
the legacy ``c10d_functional`` namespace): each returns a new tensor and a
``wait_tensor`` marks where the result is needed; ``wait_tensor`` moves
nothing itself. Everything that recognises or counts collectives — the
distributed passes' statistics, cleanup and recompute (which must not merge
or copy them), the cost model, the dump tool's collectives section, the
benches — asks here, so a new collective is taught in one place.

Per-rank accounting, the usual one: an all-reduce moves twice its size (a
reduce-scatter then an all-gather, as in ring all-reduce); a reduce-scatter
its input; an all-gather its output; others their input.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from ..meta import nbytes, tensors_of

NAMESPACES = ("_c10d_functional", "c10d_functional")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_KIND_OF_OP = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
WAIT = "wait_tensor"
# Collectives outside the functional namespaces, by (namespace, op): synchronous ones, no wait
# (expert_parallel's all-to-all of rows, whose split sizes are read from tensors).
_OTHER_KINDS = {("cann", "all_to_all_rows"): "all_to_all"}


def kind_of_target_name(name: str) -> str | None:
    """``"_c10d_functional.all_reduce.default"`` -> ``"all_reduce"``; None for waits and other ops."""
    namespace, _, rest = name.partition(".")
    if (namespace, rest.partition(".")[0]) in _OTHER_KINDS:
        return _OTHER_KINDS[namespace, rest.partition(".")[0]]
    if namespace not in NAMESPACES:
        return None
    return _KIND_OF_OP.get(rest.partition(".")[0])


def is_communication_op(node: torch.fx.Node) -> bool:
    """Any functional-collective op, ``wait_tensor`` included (what passes must not merge or copy)."""
    if node.op != "call_function":
        return False
    namespace = getattr(node.target, "namespace", None)
    return namespace in NAMESPACES or (namespace, getattr(node.target, "_opname", None)) in _OTHER_KINDS


def collective_kind(node: torch.fx.Node) -> str | None:
    """The collective a node performs (``all_reduce``, ``all_gather``, ...); None for waits and non-collectives."""
    if not is_communication_op(node):
        return None
    other = _OTHER_KINDS.get((node.target.namespace, node.target._opname))
    return other or _KIND_OF_OP.get(node.target._opname)


def is_collective(node: torch.fx.Node) -> bool:
    return collective_kind(node) is not None


def group_name_of(node: torch.fx.Node) -> str | None:
    """The process-group name a collective names (its last string argument)."""
    strings = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, str)]
    return strings[-1] if strings else None


def collective_of(node: torch.fx.Node) -> torch.fx.Node:
    """The collective a communication node performs or waits for (a wait's first argument)."""
    if collective_kind(node) is None and node.args and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return node


def waits_of(collective: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``wait_tensor`` nodes that complete ``collective``."""
    return [u for u in collective.users if is_communication_op(u) and collective_kind(u) is None]


def group_size_of(node: torch.fx.Node) -> int | None:
    """The group size a collective names (all-gather and reduce-scatter carry it); None otherwise."""
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool):
            return arg
    return None


@dataclass(frozen=True)
class Collective:
    node: str
    kind: str
    group: str | None
    elements: int        # elements this rank moves under the accounting above
    bytes: int


def _numel(value) -> int:
    return sum(t.numel() for t in tensors_of(value))


def _moved(node: torch.fx.Node, kind: str) -> tuple[int, int]:
    out = node.meta.get("val")
    inputs = node.args[0] if node.args else None
    sources = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    inp = [s.meta.get("val") for s in sources if isinstance(s, torch.fx.Node)]
    if kind == "all_reduce":
        return 2 * _numel(out), 2 * nbytes(out)
    if kind == "all_gather":
        return _numel(out), nbytes(out)
    return _numel(inp), nbytes(inp)


def collectives(graph: torch.fx.Graph) -> list[Collective]:
    """Every collective of the graph, in order."""
    found = []
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        elements, size = _moved(node, kind)
        found.append(Collective(node.name, kind, group_name_of(node), elements, size))
    return found


def collective_elements(graph: torch.fx.Graph) -> dict[str, int]:
    """Elements each rank moves per run of the graph, by kind (the three ZeRO/DP use always present)."""
    volume = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    for c in collectives(graph):
        volume[c.kind] = volume.get(c.kind, 0) + c.elements
    return volume
