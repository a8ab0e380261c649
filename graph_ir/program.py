"""A Program: every graph one rank runs for a training step, and how they run.

Compiling a step produces a :class:`Program`, not one graph. It holds named
graphs, each a :class:`TrainGraph` whose ``attrs['kind']`` (:class:`GraphKind`)
says what it computes — the whole ``step``; the ``grad`` graph (per
microbatch) and the ``apply`` graph (per optimizer step) of gradient
accumulation; the forward, backward and apply graphs of each pipeline
stage. Beside the graphs:

- ``schedule``: which graph runs how often, in order (:class:`Run`);
- ``flows``: what one graph's output hands to another graph's input
  (:class:`Flow`), e.g. the gradient accumulators from ``grad`` to ``apply``;
- ``mesh``: the mesh description it was compiled for (its rank's view).

Where values live on the mesh is recorded on the graphs themselves
(:mod:`graph_ir.placement`). ``str(program)`` is its text form; the
verifier checks each graph by its kind and every flow's two ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from .meta import GraphAttr, GraphKind, describe_value, graph_kind
from .mesh import MeshDesc
from .placement import placements
from .signature import OutputKind, Spec
from .train_graph import TrainGraph

EVERY_STEP = "step"                 # once per optimizer step
EVERY_MICROBATCH = "microbatch"     # once per microbatch of an accumulating step


@dataclass(frozen=True)
class Run:
    graph: str
    every: str = EVERY_STEP


@dataclass(frozen=True)
class Flow:
    """``source``'s output ``output`` becomes ``target``'s input ``input`` (carried by the runtime)."""

    source: str
    output: Spec
    target: str
    input: Spec

    def __str__(self) -> str:
        return f"{self.source}.{self.output.kind}:{self.output.name} -> {self.target}.{self.input.kind}:{self.input.name}"


@dataclass
class Program:
    graphs: dict[str, TrainGraph]
    schedule: list[Run]
    mesh: MeshDesc = field(default_factory=MeshDesc.single)
    flows: list[Flow] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    # What compiling it did (set by the compile driver; not part of the program's meaning):
    # the captured graph, one record per pass run, the pass context with its cached analyses.
    captured: TrainGraph | None = field(default=None, repr=False, compare=False)
    records: list = field(default_factory=list, repr=False, compare=False)
    context: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of_step(cls, graph: TrainGraph, mesh: MeshDesc | None = None) -> "Program":
        """The program of one whole-step graph."""
        graph.attrs.setdefault(GraphAttr.KIND, GraphKind.STEP.value)
        return cls({"step": graph}, [Run("step")], mesh or MeshDesc.single())

    # -- reading --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[str, TrainGraph]]:
        return iter(self.graphs.items())

    def __getitem__(self, name: str) -> TrainGraph:
        if name not in self.graphs:
            raise KeyError(f"the program has no graph '{name}'; it has {', '.join(self.graphs)}")
        return self.graphs[name]

    def kind(self, name: str) -> GraphKind:
        return graph_kind(self.graphs[name].attrs)

    def of_kind(self, kind: GraphKind | str) -> list[str]:
        return [n for n, g in self.graphs.items() if graph_kind(g.attrs) == GraphKind(kind)]

    @property
    def main(self) -> TrainGraph:
        """The graph that computes the loss (the step, or the grad graph of an accumulating step)."""
        for graph in self.graphs.values():
            if any(s.kind == OutputKind.LOSS for s in graph.signature.outputs):
                return graph
        return next(iter(self.graphs.values()))

    def num_nodes(self) -> int:
        return sum(g.num_nodes() for g in self.graphs.values())

    def state_bytes(self) -> dict[str, Any]:
        """Per graph: this rank's parameter, gradient, optimizer-state and activation bytes."""
        from .analysis.memory import state_bytes
        if self.context is not None:
            return {n: self.context.analyses.get("state_bytes", g) for n, g in self.graphs.items()}
        return {n: state_bytes(g) for n, g in self.graphs.items()}

    def flows_between(self, source: str, target: str) -> list[Flow]:
        return [f for f in self.flows if f.source == source and f.target == target]

    def replace(self, name: str, new: dict[str, TrainGraph], schedule: list[Run], flows: list[Flow]) -> None:
        """Put ``new`` graphs where graph ``name`` was (in order), with their schedule entries and flows."""
        graphs: dict[str, TrainGraph] = {}
        for key, graph in self.graphs.items():
            if key == name:
                graphs.update(new)
            else:
                graphs[key] = graph
        runs: list[Run] = []
        for run in self.schedule:
            runs.extend(schedule if run.graph == name else [run])
        self.graphs, self.schedule = graphs, runs
        self.flows = [f for f in self.flows if name not in (f.source, f.target)] + list(flows)

    def copy(self) -> "Program":
        return Program({k: g.copy() for k, g in self.graphs.items()}, list(self.schedule), self.mesh,
                       list(self.flows), dict(self.attrs), self.captured, list(self.records), self.context)

    # -- checking -------------------------------------------------------------------------------
    def check_flows(self) -> list[str]:
        """Every flow names an existing output and input of the same shape and dtype."""
        problems = []
        for flow in self.flows:
            try:
                src, dst = self.graphs[flow.source], self.graphs[flow.target]
                out = src.output_values()[src.signature.output_index(flow.output.kind, flow.output.name)]
                inp = dst.input_node(flow.input.kind, flow.input.name)
            except (KeyError, ValueError) as exc:
                problems.append(f"flow {flow}: {exc}")
                continue
            a, b = getattr(out, "meta", {}).get("val"), inp.meta.get("val")
            if a is not None and b is not None and (a.shape != b.shape or a.dtype != b.dtype):
                problems.append(f"flow {flow}: {describe_value(a)} flows into an input of {describe_value(b)}")
        names = set(self.graphs)
        for run in self.schedule:
            if run.graph not in names:
                problems.append(f"the schedule runs graph '{run.graph}', which the program does not hold")
        return problems

    # -- text -----------------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"program for {self.mesh}"]
        every = {r.graph: r.every for r in self.schedule}
        for name, g in self.graphs.items():
            lines.append(f"  graph {name}: kind {graph_kind(g.attrs)}, {g.num_nodes()} nodes, "
                         f"{len(g.signature.inputs)} inputs, {len(g.signature.outputs)} outputs, "
                         f"runs once per {every.get(name, '?')}")
            placed = placements(g)
            sharded = {k: p for k, p in placed.items() if not p.is_replicated}
            if sharded:
                lines.append(f"    placements: {len(sharded)} sharded value(s), e.g. "
                             + "; ".join(f"{k} {p}" for k, p in list(sharded.items())[:3]))
        lines.append("  schedule: " + " -> ".join(f"{r.graph}(per {r.every})" for r in self.schedule))
        pairs: dict[tuple[str, str], int] = {}
        for f in self.flows:
            pairs[(f.source, f.target)] = pairs.get((f.source, f.target), 0) + 1
        for (src, dst), count in pairs.items():
            lines.append(f"  flow {src} -> {dst}: {count} value(s)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"mesh": self.mesh.to_json(),
                "graphs": {n: {"kind": str(graph_kind(g.attrs)), "name": g.name, "nodes": g.num_nodes(),
                               "signature": g.signature.to_json(),
                               "placements": g.attrs.get(GraphAttr.PLACEMENTS, {})}
                           for n, g in self.graphs.items()},
                "schedule": [{"graph": r.graph, "every": r.every} for r in self.schedule],
                "flows": [{"source": f.source, "output": f.output.to_json(), "target": f.target,
                           "input": f.input.to_json()} for f in self.flows],
                "attrs": self.attrs}
