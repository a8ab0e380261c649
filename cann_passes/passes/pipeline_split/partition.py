"""The stage of every node: the forward by unit boundaries, each parameter at the stage that reads it
first (its home), the optimizer by the state it reads and updates, the backward by dependence."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.fx

from graph_ir.analysis.memory import aliases_input
from graph_ir.meta import ACCUMULATOR_PREFIX, GraphAttr
from graph_ir.signature import InputKind, OutputKind, split_state_name

from ...pass_manager import PassOptionError
from .errors import PipelineSplitError
from .nodes import _Nodes, _one_parameter_values


def _forward_stages(nodes: _Nodes, starts: list[int]) -> dict[torch.fx.Node, int]:
    stage, s = {}, 0
    bounds = list(starts[1:]) + [len(nodes.forward)]
    for i, node in enumerate(nodes.forward):
        while i >= bounds[s]:
            s += 1
        stage[node] = s
    return stage


def _homes(nodes: _Nodes, fstage: dict[torch.fx.Node, int], last: int,
           strict: bool) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Parameter (and updated buffer) name -> the stage whose forward reads it first (its home), and
    the parameters read by the forward of several stages (tied weights) -> those stages."""
    readers: dict[str, set[int]] = {}
    for node, name in nodes.owner.items():
        stages = {fstage[u] for u in node.users if u in fstage}
        readers.setdefault(name, set()).update(stages)
    params = {spec.name for spec in nodes.spec_of.values() if spec.kind == InputKind.PARAM}
    homes, shared = {}, {}
    for name, stages in readers.items():
        if len(stages) > 1 and strict:
            if name not in params:
                raise PassOptionError("pipeline_split", "stages", f"buffer '{name}' is updated by the step and read by the forward of stages "
                                      f"{sorted(stages)} (rule: a buffer the step updates lives on one stage; cut "
                                      "so that its uses fall in one stage)")
            shared[name] = sorted(stages)
        homes[name] = min(stages) if stages else last
    return homes, shared


def upstream_stages(nodes: _Nodes, homes: dict[str, int], ordered: Iterable[torch.fx.Node],
                    elsewhere: Callable[[torch.fx.Node], Iterable[int]]) -> dict[torch.fx.Node, set[int]]:
    """Per optimizer node of ``ordered`` (in graph order): the stages whose values it reads, directly or
    through the optimizer nodes before it; an input neither staged nor optimizer gives ``elsewhere(input)``."""
    opt = set(nodes.optimizer)
    up: dict[torch.fx.Node, set[int]] = {}
    for node in ordered:
        s = set()
        for a in node.all_input_nodes:
            if a in nodes.owner:
                s.add(homes[nodes.owner[a]])
            elif a in opt:
                s |= up[a]
            else:
                s.update(elsewhere(a))
        up[node] = s
    return up


def _output_homes(nodes: _Nodes, homes: dict[str, int]) -> dict[torch.fx.Node, set[int]]:
    """Values the step outputs as a parameter's new state (its update, optimizer state, accumulated
    gradient) -> the homes of those parameters."""
    out_home: dict[torch.fx.Node, set[int]] = {}
    for spec, value in nodes.outputs:
        if isinstance(value, torch.fx.Node) and spec.kind in (OutputKind.PARAM, OutputKind.OPT_STATE,
                                                               OutputKind.STEP_STATE, OutputKind.BUFFER):
            name = spec.name
            if spec.kind == OutputKind.OPT_STATE:
                name = split_state_name(name)[0]
            elif spec.kind == OutputKind.STEP_STATE:
                if not name.startswith(ACCUMULATOR_PREFIX):
                    continue
                name = name[len(ACCUMULATOR_PREFIX):]
            if name in homes:
                out_home.setdefault(value, set()).add(homes[name])
    return out_home


def _place_optimizer(nodes: _Nodes, homes: dict[str, int], out_home: dict, stage: dict,
                     n_stages: int) -> list[torch.fx.Node]:
    """Optimizer nodes go to the stage of the state they read and of the outputs they feed; returns those
    that combine values of several stages."""
    # An accumulated gradient is read at its parameter's stage.
    up = upstream_stages(nodes, homes, nodes.optimizer, lambda a: out_home.get(a, ()))
    opt = set(nodes.optimizer)
    down: dict[torch.fx.Node, set[int]] = {}
    for node in reversed(nodes.optimizer):
        s = set(out_home.get(node, ()))
        for u in node.users:
            if u in opt:
                s |= down[u]
        down[node] = s
    mixed = []
    for node in nodes.optimizer:
        stages = up[node] | down[node]
        if len(stages) > 1:
            mixed.append(node)
        # What a node reads decides first: a gradient feeding a norm over every stage stays with its own.
        stage[node] = max(up[node] or down[node] or {n_stages - 1})
    return mixed


def _place_backward(nodes: _Nodes, homes: dict[str, int], fstage: dict, tied: set, out_home: dict,
                    stage: dict) -> None:
    """Backward nodes go to the lowest stage their readers and reads allow (users first); one reading
    only other backward values as late as its inputs allow, so a gradient crosses once, already summed."""
    back = set(nodes.backward)
    low: dict[torch.fx.Node, int] = {}
    pinned: set[torch.fx.Node] = set()
    for node in reversed(nodes.backward):
        bound = max(out_home.get(node, {0}))
        for u in node.users:
            if u in back:
                bound = max(bound, low[u])
            elif u in stage:
                bound = max(bound, stage[u])
        for a in node.all_input_nodes:
            if a in tied:
                continue
            if a in nodes.owner:
                bound = max(bound, homes[nodes.owner[a]])
                pinned.add(node)
            elif a in fstage:
                bound = max(bound, fstage[a])
                pinned.add(node)
        low[node] = bound
    for node in nodes.backward:
        preds = [stage[a] for a in node.all_input_nodes if a in back]
        # A view costs nothing and crossing it would send its base again: it stays with its readers.
        late = preds and node not in pinned and not aliases_input(node)
        stage[node] = max(low[node], min(preds)) if late else low[node]


def _check_backward_reads(nodes: _Nodes, homes: dict[str, int], tied: set, stage: dict) -> None:
    for node in nodes.backward:
        for a in node.all_input_nodes:
            if a in nodes.owner and a not in tied and homes[nodes.owner[a]] != stage[node]:
                raise PipelineSplitError(
                    f"backward node {node.name} ({node.target}) reads '{nodes.owner[a]}' of stage "
                    f"{homes[nodes.owner[a]]} but its gradient flow puts it in stage {stage[node]}")


def _assign(nodes: _Nodes, fstage: dict[torch.fx.Node, int], n_stages: int,
            strict: bool = True) -> tuple[dict, dict, dict, list]:
    """The stage of every non-free node (forward given), each parameter's home, the parameters several
    stages read (tied weights: each of those stages holds them) and the optimizer nodes that combine
    values of several stages (placed on the last of them for now; ``_reduce_over_stages`` rewrites
    them). Not ``strict`` (pricing units): a parameter read by several units counts in the first."""
    homes, shared = _homes(nodes, fstage, n_stages - 1, strict)
    # A tied weight read in backward (the head's input gradient) says nothing about the stage: each
    # stage holding it reads its own copy.
    tied = {node for node, name in nodes.owner.items()
            if name in shared and nodes.spec_of[node].kind == InputKind.PARAM}
    if nodes.graph.attrs.get(GraphAttr.ZERO, {}).get("stage") == 3:
        # (nor does its gathered value: each holding stage gathers its own, pipeline_split's copies)
        tied |= set(_one_parameter_values(nodes.forward, tied))
    stage = dict(fstage)
    out_home = _output_homes(nodes, homes)
    mixed = _place_optimizer(nodes, homes, out_home, stage, n_stages)
    _place_backward(nodes, homes, fstage, tied, out_home, stage)
    if strict:
        _check_backward_reads(nodes, homes, tied, stage)
    return stage, homes, shared, mixed
