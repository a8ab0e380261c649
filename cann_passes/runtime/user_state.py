"""The user's model and optimizer stay valid under every plan: what they read is the trained state.

A compiled step may hold values sharded (ZeRO): optimizer state as each
rank's padded flat shard, and under ZeRO-3 the parameters too. Hooks on the
user's own objects turn that back into what torch's own distributed
conventions show, lazily, when the user reads it (the layout is
:mod:`graph_ir.placement`'s):

- ``model.state_dict()`` and ``model(x)`` (evaluation between steps): under
  ZeRO-3 a state-dict pre-hook and a forward pre-hook first gather the
  parameter shards into the model's parameters, once per step that changed
  them. Both are collectives then: every rank calls them, as with FSDP's
  full state dict.
- ``optimizer.state_dict()`` (the FSDP2 convention): every sharded state entry
  is a ``DTensor`` of the parameter's shape on the ``dp`` mesh, ``Shard(0)``
  (each rank a ``torch.chunk`` of the rows; ``Replicate`` for a 0-dim
  parameter's state), so ``torch.distributed.checkpoint`` saves and reshards
  it, and ``get_optimizer_state_dict(model, optimizer,
  options=StateDictOptions(full_state_dict=True))`` returns the full,
  parameter-shaped state (torch's own function; FQN keys). Building it is a
  collective (an all-gather of the flat shards, then each rank keeps its
  rows): every rank calls it.
- ``optimizer.load_state_dict`` takes either form on any plan: full tensors
  (a plain run's state dict, or a full state dict) are cut into this rank's
  shards by the next step; ``DTensor`` entries (a sharded state dict, or what
  ``set_optimizer_state_dict`` builds) are made full first (a collective).
  Unsharded entries (Adam's ``step``) stay plain tensors.

In one process nothing is sharded and the hooks do nothing.
"""
from __future__ import annotations

import weakref

import torch

from graph_ir.placement import gather
from graph_ir.signature import InputKind


def install(step) -> None:
    ref = weakref.ref(step)

    def sync_before_reading(*_args, **_kwargs):
        live = ref()
        if live is not None and live.model_stale and not live.capturing:
            live.sync_model()

    def sync_before_forward(module, args):
        sync_before_reading()
    sync_before_forward.is_compiled_steps_own = True   # graph_ir.guards: not a hook of the user's

    step.model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: sync_before_reading())
    step.model.register_forward_pre_hook(sync_before_forward)
    step.optimizer.register_state_dict_post_hook(lambda optimizer, state: _sharded_optimizer_state(ref(), state))
    step.optimizer.register_load_state_dict_pre_hook(lambda optimizer, state: _full_loaded_state(state))


def _sharded_optimizer_state(step, state_dict: dict) -> dict:
    """``optimizer.state_dict()`` with every sharded entry as a parameter-shaped DTensor (Shard(0) rows)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    if step is None or not step.shards.local:
        return state_dict
    full = _full_optimizer_state(step, state_dict)
    out = {}
    for position, entries in full["state"].items():
        new = dict(entries)
        for key, value in entries.items():
            axis = _gathered_axis(step, state_dict["state"][position][key], full_value=value)
            if axis is not None:
                # every rank holds the full value now: each keeps its rows, no further communication
                # (a value placed on several axes, ZeRO over TP: rows split over each in turn)
                places = [Shard(0) if value.dim() else Replicate()] * (1 if isinstance(axis, str) else len(axis))
                new[key] = distribute_tensor(value, step.world.mesh[axis], places, src_data_rank=None)
        out[position] = new
    return dict(full, state=out)


def _gathered_axis(step, before, full_value):
    """The mesh axis an entry was gathered over, or None for an entry that was not sharded."""
    if before is full_value or not isinstance(before, torch.Tensor):
        return None
    for spec_key, held in step.shards.local.items():
        if held is before:
            placed = {a for a, _ in step.shards.placements[spec_key].axes}
            axes = tuple(a for a in step.world.mesh.mesh_dim_names if a in placed)   # mesh order
            return axes[0] if len(axes) == 1 else axes
    return None


def _full_loaded_state(state_dict: dict) -> dict:
    """A state dict being loaded with its DTensor entries made full tensors (a collective)."""
    from torch.distributed.tensor import DTensor
    state = state_dict.get("state", {})
    if not any(isinstance(v, DTensor) for entries in state.values() for v in entries.values()):
        return None
    # the caller's dicts stay as they were: new ones carry the full tensors
    full = {position: {key: value.full_tensor() if isinstance(value, DTensor) else value
                       for key, value in entries.items()} for position, entries in state.items()}
    return dict(state_dict, state=full)


def _full_optimizer_state(step, state_dict: dict) -> dict:
    """``optimizer.state_dict()`` with every sharded entry gathered into the full tensor."""
    if step is None or not step.shards.local:
        return state_dict
    names = {id(p): n for n, p in step.model.named_parameters()}
    index = 0
    position_of: dict[int, str] = {}
    for group in step.optimizer.param_groups:
        for p in group["params"]:
            position_of[index] = names.get(id(p))
            index += 1
    full = {}
    for position, entries in state_dict["state"].items():
        name = position_of.get(position)
        new = dict(entries)     # the packed entries are optimizer.state's own dicts: never edit them
        for key, value in entries.items():
            spec_key = f"{InputKind.OPT_STATE.value}:{name}:{key}"
            if name is not None and isinstance(value, torch.Tensor) and step.shards.holds(spec_key, value):
                placement = step.shards.placements[spec_key]
                new[key] = gather(value, placement, step.world.group)
        full[position] = new
    return dict(state_dict, state=full)
