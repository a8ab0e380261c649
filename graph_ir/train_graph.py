"""The training-graph IR: one aten-level FX graph of a whole step, plus its signature.

A :class:`TrainGraph` is deliberately thin: the graph is a plain
``torch.fx.GraphModule`` (so torch's own tools — FakeTensorProp, the
partitioner, inductor — work on it unchanged) and everything specific to
training lives in the signature and in ``node.meta`` keys from
:mod:`graph_ir.meta`. A compiled step may hold several of these (one per
pipeline stage or per rank); ``attrs`` says which one this is.
"""
from __future__ import annotations

import copy
import hashlib
from typing import Any, Iterator

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .meta import MODULE_PATH, REGION, Region, is_fake, region_of
from .signature import Spec, StepSignature


def lazy_graph_module(root, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule that generates its Python code only when it is run or its code is read.

    torch's ``_LazyGraphModule`` (what inductor uses for the same reason): passes edit the
    graph and the pass manager marks it for recompilation after each one; generating and
    ``compile()``-ing the code of a 7B-shaped step costs about a second, and only the final
    graph is ever run.
    """
    return _LazyGraphModule(root, graph)


class TrainGraph:
    def __init__(self, gm: torch.fx.GraphModule, signature: StepSignature,
                 attrs: dict[str, Any] | None = None):
        self.gm = gm
        self.signature = signature
        # Free-form facts about this graph: its name, the tracing mode, and for
        # per-rank or per-stage graphs their rank/stage. JSON-serializable values only.
        self.attrs: dict[str, Any] = dict(attrs or {})
        # Bumped by the pass manager whenever a pass changes the graph; analyses
        # are cached against it.
        self.version = 0

    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    @property
    def name(self) -> str:
        return self.attrs.get("name", "step")

    def placeholders(self) -> list[torch.fx.Node]:
        # FX indexes nodes by op: no walk over a 24k-node graph per lookup.
        return list(self.graph.find_nodes(op="placeholder", sort=True))

    def output_node(self) -> torch.fx.Node:
        return self.graph.output_node()

    def output_values(self) -> list[torch.fx.Node]:
        return list(self.output_node().args[0])

    def input_node(self, kind: str, name: str) -> torch.fx.Node:
        return self.placeholders()[self.signature.input_index(kind, name)]

    def output_value(self, kind: str, name: str) -> torch.fx.Node:
        return self.output_values()[self.signature.output_index(kind, name)]

    def set_outputs(self, values: list[torch.fx.Node]) -> None:
        out = self.output_node()
        out.args = (list(values),)

    def fake_mode(self):
        """The FakeTensorMode the graph's values live in (to make values for new nodes).

        The first fake input's mode: every value of one graph lives in one mode, and asking
        torch's ``detect_fake_mode`` over all inputs per new node is quadratic on a 7B graph."""
        for node in self.placeholders():
            val = node.meta.get("val")
            if is_fake(val):
                return val.fake_mode
        return None

    def add_input(self, spec: Spec, value: torch.Tensor, name: str | None = None) -> torch.fx.Node:
        """Append an input (placeholder + signature position) whose value looks like ``value``."""
        if spec in self.signature.inputs:
            raise ValueError(f"graph {self.name!r} already has an input {spec.kind} '{spec.name}'")
        last = self.placeholders()[-1] if self.placeholders() else None
        ctx = self.graph.inserting_after(last) if last is not None else self.graph.inserting_before()
        with ctx:
            node = self.graph.placeholder(name or "".join(c if c.isalnum() else "_" for c in
                                                           f"{spec.kind}_{spec.name}"))
        mode = self.fake_mode()
        node.meta["val"] = mode.from_tensor(value) if mode is not None and not is_fake(value) else value
        node.meta[REGION] = Region.IO.value
        self.signature.inputs.append(spec)
        return node

    def add_output(self, spec: Spec, value: torch.fx.Node) -> None:
        if spec in self.signature.outputs:
            raise ValueError(f"graph {self.name!r} already has an output {spec.kind} '{spec.name}'")
        self.set_outputs(self.output_values() + [value])
        self.signature.outputs.append(spec)

    def compute_nodes(self, region: Region | None = None) -> Iterator[torch.fx.Node]:
        for node in self.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if region is None or region_of(node) == region:
                yield node

    def recompile(self) -> None:
        self.gm.recompile()

    def copy(self) -> "TrainGraph":
        """A structural copy: new graph and nodes, shared constants and fake values."""
        new_graph = torch.fx.Graph(tracer_cls=self.graph._tracer_cls)
        output_value, old_output = new_graph.graph_copy(self.graph, {}, return_output_node=True)
        new_graph._codegen = copy.deepcopy(self.graph._codegen)
        new_graph.output(output_value).meta = copy.copy(old_output.meta)
        gm = lazy_graph_module(self.gm, new_graph)
        clone = TrainGraph(gm, copy.deepcopy(self.signature), copy.deepcopy(self.attrs))
        clone.version = self.version
        return clone

    def fingerprint(self) -> str:
        """A hash of the graph's structure, its region/module tags and its node values' shapes."""
        # Each node as name, op, target and arguments (a node argument reads as its name),
        # hashed in one update: ``Node.format_node`` says the same for about five times the time.
        parts, names = [], {}
        for node in self.graph.nodes:
            val = node.meta.get("val")
            shape = f"{val.dtype}{tuple(val.shape)}" if isinstance(val, torch.Tensor) else ""
            target = names.get(node.target)
            if target is None:
                target = names[node.target] = str(node.target)
            parts.append(f"{node.name}={node.op}:{target}{node.args!r}{node.kwargs!r}"
                         f"|{node.meta.get(REGION)}|{node.meta.get(MODULE_PATH) or ''}|{shape}")
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()

    def state(self) -> "GraphState":
        """What the graph is now, to tell within this process whether it has changed since.

        Its nodes in order (by identity), each with its name, target, arguments, region and
        module-path tags and fake value (by identity): an edit changes one of these, as a new fake
        value is a new object. Nothing is formatted, so this costs a tenth of :meth:`fingerprint`,
        which says the same across processes.
        """
        key, values = [], []
        for node in self.graph.nodes:
            meta = node.meta
            val = meta.get("val")
            values.append(val)
            key.append((node, node.name, node.target, node.args, node.kwargs, meta.get(REGION),
                        meta.get(MODULE_PATH), id(val)))
        return GraphState(key, values)

    def num_nodes(self) -> int:
        return len(self.graph.nodes)

    def __repr__(self) -> str:
        return (f"TrainGraph({self.name!r}, nodes={self.num_nodes()}, "
                f"inputs={len(self.signature.inputs)}, outputs={len(self.signature.outputs)})")

    def __str__(self) -> str:
        from .printer import format_graph
        return format_graph(self)


class GraphState:
    """:meth:`TrainGraph.state`: equal when the graph is unchanged. It holds the fake values it
    names by identity, so no other object can take their ids while it is kept."""

    __slots__ = ("_key", "_values")

    def __init__(self, key: list, values: list):
        self._key, self._values = key, values

    def __eq__(self, other: object) -> bool:
        try:
            return isinstance(other, GraphState) and self._key == other._key
        except Exception:  # an argument whose == is not a bool (a tensor): take it as changed
            return False

    __hash__ = None   # compared, never a dict key: it holds the graph's nodes and arguments
