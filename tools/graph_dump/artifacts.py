"""Per-pass files the tool adds to a dump directory: ``NNN_<pass>.diff``, ``.dot`` and ``.svg``.

The diff is of the runnable ``.py`` dumps (line numbers are theirs), whose
lines are FX's generated code annotated with shape, region and module path.
FX keeps a node's name for its whole life, so a pass that touches ten nodes
shows as ten changed lines, and a pass that changed nothing leaves an empty
diff.
"""
from __future__ import annotations

import difflib
import logging
import os
import shutil
import subprocess
import time

from .dumpdir import DumpDir, PassDump, input_names, short_target

log = logging.getLogger("cann_graph_dump")

# A training step is hard on dot: parameters read by forward and optimizer, and
# activations saved for backward, are edges spanning the whole graph, and dot
# lays out one virtual node per rank they cross. 1,800 nodes of GPT take dot
# over 10 CPU-seconds even with the cheap layout below; 1,000 take about 2.
# Bigger graphs get the .dot only.
SVG_MAX_NODES = 1200
SVG_TIMEOUT_S = 20.0      # per graph
SVG_BUDGET_S = 40.0       # all graphs of a dump together
# Cheaper layout: straight edges, a short crossing minimisation, short simplex searches.
_FAST_LAYOUT = ["-Gsplines=false", "-Gmclimit=0.01", "-Gremincross=false", "-Gnslimit=0.2",
                "-Gnslimit1=0.2", "-Gsearchsize=5"]
_REGION_COLOURS = {"forward": "#dbeafe", "backward": "#fde68a", "optimizer": "#d1fae5", "io": "#e5e7eb"}


def comparable_code(p: PassDump) -> str:
    """The ``.py`` dump with its one pass-specific line, the constants file's name, made neutral."""
    return p.code.replace(f"'{p.stem}.constants.pt'", "'NNN_<pass>.constants.pt'")


def unified_diff(before: PassDump, after: PassDump) -> str:
    a, b = comparable_code(before), comparable_code(after)
    if a == b:
        return ""
    return "".join(difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True),
                                        fromfile=before.stem + ".py", tofile=after.stem + ".py", n=3))


def write_diffs(dump: DumpDir) -> dict[str, str]:
    """``NNN_<pass>.diff`` against the previous pass, for every pass after the capture."""
    diffs = {}
    for before, after in zip(dump.passes, dump.passes[1:]):
        text = unified_diff(before, after)
        with open(after.path(".diff"), "w", encoding="utf-8") as f:
            f.write(text)
        diffs[after.stem] = text
    return diffs


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(p: PassDump) -> str:
    lines = [f"digraph {_quote(p.stem)} {{", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
    for node in p.nodes:
        target = node["target"] if node["op"] == "call_function" else node["op"]
        label = f"{node['name']}\n{short_target(target)}\n{node.get('type', '')}"
        if node.get("module_path"):
            label += f"\n{node['module_path']}"
        colour = _REGION_COLOURS.get(node.get("region") or "io", "#ffffff")
        lines.append(f"  {_quote(node['name'])} [label={_quote(label)}, fillcolor={_quote(colour)}];")
    for node in p.nodes:
        for source in dict.fromkeys(input_names(node)):
            lines.append(f"  {_quote(source)} -> {_quote(node['name'])};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_file: str, svg_file: str, *, timeout: float = SVG_TIMEOUT_S) -> bool:
    """Graphviz's SVG of ``dot_file``; False (and no file) when ``dot`` is missing, fails or is too slow."""
    dot = shutil.which("dot")
    if dot is None:
        return False
    try:
        subprocess.run([dot, "-Tsvg", *_FAST_LAYOUT, dot_file, "-o", svg_file], check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return True
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("no SVG for %s: %s", dot_file, exc)
        if os.path.exists(svg_file):
            os.remove(svg_file)
        return False


def write_graphviz(dump: DumpDir, *, svg: bool = True, max_nodes: int = SVG_MAX_NODES,
                   budget: float = SVG_BUDGET_S) -> list[str]:
    """``NNN_<pass>.dot`` for every pass, and its ``.svg`` where small enough and time allows.

    Returns the SVGs made. Rendering stops once ``budget`` seconds are spent, so
    a slow layout never holds up the dump.
    """
    made, previous = [], None
    deadline = time.monotonic() + budget
    for p in dump.passes:
        text = to_dot(p)
        with open(p.path(".dot"), "w", encoding="utf-8") as f:
            f.write(text)
        body = text.split("\n", 1)[1]   # without the graph's name, which is the pass's
        if svg and len(p.nodes) < max_nodes:
            if previous is not None and previous[0] == body:   # unchanged graph: same picture
                shutil.copyfile(previous[1], p.path(".svg"))
                made.append(p.path(".svg"))
            elif time.monotonic() < deadline:
                if render_svg(p.path(".dot"), p.path(".svg"), timeout=min(SVG_TIMEOUT_S, deadline - time.monotonic())):
                    made.append(p.path(".svg"))
                    previous = (body, p.path(".svg"))
                else:   # too slow (or failing): a graph as big will be too
                    max_nodes = min(max_nodes, len(p.nodes))
    return made
