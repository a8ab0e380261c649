"""gloo_reduce_scatter_as_all_reduce: on a gloo process group, a gradient reduce-scatter runs as an
all-reduce and each rank keeps its own chunk.

torch 2.13's gloo backend reduce-scatters a buffer in more time than it all-reduces the whole of it
(12.4 MiB over two local ranks, ``bench.gloo_collectives``, three runs: 1.31-1.39x the in-place
all-reduce; the all-reduce and the copy of this rank's chunk 1.08-1.20x), so ZeRO's gradient
reduction cost more than DDP's there. The rewrite: ``reduce_scatter_tensor(x, op, N, group)`` ->
``all_reduce(x, op, group)``, waited where the reduce-scatter was, then a ``slice`` (a view) of this
rank's chunk ``[r*S, (r+1)*S)`` along dim 0, which the update reads in place. Each element is the
same reduction over the same ranks (on two ranks bitwise the same sum; on more, gloo's all-reduce
may add in another order, as data parallelism's does). The wire carries the whole buffer back,
and the reduced buffer stays alive until the update's last read of the chunk: (N-1)/N of a bucket
more than the reduce-scatter's result, during the update only (the bucket itself is held at the
wait either way). A copy of the chunk would free it early at the price of a shard-sized copy
into a fresh buffer every step: on the 4-layer GPT's ZeRO-1 step (2 ranks, profiled) 3.5 of its
14 ms of copies, the largest copy of the step.

Only gradient reductions are rewritten (ZeRO's buckets: reduce-scatters waited in the optimizer
region), where the gain was measured; sequence and context parallelism's reduce-scatters of
activations keep theirs. HCCL and NCCL groups keep their reduce-scatter; the compile driver
appends this pass where the mesh has a gloo axis (``MeshDesc.backends``). A reduce-scatter on a
group that is no axis of the mesh (this rank's index in it unknown) stays as it is.

In the measured ZeRO steps (``bench.step_time_dp``) the collective's own gain is within the step
time's noise on a 2-core machine; what the step shows is one bucket's bytes fewer allocated per
step, and with the chunk a view, one shard's bytes fewer again (docs/performance.md).
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.collectives import group_name_of, waits_of
from graph_ir.build import add_node
from graph_ir.meta import MODULE_PATH, Region, region_of

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ORIGIN = "gloo_reduce_scatter_as_all_reduce"


def gloo_reduce_scatters_as_all_reduces(graph: TrainGraph, mesh) -> int:
    """Rewrite every reduce-scatter on a gloo axis' group; returns how many."""
    rewritten = 0
    mode = graph.fake_mode()

    def add(target, args, like: torch.fx.Node) -> torch.fx.Node:
        return add_node(graph.graph, target, args, region=region_of(like), module_path=like.meta.get(MODULE_PATH, ""),
                        origin=ORIGIN, mode=mode)

    for node in list(graph.graph.nodes):
        if node.target is not c10d.reduce_scatter_tensor.default:
            continue
        x, op, _, name = node.args[:4]
        rank = mesh.rank_in_group(name)
        waits = waits_of(node)
        if mesh.backend_of_group(name) != "gloo" or rank is None or len(waits) != 1:
            continue
        (wait,) = waits
        if region_of(wait) != Region.OPTIMIZER:    # not a gradient's (sequence parallelism's activations)
            continue
        chunk = wait.meta["val"].shape[0]
        with graph.graph.inserting_before(node):
            reduced = add(c10d.all_reduce.default, (x, op, name), node)
        with graph.graph.inserting_before(wait):
            done = add(c10d.wait_tensor.default, (reduced,), wait)
            own = add(aten.slice.Tensor, (done, 0, rank * chunk, (rank + 1) * chunk), wait)
        wait.replace_all_uses_with(own)
        graph.graph.erase_node(wait)
        graph.graph.erase_node(node)
        rewritten += 1
    return rewritten


@register_pass("gloo_reduce_scatter_as_all_reduce", preserves=("state_bytes",))
def gloo_reduce_scatter_as_all_reduce_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Each reduce-scatter on a gloo group as an all-reduce and a copy of this rank's chunk."""
    mesh = ctx.mesh
    count = gloo_reduce_scatters_as_all_reduces(graph, mesh) if mesh is not None else 0
    ctx.stat("rewritten", count)
    return graph
