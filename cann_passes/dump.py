"""Dumps of every graph a pipeline produces, into one directory.

Layout (``NNN`` is the pass's position; ``000`` is the captured graph)::

    DIR/pipeline.txt            the pipeline text: re-run it with --pipeline
    DIR/passes.json             one record per pass (time, changed, node/op deltas, stats)
    DIR/inputs.pt               the step's inputs at the first step, keyed "kind:name", so dumps run
    DIR/NNN_<pass>.py           readable, runnable code of the graph after the pass
    DIR/NNN_<pass>.json         every node: op, inputs, value, region, module path, cost
    DIR/NNN_<pass>.constants.pt graph constants, where the graph has any
    DIR/program.txt, .json      the compiled Program: its graphs, schedule, flows, placements
    DIR/simulation.json         this rank's memory by term and step time on the plan's device profile
                                (written by the planning layer, cann_passes.figures.write_simulation)
    DIR/<graph>/...             the same files for each further graph of the program (the grad
                                and apply graphs of accumulation), from the pass that made it on;
                                they run on DIR/inputs.pt

The whole-step graph dumps at the top, so a directory of a one-graph program
reads as before; each graph a split creates has its own subdirectory, itself
a dump directory. The dump tool (``tools/graph_dump``) reads this layout; it
adds diffs, Graphviz and the HTML page on top.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from graph_ir.meta import is_fake
from graph_ir.printer import to_python_module
from graph_ir.serialize import to_json

ENV_VAR = "CANN_PASSES_DUMP"


def dump_dir_from(plan_dir: str | None) -> str | None:
    """The plan's dump directory, else the one named by $CANN_PASSES_DUMP."""
    return plan_dir or os.environ.get(ENV_VAR) or None


def _constants(tg) -> dict[str, torch.Tensor]:
    out = {}
    for node in tg.graph.nodes:
        if node.op == "get_attr":
            value = getattr(tg.gm, node.target)
            if isinstance(value, torch.Tensor):
                out[node.target] = value.detach().clone() if not value.is_meta else value
    return out


def write_json(data: dict, f) -> None:
    """``data`` as JSON with one list item (one node) per line.

    Greppable and diffable, and written by json's C encoder: an indented
    ``json.dump`` of a 13k-node graph takes seconds in the pure-Python encoder.
    """
    f.write("{\n")
    for i, (key, value) in enumerate(data.items()):
        f.write(",\n" if i else "")
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            f.write(f" {json.dumps(key)}: [\n  ")
            f.write(",\n  ".join(json.dumps(v) for v in value))
            f.write("\n ]")
        else:
            f.write(f" {json.dumps(key)}: {json.dumps(value)}")
    f.write("\n}\n")


def write_graph(directory: str, stem: str, tg, *, extra: dict[str, Any] | None = None,
                costs: dict | None = None, inputs_file: str = "inputs.pt") -> str:
    """``costs`` (node name -> NodeCost), when the caller has them, spares recomputing them."""
    os.makedirs(os.path.dirname(os.path.join(directory, stem)), exist_ok=True)
    constants_name = f"{os.path.basename(stem)}.constants.pt"
    with open(os.path.join(directory, f"{stem}.py"), "w", encoding="utf-8") as f:
        f.write(to_python_module(tg, constants_file=constants_name, inputs_file=inputs_file))
    data = to_json(tg, costs=costs)
    if extra:
        data.update(extra)
    with open(os.path.join(directory, f"{stem}.json"), "w", encoding="utf-8") as f:
        write_json(data, f)
    constants = _constants(tg)
    if constants and not any(t.is_meta or is_fake(t) for t in constants.values()):
        torch.save(constants, os.path.join(directory, constants_name))
    return os.path.join(directory, stem)


def write_reproducer(directory: str, tg, pass_text: str, index: int, pass_fn=None) -> str:
    """The graph a failing pass was given and the one-pass pipeline that fails on it: nothing
    else, since a pass reads only its graph, its options and the mesh (in the graph's attrs).
    ``pass.json`` says where the pass is defined, so a replay in another process can register a
    user's pass before running it."""
    import inspect
    path = os.path.join(directory, f"reproducer_{index:03d}")
    write_graph(path, "input", tg)
    with open(os.path.join(path, "pipeline.txt"), "w", encoding="utf-8") as f:
        f.write(pass_text + "\n")
    if pass_fn is not None:
        try:
            source = os.path.abspath(inspect.getfile(pass_fn))
        except (TypeError, OSError):
            source = None
        with open(os.path.join(path, "pass.json"), "w", encoding="utf-8") as f:
            json.dump({"module": getattr(pass_fn, "__module__", None), "file": source}, f)
    return path


class DumpWriter:
    def __init__(self, directory: str, pipeline_text: str, *, graph_name: str = "step"):
        self.directory = directory
        self.graph_name = graph_name          # the graph that dumps at the top of the directory
        self.records: dict[str, list[dict]] = {}
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "pipeline.txt"), "w", encoding="utf-8") as f:
            f.write(pipeline_text + "\n")

    def graph_directory(self, graph: str) -> str:
        return self.directory if graph == self.graph_name else os.path.join(self.directory, graph)

    def _costs(self, analyses, tg) -> dict:
        return analyses.get("cost", tg).per_node

    def _extra(self, analyses, tg) -> dict:
        memory = analyses.get("memory", tg)
        cost = analyses.get("cost", tg)
        return {"memory": memory.to_json(), "flops": cost.total_flops,
                "flops_by_region": cost.flops_by_region, "state_bytes": analyses.get("state_bytes", tg).to_json()}

    def _write(self, graph: str, index: int, name: str, tg, analyses, extra: dict | None = None) -> None:
        top = graph == self.graph_name
        write_graph(self.graph_directory(graph), f"{index:03d}_{name}", tg,
                    extra=self._extra(analyses, tg) | (extra or {}), costs=self._costs(analyses, tg),
                    inputs_file="inputs.pt" if top else os.path.join("..", "inputs.pt"))

    def write_capture(self, tg, analyses, inputs: list[torch.Tensor] | None = None) -> None:
        self._write(self.graph_name, 0, "capture", tg, analyses)
        if inputs is not None and not any(t.is_meta or is_fake(t) for t in inputs):
            # Keyed by "kind:name" so that graphs whose passes reordered or added
            # inputs still find theirs.
            named = {f"{s.kind}:{s.name}": t.detach().clone() for s, t in zip(tg.signature.inputs, inputs)}
            torch.save(named, os.path.join(self.directory, "inputs.pt"))
        self.records[self.graph_name] = [{
            "index": 0, "name": "capture", "spec": "capture", "seconds": 0.0, "changed": True,
            "nodes_before": 0, "nodes_after": tg.num_nodes(), "ops_added": {}, "ops_removed": {}, "stats": {},
            "graph": self.graph_name}]
        self._write_records(self.graph_name)

    def write_pass(self, record, tg, ctx, graph: str | None = None) -> None:
        graph = graph or self.graph_name
        self._write(graph, record.index, record.name, tg, ctx.analyses, {"explain": record.explanation})
        self.records.setdefault(graph, []).append(record.to_json())
        self._write_records(graph)

    def write_program_pass(self, record, program, ctx) -> None:
        """A program pass (a split): every graph of the program it returned, each in its directory."""
        for name, tg in program.graphs.items():
            self._write(name, record.index, record.name, tg, ctx.analyses, {"explain": record.explanation})
            self.records.setdefault(name, []).append(dict(record.to_json(), graph=name,
                                                          nodes_after=tg.num_nodes()))
            self._write_records(name)
        self.write_program(program)

    def write_program(self, program) -> None:
        with open(os.path.join(self.directory, "program.txt"), "w", encoding="utf-8") as f:
            f.write(str(program) + "\n")
        with open(os.path.join(self.directory, "program.json"), "w", encoding="utf-8") as f:
            json.dump(program.to_json() | {"directories": {
                n: os.path.relpath(self.graph_directory(n), self.directory) for n in program.graphs}},
                f, indent=1, default=str)

    def _write_records(self, graph: str) -> None:
        directory = self.graph_directory(graph)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "passes.json"), "w", encoding="utf-8") as f:
            json.dump(self.records[graph], f, indent=1, default=str)
