"""Feeding a graph from the live model, optimizer and batch, and writing its results back.

Binding goes by the graph's signature, not by capture order, so a pass may
add inputs (a loss scale, a shard of optimizer state) or outputs (metrics)
and the runtime still knows what each position is. Where the graph holds a
shard of a value (its placement, recorded by the pass that sharded it), the
:class:`ShardStore` keeps this rank's piece and :mod:`graph_ir.placement`
cuts it from the full tensor: nothing here compares shapes to guess.
"""
from __future__ import annotations

import contextlib

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from graph_ir import TrainGraph
from graph_ir.capture import batch_path
from graph_ir.meta import DTYPES_BY_NAME, GraphAttr
from graph_ir.placement import Placement, placement_of, shard
from graph_ir.signature import InputKind, OutputKind, split_state_name


class BindingError(RuntimeError):
    pass


class StepState:
    """Runtime-owned state that passes declare in ``graph.attrs['step_state']``."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}

    def get(self, graph: TrainGraph, name: str, device: torch.device) -> torch.Tensor:
        if name not in self.values:
            declared = graph.attrs.get(GraphAttr.STEP_STATE, {}).get(name)
            if declared is None:
                raise KeyError(f"graph input step_state '{name}' is not declared in graph.attrs['step_state']")
            self.values[name] = torch.full(declared.get("shape", []), declared["value"],
                                           dtype=DTYPES_BY_NAME[declared.get("dtype", "float32")], device=device)
        return self.values[name]


class ShardStore:
    """This rank's pieces of the values a graph holds sharded, keyed ``kind:name``.

    A sharded optimizer-state entry is also what ``optimizer.state`` holds, and
    the store remembers that very tensor: when ``optimizer.state`` holds another
    one (the user loaded a state dict, or capture initialised it), that one is
    the full value and is cut again. Stage-3 parameter shards live only here;
    the model's parameters keep the full tensors they had (see ``sync``).
    """

    def __init__(self, mesh, beside: "ShardStore | None" = None):
        self.mesh = mesh                                   # graph_ir.mesh.MeshDesc of this rank
        self.beside = beside                               # the rank's own store, whose pieces are pieces here too
        self.local: dict[str, torch.Tensor] = {}
        self.placements: dict[str, Placement] = {}
        self.sources: dict[str, Any] = {}

    def piece(self, key: str, placement: Placement, current: torch.Tensor, source: Any = None) -> torch.Tensor:
        """This rank's piece for ``key``: the stored one if ``current`` is it (or, for a parameter,
        if the model's tensor is unchanged since it was cut: same ``source`` token), else cut anew."""
        if self.beside is not None and self.beside.holds(key, current):
            return current   # (a tied weight's state, cut by the rank's own stage holding it too)
        held = self.local.get(key)
        if held is not None and (current is held or (source is not None and self.sources.get(key) == source)):
            return held
        self.sources[key] = source
        if tuple(current.shape) != placement.shape:
            raise BindingError(f"{key}: the graph wants a shard of a value of shape {list(placement.shape)}, "
                               f"but the model/optimizer hold shape {list(current.shape)} (rule: load full, "
                               "unsharded tensors; the compiled step shards them)")
        self.local[key] = shard(current, placement, self.mesh)
        self.placements[key] = placement
        return self.local[key]

    def store(self, key: str, value: torch.Tensor, placement: Placement) -> None:
        self.local[key] = value
        self.placements[key] = placement

    def params(self) -> dict[str, torch.Tensor]:
        prefix = InputKind.PARAM.value + ":"
        return {k[len(prefix):]: v for k, v in self.local.items() if k.startswith(prefix)}

    def holds(self, key: str, tensor: Any) -> bool:
        return key in self.local and self.local[key] is tensor


def source_token(param: torch.Tensor) -> tuple:
    """What identifies a parameter's current contents: its storage and in-place version."""
    return (param.data_ptr(), param._version)


def _hparam(optimizer: torch.optim.Optimizer, name: str) -> float:
    """``lr:group0`` -> group 0's lr; ``betas.1:group0`` -> group 0's betas[1]."""
    key, _, group = name.partition(":group")
    key, _, index = key.partition(".")
    try:
        value = optimizer.param_groups[int(group)][key]
        return float(value[int(index)] if index else value)
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise BindingError(f"graph input hparam '{name}': optimizer.param_groups has no such value "
                           f"({type(exc).__name__}: {exc})") from None


class _Slot:
    """What one signature position binds to, worked out once per graph: the binding runs every step."""
    __slots__ = ("kind", "name", "key", "placement", "owner", "state_key")

    def __init__(self, graph, spec):
        self.kind, self.name = spec.kind, spec.name
        self.key = f"{spec.kind}:{spec.name}"
        self.placement = placement_of(graph, spec.kind, spec.name) \
            if spec.kind in (InputKind.PARAM, InputKind.OPT_STATE) else None
        self.owner, self.state_key = split_state_name(spec.name) if spec.kind == InputKind.OPT_STATE else (None, None)


def _slots(graph, which: str) -> list[_Slot]:
    """The graph's input or output slots, kept with the graph (its signature and placements are
    fixed once it is compiled)."""
    cached = getattr(graph, "_binding_slots", None)
    specs = graph.signature
    if cached is None or cached[0] is not specs or len(cached[1]) != len(specs.inputs) \
            or len(cached[2]) != len(specs.outputs):
        cached = (specs, [_Slot(graph, s) for s in specs.inputs], [_Slot(graph, s) for s in specs.outputs])
        graph._binding_slots = cached
    return cached[1] if which == "inputs" else cached[2]


def bind_inputs(graph: TrainGraph, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                batch: Any, step_state: StepState, shards: ShardStore | None = None,
                init_state: Callable[[str], None] | None = None, own: bool = True,
                params: dict | None = None, buffers: dict | None = None) -> list[torch.Tensor]:
    """The graph's flat inputs. ``init_state(param_name)`` re-creates a parameter's optimizer state
    where it is missing (after ``optimizer.load_state_dict`` of an empty state, as eager does).
    A sharded optimizer state's piece replaces the full value in ``optimizer.state`` (the store
    then knows it as its own), unless ``own`` is false: inputs of a graph another rank runs,
    bound to compile it, leave this rank's optimizer state as it is. ``params`` / ``buffers``: the
    model's, by name, where the caller has them for this step."""
    params = dict(model.named_parameters()) if params is None else params
    buffers = dict(model.named_buffers()) if buffers is None else buffers
    leaves = {batch_path(path): leaf for path, leaf in pytree.tree_flatten_with_path(batch)[0]}
    device = next(iter(params.values())).device
    sharded = shards is not None
    flat = []
    for slot in _slots(graph, "inputs"):
        kind = slot.kind
        placement = slot.placement if sharded else None
        if kind == InputKind.PARAM:
            param = params[slot.name]
            value = param.detach()
            flat.append(value if placement is None else shards.piece(slot.key, placement, value, source_token(param)))
        elif kind == InputKind.BUFFER:
            flat.append(buffers[slot.name])
        elif kind == InputKind.OPT_STATE:
            name, state_key = slot.owner, slot.state_key
            state = optimizer.state[params[name]]
            if state_key not in state and init_state is not None:
                init_state(name)
            if state_key not in state:
                raise BindingError(f"optimizer state of '{name}' has no '{state_key}' (it has {sorted(state)}); "
                                   "load a state dict saved from the same optimizer, or an empty one")
            value = state[state_key]
            if placement is not None:
                value = shards.piece(slot.key, placement, value)
                if own:
                    state[state_key] = value
            flat.append(value)
        elif kind == InputKind.HPARAM:
            flat.append(torch.tensor(_hparam(optimizer, slot.name), dtype=torch.float64, device=device))
        elif kind == InputKind.BATCH:
            if slot.name not in leaves:
                raise KeyError(f"the batch has no {slot.name}; it has {sorted(leaves)}")
            # Detached: a batch that requires grad must not leak autograd history into the step.
            flat.append(leaves[slot.name].detach())
        elif kind == InputKind.STEP_STATE:
            flat.append(step_state.get(graph, slot.name, device))
        else:
            raise ValueError(f"input kind {kind!r} has no binding")
    return flat


def _same_tensor(held: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` is ``held``'s own memory, seen the same way (an input updated in place)."""
    return (value.data_ptr() == held.data_ptr() and value.shape == held.shape and value.stride() == held.stride()
            and value.dtype == held.dtype)


def write_back(graph: TrainGraph, outputs, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               step_state: StepState, shards: ShardStore | None = None,
               params: dict | None = None, buffers: dict | None = None) -> dict[str, torch.Tensor]:
    """Store new parameters, buffers, optimizer and step state; return the metrics."""
    params = dict(model.named_parameters()) if params is None else params
    buffers = dict(model.named_buffers()) if buffers is None else buffers
    sharded = shards is not None
    metrics = {}
    with torch.no_grad():
        for slot, value in zip(_slots(graph, "outputs"), outputs):
            kind = slot.kind
            placement = slot.placement if sharded else None
            if kind == OutputKind.PARAM and placement is not None:
                shards.store(slot.key, value, placement)
            elif kind == OutputKind.PARAM:
                # Rebinding .data keeps the Parameter object (and so the optimizer's
                # references and any tied modules) while taking the new storage; a
                # backend that updated the parameter in place returns its own storage.
                if not _same_tensor(params[slot.name], value):
                    params[slot.name].data = value
            elif kind == OutputKind.OPT_STATE:
                optimizer.state[params[slot.owner]][slot.state_key] = value
                if placement is not None:
                    shards.store(slot.key, value, placement)
            elif kind == OutputKind.BUFFER:
                if not _same_tensor(buffers[slot.name], value):
                    buffers[slot.name].copy_(value)
            elif kind == OutputKind.STEP_STATE:
                step_state.values[slot.name] = value
            elif kind == OutputKind.METRIC:
                metrics[slot.name] = value.detach()
    return metrics


def autocast_off() -> contextlib.ExitStack:
    """What a lowered graph runs under: its dtypes are explicit (autocast's casts, where it was
    captured under autocast, are nodes of the graph), so a caller's autocast must not cast again."""
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda"):
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack
