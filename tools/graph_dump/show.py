"""``cann-graph-dump show``: one pass's graph, or one module's nodes, as text in the terminal."""
from __future__ import annotations

import difflib

from .dumpdir import DumpDir, DumpError, PassDump, short_target

_REGION_ABBR = {"forward": "fwd", "backward": "bwd", "optimizer": "opt", "io": "io"}


def format_arg(arg) -> str:
    if isinstance(arg, dict):
        (kind, value), = arg.items()
        if kind == "node":
            return value
        if kind in ("list", "tuple"):
            inner = ", ".join(format_arg(v) for v in value)
            return f"[{inner}]" if kind == "list" else f"({inner}{',' if len(value) == 1 else ''})"
        if kind == "dtype":
            return f"torch.{value}"
        return str(value)
    return repr(arg)


def format_node(node: dict) -> str:
    if node["op"] == "placeholder":
        call = "input"
    elif node["op"] == "output":
        args = node["args"]
        call = "return " + format_arg(args["tuple"][0] if isinstance(args, dict) and args.get("tuple") else args)
    else:
        args = node["args"]["tuple"] if isinstance(args := node["args"], dict) and "tuple" in args else []
        parts = [format_arg(a) for a in args] + [f"{k}={format_arg(v)}" for k, v in node["kwargs"].items()]
        call = f"{short_target(node['target'])}({', '.join(parts)})"
    notes = [node.get("type", ""), _REGION_ABBR.get(node.get("region") or "io", "?")]
    if node.get("module_path"):
        notes.append(node["module_path"])
    notes += [f"{k}={node[k]}" for k in ("recompute", "sharding", "origin_pass") if node.get(k)]
    return f"{node['name']} = {call}  # {' '.join(notes)}"


def in_module(path: str, prefix: str) -> bool:
    """``layers.1`` holds ``layers.1`` and ``layers.1.attn``, not ``layers.10``."""
    return path == prefix or path.startswith(prefix + ".")


def module_nodes(p: PassDump, prefix: str) -> list[dict]:
    nodes = [n for n in p.nodes if in_module(n.get("module_path") or "", prefix)]
    if not nodes:
        paths = sorted({n.get("module_path") or "" for n in p.nodes} - {""})
        close = difflib.get_close_matches(prefix, paths, n=5, cutoff=0.5) or paths[:5]
        raise DumpError(f"no node of module '{prefix}' in {p.stem}; module paths look like: {', '.join(close)}")
    return nodes


def show(directory: str, pass_name: str | None = None, module: str | None = None) -> str:
    dump = DumpDir(directory)
    p = dump.find(pass_name)
    nodes = module_nodes(p, module) if module else p.nodes
    m = p.metrics()
    what = f"module {module}: {len(nodes)} of {m['nodes']} nodes" if module else f"{m['nodes']} nodes"
    header = (f"# {p.stem} ({p.spec}): {what}; peak {m['peak_bytes']:,} B, saved {m['saved_bytes']:,} B, "
              f"{m['flops']:,} FLOPs, comm {m['comm_bytes']:,} B")
    return "\n".join([header, *(format_node(n) for n in nodes)]) + "\n"
