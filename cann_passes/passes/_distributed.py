"""Shared pieces of the distributed rewrites: finding gradients, building nodes, buckets.

Collectives are torch's functional ones (``torch.ops._c10d_functional``):
each returns a new tensor and a ``wait_tensor`` node marks where the result
is needed, so a backend may overlap the communication with whatever sits
between the two nodes. They name their process group by string
(``ProcessGroup.group_name``), which the mesh description in ``ctx.mesh`` gives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import collective_elements as graph_collective_elements
from graph_ir.analysis.gradients import GradientNotFound, find_gradients, optimizer_subgraph  # noqa: F401
from graph_ir.build import fake_value, tag
from graph_ir.meta import GRADIENT_OF, Region, region_of  # noqa: F401  (GRADIENT_OF: passes' import)
from graph_ir.meta import ACCUMULATION_FIRST, ACCUMULATION_WEIGHT, GraphAttr
from graph_ir.placement import placements
from graph_ir.signature import InputKind, OutputKind, Spec

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_REGION_ORDER = {Region.IO: -1, Region.FORWARD: 0, Region.BACKWARD: 1, Region.OPTIMIZER: 2}


class DistributedRewriteError(ValueError):
    pass


# -- the mesh, as passes see it ------------------------------------------------------------------

@dataclass(frozen=True)
class MeshDim:
    group_name: str
    size: int
    rank: int


def mesh_dim(ctx: Any, dim: str, pass_name: str) -> MeshDim:
    """``ctx.mesh``'s ``dim``: a process group name, its size and this rank's index in it.

    ``ctx.mesh`` is the mesh description (:class:`graph_ir.mesh.MeshDesc`, a real or a fake mesh),
    so a pass runs without any process group, e.g. to compile a 64-rank plan in one process.
    """
    mesh = getattr(ctx, "mesh", None)
    if mesh is None:
        raise DistributedRewriteError(
            f"pass '{pass_name}' needs ctx.mesh (the device mesh with a '{dim}' dimension); "
            "compile with cann_passes.compile_program(captured, plan, MeshDesc.fake(dp=...)) or through a "
            "step after cann_passes.runtime.distributed.init_distributed(plan)")
    return MeshDim(mesh.group_name(dim), int(mesh.size(dim)), int(mesh.local_rank(dim)))


def axis_size(ctx: Any, axis: str) -> int:
    """The size of ``ctx.mesh``'s ``axis``; 1 without a mesh or without that axis."""
    mesh = getattr(ctx, "mesh", None)
    return int(mesh.size(axis)) if mesh is not None and mesh.has_axis(axis) else 1


# -- gradients (the analysis lives in graph_ir) ------------------------------------------------

def gradients(tg: TrainGraph) -> dict[str, torch.fx.Node]:
    """Trainable parameter name -> the value its optimizer update reads as its gradient (marked)."""
    try:
        return find_gradients(tg)
    except GradientNotFound as exc:
        raise DistributedRewriteError(str(exc)) from None


# -- building nodes -----------------------------------------------------------------------------

def recompute_val(tg: TrainGraph, node: torch.fx.Node) -> None:
    """Recompute ``node.meta['val']`` from its inputs' fake values (after its inputs changed shape)."""
    mode = tg.fake_mode()
    try:
        node.meta["val"] = fake_value(node.target, node.args, node.kwargs, mode=mode)
    except Exception as exc:
        raise DistributedRewriteError(
            f"node {node.name} ({node.target}) cannot run on sharded inputs: {exc} "
            "(rule: the optimizer update must be elementwise to be sharded)") from None


class NodeBuilder:
    """Appends nodes before an anchor, with fake values and the IR's metadata."""

    def __init__(self, tg: TrainGraph, anchor: torch.fx.Node, region: Region, origin: str):
        self.tg, self.anchor, self.region, self.origin = tg, anchor, region, origin

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        with self.tg.graph.inserting_before(self.anchor):
            node = self.tg.graph.call_function(target, args, kwargs)
        tag(node, region=self.region, module_path="", origin=self.origin)
        recompute_val(self.tg, node)
        return node

    def flat(self, x: torch.fx.Node) -> torch.fx.Node:
        if not x.meta["val"].is_contiguous():
            x = self(aten.clone.default, x, memory_format=torch.contiguous_format)
        return self(aten.view.default, x, [-1])

    def pad_to(self, flat: torch.fx.Node, length: int) -> torch.fx.Node:
        missing = length - flat.meta["val"].numel()
        return self(aten.constant_pad_nd.default, flat, [0, missing], 0.0) if missing else flat

    def unflat(self, flat: torch.fx.Node, start: int, numel: int, shape) -> torch.fx.Node:
        piece = self(aten.slice.Tensor, flat, 0, start, start + numel)
        return self(aten.view.default, piece, list(shape))


def after(node: torch.fx.Node) -> torch.fx.Node:
    """The anchor that inserts right after ``node`` (in creation order)."""
    return node.next


def later_region(*regions: Region) -> Region:
    return max(regions, key=lambda r: _REGION_ORDER[r])


def first_user(nodes: Iterable[torch.fx.Node], position: dict[torch.fx.Node, int],
               region: Region | None = None) -> torch.fx.Node | None:
    """The earliest node (in graph order) that reads any of ``nodes``, optionally within a region."""
    users = [u for n in nodes for u in n.users if region is None or region_of(u) == region]
    return min(users, key=position.__getitem__) if users else None


class _NodeOrder:
    """``order[node]`` sorts like the node's position in its graph, and stays right as nodes are
    inserted: FX keeps a sort key on every node (nodes compare with ``<``). A dict of positions
    would go stale on every insertion, and rebuilding it per bucket is quadratic on a 7B graph."""

    def __getitem__(self, node: torch.fx.Node) -> torch.fx.Node:
        return node


def position_map(tg: TrainGraph) -> _NodeOrder:
    return _NodeOrder()


def first_node_of(tg: TrainGraph, region: Region) -> torch.fx.Node:
    for node in tg.graph.nodes:
        if node.op == "call_function" and region_of(node) == region:
            return node
    return tg.output_node()


# -- buckets ------------------------------------------------------------------------------------

def make_buckets(names: list[str], sizes: dict[str, int], bucket_bytes: float,
                 first_bytes: float | None = None) -> list[list[str]]:
    """Consecutive names grouped while their bytes fit ``bucket_bytes`` (a bucket holds at least one);
    the first bucket while they fit ``first_bytes`` too, where given."""
    buckets: list[list[str]] = []
    used, cap = 0, min(bucket_bytes, first_bytes if first_bytes is not None else math.inf)
    for name in names:
        if not buckets or used + sizes[name] > cap:
            cap = bucket_bytes if buckets else cap
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += sizes[name]
    return buckets


def collective_elements(tg: TrainGraph) -> dict[str, int]:
    """Elements each rank moves per step, by collective (graph_ir.analysis.collectives' accounting)."""
    return graph_collective_elements(tg.graph)


def average_loss(tg: TrainGraph, group: MeshDim, origin: str) -> None:
    """Make the loss output the mean over data-parallel ranks, so every rank reports the global loss.

    Under dynamic accumulation the ranks' microbatches may differ in size: the mean is weighted
    by each rank's samples (``grad_accumulation:weight``), as the gradients are."""
    i = tg.signature.output_index(OutputKind.LOSS, "loss")
    loss = tg.output_values()[i]
    build = NodeBuilder(tg, after(loss), region_of(loss), origin)
    if tg.attrs.get(GraphAttr.GRAD_ACCUMULATION, {}).get("target"):
        weight = tg.input_node(InputKind.STEP_STATE, ACCUMULATION_WEIGHT)
        if weight.meta["val"].dtype != loss.meta["val"].dtype:
            weight = build(aten._to_copy.default, weight, dtype=loss.meta["val"].dtype)
        both = build(aten.stack.default, [build(aten.mul.Tensor, loss, weight), weight])
        summed = build(c10d.wait_tensor.default, build(c10d.all_reduce.default, both, "sum", group.group_name))
        reduced = build(aten.div.Tensor, build(aten.select.int, summed, 0, 0), build(aten.select.int, summed, 0, 1))
    else:
        reduced = build(c10d.wait_tensor.default, build(c10d.all_reduce.default, loss, "avg", group.group_name))
    values = tg.output_values()
    values[i] = reduced
    tg.set_outputs(values)


def scalar_step_state(tg: TrainGraph, name: str, like: torch.Tensor) -> torch.fx.Node:
    """A float32 0-dim step-state input ``name`` (declared with value 1.0), on ``like``'s device:
    a scalar the runtime sets per call (accumulation's weight, scale, first-microbatch flag)."""
    tg.attrs.setdefault(GraphAttr.STEP_STATE, {})[name] = {"value": 1.0, "dtype": "float32", "shape": []}
    with tg.fake_mode():
        value = torch.empty((), dtype=torch.float32, device=like.device)
    return tg.add_input(Spec(InputKind.STEP_STATE, name), value)


BUFFER_SYNC = ("broadcast", "local")


def broadcast_updated_buffers(tg: TrainGraph, group: MeshDim, origin: str, how: str = "broadcast") -> int:
    """torch DDP's ``broadcast_buffers``: every buffer the step updates (BatchNorm's running
    statistics) is replaced, before the forward reads it, by data-parallel rank 0's, so that each
    rank updates rank 0's statistics with its own batch, as under DDP (rank 0's are unchanged, and
    in train mode the normalisation reads the batch's statistics, so gradients are the same either
    way: only the buffers of ranks other than 0 differ). Accumulating, only the first microbatch
    of an optimizer step takes rank 0's (step state ``grad_accumulation:first``), as DDP, whose
    forwards under ``no_sync`` leave the next forward unsynchronised. Each broadcast sits right
    before its buffer's first reader, so that a pipeline stage's ranks broadcast the buffers of
    that stage. ``local``: each rank's follow its own batches. Returns the number broadcast."""
    if how not in BUFFER_SYNC:
        raise DistributedRewriteError(f"{origin} option buffers={how!r}: must be one of {', '.join(BUFFER_SYNC)}")
    updated = {spec.name for spec in tg.signature.outputs if spec.kind == OutputKind.BUFFER}
    synced = set(tg.attrs.get(GraphAttr.SYNC_BATCH_NORM, {}).get("buffers", ()))   # (the same on every rank)
    buffers = [node for spec, node in zip(tg.signature.inputs, tg.placeholders())
               if spec.kind == InputKind.BUFFER and spec.name in updated and node.users and spec.name not in synced]
    if how == "local" or group.size == 1 or not buffers:
        return 0
    flag = None
    if GraphAttr.GRAD_ACCUMULATION in tg.attrs:
        flag = scalar_step_state(tg, ACCUMULATION_FIRST, buffers[0].meta["val"])
    order = {n: i for i, n in enumerate(tg.graph.nodes)}
    for node in buffers:
        # (right before the buffer's first reader: under pp that is in the stage holding the buffer,
        # whose data-parallel ranks broadcast it)
        build = NodeBuilder(tg, min(node.users, key=order.__getitem__), Region.FORWARD, origin)
        first = build(aten.ne.Scalar, flag, 0) if flag is not None else None
        sent = build(c10d.broadcast.default, node, 0, group.group_name)
        taken = build(c10d.wait_tensor.default, sent)
        if first is not None:
            taken = build(aten.where.self, first, taken, node)
        node.replace_all_uses_with(taken, delete_user_cb=lambda u: u is not sent and u is not taken)
    return len(buffers)


def redirect(value: torch.fx.Node, replacement: torch.fx.Node, users: Iterable[torch.fx.Node]) -> None:
    for user in users:
        user.replace_input_with(value, replacement)


# Step metric of the loss_scale pass: whether this step's gradients overflowed (skipped if so).
FOUND_INF = "loss_scale:found_inf"


def agree_on_overflow(tg: TrainGraph, group: MeshDim, origin: str) -> bool:
    """Make fp16 loss scaling's overflow flag the same on every rank of ``group``.

    loss_scale checks the gradients this rank computed, before they are reduced; a rank whose
    gradients overflow would skip the step while the others apply the reduced, non-finite ones.
    The flag is all-reduced with ``max`` (any rank's overflow skips the step everywhere, and the
    scale then backs off everywhere), as torch's GradScaler sees the already-reduced gradients.
    Returns whether the graph had the flag.
    """
    try:
        index = tg.signature.output_index(OutputKind.METRIC, FOUND_INF)
    except ValueError:
        return False
    local = tg.output_values()[index]
    users = list(local.users)
    build = NodeBuilder(tg, after(local), region_of(local), origin)
    as_float = build(aten._to_copy.default, local, dtype=torch.float32)
    reduced = build(c10d.wait_tensor.default, build(c10d.all_reduce.default, as_float, "max", group.group_name))
    anywhere = build(aten.gt.Scalar, reduced, 0.0)
    for user in users:
        user.replace_input_with(local, anywhere)
    return True


# -- gradient reductions shared by data_parallel and optimizer_shard ---------------------------------

def expert_params(tg: TrainGraph) -> set[str]:
    """Parameters split over the ``ep`` axis (expert_parallel's experts)."""
    return {key.partition(":")[2] for key, p in placements(tg).items()
            if key.startswith("param:") and any(axis == "ep" for axis, _ in p.axes)}


REDUCE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def reduce_dtype_of(option: str, pass_name: str) -> torch.dtype | None:
    if option not in REDUCE_DTYPES:
        raise DistributedRewriteError(f"{pass_name} option reduce_dtype={option!r} must be one of "
                                      f"{tuple(REDUCE_DTYPES)}")
    return REDUCE_DTYPES[option]


def compress(build: "NodeBuilder", flat: torch.fx.Node, dtype: torch.dtype | None, reduce_op: str,
             n_ranks: int) -> tuple[torch.fx.Node, str]:
    """``flat`` cast to ``dtype`` for a 16-bit reduction, divided by the ranks first when averaging
    (a sum of N values cannot overflow where their mean does not), as torch DDP's
    ``bf16_compress_hook`` does; the op the collective then runs."""
    if dtype is None or flat.meta["val"].dtype == dtype:
        return flat, reduce_op
    low = build(aten._to_copy.default, flat, dtype=dtype)
    if reduce_op == "avg":
        return build(aten.div.Tensor, low, n_ranks), "sum"
    return low, reduce_op


def all_reduce_bucket(tg: TrainGraph, bucket: list[str], grads: dict[str, torch.fx.Node],
                      group: MeshDim | None, reduce_op: str, scale: float = 1.0,
                      origin: str = "data_parallel", dtype: torch.dtype | None = None) -> None:
    """One bucket's all-reduce (none for ``group`` None: a group of one rank), then ``scale``;
    with ``dtype`` (bf16) the bucket is reduced in it and cast back."""
    position = position_map(tg)
    values = [grads[n] for n in bucket]
    readers = {n: [u for u in grads[n].users if region_of(u) == Region.OPTIMIZER] for n in bucket}
    first_read = first_user(values, position, Region.OPTIMIZER)
    last = max(values, key=position.__getitem__)
    send = NodeBuilder(tg, after(last), later_region(*(region_of(v) for v in values)), origin)
    flats = [send.flat(v) for v in values]
    flat = send(aten.cat.default, flats) if len(flats) > 1 else flats[0]
    receive = NodeBuilder(tg, first_read, Region.OPTIMIZER, origin)
    if group is not None:
        wire, op = compress(send, flat, dtype, reduce_op, group.size)
        synced = receive(c10d.wait_tensor.default, send(c10d.all_reduce.default, wire, op, group.group_name))
        if synced.meta["val"].dtype != flat.meta["val"].dtype:
            synced = receive(aten._to_copy.default, synced, dtype=flat.meta["val"].dtype)
    else:
        synced = flat
    if scale != 1.0:
        synced = receive(aten.mul.Tensor, synced, scale)
    offset = 0
    for name, value in zip(bucket, values):
        val = value.meta["val"]
        synced_grad = receive.unflat(synced, offset, val.numel(), val.shape)
        redirect(value, synced_grad, readers[name])
        # The update reads the synchronized copy now: that is its gradient (graph_ir.analysis.gradients).
        value.meta.pop(GRADIENT_OF, None)
        synced_grad.meta[GRADIENT_OF] = name
        offset += val.numel()
