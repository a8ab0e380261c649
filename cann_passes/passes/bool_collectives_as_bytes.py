"""bool_collectives_as_bytes: a boolean tensor crosses a collective as uint8 and is read as bool again.

Inductor's backend needs it: torch 2.13's inductor types the result of a collective on a boolean
tensor as int64 on CPU, and its vectorised ``where`` then asserts on the non-boolean mask (an
attention mask all-gathered by context parallelism over the sequence: every transformers decoder
under ``cp > 1``). The rewrite: ``all_gather_into_tensor(m, ...)`` of a bool ``m`` becomes
``all_gather_into_tensor(m.to(uint8), ...)``, and what read its wait reads ``wait.to(bool)``; the
same for every collective that moves a tensor unchanged (all-gather, all-to-all, broadcast). The
values are the same (0 and 1 both ways); the wire carries the same byte per element.
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import collective_kind, waits_of
from graph_ir.build import add_node, fake_value
from graph_ir.meta import MODULE_PATH, region_of

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten
ORIGIN = "bool_collectives_as_bytes"
_MOVING = ("all_gather", "all_to_all", "broadcast")


def bool_collectives_as_bytes(graph: TrainGraph) -> int:
    """Rewrite in place; returns how many collectives now move bytes."""
    mode = graph.fake_mode()

    def cast(value: torch.fx.Node, dtype: torch.dtype, like: torch.fx.Node) -> torch.fx.Node:
        return add_node(graph.graph, aten._to_copy.default, (value,), {"dtype": dtype}, region=region_of(like),
                        module_path=like.meta.get(MODULE_PATH, ""), origin=ORIGIN, mode=mode)

    rewritten = 0
    for node in list(graph.graph.nodes):
        if collective_kind(node) not in _MOVING or not node.args:
            continue
        x, waits = node.args[0], waits_of(node)
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or not waits:
            continue
        with graph.graph.inserting_before(node):
            node.args = (cast(x, torch.uint8, node), *node.args[1:])
        node.meta["val"] = fake_value(node.target, node.args, node.kwargs, mode=mode)
        for wait in waits:
            wait.meta["val"] = fake_value(wait.target, wait.args, wait.kwargs, mode=mode)
            with graph.graph.inserting_after(wait):
                back = cast(wait, torch.bool, wait)
            wait.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        rewritten += 1
    return rewritten


@register_pass("bool_collectives_as_bytes")
def bool_collectives_as_bytes_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """A boolean tensor's all-gather, all-to-all or broadcast as uint8 (inductor types its result int64)."""
    ctx.stat("rewritten", bool_collectives_as_bytes(graph))
    return graph
