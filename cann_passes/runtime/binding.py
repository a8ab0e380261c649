"""Feeding a graph from the live model, optimizer and batch, and writing its results back.

Binding goes by the graph's signature, not by capture order, so a pass may
add inputs (a loss scale, a shard of optimizer state) or outputs (metrics)
and the runtime still knows what each position is.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_ir import TrainGraph
from graph_ir.capture import batch_path
from graph_ir.meta import DTYPES_BY_NAME
from graph_ir.signature import InputKind, OutputKind, split_state_name


class StepState:
    """Runtime-owned state that passes declare in ``graph.attrs['step_state']``."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}

    def get(self, graph: TrainGraph, name: str, device: torch.device) -> torch.Tensor:
        if name not in self.values:
            declared = graph.attrs.get("step_state", {}).get(name)
            if declared is None:
                raise KeyError(f"graph input step_state '{name}' is not declared in graph.attrs['step_state']")
            self.values[name] = torch.full(declared.get("shape", []), declared["value"],
                                           dtype=DTYPES_BY_NAME[declared.get("dtype", "float32")], device=device)
        return self.values[name]


def own_shard(full: torch.Tensor, rank: int, n_ranks: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` flattened and zero-padded to a multiple of ``n_ranks``
    (the layout of the optimizer_shard pass)."""
    flat = full.detach().reshape(-1)
    size = -(-flat.numel() // n_ranks)
    piece = flat[min(rank * size, flat.numel()):(rank + 1) * size]
    return torch.nn.functional.pad(piece, (0, size - piece.numel())).clone()


def _zero_shard(graph: TrainGraph, position: int, value: torch.Tensor) -> torch.Tensor | None:
    """``value`` cut to this rank's shard where a ZeRO graph wants a shard of a full tensor."""
    zero = graph.attrs.get("zero")
    if zero is None:
        return None
    want = graph.placeholders()[position].meta["val"].shape
    if tuple(value.shape) == tuple(want):
        return None
    return own_shard(value, zero["rank"], zero["dp"])


def bind_inputs(graph: TrainGraph, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                batch: Any, step_state: StepState, param_shards: dict | None = None) -> list[torch.Tensor]:
    """The graph's flat inputs. A ZeRO graph's sharded inputs are cut from full tensors the first
    time (optimizer state is then kept sharded in ``optimizer.state``; stage-3 parameter shards
    live in ``param_shards``)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    leaves = {batch_path(path): leaf for path, leaf in pytree.tree_flatten_with_path(batch)[0]}
    device = next(iter(params.values())).device
    flat = []
    for position, spec in enumerate(graph.signature.inputs):
        kind = spec.kind
        if kind == InputKind.PARAM:
            if param_shards is not None and spec.name in param_shards:
                flat.append(param_shards[spec.name])
                continue
            value = params[spec.name].detach()
            shard = _zero_shard(graph, position, value)
            if shard is not None and param_shards is not None:
                param_shards[spec.name] = shard
            flat.append(value if shard is None else shard)
        elif kind == InputKind.BUFFER:
            flat.append(buffers[spec.name])
        elif kind == InputKind.OPT_STATE:
            name, key = split_state_name(spec.name)
            value = optimizer.state[params[name]][key]
            shard = _zero_shard(graph, position, value)
            if shard is not None:
                optimizer.state[params[name]][key] = value = shard
            flat.append(value)
        elif kind == InputKind.HPARAM:
            key, _, group = spec.name.partition(":group")
            flat.append(torch.tensor(float(optimizer.param_groups[int(group)][key]),
                                     dtype=torch.float64, device=device))
        elif kind == InputKind.BATCH:
            if spec.name not in leaves:
                raise KeyError(f"the batch has no {spec.name}; it has {sorted(leaves)}")
            flat.append(leaves[spec.name])
        elif kind == InputKind.STEP_STATE:
            flat.append(step_state.get(graph, spec.name, device))
        else:
            raise ValueError(f"input kind {kind!r} has no binding")
    return flat


def write_back(graph: TrainGraph, outputs, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               step_state: StepState, param_shards: dict | None = None) -> dict[str, torch.Tensor]:
    """Store new parameters, buffers, optimizer and step state; return the metrics."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    metrics = {}
    with torch.no_grad():
        for spec, value in zip(graph.signature.outputs, outputs):
            kind = spec.kind
            if kind == OutputKind.PARAM and param_shards is not None and spec.name in param_shards:
                param_shards[spec.name] = value
            elif kind == OutputKind.PARAM:
                # Rebinding .data keeps the Parameter object (and so the optimizer's
                # references and any tied modules) while taking the new storage.
                params[spec.name].data = value
            elif kind == OutputKind.OPT_STATE:
                name, key = split_state_name(spec.name)
                optimizer.state[params[name]][key] = value
            elif kind == OutputKind.BUFFER:
                buffers[spec.name].copy_(value)
            elif kind == OutputKind.STEP_STATE:
                step_state.values[spec.name] = value
            elif kind == OutputKind.METRIC:
                metrics[spec.name] = value.detach()
    return metrics
