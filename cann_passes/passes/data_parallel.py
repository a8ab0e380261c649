"""data_parallel: average gradients over the data-parallel ranks with bucketed all-reduces.

Each bucket (consecutive gradients in the order backward produces them, up to
``bucket_mb``; the first up to ``first_bucket_mb``, 1 MiB, as torch DDP's first
bucket, so that the first all-reduce starts early in backward instead of
waiting for a whole bucket) is flattened into one buffer and all-reduced once. The
all-reduce sits right after the bucket's last gradient is produced and its
``wait_tensor`` right before the optimizer first reads the bucket, so a backend
can overlap it with the rest of backward. Averaging (``"avg"``) divides by the
data-parallel world size, which is the global-batch mean when every rank sees
the same number of samples. With gradient accumulation the optimizer reads
gradients already scaled by 1/(global samples), so the reduction is a sum and
it happens once per optimizer step, at the start of the optimizer region.
Under fp16 loss scaling the overflow flag is all-reduced too (``max``), so
that every rank skips the same steps.

Expert parameters (placed on the ``ep`` axis by ``expert_parallel``) hold, on each rank, the
gradient of every expert-parallel rank's rows for this rank's experts: they are summed over the
expert-data-parallel group (``edp``, the ranks holding the same experts) and divided by the whole
dp size, in their own buckets, so the mean is over the global batch as for the dense ones.

``reduce_dtype=bf16`` reduces each bucket in bf16, as torch DDP's ``bf16_compress_hook``: cast,
divided by the ranks, summed, cast back (half the bytes on the wire; the update reads fp32).

Under context parallelism with ``context_parallel{gradients=partial}`` each rank's gradient is its
part of the sum over its sequence chunks: the buckets are all-reduced once over ``dp_cp`` (dp and
cp flattened) as a sum divided by dp, where a cp all-reduce per gradient and a dp one per bucket
would move every gradient twice.

``algo`` (ring/tree/auto) is not written into the graph: the runtime maps it
onto the collective library's own setting (``HCCL_ALGO``/``NCCL_ALGO``) before
the process group exists; the pass records it in ``graph.attrs``.
"""
from __future__ import annotations

from typing import Literal

import torch

from graph_ir import TrainGraph
from graph_ir.meta import GRADIENT_OF, GraphAttr, Region, nbytes, region_of

from ..pass_manager import PassContext, register_pass
from ._distributed import (BUFFER_SYNC, REDUCE_DTYPES, DistributedRewriteError, agree_on_overflow,
                           all_reduce_bucket, average_loss, broadcast_updated_buffers, collective_elements,
                           expert_params, gradients, make_buckets, mesh_dim, position_map, reduce_dtype_of)

ALGOS = ("auto", "ring", "tree")


@register_pass("data_parallel", preserves=())
def data_parallel_pass(graph: TrainGraph, ctx: PassContext, *, bucket_mb: float = 25.0,
                       first_bucket_mb: float = 1.0, algo: Literal[ALGOS] = "auto",
                       reduce_dtype: Literal[tuple(REDUCE_DTYPES)] = "fp32",
                       buffers: Literal[BUFFER_SYNC] = "broadcast") -> TrainGraph:
    """Bucketed gradient all-reduce over the mesh's ``dp`` dimension; loss averaged over ranks.
    ``reduce_dtype=bf16``: each bucket reduced in bf16 (divided by the ranks first) and cast back.
    ``buffers``: the updated buffers broadcast from dp rank 0 before the forward (DDP's
    ``broadcast_buffers``), or ``local``."""
    dtype = reduce_dtype_of(reduce_dtype, "data_parallel")
    if algo not in ALGOS:
        raise DistributedRewriteError(f"data_parallel option algo={algo!r} must be one of {ALGOS}")
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if not value > 0:
            raise DistributedRewriteError(f"data_parallel option {name}={value} must be > 0")
    group = mesh_dim(ctx, "dp", "data_parallel")
    if GraphAttr.ZERO in graph.attrs:
        raise DistributedRewriteError("data_parallel after optimizer_shard would reduce gradients "
                                      "twice (rule: use one of the two)")
    accumulating = GraphAttr.GRAD_ACCUMULATION in graph.attrs
    grads = gradients(graph)
    position = position_map(graph)
    order = sorted(grads, key=lambda n: position[grads[n]])
    experts = expert_params(graph)
    sizes = {n: nbytes(grads[n].meta["val"]) for n in order}
    buckets = make_buckets([n for n in order if n not in experts], sizes, bucket_mb * 2**20,
                           first_bucket_mb * 2**20)
    parts = graph.attrs.get(GraphAttr.CONTEXT_PARALLEL, {}).get("partial_gradients")
    summed = mesh_dim(ctx, "dp_cp", "data_parallel") if parts else group
    for bucket in buckets:
        if parts:   # (each cp rank's part summed, the dp ranks' averaged)
            all_reduce_bucket(graph, bucket, grads, summed, "sum", 1.0 if accumulating else 1.0 / group.size,
                              dtype=dtype)
        else:
            all_reduce_bucket(graph, bucket, grads, group, "sum" if accumulating else "avg", dtype=dtype)
    expert_buckets = make_buckets([n for n in order if n in experts], sizes, bucket_mb * 2**20)
    if expert_buckets:
        edp = mesh_dim(ctx, "edp", "data_parallel")
        for bucket in expert_buckets:
            all_reduce_bucket(graph, bucket, grads, edp if edp.size > 1 else None, "sum",
                              1.0 if accumulating else 1.0 / group.size, dtype=dtype)
    average_loss(graph, group, "data_parallel")
    ctx.stat("buffers_broadcast", broadcast_updated_buffers(graph, group, "data_parallel", buffers))
    agree_on_overflow(graph, summed, "data_parallel")   # (a part's overflow is the whole's)
    graph.attrs[GraphAttr.DATA_PARALLEL] = {"dp": group.size, "buckets": len(buckets), "algo": algo}
    if parts:
        graph.attrs[GraphAttr.DATA_PARALLEL]["over"] = "dp_cp"
    if expert_buckets:
        graph.attrs[GraphAttr.DATA_PARALLEL]["expert_buckets"] = len(expert_buckets)
    ctx.stat("buckets", len(buckets))
    ctx.stat("all_reduce_elements", collective_elements(graph)["all_reduce"])
    return graph
