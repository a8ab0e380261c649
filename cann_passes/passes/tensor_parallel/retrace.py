"""Re-tracing the captured step with every input a DTensor: one per-rank aten graph."""
from __future__ import annotations

import contextlib

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from graph_ir import TrainGraph
from graph_ir.analysis.gradients import GradientNotFound, find_gradients
from graph_ir.meta import REGION
from graph_ir.signature import InputKind

from .layouts import ParamLayout, layout_for
from .placements import dtensor_placement, local_shape
from .rewriter import Rewriter, weight_nodes


def retrace(graph: TrainGraph, layouts: dict[str, ParamLayout], mesh, *, sequence_parallel: bool,
            vocab_parallel_loss: bool) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.fx.experimental.proxy_tensor import make_fx

    in_place = [dtensor_placement(layout_for(spec, layouts)) for spec in graph.signature.inputs]
    out_place = [dtensor_placement(layout_for(spec, layouts)) for spec in graph.signature.outputs]
    origins = _origins(graph, layouts)
    values = [n.meta["val"] for n in graph.placeholders()]
    grad_places, whole_grads = _gradient_placements(graph, layouts)
    weights = weight_nodes(graph)

    def step(*local):
        wrapped = [DTensor.from_local(t, mesh, [p], run_check=False, shape=v.shape, stride=v.stride())
                   if isinstance(v, torch.Tensor) else t for t, p, v in zip(local, in_place, values)]
        with implicit_replication():
            outs = Rewriter(graph.gm, mesh, sequence_parallel=sequence_parallel, origins=origins,
                            grad_places=grad_places, weights=weights, whole_grads=whole_grads).run(*wrapped)
        return [o.redistribute(mesh, [p]).to_local() if isinstance(o, DTensor) else o
                for o, p in zip(outs, out_place)]

    with FakeTensorMode(allow_non_fake_inputs=True):
        local_inputs = [torch.empty(local_shape(v.shape, p, mesh.size(0)), dtype=v.dtype, device=v.device)
                        if isinstance(v, torch.Tensor) else v for v, p in zip(values, in_place)]
    # A lazy GraphModule, as the pass manager's copies are: the code is generated when the graph runs,
    # not after each pass that follows.
    with torch.no_grad(), fx_traceback.preserve_node_meta(), _one_collective_per_layout(), \
            (loss_parallel() if vocab_parallel_loss else contextlib.nullcontext()), _use_lazy_graph_module(True):
        return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*local_inputs)


def _gradient_placements(graph: TrainGraph, layouts: dict[str, ParamLayout]) -> tuple[dict, set]:
    """Gradient node -> its parameter's placement, for each parameter split in one block per rank
    (a per-part shard's gradient is left to DTensor); and the gradient nodes of the parameters
    left whole (gathered where backward yields them split)."""
    try:
        grads = find_gradients(graph, mark=False)
    except GradientNotFound:
        grads = {}
    placed = {node: dtensor_placement(layouts[name]) for name, node in grads.items()
              if layouts.get(name) is not None and layouts[name].dim is not None and layouts[name].parts == 1}
    whole = {node for name, node in grads.items() if layouts.get(name) is not None and layouts[name].dim is None}
    return placed, whole


def _origins(graph: TrainGraph, layouts: dict[str, ParamLayout]) -> dict:
    """Node -> the nearest split parameter it derives from (for error messages): the fewest ops
    away, so a projection's output names its weight, not the embedding its input came from."""
    origin, distance = {}, {}
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        if spec.kind == InputKind.PARAM and layouts[spec.name].dim is not None:
            origin[node], distance[node] = spec.name, 0
    for node in graph.graph.nodes:
        if node not in origin:
            near = min((a for a in node.all_input_nodes if a in origin), key=distance.__getitem__, default=None)
            if near is not None:
                origin[node], distance[node] = origin[near], distance[near] + 1
    return origin


@contextlib.contextmanager
def _one_collective_per_layout():
    """One redistribution per (value, layout): a forward value read again in backward is not reduced twice."""
    import torch.distributed.tensor._dispatch as dispatch
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import Replicate, Shard

    original = redistribute.redistribute_local_tensor
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def cached(local, current_spec, target_spec, *args, **kwargs):
        # A shard gathered in forward is gathered again where backward reads it (Megatron's
        # sequence parallelism): keeping the forward's whole copy would undo the shard's saving.
        gathered = any(isinstance(a, Shard) for a in current_spec.placements) and \
            all(isinstance(b, Replicate) for b in target_spec.placements)
        region = ((fx_traceback.get_current_meta() or {}).get("custom") or {}).get(REGION) if gathered else None
        key = (id(local), tuple(current_spec.placements), tuple(target_spec.placements),
               tuple(target_spec.shape), region)
        if key not in cache:
            # The local tensor is kept with its result so its id is not reused while the cache lives.
            cache[key] = (local, original(local, current_spec, target_spec, *args, **kwargs))
        return cache[key][1]

    dispatch.redistribute_local_tensor = redistribute.redistribute_local_tensor = cached
    try:
        yield
    finally:
        dispatch.redistribute_local_tensor = redistribute.redistribute_local_tensor = original
