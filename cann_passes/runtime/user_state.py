"""The user's model and optimizer stay valid under every plan: what they read is the trained state.

A compiled step may hold values sharded (ZeRO): optimizer state as each
rank's padded flat shard, and under ZeRO-3 the parameters too. Hooks on the
user's own objects turn that back into what eager PyTorch would show, lazily,
when the user reads it (the layout is :mod:`graph_ir.placement`'s):

- ``model.state_dict()`` and ``model(x)`` (evaluation between steps): under
  ZeRO-3 a state-dict pre-hook and a forward pre-hook first gather the
  parameter shards into the model's parameters, once per step that changed
  them. Both are collectives then: every rank calls them, as with FSDP's
  full state dict.
- ``optimizer.state_dict()``: a post-hook replaces every sharded state entry
  by the full, parameter-shaped tensor (torch's ``full_state_dict``
  convention; ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
  returns it too). It is a collective under ZeRO. ``optimizer.load_state_dict``
  of a full state works on any plan: the step cuts this rank's shards from
  it on the next call. For a checkpoint that each rank writes its own shards
  of (DTensors), use :mod:`cann_passes.runtime.checkpoint`.

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

    step.model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: sync_before_reading())
    step.model.register_forward_pre_hook(lambda module, args: sync_before_reading())
    step.optimizer.register_state_dict_post_hook(lambda optimizer, state: _full_optimizer_state(ref(), state))


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
