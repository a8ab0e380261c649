"""Making and re-deriving fake values: new nodes of a pass, and whole graphs re-run on fake inputs.

A node a pass adds must look like a captured one (see :mod:`graph_ir.meta`):
a fake value in the graph's own fake mode, a region, a module path, and here
also the pass that made it, so dumps and lowering reports can say where it
came from.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .meta import MODULE_PATH, ORIGIN_PASS, REGION, Region, is_fake


def fake_value(target, args: tuple, kwargs: dict | None = None, *, mode) -> Any:
    """What ``target`` returns when its node arguments are replaced by their ``meta["val"]``.

    ``mode`` is the graph's FakeTensorMode (``TrainGraph.fake_mode()``): values made
    outside it would not mix with the graph's others.
    """
    vals, kw = torch.fx.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    with mode if mode is not None else contextlib.nullcontext():
        return target(*vals, **kw)


def tag(node: torch.fx.Node, *, region: Region | str, module_path: str, origin: str) -> None:
    node.meta[REGION] = Region(region).value
    node.meta[MODULE_PATH] = module_path
    node.meta[ORIGIN_PASS] = origin


def add_node(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None, *,
             region: Region | str, module_path: str, origin: str, mode) -> torch.fx.Node:
    """A ``call_function`` node at ``graph``'s insertion point, tagged, with its fake value."""
    node = graph.call_function(target, args, kwargs)
    tag(node, region=region, module_path=module_path, origin=origin)
    node.meta["val"] = fake_value(target, node.args, node.kwargs, mode=mode)
    return node


def propagate_fake_values(gm: torch.fx.GraphModule, inputs: Sequence[Any],
                          mode: FakeTensorMode | None = None) -> torch.fx.GraphModule:
    """Set every node's ``meta["val"]`` by running ``gm`` on fake copies of ``inputs``.

    Tensors already fake in ``mode`` are used as they are; other tensors (real, or
    fake in another mode) are converted. Non-tensor inputs pass through.
    """
    mode = mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=True)
    fake = [t if is_fake(t) and t.fake_mode is mode
            else mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake)
    return gm
