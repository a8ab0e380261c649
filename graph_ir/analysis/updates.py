"""Which inputs a graph updates: the parameters, buffers and optimizer state it returns as their
own new values, and which collectives distribute an update once it is made.

A lowering may write such an input in place (the graph returns the input itself, holding its
new contents); the passes that prepare it (``wait_for_reductions_first``,
``reuse_dead_operands``) and the lowerings ask here, so the rule is stated once.
"""
from __future__ import annotations

import torch.fx

from ..meta import GraphKind, Region, graph_kind, region_of
from ..signature import InputKind
from ..train_graph import TrainGraph
from .collectives import collective_kind, collective_of, is_communication_op

# Inputs the runtime owns and stores back after the step; the batch and hyperparameters are the user's.
UPDATABLE_KINDS = (InputKind.PARAM.value, InputKind.BUFFER.value, InputKind.OPT_STATE.value)
# Graphs whose updated inputs the runtime stores right after the call, with no other graph holding
# an older view of them in between (pipeline stages pass saved values between calls).
INPUT_WRITING_GRAPHS = (GraphKind.STEP, GraphKind.APPLY)


def updated_inputs(graph: TrainGraph) -> dict[torch.fx.Node, int]:
    """Placeholder -> index of the output that is its new value: a parameter, buffer or optimizer
    state a step or apply graph takes and returns."""
    if graph_kind(graph.attrs) not in INPUT_WRITING_GRAPHS:
        return {}
    outputs = {(s.kind, s.name): i for i, s in enumerate(graph.signature.outputs)}
    return {node: outputs[(spec.kind, spec.name)]
            for node, spec in zip(graph.placeholders(), graph.signature.inputs)
            if spec.kind in UPDATABLE_KINDS and (spec.kind, spec.name) in outputs}


def distributes_update(node: torch.fx.Node) -> bool:
    """Whether a communication node is an all-gather (or its wait) of values the optimizer computed:
    the one kind of collective that may follow a write of an input."""
    c = collective_of(node)
    return collective_kind(c) == "all_gather" and bool(c.all_input_nodes) and all(
        a.op == "call_function" and region_of(a) == Region.OPTIMIZER and not is_communication_op(a)
        for a in c.all_input_nodes)
