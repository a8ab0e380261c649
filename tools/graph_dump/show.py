"""``cann-graph-dump show``: one pass's graph, or one module's nodes and its own figures, as text in the
terminal."""
from __future__ import annotations

import difflib

from .dumpdir import DumpDir, DumpError, PassDump, collective_bytes, collective_kind, short_target, value_bytes

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


def module_figures(p: PassDump, nodes: list[dict]) -> dict:
    """A module's own figures, summed over its nodes from what the dump recorded per node.

    ``saved_bytes`` counts the buffers in the graph's saved-for-backward set that the module's
    nodes allocate, sized as the memory analysis sizes them (a multi-output node's items own its
    bytes); it is None where the dump predates ``saved_values``. A module has no peak of its own:
    the peak is of everything live at one point of the step, so only the whole graph has one.
    """
    names = {n["name"] for n in nodes}
    by_name = {n["name"]: n for n in p.nodes}
    flops_by_region: dict[str, int] = {}
    for n in nodes:
        region = n.get("region") or "io"
        flops_by_region[region] = flops_by_region.get(region, 0) + (n.get("cost") or {}).get("flops", 0)
    saved = p.memory.get("saved_values")
    saved_bytes = None if saved is None else sum(
        value_bytes(by_name[name]["value"]) for name in saved
        if name in names and isinstance(by_name[name].get("value"), dict))
    return {"nodes": len(nodes), "flops": sum(flops_by_region.values()), "flops_by_region": flops_by_region,
            "bytes": sum((n.get("cost") or {}).get("bytes", 0) for n in nodes), "saved_bytes": saved_bytes,
            "comm_bytes": sum(collective_bytes(n, by_name) for n in nodes if collective_kind(n)),
            "has_cost": any("cost" in n for n in p.nodes)}


def _module_line(module: str, f: dict) -> str:
    if f["has_cost"]:
        regions = ", ".join(f"{_REGION_ABBR.get(r, r)} {v:,}" for r, v in f["flops_by_region"].items() if v)
        cost = f"{f['flops']:,} FLOPs{f' ({regions})' if regions else ''}, {f['bytes']:,} B read+written"
    else:
        cost = "FLOPs and bytes not recorded per node in this dump"
    saved = ("saved for backward not recorded in this dump" if f["saved_bytes"] is None
             else f"{f['saved_bytes']:,} B saved for backward")
    return f"# module {module} with its submodules: {cost}, {saved}, comm {f['comm_bytes']:,} B"


def show(directory: str, pass_name: str | None = None, module: str | None = None) -> str:
    dump = DumpDir(directory)
    p = dump.find(pass_name)
    m = p.metrics()
    whole = (f"peak {m['peak_bytes']:,} B, saved {m['saved_bytes']:,} B, {m['flops']:,} FLOPs, "
             f"comm {m['comm_bytes']:,} B")
    if not module:
        return "\n".join([f"# {p.stem} ({p.spec}): {m['nodes']} nodes; {whole}",
                          *(format_node(n) for n in p.nodes)]) + "\n"
    nodes = module_nodes(p, module)
    header = [f"# {p.stem} ({p.spec}): module {module}: {len(nodes)} of {m['nodes']} nodes",
              _module_line(module, module_figures(p, nodes)),
              f"# whole graph, not the module's (a peak is the whole step's): {whole}"]
    return "\n".join([*header, *(format_node(n) for n in nodes)]) + "\n"
