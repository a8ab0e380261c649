"""cleanup: remove dead nodes and merge duplicate pure computations.

Capture leaves dead code (the unused half of a ``native_layer_norm`` triple,
detached aliases) and duplicate work (``t(weight)`` traced separately for the
forward and the backward use). Merging duplicates is safe only for pure,
deterministic ops: two random draws are two draws and two collectives two
communications (``graph_ir.analysis.effects``); both are left alone. Duplicates in different
regions are left alone too: a forward value computed again in backward is a
recompute decision (it trades FLOPs for saved memory), and merging the two
would undo it.
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


@register_pass("cleanup", preserves=())
def cleanup_pass(graph: TrainGraph, ctx: PassContext, *, cse: bool = True) -> TrainGraph:
    """Dead-code elimination, then (with ``cse``) merging of duplicate pure nodes."""
    before = graph.num_nodes()
    merged = eliminate_common_subexpressions(graph.graph) if cse else 0
    eliminate_dead_code(graph.graph)
    ctx.stat("merged", merged)
    ctx.stat("removed", before - graph.num_nodes())
    return graph
