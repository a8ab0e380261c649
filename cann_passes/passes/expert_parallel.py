"""expert_parallel: each rank keeps ``E/ep`` of a mixture-of-experts layer's experts, and the rows
routed to the others' experts travel there and back by all-to-alls.

What it reads off the graph (not the model's spelling): a *grouped matmul* over experts
(``transformers.grouped_mm_fallback``, transformers' default experts on CPU; its registered
backward ``grouped_mm_fallback_backward``) takes rows sorted by expert, a ``[E, in, out]``
weight that is a view of a parameter, and ``offs``, the cumulative row count of each expert.
The grouped matmuls sharing one ``offs`` are one expert block (up/gate projection, activation,
down projection); what sits between them must treat rows independently (pointwise ops, cuts and
joins of the last dim), which is checked.

The rewrite, per block, on the expert-parallel group of ``ep`` ranks (consecutive data-parallel
ranks; each feeds its own rows):

- forward: the per-expert counts (from ``offs``) are exchanged (an all-to-all of ``E`` integers);
  the sorted rows are sent to the rank owning their expert (``cann.all_to_all_rows``, uneven
  splits from the counts); the received rows, grouped by source rank, are put in local-expert
  order (``cann.expert_major_order``, a stable sort) and multiplied by the local experts with the
  local ``offs``; the block's output goes back by the inverse order and the reverse all-to-all;
- backward: the gradient of the block's output takes the same way to the experts and the
  gradient of its input the same way back; the local experts' weight gradients stay local;
- the expert parameters (and their optimizer state) become this rank's ``Shard(0)`` over the
  ``ep`` axis (``graph_ir.placement``), so the runtime binds, checkpoints and gathers them by the
  one layout code; ``data_parallel`` then averages them over the expert-data-parallel group
  (``edp``) instead of the whole dp group, and ``grad_clip`` sums their squared norms over ``ep``.

The rows a rank receives depend on the routing, so the two custom ops' fake values carry the
balanced count (as many rows as the rank sends): the cost model and the memory estimate price the
balanced case, and a backend that compiles static shapes cannot run this graph (the plan refuses
every backend but eager). The all-to-all of rows is synchronous (``torch.distributed
.all_to_all_single`` on the group the name resolves to), since its split sizes are read from
tensors; the counts' all-to-all is a functional collective.

The router, its top-k, the load-balancing loss and the shared experts stay on every rank's own
rows, as under data parallelism.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.expert_dispatch import grouped_mm_ops
from graph_ir.meta import GraphAttr, Region, region_of
from graph_ir.placement import Placement, placement_of, set_placement
from graph_ir.signature import InputKind, OutputKind, split_state_name

from ..pass_manager import PassContext, register_pass
from ._distributed import DistributedRewriteError, NodeBuilder, aten, c10d, mesh_dim, recompute_val

ORIGIN = "expert_parallel"
ATTR = GraphAttr.EXPERT_PARALLEL


@torch.library.custom_op("cann::all_to_all_rows", mutates_args=())
def all_to_all_rows(x: torch.Tensor, send_rows: torch.Tensor, recv_rows: torch.Tensor,
                    group_name: str) -> torch.Tensor:
    """Rows ``x`` cut into ``send_rows[r]``-row pieces, piece ``r`` to rank ``r`` of the group;
    the result holds ``recv_rows[r]`` rows from each rank ``r``, in rank order."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    group = _resolve_process_group(group_name)
    send, recv = send_rows.tolist(), recv_rows.tolist()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


@all_to_all_rows.register_fake
def _(x, send_rows, recv_rows, group_name):
    # The balanced count: a rank receives, on average, as many rows as it sends.
    return x.new_empty(x.shape)


@torch.library.custom_op("cann::expert_major_order", mutates_args=())
def expert_major_order(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The order that sorts rows received rank by rank (``counts[r, e]`` rows of local expert ``e``
    from rank ``r``, rank-major) into expert-major order, keeping the ranks' order within an expert."""
    sources, experts = counts.shape
    ids = torch.arange(experts, device=counts.device).repeat(sources)
    expert_of_row = torch.repeat_interleave(ids, counts.reshape(-1))
    return torch.sort(expert_of_row, stable=True).indices


@expert_major_order.register_fake
def _(rows, counts):
    return torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)


ALL_TO_ALL_ROWS = torch.ops.cann.all_to_all_rows.default
EXPERT_MAJOR_ORDER = torch.ops.cann.expert_major_order.default


# Between a block's grouped matmuls, what keeps rows independent: pointwise ops and cuts or joins
# of the last dim (a gated activation splits the up projection's output in two).
_ROW_LOCAL_CUTS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                   aten.slice.Tensor, aten.narrow.default, aten.cat.default)
# Ops that keep a tensor's rows where they are (a new tensor of the same shape, a copy).
_SAME_ROWS = (aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
              aten.fill.Scalar, aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default)


def _cut_dim(node: torch.fx.Node) -> int:
    if node.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)


def _row_local(node: torch.fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise in node.target.tags or node.target in _SAME_ROWS:
        return True
    if node.target in _ROW_LOCAL_CUTS:
        source = node.args[0][0] if node.target is aten.cat.default else node.args[0]
        return _cut_dim(node) % source.meta["val"].ndim != 0
    return False


def _param_of(params: dict[torch.fx.Node, str], node: torch.fx.Node) -> str | None:
    """The parameter (of ``params``: placeholder -> name) a grouped matmul's weight is a view or a cast of."""
    seen = node
    while seen not in params:
        if seen.op != "call_function" or seen.target not in (aten.transpose.int, aten.permute.default,
                                                             aten.alias.default, aten._to_copy.default,
                                                             aten.clone.default, aten.t.default):
            return None
        seen = seen.args[0]
    return params[seen]


class _Block:
    """One expert block: its forward grouped matmuls in order and the backward node of each."""

    def __init__(self, offs: torch.fx.Node, forward: list[torch.fx.Node], backward: dict):
        self.offs, self.forward, self.backward = offs, forward, backward

    @property
    def first(self) -> torch.fx.Node:
        return self.forward[0]

    @property
    def last(self) -> torch.fx.Node:
        return self.forward[-1]


def _blocks(graph: TrainGraph, gmm, gmm_backward) -> list[_Block]:
    by_offs: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.graph.nodes:
        if node.target is gmm:
            if region_of(node) != Region.FORWARD:
                raise DistributedRewriteError(f"expert_parallel: grouped matmul {node.name} sits in "
                                              f"{region_of(node).value}; the pass runs before recompute")
            by_offs.setdefault(node.args[2], []).append(node)
    blocks = []
    for offs, forward in by_offs.items():
        backward = {}
        for f in forward:
            # (the same weight view and offsets: autocast may hand backward a cast copy of the rows)
            found = [u for u in f.args[1].users if u.target is gmm_backward and u.args[2] is offs]
            if len(found) > 1:
                raise DistributedRewriteError(f"expert_parallel: grouped matmul {f.name} has "
                                              f"{len(found)} backward nodes; one was expected")
            if found:
                backward[f] = found[0]
        blocks.append(_Block(offs, forward, backward))
    return blocks


def _expert_rows(block: _Block) -> set[torch.fx.Node]:
    """The nodes that compute on the experts' rows once they are dispatched: everything reached from
    the block's first grouped matmul and from the backward of its last, up to where rows go back
    (readers of the last forward output, the input gradient of the first) and the weight gradients."""
    stops = {block.last}
    for b in block.backward.values():
        stops |= {u for u in b.users if u.args[1] == 1}
    b1 = block.backward.get(block.first)
    if b1 is not None:
        stops |= {u for u in b1.users if u.args[1] == 0}
    reached, stack = set(), [block.first, *block.backward.values()]
    while stack:
        node = stack.pop()
        if node in reached:
            continue
        reached.add(node)
        if node not in stops:
            stack.extend(u for u in node.users if u.op != "output")
    return reached


def _check_rows(block: _Block, rows: int) -> None:
    """What runs on the experts' rows keeps rows independent and reads no other per-row value
    (those rows are elsewhere after the dispatch)."""
    local = _expert_rows(block)
    grouped = set(block.forward) | set(block.backward.values())
    for node in local - grouped:
        if node.target is operator.getitem and node.args[0] in grouped:
            continue
        if not _row_local(node):
            raise DistributedRewriteError(
                f"expert_parallel: {node.name} ({node.target}) computes on the rows of the expert block at "
                f"{block.first.name} and mixes rows (rule: only pointwise ops and cuts of the last dim may "
                "sit between its grouped matmuls: the rows are the experts' after the dispatch)")
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg not in local and isinstance(val, torch.Tensor) and val.ndim >= 1 and val.shape[0] == rows:
                raise DistributedRewriteError(
                    f"expert_parallel: {node.name} ({node.target}) in the expert block at {block.first.name} "
                    f"reads {arg.name}, a per-row value from outside the block (rule: after the dispatch "
                    "the block's rows are other tokens; a per-row input would not follow them)")


@register_pass("expert_parallel", preserves=())
def expert_parallel_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Experts split over the mesh's ``ep`` axis; rows dispatched and combined by all-to-alls."""
    ops = grouped_mm_ops()
    group = mesh_dim(ctx, "ep", "expert_parallel")
    if GraphAttr.ZERO in graph.attrs or GraphAttr.DATA_PARALLEL in graph.attrs:
        raise DistributedRewriteError("expert_parallel must run before data_parallel / optimizer_shard "
                                      "(rule: they reduce the expert gradients over the expert-data-parallel "
                                      "group, which this pass marks)")
    blocks = _blocks(graph, *ops) if ops else []
    if not blocks:
        raise DistributedRewriteError(
            "expert_parallel: the graph has no grouped matmul over experts (rule: experts are found as "
            "transformers' grouped_mm_fallback with its registered backward, the default experts "
            "implementation on CPU; an eager per-expert loop or batched_mm is not split)")
    ep, coord = group.size, group.rank
    experts: dict[str, int] = {}
    params = {n: s.name for s, n in zip(graph.signature.inputs, graph.placeholders()) if s.kind == InputKind.PARAM}
    for block in blocks:
        count = block.offs.meta["val"].shape[0]
        for f in block.forward:
            name = _param_of(params, f.args[1])
            if name is None:
                raise DistributedRewriteError(
                    f"expert_parallel: the weight of grouped matmul {f.name} ({f.args[1].name}) is not a "
                    "view of one parameter (rule: each expert's weight is a slice of an [experts, ...] "
                    "parameter)")
            shape = tuple(graph.input_node(InputKind.PARAM, name).meta["val"].shape)
            if shape[0] != count or count % ep:
                raise DistributedRewriteError(
                    f"expert_parallel: parameter '{name}' holds {shape[0]} experts along dim 0 and the block "
                    f"routes to {count}; ep={ep} must divide the expert count (rule: every rank keeps "
                    "E/ep whole experts)")
            experts[name] = shape[0]
        _check_rows(block, block.first.args[0].meta["val"].shape[0])
    for block in blocks:
        _rewrite_block(graph, block, group)
    _propagate(graph, _shard_parameters(graph, experts, ep, coord))
    graph.attrs[ATTR] = {"ep": ep, "rank": coord, "blocks": len(blocks),
                         "experts": {n: e for n, e in sorted(experts.items())},
                         "local_experts": {n: e // ep for n, e in sorted(experts.items())}}
    ctx.stat("blocks", len(blocks))
    ctx.stat("expert_params", len(experts))
    return graph


def _rewrite_block(graph: TrainGraph, block: _Block, group) -> None:
    ep = group.size
    offs = block.offs
    experts = offs.meta["val"].shape[0]
    local = experts // ep
    f1, fk = block.first, block.last
    b = NodeBuilder(graph, f1, Region.FORWARD, ORIGIN)
    offs64 = b(aten._to_copy.default, offs, dtype=torch.int64)
    before = b(aten.constant_pad_nd.default, b(aten.slice.Tensor, offs64, 0, 0, experts - 1), [1, 0], 0.0)
    counts = b(aten.sub.Tensor, offs64, before)
    exchanged = b(c10d.all_to_all_single.default, counts, [local] * ep, [local] * ep, group.group_name)
    recv_counts = b(aten.view.default, b(c10d.wait_tensor.default, exchanged), [ep, local])
    send_rows = b(aten.sum.dim_IntList, b(aten.view.default, counts, [ep, local]), [1])
    recv_rows = b(aten.sum.dim_IntList, recv_counts, [1])
    x = f1.args[0]
    received = b(ALL_TO_ALL_ROWS, x, send_rows, recv_rows, group.group_name)
    order = b(EXPERT_MAJOR_ORDER, received, recv_counts)
    x_local = b(aten.index.Tensor, received, [order])
    offs_local = b(aten.cumsum.default, b(aten.sum.dim_IntList, recv_counts, [0]), 0, dtype=torch.int32)
    back = b(aten.argsort.default, order)

    def send_back(builder: NodeBuilder, value: torch.fx.Node) -> torch.fx.Node:
        return builder(ALL_TO_ALL_ROWS, builder(aten.index.Tensor, value, [back]), recv_rows, send_rows,
                       group.group_name)

    def send_out(builder: NodeBuilder, value: torch.fx.Node) -> torch.fx.Node:
        return builder(aten.index.Tensor, builder(ALL_TO_ALL_ROWS, value, send_rows, recv_rows,
                                                  group.group_name), [order])

    grouped = list(block.forward) + list(block.backward.values())
    for node in grouped:
        node.update_arg(2, offs_local)
    if f1 in block.backward:
        b1 = block.backward[f1]
        b1.update_arg(0, _on_local_rows(graph, b1.args[0], x, x_local, f1)
                      or send_out(NodeBuilder(graph, b1, Region.BACKWARD, ORIGIN), b1.args[0]))
    f1.update_arg(0, x_local)
    # The block's output, back to the rows' own ranks, for every reader outside the block.
    y = send_back(NodeBuilder(graph, fk.next, Region.FORWARD, ORIGIN), fk)
    made = {y, y.args[0]}
    for user in list(fk.users):
        if user not in made and user not in grouped:
            user.replace_input_with(fk, y)
    if fk in block.backward:
        bk = block.backward[fk]
        bk.update_arg(3, send_out(NodeBuilder(graph, bk, Region.BACKWARD, ORIGIN), bk.args[3]))
    if f1 in block.backward:
        b1 = block.backward[f1]
        grad_x = next((u for u in b1.users if u.target is operator.getitem and u.args[1] == 0), None)
        if grad_x is not None:
            full = send_back(NodeBuilder(graph, grad_x.next, region_of(grad_x), ORIGIN), grad_x)
            made = {full, full.args[0]}
            for user in list(grad_x.users):
                if user not in made:
                    user.replace_input_with(grad_x, full)


def _on_local_rows(graph: TrainGraph, value: torch.fx.Node, rows: torch.fx.Node, local: torch.fx.Node,
                   first: torch.fx.Node) -> torch.fx.Node | None:
    """``value`` as computed from ``local`` instead of ``rows``, where it is ``rows`` through
    single-input row-keeping ops (autocast's casts of a saved activation); None otherwise."""
    chain = []
    while value is not rows:
        if value.op != "call_function" or value.target not in _SAME_ROWS or len(value.all_input_nodes) != 1:
            return None
        chain.append(value)
        value = value.all_input_nodes[0]
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    made = local
    for node in reversed(chain):
        anchor = first if order[node] < order[first] else node
        with graph.graph.inserting_before(anchor):
            copy = graph.graph.call_function(node.target, (made, *node.args[1:]), dict(node.kwargs))
        copy.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        recompute_val(graph, copy)
        made = copy
    return made


def _shard_parameters(graph: TrainGraph, experts: dict[str, int], ep: int, coord: int) -> list[torch.fx.Node]:
    """Each expert parameter and its optimizer state: this rank's ``E/ep`` experts (``Shard(0)``).
    Returns the inputs whose shape changed."""
    changed = []
    mode = graph.fake_mode()
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        name = spec.name if spec.kind == InputKind.PARAM else (
            split_state_name(spec.name)[0] if spec.kind == InputKind.OPT_STATE else None)
        if name not in experts:
            continue
        val = node.meta["val"]
        if spec.kind == InputKind.OPT_STATE and (val.ndim == 0 or val.shape[0] != experts[name]):
            continue   # a step count
        placement = Placement.sharded(tuple(val.shape), 0, "ep")
        with mode:
            node.meta["val"] = torch.empty((val.shape[0] // ep, *val.shape[1:]), dtype=val.dtype,
                                           device=val.device)
        set_placement(graph, spec.kind, spec.name, placement, node)
        changed.append(node)
    for spec in graph.signature.outputs:
        if spec.kind not in (OutputKind.PARAM, OutputKind.OPT_STATE):
            continue
        source = InputKind.PARAM if spec.kind == OutputKind.PARAM else InputKind.OPT_STATE
        placement = placement_of(graph, source, spec.name)
        if placement is not None:
            set_placement(graph, spec.kind, spec.name, placement)
    return changed


def _propagate(graph: TrainGraph, changed: list[torch.fx.Node]) -> None:
    """The values computed from the expert shards again, in graph order: their shapes flow to the
    weight views, the weight gradients and the updates (nothing else changed shape)."""
    dirty = set(changed)
    for node in graph.graph.nodes:
        if node.op == "call_function" and any(a in dirty for a in node.all_input_nodes):
            recompute_val(graph, node)
            dirty.add(node)
