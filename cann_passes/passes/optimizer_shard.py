"""optimizer_shard: ZeRO stages 1-3 as rewrites of the whole-step graph.

Every parameter is sharded on its own (as FSDP2 does): flattened, padded to a
multiple of the data-parallel size N, and rank r owns elements
``[r*s, (r+1)*s)`` with ``s = ceil(numel / N)``. Sharding each parameter
keeps the update rule untouched: it is elementwise, so the optimizer nodes
that updated a full parameter now update a 1-D shard, its state inputs are
shards, and the scalar step count stays a scalar. A bucket of gradients is
laid out as ``cat([g.view(N, s_i)], dim=1)`` so that one reduce-scatter hands
each rank the shard of every parameter in the bucket, and one all-gather of
the concatenated new shards rebuilds them.

- stage 1: optimizer state sharded. Gradients are reduce-scattered after
  backward ends (full gradients live until then, as in the paper's P_os and
  DeepSpeed's stage 1, which reduces into each rank's partition; an
  all-reduce would move twice the gradient bytes for halves no rank reads),
  each rank updates its shards, new parameters are all-gathered. A parameter whose flat shards fill
  its column of the gathered table exactly (no padding) gets its new value as that column copied
  over its own input, which the eager backend writes in place (``reuse_dead_operands``): the
  gathered table then stays inside the step (``plan_buffers`` holds it across steps); a padded one
  is a fresh copy of its column.
- stage 2: as stage 1, but each bucket is reduce-scattered as soon as its
  last gradient exists, so full gradients die early; the graph's memory
  profile shows the lower peak.
- stage 1/2 with ``master=sharded`` (the paper's mixed-precision layout): the
  fp32 parameters, which are the master weights, are sharded like the
  optimizer state; the parameter inputs and outputs are this rank's shards.
  Before its first read each parameter is gathered whole once for the step:
  one that mixed precision reads only through its bf16/fp16 cast is gathered
  in that dtype (the cast is made on the shard, so the copy is bit for bit
  the cast of the whole fp32 parameter), any other in its own dtype. The
  whole copy serves forward and backward and dies after its last use; no new
  parameters are gathered after the update. The default, ``master=whole``,
  keeps the fp32 parameters whole on every rank (what forward reads in fp32
  training). Not built with gradient accumulation (it would gather once per
  microbatch) nor with pp > 1.
- stage 3: parameters sharded as well: the graph's parameter inputs and
  outputs are shards. A bucket of parameters is all-gathered right before its
  first forward use and gathered again before its first backward use (views
  of the forward copy that backward reads are rebuilt on the new copy), so no
  full parameter is kept from forward to backward.

Padding (the last rank's shard tail) is zero in parameters, gradients and
state, which the update keeps at zero; its bytes are reported in
``graph.attrs['zero']`` and in the pass statistics.

Under context parallelism with ``context_parallel{gradients=partial}`` each
rank's gradient is its part of the sum over its sequence chunks: each
bucket's reduce-scattered shard is all-reduced (summed) over cp, 1/N of the
bytes an all-reduce of every whole gradient over cp moves, and the fp16
overflow flag is agreed over ``dp_cp``.
"""
from __future__ import annotations

from typing import Literal

import torch

from graph_ir import TrainGraph
from graph_ir.meta import GRADIENT_OF, GraphAttr, Region, nbytes, region_of
from graph_ir.placement import FlatShard, Placement, placement_of, set_placement
from graph_ir.signature import InputKind, OutputKind

from ..pass_manager import PassContext, register_pass
from ._distributed import (BUFFER_SYNC, REDUCE_DTYPES, DistributedRewriteError, MeshDim, NodeBuilder, after,
                           agree_on_overflow, all_reduce_bucket, aten, average_loss, axis_size,
                           broadcast_updated_buffers, c10d, collective_elements, compress, expert_params,
                           first_node_of, first_user, gradients, later_region, make_buckets, mesh_dim,
                           optimizer_subgraph, position_map, recompute_val, redirect, reduce_dtype_of)
from graph_ir.analysis.cost import is_view_op

ORIGIN = "optimizer_shard"
DP = "dp"


class ShardLayout:
    """Per-parameter flat shards over the dp axis: graph_ir.placement's FlatShard, sized here for N ranks.

    The graph's parameter may already be this rank's tensor-parallel shard (the ``tensor_parallel``
    pass ran first): the flat shard is then cut from that local shard, and the placement recorded
    is the composition, ``tp: Shard(d)`` then ``dp: FlatShard`` (ZeRO over TP on a 2-D mesh).
    """

    def __init__(self, tg: TrainGraph, names: list[str], group: MeshDim, axis: str = DP):
        self.group = group
        self.shape = {n: tuple(tg.input_node(InputKind.PARAM, n).meta["val"].shape) for n in names}
        # Sizes of this rank's flat shards come from the local (per-rank graph) shape.
        self.local = {n: Placement.flat_shard(self.shape[n], axis) for n in names}
        self.placement = {n: _over_dp(tg, n, self.local[n], axis) for n in names}
        self.numel = {n: p.numel for n, p in self.local.items()}
        self.shard = {n: p.flat_shard_numel(group.size) for n, p in self.local.items()}

    def valid(self, name: str) -> int:
        """Elements of ``name`` this rank's shard holds before padding."""
        return self.local[name].valid_numel(self.group.size, self.group.rank)

    def padding(self, name: str) -> int:
        return self.local[name].padding(self.group.size)

    def to_json(self) -> dict:
        return {n: {"shape": list(self.shape[n]), "numel": self.numel[n], "shard": self.shard[n],
                    "padding": self.padding(n), "placement": str(self.placement[n])} for n in self.shape}


def _over_dp(tg: TrainGraph, name: str, local: Placement, axis: str = DP) -> Placement:
    """The placement of ``name``'s flat shard over ``axis`` (dp; edp for an expert parameter): on
    top of its tensor- or expert-parallel one, if it has one."""
    before = placement_of(tg, InputKind.PARAM, name)
    if before is None or before.is_replicated:
        return local
    return before.then(axis, FlatShard())


# -- gradients: reduce-scatter ------------------------------------------------------------------

def _reduce_scatter_bucket(tg: TrainGraph, bucket: list[str], grads, layout: ShardLayout, stage: int,
                           reduce_op: str, scale: float = 1.0, dtype: torch.dtype | None = None,
                           parts_over=None) -> dict[str, torch.fx.Node]:
    """``parts_over``: the cp group when each rank's gradient is its part of a sum over its sequence
    chunks (``context_parallel{gradients=partial}``): the dp shard is summed over it after the
    reduce-scatter, moving 1/dp of the bytes an all-reduce of the whole gradient over cp would."""
    position = position_map(tg)
    values = [grads[n] for n in bucket]
    readers = {n: [u for u in grads[n].users if region_of(u) == Region.OPTIMIZER] for n in bucket}
    first_read = first_user(values, position, Region.OPTIMIZER)
    region = later_region(*(region_of(v) for v in values))
    if stage == 1 and region == Region.BACKWARD:
        anchor = first_node_of(tg, Region.OPTIMIZER)      # after backward: full gradients live to its end
    else:
        anchor = after(max(values, key=position.__getitem__))  # as soon as the bucket is complete
    n_ranks = layout.group.size
    send = NodeBuilder(tg, anchor, region, ORIGIN)
    rows = [send(aten.view.default, send.pad_to(send.flat(v), n_ranks * layout.shard[n]),
                 [n_ranks, layout.shard[n]]) for n, v in zip(bucket, values)]
    table = send(aten.cat.default, rows, 1) if len(rows) > 1 else rows[0]
    wire, op = compress(send, send(aten.view.default, table, [-1]), dtype, reduce_op, n_ranks)
    scattered = send(c10d.reduce_scatter_tensor.default, wire, op, n_ranks, layout.group.group_name)
    receive = NodeBuilder(tg, first_read, Region.OPTIMIZER, ORIGIN)
    mine = receive(c10d.wait_tensor.default, scattered)
    if mine.meta["val"].dtype != table.meta["val"].dtype:
        mine = receive(aten._to_copy.default, mine, dtype=table.meta["val"].dtype)
    if parts_over is not None:
        mine = receive(c10d.wait_tensor.default,
                       receive(c10d.all_reduce.default, mine, "sum", parts_over.group_name))
    if scale != 1.0:
        mine = receive(aten.mul.Tensor, mine, scale)
    shards, offset = {}, 0
    for name in bucket:
        shards[name] = receive(aten.slice.Tensor, mine, 0, offset, offset + layout.shard[name])
        redirect(grads[name], shards[name], readers[name])
        # The update now reads this rank's shard: that is the gradient it holds.
        grads[name].meta.pop(GRADIENT_OF, None)
        shards[name].meta[GRADIENT_OF] = name
        set_placement(tg, "grad", name, layout.placement[name], shards[name])
        offset += layout.shard[name]
    return shards


# -- parameters and state as shards in the optimizer -------------------------------------------

def _slice_own_shard(tg: TrainGraph, name: str, layout: ShardLayout) -> None:
    """Stage 1/2: the optimizer reads this rank's shard of the (full) parameter input."""
    param = tg.input_node(InputKind.PARAM, name)
    readers = [u for u in param.users if region_of(u) == Region.OPTIMIZER]
    build = NodeBuilder(tg, first_user([param], position_map(tg), Region.OPTIMIZER), Region.OPTIMIZER, ORIGIN)
    start = layout.group.rank * layout.shard[name]
    flat = build.flat(param)
    own = build(aten.slice.Tensor, flat, 0, min(start, layout.numel[name]), start + layout.valid(name))
    redirect(param, build.pad_to(own, layout.shard[name]), readers)


def _shard_inputs(tg: TrainGraph, names: list[str], layout: ShardLayout, shard_params: bool) -> None:
    mode = tg.fake_mode()
    for i, spec in enumerate(tg.signature.inputs):
        if spec.kind == InputKind.OPT_STATE:
            owner = spec.name.rpartition(":")[0]
        elif spec.kind == InputKind.PARAM and shard_params:
            owner = spec.name
        else:
            continue
        if owner not in layout.shard:
            continue
        node = tg.placeholders()[i]
        val = node.meta["val"]
        if tuple(val.shape) == layout.shape[owner]:  # scalar state (the step count) stays whole
            with mode:
                node.meta["val"] = torch.empty(layout.shard[owner], dtype=val.dtype, device=val.device)
            # The same placement for the input and the output it becomes: binding, checkpoints and
            # the user-facing state dicts read it (graph_ir.placement), nothing re-derives it.
            set_placement(tg, spec.kind, spec.name, layout.placement[owner], node)
    if not shard_params:
        for name in names:
            _slice_own_shard(tg, name, layout)


def _gather_new_params(tg: TrainGraph, bucket: list[str], layout: ShardLayout) -> None:
    """Stage 1/2: all-gather the bucket's updated shards into full parameters for the outputs."""
    position = position_map(tg)
    outputs = tg.output_values()
    index = {n: tg.signature.output_index(OutputKind.PARAM, n) for n in bucket}
    shards = [outputs[index[n]] for n in bucket]
    send = NodeBuilder(tg, after(max(shards, key=position.__getitem__)), Region.OPTIMIZER, ORIGIN)
    row = send(aten.cat.default, shards) if len(shards) > 1 else shards[0]
    gathered = send(c10d.all_gather_into_tensor.default, row, layout.group.size, layout.group.group_name)
    receive = NodeBuilder(tg, tg.output_node(), Region.OPTIMIZER, ORIGIN)
    table = receive(aten.view.default, receive(c10d.wait_tensor.default, gathered), [layout.group.size, -1])
    offset = 0
    for name in bucket:
        param = tg.input_node(InputKind.PARAM, name)
        val = param.meta["val"]
        if layout.padding(name) == 0 and val.is_contiguous() and val.dtype == table.meta["val"].dtype:
            # The column fills the parameter exactly: its new value is the column copied over the
            # parameter input, which the eager backend writes in place (reuse_dead_operands), so
            # the gathered table stays inside the step and no parameter is allocated afresh.
            whole = receive(aten.view.default, param, [layout.group.size, layout.shard[name]])
            full = receive(aten.view.default, receive(aten.copy.default, whole,
                                                      _column(receive, table, offset, name, layout)),
                           list(layout.shape[name]))
        else:
            full = _column_to_param(receive, table, offset, name, layout)
        outputs[index[name]] = full
        offset += layout.shard[name]
    tg.set_outputs(outputs)


def _column(build: NodeBuilder, table, offset: int, name: str, layout: ShardLayout):
    return build(aten.slice.Tensor, table, 1, offset, offset + layout.shard[name])


def _column_to_param(build: NodeBuilder, table, offset: int, name: str, layout: ShardLayout):
    column = _column(build, table, offset, name, layout)
    return build.unflat(build.flat(column), 0, layout.numel[name], layout.shape[name])


# -- stage 3: gather parameters for forward, again for backward ---------------------------------

def _gather_params(tg: TrainGraph, bucket: list[str], anchor, region: Region, layout: ShardLayout,
                   spelled_apart: bool) -> dict[str, torch.fx.Node]:
    build = NodeBuilder(tg, anchor, region, ORIGIN)
    shards = [tg.input_node(InputKind.PARAM, n) for n in bucket]
    # The backward gather reads the same shards as the forward one; spelling its cat
    # differently keeps common-subexpression elimination from merging the two gathers
    # (functional collectives are not marked impure), which would keep the forward
    # copy alive through backward.
    row = (build(aten.cat.default, shards, 0) if spelled_apart else build(aten.cat.default, shards)) \
        if len(shards) > 1 else build(aten.alias.default, shards[0]) if spelled_apart else shards[0]
    gathered = build(c10d.wait_tensor.default,
                     build(c10d.all_gather_into_tensor.default, row, layout.group.size, layout.group.group_name))
    table = build(aten.view.default, gathered, [layout.group.size, -1])
    full, offset = {}, 0
    for name in bucket:
        full[name] = _column_to_param(build, table, offset, name, layout)
        offset += layout.shard[name]
    return full


def _param_readers(tg: TrainGraph, names: list[str], region: Region, roots: dict) -> dict[str, list]:
    """Nodes in ``region`` reading each parameter: the input itself, or a view chain of ``roots[name]``."""
    readers = {}
    for name in names:
        sources = [tg.input_node(InputKind.PARAM, name)] + _view_chain(roots.get(name))
        readers[name] = [(u, s) for s in sources for u in list(s.users) if region_of(u) == region
                         and u.op == "call_function"]
    return readers


def _view_chain(root) -> list[torch.fx.Node]:
    if root is None:
        return []
    chain, stack = [], [root]
    while stack:
        node = stack.pop()
        chain.append(node)
        # A dtype cast (mixed precision casts each weight once and backward reads that cast) is
        # rebuilt on the backward copy like a view: else the forward copy's cast lives to backward.
        stack.extend(u for u in node.users if (is_view_op(u) or _is_dtype_cast(u)) and region_of(u) == Region.FORWARD)
    return chain


def _rebuild_view(tg: TrainGraph, node, fwd_full, bwd_full, before, memo: dict):
    """The backward twin of a forward view ``node`` of ``fwd_full``, built on ``bwd_full``."""
    if node is fwd_full:
        return bwd_full
    if node not in memo:
        base = _rebuild_view(tg, node.all_input_nodes[0], fwd_full, bwd_full, before, memo)
        args = torch.fx.node.map_arg(node.args, lambda a: base if a is node.all_input_nodes[0] else a)
        memo[node] = NodeBuilder(tg, before, Region.BACKWARD, ORIGIN)(node.target, *args, **node.kwargs)
    return memo[node]


def _shard_parameters(tg: TrainGraph, names: list[str], layout: ShardLayout, bucket_bytes: float) -> None:
    sizes = {n: layout.numel[n] * tg.input_node(InputKind.PARAM, n).meta["val"].element_size() for n in names}
    position = position_map(tg)
    fwd_readers = _param_readers(tg, names, Region.FORWARD, {})
    used = [n for n in names if fwd_readers[n]]
    used.sort(key=lambda n: min(position[u] for u, _ in fwd_readers[n]))
    fwd_full = {}
    for bucket in make_buckets(used, sizes, bucket_bytes):
        anchor = min((u for n in bucket for u, _ in fwd_readers[n]), key=position_map(tg).__getitem__)
        fwd_full.update(_gather_params(tg, bucket, anchor, Region.FORWARD, layout, False))
        for n in bucket:
            for user, source in fwd_readers[n]:
                user.replace_input_with(source, fwd_full[n])
    bwd_readers = _param_readers(tg, names, Region.BACKWARD, fwd_full)
    position = position_map(tg)
    used = [n for n in names if bwd_readers[n]]
    used.sort(key=lambda n: min(position[u] for u, _ in bwd_readers[n]))
    for bucket in make_buckets(used, sizes, bucket_bytes):
        anchor = min((u for n in bucket for u, _ in bwd_readers[n]), key=position_map(tg).__getitem__)
        bwd_full = _gather_params(tg, bucket, anchor, Region.BACKWARD, layout, True)
        for n in bucket:
            memo: dict = {}
            for user, source in bwd_readers[n]:
                if source.op == "placeholder":
                    twin = bwd_full[n]
                else:
                    twin = _rebuild_view(tg, source, fwd_full[n], bwd_full[n], anchor, memo)
                user.replace_input_with(source, twin)


# -- stage 1/2, master sharded: the step's low-precision parameters gathered once ------------------

_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
LOW_DTYPES = (torch.bfloat16, torch.float16)


def _step_readers(param: torch.fx.Node) -> list[torch.fx.Node]:
    """The forward and backward nodes that read a parameter input (the update reads its shard)."""
    return [u for u in param.users if u.op == "call_function" and region_of(u) in (Region.FORWARD, Region.BACKWARD)]


def _is_dtype_cast(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _CASTS:
        return False
    return node.target is not aten._to_copy.default or set(node.kwargs) == {"dtype"}


def _low_precision_cast(param: torch.fx.Node) -> torch.fx.Node | None:
    """The one cast to bf16/fp16 that every forward and backward read of ``param`` goes through.

    Mixed precision (the autocast pass) casts a weight once per step and shares that cast between
    forward and backward; a weight read so is needed whole only in the low dtype.
    """
    readers = _step_readers(param)
    if len(readers) != 1 or not _is_dtype_cast(readers[0]):
        return None                  # read in its own dtype too, or a cast that also moves or re-lays it
    cast = readers[0]
    val = cast.meta.get("val")
    return cast if isinstance(val, torch.Tensor) and val.dtype in LOW_DTYPES else None


def _gather_whole_for_step(tg: TrainGraph, names: list[str], layout: ShardLayout, bucket_bytes: float) -> dict:
    """Stage 1/2 with the master sharded: rebuild each parameter whole once, before its first read.

    A parameter read only through one low-precision cast is gathered in that dtype (the cast is
    made on this rank's fp32 shard, so the gathered copy is bit for bit the cast of the whole
    fp32 parameter); any other is gathered in its own dtype. The whole copy serves forward and
    backward (no second gather, unlike stage 3) and dies after its last backward use.
    Returns the gathered elements per dtype name.
    """
    position = position_map(tg)
    todo = []
    for name in names:
        param = tg.input_node(InputKind.PARAM, name)
        cast = _low_precision_cast(param)
        readers = [cast] if cast is not None else _step_readers(param)
        if readers:
            todo.append((min(readers, key=position.__getitem__), name, cast))
    todo.sort(key=lambda t: position[t[0]])
    dtype_of = {n: (c.meta["val"].dtype if c is not None else tg.input_node(InputKind.PARAM, n).meta["val"].dtype)
                for _, n, c in todo}
    cast_of = {n: c for _, n, c in todo}
    # Buckets of one dtype each (one all-gather moves one dtype), in first-read order.
    runs: list[list[str]] = []
    for _, name, _ in todo:
        if runs and dtype_of[runs[-1][-1]] == dtype_of[name]:
            runs[-1].append(name)
        else:
            runs.append([name])
    moved: dict[str, int] = {}
    for run in runs:
        dtype = dtype_of[run[0]]
        sizes = {n: layout.numel[n] * dtype.itemsize for n in run}
        for bucket in make_buckets(run, sizes, bucket_bytes):
            params = {n: tg.input_node(InputKind.PARAM, n) for n in bucket}
            readers = {n: [cast_of[n]] if cast_of[n] is not None else _step_readers(params[n]) for n in bucket}
            anchor = min((u for n in bucket for u in readers[n]), key=position_map(tg).__getitem__)
            build = NodeBuilder(tg, anchor, region_of(anchor), ORIGIN)
            pieces = [build(aten._to_copy.default, params[n], dtype=dtype) if cast_of[n] is not None else params[n]
                      for n in bucket]
            row = build(aten.cat.default, pieces) if len(pieces) > 1 else pieces[0]
            gathered = build(c10d.wait_tensor.default,
                             build(c10d.all_gather_into_tensor.default, row, layout.group.size,
                                   layout.group.group_name))
            table = build(aten.view.default, gathered, [layout.group.size, -1])
            offset = 0
            for name in bucket:
                whole = _column_to_param(build, table, offset, name, layout)
                offset += layout.shard[name]
                if cast_of[name] is not None:
                    cast_of[name].replace_all_uses_with(whole)
                    tg.graph.erase_node(cast_of[name])
                else:
                    for user in readers[name]:
                        user.replace_input_with(params[name], whole)
            key = str(dtype).removeprefix("torch.")
            moved[key] = moved.get(key, 0) + layout.group.size * sum(layout.shard[n] for n in bucket)
    return moved


MASTER_OPTIONS = ("whole", "sharded")


def _master_sharded(graph: TrainGraph, stage: int, master: str, pp: int) -> bool:
    if master not in MASTER_OPTIONS:
        raise DistributedRewriteError(f"optimizer_shard option master={master!r} must be one of {MASTER_OPTIONS}")
    if stage == 3 or master == "whole":
        return stage == 3
    if pp > 1:
        raise DistributedRewriteError(
            f"optimizer_shard option master='sharded' with pp = {pp} is not built (rule: parameter shards "
            "are not split into pipeline stages yet, as for ZeRO-3; use master='whole')")
    if GraphAttr.GRAD_ACCUMULATION in graph.attrs:
        raise DistributedRewriteError(
            "optimizer_shard option master='sharded' with gradient accumulation is not built (rule: the "
            "whole parameters would be gathered once per microbatch; use master='whole' or stage=3)")
    return True


def _expert_gradients(graph: TrainGraph, ctx: PassContext, names: list[str], grads, sizes: dict, bucket_bytes: float,
                      stage: int, accumulating: bool, dp: int, dtype: torch.dtype | None = None
                      ) -> ShardLayout | None:
    """Expert parameters (``expert_parallel``'s, already 1/ep per rank) are ZeRO-sharded (stage 3:
    the parameters too) over the expert-data-parallel group (``edp``, the ranks holding the same experts), their gradients
    reduce-scattered there and divided by the whole dp size (the global-batch mean); with one such
    rank there is nothing to shard and the gradient is only divided. Returns their layout, or None."""
    if not names:
        return None
    edp = mesh_dim(ctx, "edp", ORIGIN)
    scale = 1.0 if accumulating else 1.0 / dp
    if edp.size == 1:
        for bucket in make_buckets(names, sizes, bucket_bytes):
            all_reduce_bucket(graph, bucket, grads, None, "sum", scale, ORIGIN, dtype)
        return None
    layout = ShardLayout(graph, names, edp, axis="edp")
    for bucket in make_buckets(names, sizes, bucket_bytes):
        _reduce_scatter_bucket(graph, bucket, grads, layout, stage, "sum", scale, dtype)
    return layout


# -- the pass -----------------------------------------------------------------------------------

@register_pass("optimizer_shard", preserves=())
def optimizer_shard_pass(graph: TrainGraph, ctx: PassContext, *, stage: int = 1,
                         bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                         master: Literal[MASTER_OPTIONS] = "whole",
                         reduce_dtype: Literal[tuple(REDUCE_DTYPES)] = "fp32",
                         buffers: Literal[BUFFER_SYNC] = "broadcast") -> TrainGraph:
    """ZeRO stage 1/2/3 over the mesh's ``dp`` dimension (see the module docstring);
    ``reduce_dtype=bf16``: gradients reduce-scattered in bf16 (divided by the ranks first);
    ``buffers``: as data_parallel's (dp rank 0's updated buffers broadcast, or ``local``).
    ``first_bucket_mb``: at stages 2 and 3, whose buckets are reduce-scattered as soon as they are
    complete, the first bucket of gradients holds up to this much (as data_parallel's and torch
    DDP's first bucket), so a reduction starts early in backward; new parameters are gathered in
    ``bucket_mb`` buckets."""
    dtype = reduce_dtype_of(reduce_dtype, ORIGIN)
    if stage not in (1, 2, 3):
        raise DistributedRewriteError(f"optimizer_shard option stage={stage} must be 1, 2 or 3")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if not value > 0:
            raise DistributedRewriteError(f"optimizer_shard option {name}={value} must be > 0")
    group = mesh_dim(ctx, DP, ORIGIN)
    if group.size < 2:
        raise DistributedRewriteError("optimizer_shard needs a dp dimension of 2 or more ranks "
                                      "(rule: ZeRO shards over data-parallel ranks)")
    if GraphAttr.DATA_PARALLEL in graph.attrs or GraphAttr.ZERO in graph.attrs:
        raise DistributedRewriteError("optimizer_shard on a graph that already synchronizes gradients "
                                      "(rule: use one of data_parallel and optimizer_shard, once)")
    accumulating = GraphAttr.GRAD_ACCUMULATION in graph.attrs
    bucket_bytes = bucket_mb * 2**20
    grads = gradients(graph)
    position = position_map(graph)
    order = sorted(grads, key=lambda n: position[grads[n]])
    experts = expert_params(graph)
    dense = [n for n in order if n not in experts]
    layout = ShardLayout(graph, dense, group)
    sizes = {n: nbytes(grads[n].meta["val"]) for n in order}
    buckets = make_buckets(dense, sizes, bucket_bytes)
    # Stage 1 reduces after backward: one split of its gradients would only add a collective.
    reduced = buckets if stage == 1 else make_buckets(dense, sizes, bucket_bytes, first_bucket_mb * 2**20)
    sharded_master = _master_sharded(graph, stage, master, axis_size(ctx, "pp"))
    parts = graph.attrs.get(GraphAttr.CONTEXT_PARALLEL, {}).get("partial_gradients")
    parts_over = mesh_dim(ctx, "cp", ORIGIN) if parts else None
    if parts and experts:
        raise DistributedRewriteError("optimizer_shard: partial context-parallel gradients with expert "
                                      "parameters (rule: context_parallel{gradients=partial} is for dense models)")
    for bucket in reduced:
        _reduce_scatter_bucket(graph, bucket, grads, layout, stage, "sum" if accumulating else "avg",
                               dtype=dtype, parts_over=parts_over)
    expert_layout = _expert_gradients(graph, ctx, [n for n in order if n in experts], grads, sizes,
                                      bucket_bytes, stage, accumulating, group.size, dtype)
    _shard_inputs(graph, dense, layout, shard_params=sharded_master)
    if expert_layout is not None:
        _shard_inputs(graph, list(expert_layout.shape), expert_layout, shard_params=sharded_master)
    for node in optimizer_subgraph(graph, order):
        recompute_val(graph, node)
    gathered = {}
    if stage == 3:
        _shard_parameters(graph, dense, layout, bucket_bytes)
        if expert_layout is not None:   # gathered over edp, where forward and backward read them
            _shard_parameters(graph, list(expert_layout.shape), expert_layout, bucket_bytes)
    elif sharded_master:
        gathered = _gather_whole_for_step(graph, dense, layout, bucket_bytes)
        if expert_layout is not None:
            gathered.update(_gather_whole_for_step(graph, list(expert_layout.shape), expert_layout, bucket_bytes))
    else:
        for bucket in buckets:
            _gather_new_params(graph, bucket, layout)
        if expert_layout is not None:
            for bucket in make_buckets(list(expert_layout.shape), sizes, bucket_bytes):
                _gather_new_params(graph, bucket, expert_layout)
    average_loss(graph, group, ORIGIN)
    ctx.stat("buffers_broadcast", broadcast_updated_buffers(graph, group, ORIGIN, buffers))
    # every rank skips the same fp16 steps (with cp parts, a part's overflow is the whole's)
    agree_on_overflow(graph, mesh_dim(ctx, "dp_cp", ORIGIN) if parts else group, ORIGIN)
    padding = {n: layout.padding(n) for n in dense}
    if expert_layout is not None:
        padding.update({n: expert_layout.padding(n) for n in expert_layout.shape})
    graph.attrs[GraphAttr.SHARDED_STATE] = True
    graph.attrs[GraphAttr.ZERO] = {"stage": stage, "dp": group.size, "rank": group.rank, "axis": DP,
                                   "master": "sharded" if sharded_master else "whole",
                                   "gathered_for_step": gathered, "params": layout.to_json()}
    if expert_layout is not None:
        graph.attrs[GraphAttr.ZERO]["expert_params"] = expert_layout.to_json()
    ctx.stat("buckets", len(reduced))
    ctx.stat("padding_elements", sum(padding.values()))
    for kind, elements in collective_elements(graph).items():
        ctx.stat(f"{kind}_elements", elements)
    return graph


def zero_model_state_bytes(psi: float, dp: int, stage: int, *, k: int = 12, param_bytes: int = 2,
                           grad_bytes: int = 2) -> float:
    """Per-rank bytes of parameters, gradients and optimizer state (the ZeRO paper's model).

    ``k`` bytes of optimizer state per parameter (12 for mixed-precision Adam:
    fp32 master copy, momentum, variance); stage 0 is plain data parallelism.
    """
    params, grads, state = param_bytes * psi, grad_bytes * psi, k * psi
    if stage >= 1:
        state /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    return params + grads + state
