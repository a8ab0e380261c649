"""What a compiled step holds, read from its program: parameter, gradient and optimizer-state bytes.

The totals are the compiler's own per-rank accounting (``Program.state_bytes``:
graph inputs by kind, and the values each optimizer update reads as its
gradient); this adds the split the fine-tuning report needs — trainable
against frozen parameters — and which parameters own gradients and state.
A frozen weight has a gradient buffer or optimizer state only if the graph
really computes or reads one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from graph_ir.analysis.gradients import GradientNotFound, find_gradients
from graph_ir.meta import nbytes
from graph_ir.signature import InputKind, OutputKind


@dataclass
class StepStateBytes:
    trainable_param_bytes: int
    frozen_param_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int                                     # forward values backward reads
    trainable: list[str] = field(default_factory=list)        # parameters the program updates
    optimizer_state: list[str] = field(default_factory=list)  # opt_state inputs, "<param>:<key>"
    gradient_shapes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def model_state_bytes(self) -> int:
        return self.trainable_param_bytes + self.frozen_param_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def to_json(self) -> dict:
        return dict(asdict(self), model_state_bytes=self.model_state_bytes)


def _updating_graph(program):
    """The graph that applies the optimizer (the step, or the apply graph when accumulating)."""
    for graph in program.graphs.values():
        if any(s.kind == OutputKind.PARAM for s in graph.signature.outputs):
            return graph
    raise ValueError(f"no graph of the program updates parameters ({', '.join(program.graphs)})")


def step_state_bytes(program) -> StepStateBytes:
    """This rank's bytes of one compiled program (``step.last.program``), by what they hold."""
    graph = _updating_graph(program)
    totals = program.state_bytes()
    name = next(n for n, g in program.graphs.items() if g is graph)
    activations = sum(s.activations for s in totals.values())
    updated = {s.name for s in graph.signature.outputs if s.kind == OutputKind.PARAM}
    trainable_b = frozen_b = 0
    states = []
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        if spec.kind == InputKind.PARAM:
            if spec.name in updated:
                trainable_b += nbytes(node.meta.get("val"))
            else:
                frozen_b += nbytes(node.meta.get("val"))
        elif spec.kind == InputKind.OPT_STATE:
            states.append(spec.name)
    try:
        shapes = [tuple(g.meta["val"].shape) for g in find_gradients(graph, mark=False).values()]
    except GradientNotFound:
        shapes = []
    return StepStateBytes(trainable_b, frozen_b, totals[name].grads, totals[name].optimizer_state, activations,
                          sorted(updated), states, shapes)
