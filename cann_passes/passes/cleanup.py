"""cleanup: remove dead nodes, merge duplicate pure computations, drop concatenated empties.

Capture leaves dead code (the unused half of a ``native_layer_norm`` triple,
detached aliases) and duplicate work (``t(weight)`` traced separately for the
forward and the backward use). Merging duplicates is safe only for pure,
deterministic ops: two random draws are two draws and two collectives two
communications (``graph_ir.analysis.effects``); both are left alone. Duplicates in different
regions are left alone too: a forward value computed again in backward is a
recompute decision (it trades FLOPs for saved memory), and merging the two
would undo it.

A ``cat`` that joins one tensor to legacy empty ``(0,)`` tensors (which ``cat`` skips: a
key/value cache's first update, ``cat([empty, key])``) is a contiguous copy of that tensor and
becomes ``clone(x, memory_format=contiguous_format)``. Besides the copy it saves, inductor's
decomposition turns such a ``cat`` into ``clone(x)``, which keeps a strided operand's layout where
``cat`` returns a contiguous tensor, and the ``view`` that follows no longer applies (BLOOM).
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.effects import may_merge
from graph_ir.build import ImpurityCache, eliminate_dead_code
from graph_ir.meta import GRADIENT_OF, RECOMPUTE, REGION

from ..pass_manager import PassContext, register_pass


def _mergeable(node: torch.fx.Node, impure: ImpurityCache) -> bool:
    if node.op != "call_function" or impure(node) or not may_merge(node):
        return False
    # Recomputed copies are placed per block on purpose: merging two of them
    # would keep one alive across the blocks in between. Each parameter's gradient stays its own
    # value: two parameters sharing one would leave every per-gradient rewrite (accumulators,
    # buckets, shards, stages) with one value and two owners.
    return not node.meta.get(RECOMPUTE) and GRADIENT_OF not in node.meta


_NODE = torch.fx.Node


def _freeze(a):
    # Dispatch on the exact type: a node's arguments are mostly nodes and tuples of them, and
    # this runs for every argument of every node (a 7B-shaped step has about 50,000).
    kind = type(a)
    if kind is _NODE:
        return a   # hashed by identity: one node, one name in its graph
    if kind is tuple or kind is list:
        return (kind.__name__, tuple([_freeze(x) for x in a]))
    if kind is dict or isinstance(a, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in a.items()))
    if isinstance(a, (list, tuple)):   # an immutable_list or a named tuple
        return (kind.__name__, tuple([_freeze(x) for x in a]))
    return (kind.__name__, a)


def _key(node: torch.fx.Node):
    return (node.meta.get(REGION), node.target, _freeze(node.args), _freeze(node.kwargs))


def eliminate_common_subexpressions(graph: torch.fx.Graph) -> int:
    seen: dict = {}
    merged = 0
    impure = ImpurityCache()
    for node in list(graph.nodes):
        if not _mergeable(node, impure):
            continue
        key = _key(node)
        try:
            first = seen.get(key)
        except TypeError:   # an unhashable constant argument
            continue
        if first is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        merged += 1
    return merged


_CAT = torch.ops.aten.cat.default


def _legacy_empty(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == 0


def drop_empty_cat_operands(graph: torch.fx.Graph) -> int:
    """Each ``cat`` of one tensor and legacy empties becomes a contiguous clone of the tensor."""
    rewritten = 0
    for node in graph.find_nodes(op="call_function", target=_CAT):
        operands, out = node.args[0], node.meta.get("val")
        if not isinstance(out, torch.Tensor) or not out.is_contiguous():
            continue
        kept = [a for a in operands if not (isinstance(a, torch.fx.Node) and _legacy_empty(a.meta.get("val")))]
        if len(kept) != 1 or len(kept) == len(operands) or not isinstance(kept[0], torch.fx.Node):
            continue
        value = kept[0].meta.get("val")
        if not isinstance(value, torch.Tensor) or value.shape != out.shape or value.dtype != out.dtype:
            continue
        node.target = torch.ops.aten.clone.default
        node.args, node.kwargs = (kept[0],), {"memory_format": torch.contiguous_format}
        rewritten += 1
    return rewritten


@register_pass("cleanup", preserves=())
def cleanup_pass(graph: TrainGraph, ctx: PassContext, *, cse: bool = True) -> TrainGraph:
    """Empty ``cat`` operands dropped, dead-code elimination, then (with ``cse``) merging of
    duplicate pure nodes."""
    before = graph.num_nodes()
    ctx.stat("cat_to_clone", drop_empty_cat_operands(graph.graph))
    merged = eliminate_common_subexpressions(graph.graph) if cse else 0
    eliminate_dead_code(graph.graph)
    ctx.stat("merged", merged)
    ctx.stat("removed", before - graph.num_nodes())
    return graph
