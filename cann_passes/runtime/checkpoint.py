"""Sharded checkpoints of a compiled step with ``torch.distributed.checkpoint``.

Every parameter and optimizer-state tensor is stored flat (1-D, its own
element count, no padding), so the layout on disk does not depend on the
data-parallel degree or the ZeRO stage: a ZeRO shard is saved as a
``DTensor`` sharded on dim 0 over the ``dp`` mesh (each rank writes its own
piece), a replicated tensor as a plain tensor (written once). Loading builds
the same description for the *current* run and lets DCP reshard, so a run
saved on 2 ranks with ZeRO-1 resumes on 4 ranks, or with plain data
parallelism, or in one process.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

STATE_FILE_META = "meta"


def gather_full(shard: torch.Tensor, shape, group) -> torch.Tensor:
    """The full tensor from every rank's padded 1-D shard (a collective over ``group``)."""
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    numel = 1
    for s in shape:
        numel *= s
    return torch.cat(pieces)[:numel].view(shape).clone()


def _flat(step, name: str, tensor: torch.Tensor, full_numel: int):
    """``tensor`` as the flat description DCP saves: a DTensor if it is this rank's shard."""
    if tensor.dim() == 1 and tensor.numel() != full_numel and step.world is not None:
        from torch.distributed.tensor import DTensor, Shard
        rank, size = step.world.dp_rank, step.world.dp_size
        per_rank = tensor.numel()
        valid = max(0, min(per_rank, full_numel - rank * per_rank))
        return DTensor.from_local(tensor[:valid], step.world.mesh["dp"], [Shard(0)], run_check=False,
                                  shape=torch.Size([full_numel]), stride=(1,))
    return tensor.view(-1) if tensor.dim() else tensor


def state_dict(step) -> dict:
    """The step's model, optimizer and runtime state as DCP would save or load it (tensors alias the live ones)."""
    out = {}
    params = dict(step.model.named_parameters())
    for name, p in params.items():
        source = step.param_shards.get(name, p.data)
        out[f"model/{name}"] = _flat(step, name, source, p.numel())
        for key, value in step.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}:{key}"] = _flat(step, name, value, p.numel() if value.dim() else 1)
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
    step.compile(example_batch)
    target = state_dict(step)
    dcp.load(target, checkpoint_id=str(path))
    meta = target[STATE_FILE_META]
    step.steps_run = meta["steps_run"]
    for group, lr in zip(step.optimizer.param_groups, meta["lrs"]):
        group["lr"] = lr
