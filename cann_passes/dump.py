"""Dumps of every graph a pipeline produces, into one directory.

Layout (``NNN`` is the pass's position; ``000`` is the captured graph)::

    DIR/pipeline.txt            the pipeline text: re-run it with --pipeline
    DIR/passes.json             one record per pass (time, changed, node/op deltas, stats)
    DIR/inputs.pt               the step's inputs at the first step, keyed "kind:name", so dumps run
    DIR/NNN_<pass>.py           readable, runnable code of the graph after the pass
    DIR/NNN_<pass>.json         every node: op, inputs, value, region, module path, cost
    DIR/NNN_<pass>.constants.pt graph constants, where the graph has any

The dump tool (``tools/graph_dump``) reads this layout; it adds diffs, Graphviz
and the HTML page on top.
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
                costs: dict | None = None) -> str:
    """``costs`` (node name -> NodeCost), when the caller has them, spares recomputing them."""
    os.makedirs(os.path.dirname(os.path.join(directory, stem)), exist_ok=True)
    constants_name = f"{os.path.basename(stem)}.constants.pt"
    with open(os.path.join(directory, f"{stem}.py"), "w", encoding="utf-8") as f:
        f.write(to_python_module(tg, constants_file=constants_name))
    data = to_json(tg, costs=costs)
    if extra:
        data.update(extra)
    with open(os.path.join(directory, f"{stem}.json"), "w", encoding="utf-8") as f:
        write_json(data, f)
    constants = _constants(tg)
    if constants and not any(t.is_meta or is_fake(t) for t in constants.values()):
        torch.save(constants, os.path.join(directory, constants_name))
    return os.path.join(directory, stem)


def write_reproducer(directory: str, tg, pass_text: str, index: int, *, plan: dict | None = None) -> str:
    """The graph a failing pass was given, the one-pass pipeline that fails on it, and the plan
    (passes read options such as ``autocast_overrides`` from it)."""
    path = os.path.join(directory, f"reproducer_{index:03d}")
    write_graph(path, "input", tg)
    with open(os.path.join(path, "pipeline.txt"), "w", encoding="utf-8") as f:
        f.write(pass_text + "\n")
    if plan is not None:
        with open(os.path.join(path, "plan.json"), "w", encoding="utf-8") as f:
            json.dump(plan, f, indent=1, default=str)
    return path


class DumpWriter:
    def __init__(self, directory: str, pipeline_text: str, *, graph_name: str = "step"):
        self.directory = directory
        self.graph_name = graph_name
        self.records: list[dict] = []
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "pipeline.txt"), "w", encoding="utf-8") as f:
            f.write(pipeline_text + "\n")

    def _stem(self, index: int, name: str) -> str:
        prefix = "" if self.graph_name == "step" else f"{self.graph_name}/"
        return f"{prefix}{index:03d}_{name}"

    def _costs(self, analyses, tg) -> dict:
        return analyses.get("cost", tg).per_node

    def _extra(self, analyses, tg) -> dict:
        memory = analyses.get("memory", tg)
        cost = analyses.get("cost", tg)
        return {"memory": memory.to_json(), "flops": cost.total_flops,
                "flops_by_region": cost.flops_by_region}

    def write_capture(self, tg, analyses, inputs: list[torch.Tensor] | None = None) -> None:
        write_graph(self.directory, self._stem(0, "capture"), tg, extra=self._extra(analyses, tg),
                    costs=self._costs(analyses, tg))
        if inputs is not None and not any(t.is_meta or is_fake(t) for t in inputs):
            # Keyed by "kind:name" so that graphs whose passes reordered or added
            # inputs still find theirs.
            named = {f"{s.kind}:{s.name}": t.detach().clone() for s, t in zip(tg.signature.inputs, inputs)}
            torch.save(named, os.path.join(self.directory, "inputs.pt"))
        self.records.append({"index": 0, "name": "capture", "spec": "capture", "seconds": 0.0,
                             "changed": True, "nodes_before": 0, "nodes_after": tg.num_nodes(),
                             "ops_added": {}, "ops_removed": {}, "stats": {}})
        self._write_records()

    def write_pass(self, record, tg, ctx) -> None:
        write_graph(self.directory, self._stem(record.index, record.name), tg,
                    extra=self._extra(ctx.analyses, tg) | {"explain": ctx.explain.get(record.name)},
                    costs=self._costs(ctx.analyses, tg))
        self.records.append(record.to_json())
        self._write_records()

    def _write_records(self) -> None:
        with open(os.path.join(self.directory, "passes.json"), "w", encoding="utf-8") as f:
            json.dump(self.records, f, indent=1, default=str)
