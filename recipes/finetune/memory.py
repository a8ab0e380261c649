"""What a compiled step holds, read from its graph: parameter, gradient and optimizer-state bytes.

Read from the graph's signature and dataflow, not from the model: a gradient
is a value the backward region produces and the optimizer region reads, so a
frozen weight has a gradient buffer only if the graph really computes one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from graph_ir.analysis.memory import buffer_bytes, storage_roots
from graph_ir.meta import Region, nbytes, region_of
from graph_ir.signature import InputKind, OutputKind


@dataclass
class StateBytes:
    trainable_param_bytes: int
    frozen_param_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    trainable: list[str] = field(default_factory=list)       # parameters the graph updates
    optimizer_state: list[str] = field(default_factory=list)  # opt_state inputs, "<param>:<key>"
    gradient_shapes: list[tuple[int, ...]] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def gradient_values(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The buffers backward writes that the optimizer reads (one per updated parameter)."""
    root = storage_roots(graph)
    grads: dict[torch.fx.Node, None] = {}
    for node in graph.nodes:
        if node.op != "call_function" or region_of(node) != Region.OPTIMIZER:
            continue
        for arg in node.all_input_nodes:
            base = root[arg]
            if base.op == "call_function" and region_of(base) == Region.BACKWARD:
                grads[base] = None
    return list(grads)


def state_bytes(train_graph) -> StateBytes:
    """Bytes of parameters (trainable / frozen), gradients and optimizer state in one step graph."""
    sig = train_graph.signature
    updated = {s.name for s in sig.outputs if s.kind == OutputKind.PARAM}
    trainable_b = frozen_b = state_b = 0
    states = []
    for spec, node in zip(sig.inputs, train_graph.placeholders()):
        size = nbytes(node.meta.get("val"))
        if spec.kind == InputKind.PARAM:
            if spec.name in updated:
                trainable_b += size
            else:
                frozen_b += size
        elif spec.kind == InputKind.OPT_STATE:
            state_b += size
            states.append(spec.name)
    grads = gradient_values(train_graph.graph)
    return StateBytes(trainable_b, frozen_b, sum(buffer_bytes(g) for g in grads), state_b,
                      sorted(updated), states, [tuple(g.meta["val"].shape) for g in grads])
