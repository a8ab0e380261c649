"""grad_accumulation: make the step accumulate gradients over microbatches.

The rewrite gives every trainable parameter a runtime-owned accumulator
(step state ``grad_accumulation:<param>``, zeros at the start of an optimizer
step) and two scalars, ``grad_accumulation:weight`` (the microbatch's sample
count) and ``grad_accumulation:scale`` (1 / samples of the optimizer step):

    backward:   acc = acc_in + weight * grad          -> step-state output
    optimizer:  reads scale * acc as the gradient

Run whole with ``acc_in = 0, weight = scale * samples = 1`` it is the original
step. The ``split_grad_apply`` pass cuts it at the optimizer region into a "grad"
graph, run once per microbatch, and an "apply" graph, run once per optimizer step; because
``data_parallel`` and ``optimizer_shard`` see the ``grad_accumulation`` mark
and synchronize the optimizer's gradients at the start of the optimizer
region, gradients cross ranks once per optimizer step, not per microbatch.
The pass must therefore run before those two.

``weight=seed`` weights the backward seed instead (``acc = acc_in + grad`` of ``weight * loss``):
needed where a parameter's gradient sums terms from other ranks' losses (expert parallelism's
all-to-all sends each expert the rows of every rank in its group), which the rank's own weight
must not scale when the ranks' microbatches differ in size (``target``: chosen at run time).
``gradient`` keeps the gradients bitwise those of the unweighted backward, scaled after.

``microbatches`` (static: the runtime splits each batch in that many) and
``target`` (dynamic: samples per optimizer step, chosen at run time) are
recorded for the runtime; the graph is the same for both.
"""
from __future__ import annotations

import torch

from graph_ir import TrainGraph
from graph_ir.analysis.gradients import GradientNotFound, backward_seed
from graph_ir.meta import (ACCUMULATION_SCALE, ACCUMULATION_WEIGHT, ACCUMULATOR_PREFIX,
                           GraphAttr, Region, region_of)
from graph_ir.signature import InputKind, OutputKind, Spec

from ..pass_manager import PassContext, register_pass
from ._distributed import (GRADIENT_OF, DistributedRewriteError, NodeBuilder, after, aten, first_node_of,
                           gradients, position_map, redirect, scalar_step_state)

# The step-state names are graph_ir vocabulary: the runtime sets and carries them too.
WEIGHT, SCALE, ACCUMULATOR = ACCUMULATION_WEIGHT, ACCUMULATION_SCALE, ACCUMULATOR_PREFIX


def _accumulator(tg: TrainGraph, name: str, grad: torch.fx.Node) -> torch.fx.Node:
    val = grad.meta["val"]
    tg.attrs.setdefault(GraphAttr.STEP_STATE, {})[ACCUMULATOR + name] = {
        "value": 0.0, "dtype": str(val.dtype).removeprefix("torch."), "shape": list(val.shape)}
    with tg.fake_mode():
        value = torch.empty(val.shape, dtype=val.dtype, device=val.device)
    return tg.add_input(Spec(InputKind.STEP_STATE, ACCUMULATOR + name), value)


@register_pass("grad_accumulation", preserves=())
def grad_accumulation_pass(graph: TrainGraph, ctx: PassContext, *, microbatches: int = 1,
                           target: int = 0, weight: str = "gradient") -> TrainGraph:
    """Accumulate sample-weighted gradients in step state; the optimizer reads their scaled sum."""
    if microbatches < 1 or target < 0:
        raise DistributedRewriteError(f"grad_accumulation options microbatches={microbatches} (>= 1) "
                                      f"and target={target} (>= 0, 0 = static) are out of range")
    if weight not in ("gradient", "seed"):
        raise DistributedRewriteError(f"grad_accumulation option weight={weight!r}: must be 'gradient' "
                                      "(scale each gradient) or 'seed' (scale the backward seed)")
    if weight == "gradient" and target and GraphAttr.EXPERT_PARALLEL in graph.attrs:
        raise DistributedRewriteError(
            "grad_accumulation option weight='gradient' with target > 0 on an expert-parallel step: an "
            "expert's gradient sums the losses of every rank of its group, whose microbatch sizes differ "
            "at run time, so this rank's weight cannot scale it (rule: use weight=seed)")
    if any(k in graph.attrs for k in (GraphAttr.DATA_PARALLEL, GraphAttr.ZERO, GraphAttr.GRAD_ACCUMULATION)):
        raise DistributedRewriteError("grad_accumulation must run before data_parallel and optimizer_shard "
                                      "(rule: gradients are synchronized once per optimizer step), and once")
    grads = gradients(graph)
    position = position_map(graph)
    loss = graph.output_value(OutputKind.LOSS, "loss")
    weight_in = scalar_step_state(graph, WEIGHT, loss.meta["val"])
    scale = scalar_step_state(graph, SCALE, loss.meta["val"])
    optimizer_start = first_node_of(graph, Region.OPTIMIZER)
    if weight == "seed":
        try:
            seed = backward_seed(graph)
        except GradientNotFound as exc:
            raise DistributedRewriteError(f"grad_accumulation weight=seed needs {exc}") from None
        users = list(seed.users)
        build = NodeBuilder(graph, after(seed), Region.BACKWARD, "grad_accumulation")
        weighted = build(aten.mul.Tensor, seed, weight_in)
        for user in users:
            user.replace_input_with(seed, weighted)
    for name in sorted(grads, key=lambda n: position[grads[n]]):
        grad = grads[name]
        readers = [u for u in grad.users if region_of(u) == Region.OPTIMIZER]
        acc_in = _accumulator(graph, name, grad)
        build = NodeBuilder(graph, after(grad), region_of(grad), "grad_accumulation")
        acc = build(aten.add.Tensor, acc_in, grad if weight == "seed" else build(aten.mul.Tensor, grad, weight_in))
        graph.add_output(Spec(OutputKind.STEP_STATE, ACCUMULATOR + name), acc)
        # All scaled gradients come before any update, so a later pass can gather them into
        # buckets and synchronize each before its first reader.
        scaled = NodeBuilder(graph, optimizer_start, Region.OPTIMIZER, "grad_accumulation")(
            aten.mul.Tensor, acc, scale)
        redirect(grad, scaled, readers)
        grad.meta.pop(GRADIENT_OF, None)
        scaled.meta[GRADIENT_OF] = name
    graph.attrs[GraphAttr.GRAD_ACCUMULATION] = {"microbatches": microbatches, "target": target, "weight": weight}
    ctx.stat("accumulators", len(grads))
    return graph
