"""What each node of the whole step is to the split: copied wherever needed (free), or forward,
backward or optimizer computation placed on one stage."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.effects import may_duplicate
from graph_ir.meta import ACCUMULATOR_PREFIX, Region, region_of
from graph_ir.signature import InputKind, OutputKind, Spec, split_state_name


@dataclass
class _Nodes:
    graph: TrainGraph
    order: dict[torch.fx.Node, int]
    spec_of: dict[torch.fx.Node, Spec]                # placeholder -> its input spec
    owner: dict[torch.fx.Node, str]                   # staged placeholder -> parameter (or buffer) name
    free: set[torch.fx.Node]                          # copied wherever needed
    forward: list[torch.fx.Node]                      # non-free forward computation, in order
    backward: list[torch.fx.Node]
    optimizer: list[torch.fx.Node]
    outputs: list[tuple[Spec, object]] = field(default_factory=list)


def _owners(spec_of: dict[torch.fx.Node, Spec], graph: TrainGraph) -> dict[torch.fx.Node, str]:
    """Placeholders that live on one stage (parameters, updated buffers, their optimizer state and
    gradient accumulators) -> the parameter (or buffer) they belong to."""
    updated_buffers = {s.name for s in graph.signature.outputs if s.kind == OutputKind.BUFFER}
    owner: dict[torch.fx.Node, str] = {}
    for node, spec in spec_of.items():
        if spec.kind == InputKind.PARAM or (spec.kind == InputKind.BUFFER and spec.name in updated_buffers):
            owner[node] = spec.name
        elif spec.kind == InputKind.OPT_STATE:
            owner[node] = split_state_name(spec.name)[0]
        elif spec.kind == InputKind.STEP_STATE and spec.name.startswith(ACCUMULATOR_PREFIX):
            owner[node] = spec.name[len(ACCUMULATOR_PREFIX):]
    return owner


def _one_parameter_values(forward, params: set, ignored=frozenset()) -> dict[torch.fx.Node, torch.fx.Node]:
    """Forward values computed from one parameter alone (a cast; ZeRO-3's gather of its shard, the
    wait, the unpadding views) -> that parameter; ``forward`` in node order. Inputs in ``ignored``
    (values copied into every stage, such as a step-state flag) do not count."""
    source: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in forward:
        read = {a if a in params else source.get(a) for a in node.all_input_nodes if a not in ignored}
        if len(read) == 1 and None not in read:
            source[node] = read.pop()
    return source


def _classify(graph: TrainGraph) -> _Nodes:
    spec_of = dict(zip(graph.placeholders(), graph.signature.inputs))
    owner = _owners(spec_of, graph)
    free: set[torch.fx.Node] = set()
    forward, backward, optimizer = [], [], []
    order = {}
    for i, node in enumerate(graph.graph.nodes):
        order[node] = i
        if node.op == "get_attr":   # a constant (one the tensor_parallel rewrite traced): copied like one
            free.add(node)
            continue
        if node.op != "call_function":
            continue
        if may_duplicate(node) and all(a in free or (a.op == "placeholder" and a not in owner)
                                        for a in node.all_input_nodes):
            free.add(node)
            continue
        {Region.FORWARD: forward, Region.BACKWARD: backward, Region.OPTIMIZER: optimizer}.get(
            region_of(node), forward).append(node)
    nodes = _Nodes(graph, order, spec_of, owner, free, forward, backward, optimizer)
    nodes.outputs = list(zip(graph.signature.outputs, graph.output_values()))
    return nodes
