"""The verifier: what every TrainGraph must satisfy after every pass.

Rules (each failure names the node and the rule):
- FX well-formedness (``Graph.lint``: defined-before-use, one output).
- The signature has one position per placeholder and per output value, and
  an updated parameter or optimizer state keeps its input's shape and dtype.
- Every computing node has a fake value, a known region and a module path.
- Regions flow forward: a forward node reads no backward or optimizer value,
  and a backward node reads no optimizer value.
- Each graph is checked by its kind (``attrs['kind']``, :class:`GraphKind`):
  a step, a microbatch's grad graph and torch.compile's halves have exactly
  one loss; an apply graph has none and no forward or backward node; a grad
  graph has no optimizer node.
- With ``deep=True``: fake-tensor propagation from the inputs reproduces every
  node's recorded shape and dtype (catches a pass that edited a node but not
  its metadata). It costs about a millisecond per node.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.fx

from .build import propagate_fake_values
from .meta import MODULE_PATH, REGION, GraphAttr, GraphKind, Region, describe_value, expected_losses, graph_kind
from .serialize import value_matches
from .signature import InputKind, OutputKind
from .train_graph import TrainGraph, lazy_graph_module

_ORDER = {Region.IO: -1, Region.FORWARD: 0, Region.BACKWARD: 1, Region.OPTIMIZER: 2}
_BY_VALUE = {r.value: r for r in Region}


class VerificationError(ValueError):
    def __init__(self, graph_name: str, problems: list[str]):
        self.problems = problems
        shown = "\n  - ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"graph {graph_name!r} fails verification:\n  - {shown}{more}")


# Regions a graph of each kind may compute in (None: any).
_REGIONS_OF_KIND = {GraphKind.GRAD: {Region.FORWARD, Region.BACKWARD},
                    GraphKind.APPLY: {Region.OPTIMIZER}}


def _check_signature(tg: TrainGraph) -> list[str]:
    problems = list(tg.signature.check(losses=expected_losses(tg.attrs)))
    placeholders, outputs = tg.placeholders(), tg.output_values()
    if len(placeholders) != len(tg.signature.inputs):
        problems.append(f"{len(placeholders)} placeholders but the signature names "
                        f"{len(tg.signature.inputs)} inputs")
    if len(outputs) != len(tg.signature.outputs):
        problems.append(f"{len(outputs)} outputs but the signature names {len(tg.signature.outputs)}")
    if problems:
        return problems
    if tg.attrs.get(GraphAttr.SHARDED_STATE):
        return problems
    # One index of the inputs: a list search per output is quadratic on a 7B-shaped step.
    index: dict[tuple[str, str], int] = {}
    for j, spec in enumerate(tg.signature.inputs):
        index.setdefault((spec.kind, spec.name), j)
    pairs = [(OutputKind.PARAM, InputKind.PARAM), (OutputKind.OPT_STATE, InputKind.OPT_STATE),
             (OutputKind.BUFFER, InputKind.BUFFER)]
    for out_kind, in_kind in pairs:
        for i, spec in tg.signature.outputs_of(out_kind):
            j = index.get((in_kind, spec.name))
            if j is None:
                continue  # per-rank graphs may output state they were not given (sharded)
            out_val = outputs[i].meta.get("val") if isinstance(outputs[i], torch.fx.Node) else None
            in_val = placeholders[j].meta.get("val")
            if out_val is not None and in_val is not None and not value_matches(out_val, in_val):
                problems.append(f"output {spec.kind} '{spec.name}' is {describe_value(out_val)} but "
                                f"its input is {describe_value(in_val)} (rule: updates keep shape and dtype)")
    return problems


def _check_nodes(tg: TrainGraph) -> list[str]:
    problems = []
    try:
        kind = graph_kind(tg.attrs)
    except ValueError:
        return [f"graph kind {tg.attrs.get(GraphAttr.KIND)!r} is not one of {[k.value for k in GraphKind]}"]
    allowed = _REGIONS_OF_KIND.get(kind)
    for node in tg.graph.nodes:
        if node.op in ("output",):
            continue
        if "val" not in node.meta:
            problems.append(f"node {node.name} ({node.target}) has no fake value (meta['val'])")
        if node.op != "call_function":
            continue
        try:
            region = _BY_VALUE.get(node.meta.get(REGION)) or Region(node.meta.get(REGION))
        except ValueError:
            problems.append(f"node {node.name} has region {node.meta.get(REGION)!r}; "
                            f"expected one of {[r.value for r in Region]}")
            continue
        if allowed is not None and region not in allowed:
            problems.append(f"node {node.name} is in region {region.value}, which a {kind.value} graph "
                            f"does not compute (rule: {kind.value} graphs hold only "
                            f"{', '.join(sorted(r.value for r in allowed))})")
        if not isinstance(node.meta.get(MODULE_PATH, ""), str):
            problems.append(f"node {node.name} has a non-string module path")
        for arg in node.all_input_nodes:
            value = arg.meta.get(REGION, Region.IO.value)
            arg_region = _BY_VALUE.get(value) or Region(value)   # a dict lookup: every edge is read
            if _ORDER[arg_region] > _ORDER[region]:
                problems.append(f"node {node.name} ({region.value}) reads {arg.name} "
                                f"({arg_region.value}): regions must flow forward -> backward -> optimizer")
    return problems


def _check_values(tg: TrainGraph) -> list[str]:
    gm = lazy_graph_module(tg.gm, copy.deepcopy(tg.graph))
    recorded = {n.name: n.meta.get("val") for n in tg.graph.nodes}
    inputs = [node.meta["val"] for node in tg.placeholders()]
    try:
        propagate_fake_values(gm, inputs)
    except Exception as exc:  # the graph cannot even run on fake tensors
        return [f"fake-tensor propagation fails: {type(exc).__name__}: {exc}"]
    problems = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or recorded.get(node.name) is None:
            continue
        if not value_matches(node.meta.get("val"), recorded[node.name]):
            problems.append(f"node {node.name} ({node.target}) records {describe_value(recorded[node.name])} "
                            f"but computes {describe_value(node.meta.get('val'))}")
    return problems


def verify(tg: TrainGraph, *, deep: bool = False, nodes: bool = True) -> None:
    """Raise VerificationError listing every rule the graph breaks. ``nodes=False`` skips FX's lint
    and the per-node rules: for a graph whose nodes, arguments, tags and values (``TrainGraph.state``)
    and kind passed them as they are now."""
    problems = []
    if nodes:
        try:
            tg.graph.lint()
        except Exception as exc:
            problems.append(f"FX lint: {exc}")
    problems += _check_signature(tg)
    if nodes:
        problems += _check_nodes(tg)
    if deep and not problems:
        problems += _check_values(tg)
    if problems:
        raise VerificationError(tg.name, problems)


def verify_program(program, *, deep: bool | Callable[[TrainGraph], bool] = False,
                   nodes: Callable[[TrainGraph], bool] | None = None) -> None:
    """Every graph by its kind, then the program's flows and schedule. ``deep``: for every graph,
    or those for which it answers true; ``nodes``: which graphs get the node rules (all by default)."""
    for graph in program.graphs.values():
        verify(graph, deep=deep(graph) if callable(deep) else deep, nodes=True if nodes is None else nodes(graph))
    problems = program.check_flows()
    if problems:
        raise VerificationError("program", problems)
