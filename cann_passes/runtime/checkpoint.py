"""Sharded checkpoints of a compiled step with ``torch.distributed.checkpoint``.

Every parameter and optimizer-state tensor is stored flat (1-D, its own
element count in row-major order, no padding), so the layout on disk does not
depend on the mesh: not on the data-parallel degree, the ZeRO stage, nor the
tensor-parallel degree. A value the step holds sharded is saved as a
``ShardedTensor`` whose local shards are the runs of the flat value this
rank's piece covers (:func:`graph_ir.placement.flat_runs`: one run for a flat
ZeRO shard or a column-parallel weight, one per row for a row-parallel
weight, and the composition for ZeRO over tensor parallelism); each run is
written by one rank only (the first of the ranks holding the same piece), a
replicated value is a plain tensor (written once). Loading builds the same
description for the *current* run, its runs views of the live shards, and
DCP copies in whatever overlaps: a run saved with dp=2 x tp=2 and ZeRO-1
resumes at tp=1, at tp=4, in one process, or with any ZeRO stage.

``ShardedTensor`` rather than ``DTensor``: a DTensor's piece is one box of
the value, cut evenly; a flat shard of a row-parallel weight is neither.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from graph_ir.mesh import MeshDesc
from graph_ir.placement import Placement, flat_runs
from graph_ir.signature import InputKind

STATE_FILE_META = "meta"


class CheckpointError(RuntimeError):
    pass


def _writes(placement: Placement, mesh: MeshDesc) -> bool:
    """Whether this rank writes its piece: ranks that differ only on axes the value is replicated
    over hold the same piece, and the one at coordinate 0 on those axes writes it."""
    placed = {a for a, _ in placement._active()}
    return all(mesh.local_rank(a) == 0 for a in mesh.axes if a not in placed)


def _flat(step, key: str, tensor: torch.Tensor, *, saving: bool):
    """``tensor`` as the flat description DCP saves or loads: a ShardedTensor where it is this rank's piece."""
    if not step.shards.holds(key, tensor):
        return tensor.view(-1) if tensor.dim() else tensor
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    placement, mesh = step.shards.placements[key], step.mesh
    local = tensor.view(-1)
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = flat_runs(placement, mesh) if not saving or _writes(placement, mesh) else []
    device = f"rank:{rank}/{local.device}"
    shards = [Shard(local[at:at + n], ShardMetadata([g], [n], device)) for g, at, n in runs]
    # The global metadata only needs to be consistent: this rank's runs, and what they leave
    # uncovered assigned to another rank (DCP plans reads and writes from local shards alone).
    gaps, covered = [], 0
    for g, _, n in sorted(runs):
        if g > covered:
            gaps.append((covered, g - covered))
        covered = g + n
    if covered < placement.numel:
        gaps.append((covered, placement.numel - covered))
    other = f"rank:{(rank + 1) % world}/{local.device}"
    metadata = [s.metadata for s in shards] + [ShardMetadata([g], [n], other) for g, n in gaps]
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metadata, torch.Size([placement.numel]), properties))


def state_dict(step, *, saving: bool = True) -> dict:
    """The step's model, optimizer and runtime state as DCP would save or load it (tensors alias the live ones)."""
    out = {}
    params = dict(step.model.named_parameters())
    shards = step.shards.params()
    for name, p in params.items():
        key = f"{InputKind.PARAM.value}:{name}"
        out[f"model/{name}"] = _flat(step, key, shards.get(name, p.data), saving=saving)
        for state_key, value in step.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}:{state_key}"] = _flat(
                    step, f"{InputKind.OPT_STATE.value}:{name}:{state_key}", value, saving=saving)
    for name, b in step.model.named_buffers():
        out[f"buffer/{name}"] = b.view(-1) if b.dim() else b
    out[STATE_FILE_META] = {"steps_run": step.steps_run,
                            "lrs": [float(g["lr"]) for g in step.optimizer.param_groups]}
    return out


def save(step, path: str | os.PathLike) -> None:
    """Save on every rank (a collective): each piece is written by one of the ranks holding it."""
    dcp.save(state_dict(step, saving=True), checkpoint_id=str(path))


def load(step, path: str | os.PathLike, example_batch) -> None:
    """Load into a step built like the saved one, on any mesh (dp, tp degree) / ZeRO stage (a collective).

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
    target = state_dict(step, saving=False)
    try:
        dcp.load(target, checkpoint_id=str(path))
    except Exception as exc:
        raise CheckpointError(f"checkpoint.load from {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    meta = target[STATE_FILE_META]
    step.steps_run = meta["steps_run"]
    for group, lr in zip(step.optimizer.param_groups, meta["lrs"]):
        group["lr"] = lr
    if step.shards.params():
        # the loaded parameters are in the shards: the model's own tensors are older now
        step.model_stale = True
