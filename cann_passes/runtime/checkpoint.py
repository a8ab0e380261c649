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

The runtime-owned step state that passes declare ``persistent`` in
``graph.attrs["step_state"]`` (fp16 dynamic loss scaling's ``loss_scale:scale``
and ``loss_scale:growth_tracker``) is saved as ``step_state/<name>``, as
``GradScaler.state_dict()`` travels with a torch checkpoint: a resumed run
scales, skips and grows exactly as the uninterrupted one. Every rank holds the
same value (the overflow flag is combined over dp, tp and the pipeline ranks),
so it is a plain tensor, written once and read by every rank. Per-step values
(accumulation weights, gradient accumulators) are not persistent: the runtime
sets them for each step. A checkpoint without step state (saved before it was
stored, or by a step without loss scaling) loads with the declared initial
values and a warning naming them; step state the checkpoint holds and the step
does not declare is ignored with a warning naming it. ``load`` returns these
notes.

With pipeline stages every rank keeps every parameter of the user's model but
updates only those of its own stages: each rank saves only the values its
stages hold, and loading fills every rank's copy.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from graph_ir.meta import DTYPES_BY_NAME, GraphAttr
from graph_ir.mesh import MeshDesc
from graph_ir.pipeline_info import pipeline_split_of
from graph_ir.placement import Placement, flat_runs
from graph_ir.signature import InputKind

STATE_FILE_META = "meta"
STEP_STATE_PREFIX = "step_state/"


class CheckpointError(RuntimeError):
    pass


class CheckpointWarning(UserWarning):
    """A checkpoint loaded, but not all of the step's persistent state came from it."""


def _writes(placement: Placement, mesh: MeshDesc) -> bool:
    """Whether this rank writes its piece: ranks that differ only on axes the value is replicated
    over hold the same piece, and the one at coordinate 0 on those axes writes it."""
    placed = {a for a, _ in placement._active()}
    axes = list(mesh.axes)
    if placed & {"ep", "edp"}:   # an expert shard: dp is the product of its sub-axes ep and edp
        axes = [a for a in axes if a != "dp"] + ["ep", "edp"]
    return all(mesh.local_rank(a) == 0 for a in axes if a not in placed)


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


def persistent_step_state(step) -> dict[str, dict]:
    """Name -> declaration of the step state that the graphs ``step`` compiled declare persistent
    (empty before the step compiled)."""
    out = {}
    for comp in step._compiled.values():
        for graph in comp.program.graphs.values():
            for name, declared in graph.attrs.get(GraphAttr.STEP_STATE, {}).items():
                if declared.get("persistent"):
                    out[name] = declared
    return out


def _step_state_tensors(step, names) -> dict[str, torch.Tensor]:
    """The live value of each persistent step-state entry (its declared initial value before the
    first step that bound it)."""
    declared = persistent_step_state(step)
    out = {}
    for name in names:
        value = step.step_state.values.get(name)
        if value is None:
            d = declared[name]
            value = torch.full(d.get("shape", []), d["value"], dtype=DTYPES_BY_NAME[d.get("dtype", "float32")])
        out[STEP_STATE_PREFIX + name] = value
    return out


def _pipeline_foreign_params(step) -> set[str]:
    """With pipeline stages: the parameters no stage of this rank holds (its copy of them is never
    updated, so it must not be what a checkpoint keeps)."""
    if not step._compiled:
        return set()
    program = step.last.program
    info = pipeline_split_of(program)
    if info is None or step.world is None:
        return set()
    pp_rank = step.mesh.local_rank("pp")
    held = set()
    for name, graph in program.graphs.items():
        stage = int(name.split(".")[0].removeprefix("stage")) if name.startswith("stage") else None
        if stage is not None and info.stage_to_rank[stage] == pp_rank:
            held |= {s.name for s in graph.signature.inputs if s.kind == InputKind.PARAM}
    return set(dict(step.model.named_parameters())) - held


def state_dict(step, *, saving: bool = True) -> dict:
    """The step's model, optimizer and runtime state as DCP would save or load it (tensors alias the live ones)."""
    out = {}
    params = dict(step.model.named_parameters())
    shards = step.shards.params()
    foreign = _pipeline_foreign_params(step) if saving else set()
    for name, p in params.items():
        if name in foreign:
            continue
        key = f"{InputKind.PARAM.value}:{name}"
        out[f"model/{name}"] = _flat(step, key, shards.get(name, p.data), saving=saving)
        for state_key, value in step.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}:{state_key}"] = _flat(
                    step, f"{InputKind.OPT_STATE.value}:{name}:{state_key}", value, saving=saving)
    for name, b in step.model.named_buffers():
        out[f"buffer/{name}"] = b.view(-1) if b.dim() else b
    if saving:   # loading adds the entries the checkpoint has (one without them still loads)
        out.update(_step_state_tensors(step, sorted(persistent_step_state(step))))
    out[STATE_FILE_META] = {"steps_run": step.steps_run,
                            "lrs": [float(g["lr"]) for g in step.optimizer.param_groups]}
    return out


def save(step, path: str | os.PathLike) -> None:
    """Save on every rank (a collective): each piece is written by one of the ranks holding it.

    Gradients accumulated since the last optimizer step (``accumulate_target``) are per-step state
    and not saved, as ``.grad`` is not in a torch state dict: saving then says so."""
    pending = getattr(getattr(step, "accumulation", None), "pending_microbatches", 0)
    if pending:
        warnings.warn(f"checkpoint.save to {str(path)!r}: the gradients of {pending} microbatch(es) accumulated "
                      "since the last optimizer step are not saved (rule: save right after an optimizer step, "
                      "step.metrics['applied'] true, to resume exactly)", CheckpointWarning, stacklevel=2)
    dcp.save(state_dict(step, saving=True), checkpoint_id=str(path))


def _step_state_notes(path, declared: dict[str, dict], saved: set[str]) -> list[str]:
    notes = []
    missing = sorted(set(declared) - saved)
    if missing:
        initial = ", ".join(f"{n} = {declared[n]['value']!r}" for n in missing)
        notes.append(f"checkpoint {str(path)!r} holds no step state {missing} (saved before step state was "
                     f"checkpointed, or by a step that does not declare it): it starts from its initial value "
                     f"({initial}), so a resumed fp16 run rescales and skips as a fresh one would")
    ignored = sorted(saved - set(declared))
    if ignored:
        notes.append(f"checkpoint {str(path)!r} holds step state {[STEP_STATE_PREFIX + n for n in ignored]}, "
                     "which this step does not declare (its plan has no pass that keeps it, e.g. no dynamic fp16 "
                     "loss scaling): ignored")
    return notes


def load(step, path: str | os.PathLike, example_batch) -> list[str]:
    """Load into a step built like the saved one, on any mesh (dp, tp degree) / ZeRO stage (a collective).

    ``example_batch`` compiles the step first, so that its (possibly sharded)
    state exists to be filled. Returns the notes on step state the checkpoint
    and the step do not share (each also a warning); empty when they agree.
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
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"checkpoint.load from {str(path)!r}: its .metadata does not read: "
                              f"{type(exc).__name__}: {exc}") from exc
    saved = {k[len(STEP_STATE_PREFIX):] for k in keys if k.startswith(STEP_STATE_PREFIX)}
    declared = persistent_step_state(step)
    device = next(step.model.parameters()).device   # where binding makes step state
    for name in sorted(saved & set(declared)):
        d = declared[name]
        target[STEP_STATE_PREFIX + name] = torch.empty(d.get("shape", []), device=device,
                                                       dtype=DTYPES_BY_NAME[d.get("dtype", "float32")])
    try:
        dcp.load(target, checkpoint_id=str(path))
    except Exception as exc:
        raise CheckpointError(f"checkpoint.load from {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    for name in sorted(saved & set(declared)):
        step.step_state.values[name] = target[STEP_STATE_PREFIX + name]
    notes = _step_state_notes(path, declared, saved)
    for note in notes:
        warnings.warn(note, CheckpointWarning, stacklevel=2)
    meta = target[STATE_FILE_META]
    step.steps_run = meta["steps_run"]
    for group, lr in zip(step.optimizer.param_groups, meta["lrs"]):
        group["lr"] = lr
    if step.shards.params():
        # the loaded parameters are in the shards: the model's own tensors are older now
        step.model_stale = True
    return notes
