"""Sharded checkpoints of a compiled step with ``torch.distributed.checkpoint``.

Every parameter and optimizer-state tensor is stored flat (1-D, its own
element count, no padding), so the layout on disk does not depend on the
data-parallel degree or the ZeRO stage: a value the step holds sharded is
saved as a ``DTensor`` (:func:`graph_ir.placement.to_dtensor`: each rank
writes its own piece), a replicated one as a plain tensor (written once).
Loading builds the same description for the *current* run and lets DCP
reshard, so a run saved on 2 ranks with ZeRO-1 resumes on 4 ranks, or with
plain data parallelism, or in one process.
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from graph_ir.placement import to_dtensor
from graph_ir.signature import InputKind

STATE_FILE_META = "meta"


class CheckpointError(RuntimeError):
    pass


def _flat(step, key: str, tensor: torch.Tensor):
    """``tensor`` as the flat description DCP saves: a DTensor where it is this rank's shard."""
    if step.shards.holds(key, tensor):
        placement = step.shards.placements[key]
        (axis, _), = placement.axes
        return to_dtensor(tensor, placement, step.world.mesh[axis], step.mesh)
    return tensor.view(-1) if tensor.dim() else tensor


def state_dict(step) -> dict:
    """The step's model, optimizer and runtime state as DCP would save or load it (tensors alias the live ones)."""
    out = {}
    params = dict(step.model.named_parameters())
    shards = step.shards.params()
    for name, p in params.items():
        key = f"{InputKind.PARAM.value}:{name}"
        out[f"model/{name}"] = _flat(step, key, shards.get(name, p.data))
        for state_key, value in step.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}:{state_key}"] = _flat(step, f"{InputKind.OPT_STATE.value}:{name}:{state_key}",
                                                         value)
    for name, b in step.model.named_buffers():
        out[f"buffer/{name}"] = b.view(-1) if b.dim() else b
    out[STATE_FILE_META] = {"steps_run": step.steps_run,
                            "lrs": [float(g["lr"]) for g in step.optimizer.param_groups]}
    return out


def save(step, path: str | os.PathLike) -> None:
    """Save on every rank (a collective): each rank writes the shards it owns."""
    dcp.save(state_dict(step), checkpoint_id=str(path))


def load(step, path: str | os.PathLike, example_batch) -> None:
    """Load into a step built like the saved one, on any dp degree / ZeRO stage (a collective).

    ``example_batch`` compiles the step first, so that its (possibly sharded)
    state exists to be filled.
    """
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(f"checkpoint.load: no checkpoint at {str(path)!r} (rule: give the directory "
                              "cann_passes.runtime.checkpoint.save wrote; it holds a .metadata file)")
    step.compile(example_batch)
    # Cut every sharded value now, so that DCP loads into this rank's pieces.
    graphs = step.last.program.graphs.values()
    for graph in graphs:
        step._inputs(graph, example_batch if any(s.kind == InputKind.BATCH for s in graph.signature.inputs)
                     else None)
    target = state_dict(step)
    try:
        dcp.load(target, checkpoint_id=str(path))
    except Exception as exc:
        raise CheckpointError(f"checkpoint.load from {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    meta = target[STATE_FILE_META]
    step.steps_run = meta["steps_run"]
    for group, lr in zip(step.optimizer.param_groups, meta["lrs"]):
        group["lr"] = lr
