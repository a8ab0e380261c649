"""JSON form of a TrainGraph: every node with its op, inputs, value, region and module path.

The JSON is loadable: ``from_json`` rebuilds a runnable TrainGraph (targets
resolved by name in ``torch.ops``, fake values recomputed by FakeTensorProp),
so a dump from one machine can be inspected or re-run on another. Tensor
constants are not embedded; graphs that hold them record their names and
shapes, and loading asks for them.
"""
from __future__ import annotations

import builtins
import json
import math
import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .build import propagate_fake_values
from .meta import (DTYPES_BY_NAME, MODULE_PATH, ORIGIN_PASS, RECOMPUTE, REGION, REUSES_OPERAND, SHARDING,
                   describe_value, tensors_of)
from .signature import StepSignature
from .train_graph import TrainGraph, lazy_graph_module

FORMAT_VERSION = 1
_DTYPES = DTYPES_BY_NAME


def target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if isinstance(target, str):
        return target
    return f"{target.__module__}.{target.__qualname__}"


def resolve_target(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    if module in ("_operator", "operator"):
        return getattr(operator, attr)
    if module == "builtins":
        return getattr(builtins, attr)
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _encode(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return {"node": arg.name}
    if isinstance(arg, (list, tuple)):
        return {"tuple" if isinstance(arg, tuple) else "list": [_encode(a) for a in arg]}
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).replace("torch.", "")}
    if isinstance(arg, torch.device):
        return {"device": str(arg)}
    if isinstance(arg, (torch.memory_format, torch.layout)):
        return {"torch": str(arg).replace("torch.", "")}
    if isinstance(arg, float) and not math.isfinite(arg):
        return {"float": repr(arg)}
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    raise TypeError(f"cannot serialize argument {arg!r} of type {type(arg).__name__}")


def _decode(obj: Any, nodes: dict[str, torch.fx.Node]) -> Any:
    if not isinstance(obj, dict):
        return obj
    (kind, value), = obj.items()
    if kind == "node":
        return nodes[value]
    if kind in ("list", "tuple"):
        items = [_decode(v, nodes) for v in value]
        return tuple(items) if kind == "tuple" else items
    if kind == "dtype":
        return _DTYPES[value]
    if kind == "device":
        return torch.device(value)
    if kind == "torch":
        return getattr(torch, value)
    if kind == "float":
        return float(value)
    raise ValueError(f"unknown encoded argument kind {kind!r}")


def _value_json(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return {"shape": list(val.shape), "dtype": str(val.dtype).replace("torch.", "")}
    if isinstance(val, (list, tuple)):
        return [_value_json(v) for v in val]
    return None


def node_json(node: torch.fx.Node, cost=None) -> dict:
    data = {"name": node.name, "op": node.op, "target": target_name(node.target),
            "args": _encode(node.args), "kwargs": {k: _encode(v) for k, v in node.kwargs.items()},
            "value": _value_json(node.meta.get("val")), "type": describe_value(node.meta.get("val")),
            "region": node.meta.get(REGION), "module_path": node.meta.get(MODULE_PATH, ""),
            "users": [u.name for u in node.users]}
    for key in (RECOMPUTE, SHARDING, ORIGIN_PASS, REUSES_OPERAND):
        if key in node.meta:
            data[key] = node.meta[key]
    if cost is not None:
        data["cost"] = {"flops": cost.flops, "bytes": cost.bytes, "matmul": cost.matmul}
    return data


def _layout_json(val: Any) -> Any:
    """A value's whole layout (shape, strides, dtype, device), or a plain Python scalar."""
    if isinstance(val, torch.Tensor):
        return {"shape": list(val.shape), "stride": list(val.stride()),
                "dtype": str(val.dtype).replace("torch.", ""), "device": str(val.device)}
    if isinstance(val, (list, tuple)):
        return {"seq": [_layout_json(v) for v in val], "tuple": isinstance(val, tuple)}
    if val is None or isinstance(val, (bool, int, float)) and not isinstance(val, torch.SymInt):
        return {"scalar": val} if not (isinstance(val, float) and not math.isfinite(val)) else None
    return None


def _fake_from_layout(data: Any, mode: FakeTensorMode) -> Any:
    if data is None:
        return None
    if "scalar" in data:
        return data["scalar"]
    if "seq" in data:
        items = [_fake_from_layout(v, mode) for v in data["seq"]]
        return tuple(items) if data["tuple"] else items
    # A meta tensor of the recorded layout wrapped as a fake one: what FakeTensorMode makes for an
    # op's output, without dispatching an op per node.
    # (No memo entry: nothing converts these meta tensors again.)
    meta = torch.empty_strided(data["shape"], data["stride"], dtype=_DTYPES[data["dtype"]], device="meta")
    return FakeTensor(mode, meta, torch.device(data["device"]))


def _plain_meta(node: torch.fx.Node) -> dict:
    """The node's metadata that JSON holds as it is (region, module path, recompute marks, ...)."""
    out = {}
    for key, value in node.meta.items():
        if key in ("val", "stack_trace", "tensor_meta"):
            continue
        try:
            if json.loads(json.dumps(value)) == value:
                out[key] = value
        except (TypeError, ValueError):
            continue
    return out


def to_json(tg: TrainGraph, *, with_cost: bool = True, costs: dict | None = None,
            layouts: bool = False) -> dict:
    """``costs`` (node name -> NodeCost, e.g. ``graph_cost(...).per_node``) spares recomputing them.

    ``layouts`` also records every value's strides and device and all JSON-held metadata, so
    that ``from_json(..., recorded_values=True)`` rebuilds the graph exactly without re-running
    fake tensors over it (what the compile cache stores)."""
    if with_cost:
        from .analysis.cost import node_cost
        known = costs or {}
        costs = {n: known[n.name] if n.name in known else node_cost(n) for n in tg.graph.nodes}
    else:
        costs = None
    constants = {n.target: _value_json(getattr(tg.gm, n.target, None))
                 for n in tg.graph.nodes if n.op == "get_attr"}
    nodes = [node_json(n, costs[n] if costs else None) for n in tg.graph.nodes]
    if layouts:
        for item, node in zip(nodes, tg.graph.nodes):
            item["layout"] = _layout_json(node.meta.get("val"))
            item["meta"] = _plain_meta(node)
    return {"format_version": FORMAT_VERSION, "name": tg.name, "attrs": tg.attrs,
            "signature": tg.signature.to_json(), "constants": constants, "nodes": nodes}


def from_json(data: dict, constants: dict[str, torch.Tensor] | None = None, *,
              recorded_values: bool = False) -> TrainGraph:
    """Rebuild a TrainGraph; ``constants`` supplies tensors for get_attr nodes.

    ``recorded_values`` (JSON written with ``layouts=True``): every node's fake value is made
    from its recorded layout and its metadata restored as recorded, instead of re-running fake
    tensors over the graph (about a millisecond per node)."""
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"graph JSON format_version {data.get('format_version')} is not {FORMAT_VERSION}")
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    nodes: dict[str, torch.fx.Node] = {}
    for item in data["nodes"]:
        op = item["op"]
        if op == "placeholder":
            node = graph.placeholder(item["name"])
        elif op == "output":
            node = graph.output(_decode(item["args"], nodes)[0])
        elif op == "get_attr":
            if not constants or item["target"] not in constants:
                raise ValueError(f"graph constant {item['target']!r} is needed to load this graph")
            root.register_buffer(item["target"], constants[item["target"]])
            node = graph.get_attr(item["target"])
        else:
            node = graph.call_function(resolve_target(item["target"]), _decode(item["args"], nodes),
                                       {k: _decode(v, nodes) for k, v in item["kwargs"].items()})
        node.name = item["name"]
        for key in (REGION, MODULE_PATH, RECOMPUTE, SHARDING, ORIGIN_PASS, REUSES_OPERAND):
            if item.get(key) is not None:
                node.meta[key] = item[key]
        nodes[item["name"]] = node
    if recorded_values:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for item, node in zip(data["nodes"], graph.nodes):
            if "layout" not in item:
                raise ValueError(f"node {item['name']} has no recorded layout (written without layouts=True)")
            node.meta.update(item.get("meta", {}))
            if item["op"] != "output":
                node.meta["val"] = _fake_from_layout(item["layout"], mode)
        gm = lazy_graph_module(root, graph)
    else:
        gm = torch.fx.GraphModule(root, graph)
        _propagate_fake_values(gm, [n for n in data["nodes"] if n["op"] == "placeholder"])
    return TrainGraph(gm, StepSignature.from_json(data["signature"]), data.get("attrs", {}))


def _propagate_fake_values(gm: torch.fx.GraphModule, placeholders: list[dict]) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty(item["value"]["shape"], dtype=_DTYPES[item["value"]["dtype"]])
                  for item in placeholders]
    propagate_fake_values(gm, inputs, mode)


def value_matches(a: Any, b: Any) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(ta, tb))
