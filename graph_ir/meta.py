"""The one vocabulary of graph metadata, defined once and used everywhere.

Every node of a training graph carries, in ``node.meta``:

- ``REGION``: which part of the step it belongs to (:class:`Region`).
- ``MODULE_PATH``: the dotted path of the ``nn.Module`` it came from
  (``layers.3.attn.qkv``), or ``""`` where no module ran it (the loss, the
  optimizer update).
- ``"val"``: a fake tensor (or a tuple of them) giving shape and dtype; this is
  torch's own key, kept so that torch's tools (FakeTensorProp, inductor) work.

Passes add their own keys here rather than inventing new spellings.
"""
from __future__ import annotations

import enum
from typing import Any

import torch
import torch.fx

REGION = "region"
MODULE_PATH = "module_path"
COST = "cost"
SHARDING = "sharding"
RECOMPUTE = "recompute"
# On a recomputed copy: the name of the forward node it recomputes (where the copy's work lies in
# the forward order, which a pipeline cut must not split from the values the copy starts from).
RECOMPUTE_OF = "recompute_of"
ORIGIN_PASS = "origin_pass"
# On a backward node that yields a parameter's gradient: the parameter's name.
GRADIENT_OF = "gradient_of"
# True on a pointwise node that may run in place over its first operand's buffer (that buffer dies
# there): reuse_dead_operands decides, the eager lowering applies it.
REUSES_OPERAND = "reuses_operand"
# On a marked multi-tensor op (graph_ir.multi_tensor_ops): (argument, list index) of each tensor it
# writes a copy of instead (one read again later, or an input the step does not return as itself).
REUSE_COPIES = "reuse_copies"
# True on a 0-dim float64 node of the optimizer region the eager lowering computes as a Python float;
# on a consumer, the argument positions that then take that float (scalars_on_host).
ON_HOST = "on_host"
HOST_OPERANDS = "host_operands"
# On an add of x and (h * t1) / t2, or an addcmul of x, h * t1 and t2, with h such a float: the op the
# eager lowering folds it into ("addcdiv" / "addcmul" with value=h: one pass over memory, not three).
HOST_FOLD = "host_fold"
# On a node whose buffer the eager backend holds across steps: its slot in the graph's buffer plan
# (GraphAttr.BUFFER_PLAN); plan_buffers decides, the eager lowering writes the op's out= overload there.
HELD_BUFFER = "held_buffer"
# ``SHARDING`` holds a node's placement on the mesh (:mod:`graph_ir.placement`), as JSON.


class GraphAttr:
    """Keys of ``TrainGraph.attrs``: the facts passes and the runtime tell each other about a graph.

    Defined once here so that a pass marking a graph and the code reading the
    mark cannot drift apart. Values are JSON-serializable.
    """

    NAME = "name"                      # the graph's name ("step", "step.grad", ...)
    KIND = "kind"                      # a GraphKind: what the graph computes, how it is verified
    STEP_STATE = "step_state"          # runtime-carried state a pass declares: name -> {value, dtype, shape,
                                       # persistent}; persistent: carried from step to step (checkpointed)
    PLACEMENTS = "placements"          # "kind:name" of an input/output -> placement JSON (graph_ir.placement)
    SHARDED_STATE = "sharded_state"    # True: state inputs/outputs may be shards of the model's tensors
    DATA_PARALLEL = "data_parallel"    # {dp, buckets, algo}: gradients all-reduced (data_parallel)
    ZERO = "zero"                      # {stage, dp, rank, params}: ZeRO rewrite done (optimizer_shard)
    TENSOR_PARALLEL = "tensor_parallel"  # {tp, rank, family, rules, params}: tensor_parallel's split
    CONTEXT_PARALLEL = "context_parallel"  # {cp, rank, seq}: the sequence split over cp (context_parallel)
    EXPERT_PARALLEL = "expert_parallel"  # {ep, experts, ...}: experts split over ep (expert_parallel)
    SYNC_BATCH_NORM = "sync_batch_norm"  # {dp, batch_norms, buffers}: statistics over dp (sync_batch_norm)
    GRAD_ACCUMULATION = "grad_accumulation"  # {microbatches, target, weight}: accumulating step
    OPTIMIZER_FUSED = "optimizer_fused"  # capture: the optimizer asked for torch's fused kernel (fused=True)
    MESH = "mesh"                      # the mesh description the graph was compiled for (JSON)
    RANK = "rank"                      # the global rank a per-rank graph belongs to
    STAGE = "stage"                    # a pipeline stage graph: {index, stages, rank, first, last}
    WRITTEN_INPUTS = "written_inputs"  # placeholders reuse_dead_operands lets the step write in place
    BUFFER_PLAN = "buffer_plan"        # slot sizes in bytes of the buffers plan_buffers holds across steps
    GLOO_ORDERED = "gloo_ordered"      # True: gloo_all_gathers_alone ordered this graph's all-gathers
    # On a Program (program.attrs): the pipeline split (stages, stage -> rank, units, costs).
    PIPELINE_PARALLEL = "pipeline_parallel"
    PASS_PIPELINE = "pass_pipeline"    # the pass pipeline text the program was compiled with
    BACKEND = "backend"                # the lowering backend its backend-specific passes were chosen for
    COMPILE_CACHE = "compile_cache"    # "hit" when the program was read from the compile cache


class GraphKind(str, enum.Enum):
    """What a graph of a program computes; the verifier checks each kind by its own rules."""

    STEP = "step"            # a whole step: forward, loss, backward, optimizer
    GRAD = "grad"            # one microbatch: forward, loss, backward, gradient accumulation
    APPLY = "apply"          # once per optimizer step: gradient sync and optimizer; no loss
    FORWARD = "forward"      # torch.compile's forward half (AOTAutograd)
    BACKWARD = "backward"    # torch.compile's backward half
    # One pipeline stage (pipeline_split), run per microbatch except apply:
    STAGE_FORWARD = "stage_forward"                  # boundary in -> boundary out (loss on the last), saved values
    STAGE_BACKWARD = "stage_backward"                # saved + boundary gradients -> gradients for the previous stage
    STAGE_BACKWARD_INPUT = "stage_backward_input"    # the part of backward the previous stage waits for
    STAGE_BACKWARD_WEIGHT = "stage_backward_weight"  # the rest: parameter gradients into the accumulators
    STAGE_APPLY = "stage_apply"                      # once per step: the stage's optimizer update

    def __str__(self) -> str:
        return self.value


def graph_kind(attrs: dict) -> GraphKind:
    return GraphKind(attrs.get(GraphAttr.KIND, GraphKind.STEP.value))


def expected_losses(attrs: dict) -> int:
    """How many loss outputs a graph of this kind has: one for what computes a microbatch's loss."""
    kind = graph_kind(attrs)
    if kind == GraphKind.STAGE_FORWARD:
        return int(bool(attrs.get(GraphAttr.STAGE, {}).get("last")))
    return 0 if kind in (GraphKind.APPLY, GraphKind.STAGE_BACKWARD, GraphKind.STAGE_BACKWARD_INPUT,
                         GraphKind.STAGE_BACKWARD_WEIGHT, GraphKind.STAGE_APPLY) else 1


class StageValue:
    """Signature kinds of the values that pass between pipeline stage graphs (named by the step's node)."""

    ACTIVATION = "activation"      # a forward value sent to the next stage
    GRADIENT = "boundary_grad"     # a backward value sent to the previous stage
    SAVED = "saved"                # a forward value the same stage's backward reads
    INTERMEDIATE = "bw_intermediate"  # handed from backward_input to backward_weight
    KINDS = (ACTIVATION, GRADIENT, SAVED, INTERMEDIATE)


# Step-state names of gradient accumulation, shared by the pass that adds them and the runtime
# that sets them: the microbatch's sample count, 1 / samples of the optimizer step, and the
# per-parameter accumulators under their own prefix (so a parameter named "weight" cannot collide);
# and 1.0 for the first microbatch of an optimizer step, else 0.0 (data parallelism broadcasts
# the updated buffers there only, as DDP does under no_sync).
ACCUMULATION_PREFIX = "grad_accumulation:"
ACCUMULATION_WEIGHT = ACCUMULATION_PREFIX + "weight"
ACCUMULATION_SCALE = ACCUMULATION_PREFIX + "scale"
ACCUMULATION_FIRST = ACCUMULATION_PREFIX + "first"
ACCUMULATOR_PREFIX = ACCUMULATION_PREFIX + "grad/"


class Region(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    # Placeholders and the output node belong to no region of computation.
    IO = "io"

    def __str__(self) -> str:  # prints as "forward", not "Region.FORWARD"
        return self.value


# dtype spellings used in JSON, dumps and step-state declarations ("float32", "bfloat16", ...).
DTYPES_BY_NAME = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)}


def is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(value, FakeTensor)


def region_of(node: torch.fx.Node) -> Region:
    value = node.meta.get(REGION)
    if value is None:
        return Region.IO if node.op in ("placeholder", "output") else Region.FORWARD
    # A dict lookup, not Enum's constructor: passes ask this of every node, several times.
    return _REGIONS.get(value) or Region(value)


_REGIONS = {r.value: r for r in Region}


def module_path_of(node: torch.fx.Node) -> str:
    return node.meta.get(MODULE_PATH, "")


def tensor_meta(node: torch.fx.Node) -> Any:
    """The fake value(s) of a node: a tensor, a tuple of them, or a Python scalar."""
    return node.meta.get("val")


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def nbytes(value: Any) -> int:
    """Bytes of the tensor(s) in a node's value; symbolic sizes are not expected here."""
    return sum(t.numel() * t.element_size() for t in tensors_of(value))


_DTYPE_ABBR = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}


def dtype_abbr(dtype: torch.dtype) -> str:
    return _DTYPE_ABBR.get(dtype, str(dtype).replace("torch.", ""))


def describe_value(value: Any) -> str:
    """``f32[4, 8]``-style text for a value, as in torch's print_readable."""
    if isinstance(value, torch.Tensor):
        return f"{dtype_abbr(value.dtype)}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    if value is None:
        return "none"
    return type(value).__name__
