"""Readable and runnable text of a TrainGraph.

``format_graph`` is FX's own generated Python with, on each line, the value's
shape and dtype, its region and its module path. ``to_python_module`` wraps
that code into a standalone file that runs: it rebuilds the GraphModule and,
if an inputs file lies beside it, runs the step on those inputs.
"""
from __future__ import annotations

import re

import torch.fx

from .meta import describe_value, module_path_of, region_of

_ASSIGN = re.compile(r"^(\s+)([A-Za-z_][A-Za-z0-9_]*) = (.*)$")
_REGION_ABBR = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "io": "io"}


def node_comment(node: torch.fx.Node) -> str:
    parts = [describe_value(node.meta.get("val")), _REGION_ABBR[str(region_of(node))]]
    if module_path_of(node):
        parts.append(module_path_of(node))
    for key in ("recompute", "sharding", "origin_pass"):
        if node.meta.get(key):
            parts.append(f"{key}={node.meta[key]}")
    return "  # " + " ".join(parts)


def annotated_code(gm: torch.fx.GraphModule) -> str:
    """The GraphModule's forward source with a comment on every assignment."""
    by_name = {n.name: n for n in gm.graph.nodes}
    lines = []
    for line in gm.code.strip("\n").splitlines():
        m = _ASSIGN.match(line)
        node = by_name.get(m.group(2)) if m else None
        if node is not None:
            # Drop FX's "x = None" frees: they say nothing to a reader.
            line = re.sub(r";\s+[A-Za-z0-9_ =]+ = None$", "", line)
            line += node_comment(node)
        lines.append(line)
    return "\n".join(lines)


def _signature_lines(tg) -> list[str]:
    lines = ["# inputs:"]
    for node, spec in zip(tg.placeholders(), tg.signature.inputs):
        lines.append(f"#   {node.name:<40} {spec.kind:<9} {spec.name}  {describe_value(node.meta.get('val'))}")
    lines.append("# outputs:")
    for i, spec in enumerate(tg.signature.outputs):
        lines.append(f"#   [{i}] {spec.kind:<9} {spec.name}")
    return lines


def format_graph(tg) -> str:
    header = [f"# TrainGraph {tg.name!r}: {tg.num_nodes()} nodes", *_signature_lines(tg)]
    return "\n".join(header) + "\n" + annotated_code(tg.gm) + "\n"


_RUNNER = '''

class Step(torch.nn.Module):
    """The graph above; constants (if any) are loaded from {constants!r} beside this file."""

    def __init__(self):
        super().__init__()
        constants_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), {constants!r})
        if os.path.exists(constants_file):
            for name, value in torch.load(constants_file, weights_only=True).items():
                self.register_buffer(name, value)

{forward}


def main(argv=None):
    """Run the step on the inputs saved beside this file and print the outputs' summary."""
    here = os.path.dirname(os.path.abspath(__file__))
    inputs_file = os.path.join(here, {inputs!r})
    if not os.path.exists(inputs_file):
        raise SystemExit(f"no inputs at {{inputs_file}}: dump with inputs to run this graph")
    saved = torch.load(inputs_file, weights_only=True)
    inputs = []
    for kind, name in INPUT_SPECS:
        key = f"{{kind}}:{{name}}"
        if key in saved:
            inputs.append(saved[key])
        elif name in STEP_STATE:  # state a pass added: starts from its declared value
            inputs.append(torch.full(STEP_STATE[name].get("shape", []), STEP_STATE[name]["value"],
                                     dtype=getattr(torch, STEP_STATE[name].get("dtype", "float32"))))
        else:
            raise SystemExit(f"{{inputs_file}} has no value for input {{key}}")
    outputs = Step()(*inputs)
    if LOSS_INDEX is not None:
        print("loss", float(outputs[LOSS_INDEX]))
    else:  # a graph without a loss (the apply graph of accumulation): what it updated
        print("outputs", len(outputs), "first", OUTPUT_SPECS[0] if OUTPUT_SPECS else None,
              "sum", float(outputs[0].double().sum()) if outputs else None)
    return outputs


if __name__ == "__main__":
    main()
'''


def to_python_module(tg, *, inputs_file: str = "inputs.pt", constants_file: str = "constants.pt") -> str:
    """A standalone Python file whose ``Step`` module computes this graph."""
    forward = "\n".join("    " + line if line else line for line in annotated_code(tg.gm).splitlines())
    head = [f'"""TrainGraph {tg.name!r} ({tg.num_nodes()} nodes). Run it: python THIS_FILE.py"""',
            *_signature_lines(tg),
            "import os", "", "import torch", "import torch.fx",
            "from torch import device, inf, nan  # noqa: F401  (used by generated code)",
            "import torch.fx._pytree as fx_pytree  # noqa: F401",
            "import torch.utils._pytree as pytree  # noqa: F401",
            "import operator  # noqa: F401", "",
            f"INPUT_SPECS = {[(s.kind, s.name) for s in tg.signature.inputs]!r}",
            f"STEP_STATE = {tg.attrs.get('step_state', {})!r}",
            f"OUTPUT_SPECS = {[(s.kind, s.name) for s in tg.signature.outputs]!r}",
            f"LOSS_INDEX = {next((i for i, s in enumerate(tg.signature.outputs) if s.kind == 'loss'), None)!r}"]
    body = _RUNNER.format(forward=forward, inputs=inputs_file, constants=constants_file)
    return "\n".join(head) + "\n" + body
