"""Which value each parameter's optimizer update reads as its gradient.

Read from the graph's semantics, not from names: the gradient of a trainable
parameter is the one value its optimizer subgraph (the optimizer-region
ancestors of its updated output) reads from outside the optimizer region
that is not a graph input and is floating point (a boolean flag such as loss
scaling's overflow check is read too, but is no gradient). Passes that move a gradient (accumulation, a
reduce-scatter that leaves each rank a shard) re-mark the node the update now
reads with ``meta[GRADIENT_OF]``, and marks win while the update still reads them.
Capture marks every gradient first, so that ``cleanup`` keeps each parameter's
its own value (two equal gradient computations are not merged).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.fx

from ..meta import GRADIENT_OF, Region, region_of
from ..signature import OutputKind


class GradientNotFound(ValueError):
    pass


def backward_seed(tg) -> torch.fx.Node:
    """The ``ones_like(loss)`` that starts the backward: scaling it scales every gradient,
    including the parts a parameter receives from other ranks' losses through a collective."""
    loss = tg.output_value(OutputKind.LOSS, "loss")
    seeds = [u for u in loss.users if u.target == torch.ops.aten.ones_like.default
             and region_of(u) == Region.BACKWARD]
    if len(seeds) != 1:
        raise GradientNotFound(f"the backward seed ones_like(loss) in the backward region: found {len(seeds)} "
                               "(was the step captured by capture_train_step?)")
    return seeds[0]


def optimizer_ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    seen, stack, out = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function" or region_of(n) != Region.OPTIMIZER:
            continue
        seen.add(n)
        out.append(n)
        stack.extend(n.all_input_nodes)
    return out


def _floating(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    # Without a recorded value the node cannot be excluded: keep it, the count check decides.
    return not isinstance(val, torch.Tensor) or val.is_floating_point()


def find_gradients(tg, *, mark: bool = True) -> dict[str, torch.fx.Node]:
    """Trainable parameter name -> the value its optimizer update reads as its gradient."""
    # A mark is kept only while the optimizer still reads its node: a pass that recomputed the
    # value elsewhere (autocast's matmul in fp16, cast back to fp32 for the update) leaves the mark
    # on a node the update no longer reads, and the analysis below finds the one it does.
    marked, stale = {}, {}
    for n in tg.graph.nodes:
        if GRADIENT_OF in n.meta:
            read = any(region_of(u) == Region.OPTIMIZER for u in n.users)
            (marked if read else stale)[n.meta[GRADIENT_OF]] = n
    outputs = tg.output_values()
    found: dict[str, torch.fx.Node] = {}
    for i, spec in tg.signature.outputs_of(OutputKind.PARAM):
        if spec.name in marked:
            found[spec.name] = marked[spec.name]
            continue
        # A gradient is floating point: a flag an update selects on (loss_scale's ``found_inf``,
        # a bool read by every ``where(found_inf, old, new)``) is not one.
        reads = {a for n in optimizer_ancestors(outputs[i]) for a in n.all_input_nodes
                 if a.op != "placeholder" and region_of(a) != Region.OPTIMIZER and _floating(a)}
        if len(reads) != 1:
            raise GradientNotFound(
                f"cannot find the gradient of '{spec.name}': its optimizer update reads "
                f"{len(reads)} computed values from outside the optimizer region "
                f"({sorted(a.name for a in reads)}); expected exactly one")
        found[spec.name] = reads.pop()
        if mark:
            found[spec.name].meta[GRADIENT_OF] = spec.name
            if spec.name in stale and stale[spec.name] is not found[spec.name]:
                stale[spec.name].meta.pop(GRADIENT_OF, None)
    return found


def optimizer_subgraph(tg, names: Iterable[str]) -> list[torch.fx.Node]:
    """Optimizer-region nodes computing the given parameters' and their state's outputs, in order."""
    wanted = set(names)
    outputs = tg.output_values()
    roots = [outputs[i] for i, s in enumerate(tg.signature.outputs)
             if (s.kind == OutputKind.PARAM and s.name in wanted)
             or (s.kind == OutputKind.OPT_STATE and s.name.rpartition(":")[0] in wanted)]
    members = {n for r in roots for n in optimizer_ancestors(r)}
    return [n for n in tg.graph.nodes if n in members]
