"""The traced per-rank graph made an IR graph again: tags, group names, functional and lowerable ops."""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import is_communication_op
from graph_ir.meta import MODULE_PATH, RECOMPUTE, REGION, Region

from .common import ATTR, TensorParallelError, aten
from .marks import mark_random_pieces


def finish(gm: torch.fx.GraphModule, graph: TrainGraph, traced_group: str, group_name: str, *,
           origin: str = ATTR) -> None:
    """IR metadata on the traced nodes; collectives named by the mesh description's group and
    tagged with the pass that made them (``origin``)."""
    _restore_metadata(gm, graph, traced_group, group_name, origin)
    _functionalize_in_place(gm.graph)
    _lowerable_forms(gm.graph)
    _drop_identity_views(gm.graph)
    # DTensor's shard-offset arithmetic for per-part shards is traced but never read.
    gm.graph.eliminate_dead_code()
    mark_random_pieces(gm.graph)
    gm.graph.lint()
    gm.recompile()


def _restore_metadata(gm: torch.fx.GraphModule, graph: TrainGraph, traced_group: str, group_name: str,
                      origin: str) -> None:
    """Placeholders named and tagged as the captured graph's; every traced node tagged as the node it
    was traced for; collectives on the mesh description's group, not the tracing mesh's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, old in zip(placeholders, graph.placeholders()):
        node.name = node.target = old.name
        node.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "tensor_meta")})
    for node in gm.graph.nodes:
        custom = node.meta.pop("custom", None) or {}
        if node.op in ("placeholder", "output"):
            node.meta[REGION] = Region.IO.value
            continue
        node.meta[REGION] = custom.get(REGION) or Region.FORWARD.value
        node.meta[MODULE_PATH] = custom.get(MODULE_PATH) or ""
        if custom.get(RECOMPUTE) is not None:
            node.meta[RECOMPUTE] = custom[RECOMPUTE]
        node.meta.pop("stack_trace", None)
        if is_communication_op(node) and _on_group(node, traced_group):
            # (a collective of an earlier pass, traced again on its own group, keeps that group)
            node.args = tuple(group_name if a == traced_group else a for a in node.args)
            node.meta["origin_pass"] = origin


def _on_group(node: torch.fx.Node, group: str) -> bool:
    """The collective runs on ``group`` (a wait: the collective it waits for does)."""
    if group in node.args:
        return True
    source = node.args[0] if node.args else None
    return isinstance(source, torch.fx.Node) and is_communication_op(source) and group in source.args


def _functionalize_in_place(graph: torch.fx.Graph) -> None:
    """In-place ops DTensor's rules trace (the vocab-parallel embedding masks its ids in place) become
    their functional form, later readers of the mutated tensor reading the result."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target._schema.name.endswith("_")
                and target._schema.is_mutable and target.namespace == "aten"):
            continue
        packet = getattr(aten, target._schema.name.split("::")[1][:-1], None)
        functional = getattr(packet, target._overloadname, None) if packet is not None else None
        mutated = node.args[0]
        if functional is None or mutated.op == "placeholder":
            raise TensorParallelError(f"tensor_parallel: traced an in-place {target} on "
                                      f"{'an input' if functional else 'a value'} it cannot make functional")
        later = [u for u in mutated.users if u is not node and order[u] > order[node]]
        node.target = functional
        for user in later:
            user.replace_input_with(mutated, node)
        # the in-place op returned its input; readers of its result already read ``node``


def _lowerable_forms(graph: torch.fx.Graph) -> None:
    """Spell two ops DTensor's local kernels use the way the captured graphs already do, so every
    backend that takes the captured step takes this one (torchair has no converter for either):
    ``index_put(x, [bool mask], v)`` (the vocab-parallel embedding zeroing other ranks' rows) as
    ``where``, and ``squeeze.dims`` of size-1 dims as a ``view``."""
    for node in list(graph.nodes):
        if node.target is aten.index_put.default and len(node.args[1]) == 1:
            _masked_put_as_where(graph, node)
        elif node.target is aten.index_put.default and len(node.args[1]) == 2 and _is_row_arange(node):
            _row_put_as_scatter(graph, node)
        elif node.target is aten.squeeze.dims:
            node.target, node.args = aten.view.default, (node.args[0], list(node.meta["val"].shape))


def _masked_put_as_where(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    x, (mask,), value = node.args[:3]
    xv, mv = x.meta["val"], mask.meta["val"]
    if mv.dtype != torch.bool or tuple(mv.shape) != tuple(xv.shape[:mv.ndim]) or node.args[3:4] == (True,):
        return
    with graph.inserting_before(node):
        shaped = graph.call_function(aten.view.default, (mask, list(mv.shape) + [1] * (xv.ndim - mv.ndim)))
        fill = graph.call_function(aten._to_copy.default, (value,), {"dtype": xv.dtype})
        where = graph.call_function(aten.where.self, (shaped, fill, x))
    for new in (shaped, fill, where):
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    shaped.meta["val"] = mv.view(list(mv.shape) + [1] * (xv.ndim - mv.ndim))
    fill.meta["val"] = value.meta["val"].to(xv.dtype)
    where.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(where)
    graph.erase_node(node)


def _row_put_as_scatter(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """grad[arange(N), target] = v (the vocab-parallel loss' backward): one column per row."""
    x, (_, cols), value = node.args[:3]
    n = x.meta["val"].shape[0]
    with graph.inserting_before(node):
        index = graph.call_function(aten.view.default, (cols, [n, 1]))
        src = graph.call_function(aten.view.default, (value, [n, 1]))
        scatter = graph.call_function(aten.scatter.src, (x, 1, index, src))
    for new in (index, src, scatter):
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    index.meta["val"] = cols.meta["val"].view(n, 1)
    src.meta["val"] = value.meta["val"].view(n, 1)
    scatter.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(scatter)
    graph.erase_node(node)


def _is_row_arange(node: torch.fx.Node) -> bool:
    x, (rows, cols), value = node.args[:3]
    n = x.meta["val"].shape[0] if x.meta["val"].ndim == 2 else None
    counts_rows = (rows.target is aten.arange.default and tuple(rows.args[:1]) == (n,)) or \
        (rows.target is aten.arange.start and tuple(rows.args[:2]) == (0, n))
    return (n is not None and counts_rows and node.args[3:4] != (True,)
            and all(tuple(v.meta["val"].shape) == (n,) for v in (cols, value)))


def _drop_identity_views(graph: torch.fx.Graph) -> None:
    """DTensor's from_local/to_local trace ``view(x, x.shape)`` aliases; the graph is functional, drop them."""
    for node in list(graph.nodes):
        if node.target is aten.view.default or node.target is aten.alias.default:
            src = node.args[0]
            val, src_val = node.meta.get("val"), getattr(src, "meta", {}).get("val")
            if isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor) \
                    and val.shape == src_val.shape and val.stride() == src_val.stride():
                node.replace_all_uses_with(src)
                graph.erase_node(node)
