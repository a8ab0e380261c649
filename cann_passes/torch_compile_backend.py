"""A ``torch.compile`` backend: the plan's passes on AOTAutograd's forward and backward graphs.

For users who keep their own training loop and optimizer: Dynamo captures
the model, AOTAutograd splits forward and backward, and each half becomes a
TrainGraph (every node tagged with its region) that runs through the same
pass manager and lowering as a whole step. The pipeline is the plan's
``pipeline`` text, else ``cleanup`` plus the plan's extra passes.

Two whole-step capabilities have a form here, built on AOTAutograd's own machinery:

- ``precision`` bf16 / fp16: AOTAutograd traces under ``torch.autocast`` of that dtype, so the
  graphs hold exactly the casts eager autocast makes (weights stay the user's fp32; fp16 needs
  the user's ``torch.amp.GradScaler``, as in eager).
- ``recompute``: chosen on the joint graph before it is split. ``selective`` tags every
  attention core (graph_ir.analysis.structure.attention_cores; random ops excepted) as
  must-recompute, the tags ``torch.utils.checkpoint`` gives its regions, so the partitioner keeps
  their inputs and recomputes them in backward; ``full`` and ``budget`` hand AOTAutograd's
  min-cut partitioner an activation memory budget (0, or the plan's ``recompute_budget``).

The rest needs the optimizer in the graph or the whole step (parallelism, ZeRO,
accumulation, clipping, loss scaling, block-structured recompute) and is refused by field,
never ignored.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.meta import MODULE_PATH, REGION, Region
from graph_ir.signature import InputKind, OutputKind, Spec, StepSignature

from .lowering import get_lowering, resolve_backend
from .compile import with_required_passes
from .pass_manager import PassContext, PassManager, Pipeline
from .plan import Plan, PlanError


def _as_train_graph(gm: torch.fx.GraphModule, region: Region, name: str) -> TrainGraph:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = list(gm.graph.output_node().args[0])
    for node in gm.graph.nodes:
        node.meta[REGION] = Region.IO.value if node.op in ("placeholder", "output") else region.value
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
        node.meta[MODULE_PATH] = _module_path(stack)
    # Forward/backward graphs have no loss position of their own: name it as an output
    # like the others and mark the graph's kind so the verifier does not ask for one.
    signature = StepSignature([Spec(InputKind.BATCH, p.name) for p in placeholders],
                              [Spec(OutputKind.LOSS, "loss")] +
                              [Spec(OutputKind.METRIC, f"out{i}") for i in range(1, len(outputs))])
    return TrainGraph(gm, signature, {"name": name, "kind": region.value})


def _module_path(stack: dict) -> str:
    if not stack:
        return ""
    _, (path, _) = list(stack.items())[-1]
    # Dynamo spells paths as L['self'].layers[0].attn; keep the dotted tail.
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("[", ".").replace("]", "").replace("'", "")


_APPLIES = {"backend", "pipeline", "extra_passes", "verify", "device_profile", "torchair", "dump_dir",
            "precision", "recompute", "recompute_budget", "recompute_bans", "attention_ops"}
_RECOMPUTE_HERE = ("none", "selective", "full", "budget")


def _refuse_whole_step_fields(plan: Plan) -> None:
    default = Plan()
    for name, value in plan.to_dict().items():
        if name not in _APPLIES and value != getattr(default, name):
            raise PlanError(name, "applies to whole compiled steps (compile_for_npu), not to the "
                            "torch.compile backend's forward/backward graphs", value)
    if plan.recompute not in _RECOMPUTE_HERE:
        raise PlanError("recompute", f"the torch.compile backend takes {', '.join(_RECOMPUTE_HERE)} "
                        "(the other policies need the model's block structure: compile_for_npu)", plan.recompute)
    if plan.recompute == "budget" and plan.recompute_budget is not None and plan.recompute_budget > 1:
        raise PlanError("recompute_budget", "is a fraction of the saved activations (<= 1.0) with the "
                        "torch.compile backend", plan.recompute_budget)


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _joint_regions(joint: torch.fx.GraphModule) -> None:
    """Forward / backward region of every joint-graph node: backward is what the tangents reach."""
    backward: set = set()
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            is_tangent = "tangents" in node.name
            node.meta[REGION] = Region.IO.value
            if is_tangent:
                backward.add(node)
        elif node.op == "output":
            node.meta[REGION] = Region.IO.value
        else:
            if any(a in backward for a in node.all_input_nodes):
                backward.add(node)
            node.meta[REGION] = (Region.BACKWARD if node in backward else Region.FORWARD).value


def _tag_attention_cores(joint: torch.fx.GraphModule, plan: Plan) -> int:
    """Mark each attention core's nodes must-recompute; how many nodes."""
    from torch.utils.checkpoint import CheckpointPolicy
    from graph_ir.analysis.effects import random_op
    from graph_ir.analysis.structure import attention_cores
    bans = tuple(plan.recompute_bans)
    tagged = 0
    for core in attention_cores(joint.graph, plan.attention_ops):
        # Never a random op, even one drawing nothing (SDPA, dropout at p=0): the partitioner would
        # thread RNG state through it; nor the outputs of one (it is saved whole).
        kept = {n for n in core if n.op == "call_function" and (random_op(n.target) or any(
            str(n.target).startswith(b) or b in str(n.target) for b in bans))}
        for node in core:
            if node.op != "call_function" or node in kept or (
                    node.target is operator.getitem and node.args[0] in kept):
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            # One region id for all: cores never touch (projections lie between), and unequal ids
            # would make the partitioner save a multi-output op (SDPA) where two cores share a value.
            node.meta["ac_graph_id"] = 0
            tagged += 1
    return tagged


def make_partition(plan: Plan, lowering_name: str, partitions: list):
    """AOTAutograd's ``partition_fn`` for the plan's recompute; notes what it kept in ``partitions``."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    def partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        tagged = 0
        budget = None
        if plan.recompute == "selective":
            _joint_regions(joint_module)
            tagged = _tag_attention_cores(joint_module, plan)
        elif plan.recompute == "full":
            budget = 0.0
        elif plan.recompute == "budget":
            budget = plan.recompute_budget if plan.recompute_budget is not None else 0.5
        use_min_cut = lowering_name == "inductor" or budget is not None
        split = min_cut_rematerialization_partition if use_min_cut else default_partition
        with functorch_config.patch(activation_memory_budget=1.0 if budget is None else budget):
            fw, bw = split(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        saved = len(fw.graph.output_node().args[0]) - num_fwd_outputs
        partitions.append({"saved_values": saved, "tagged_for_recompute": tagged,
                           "partitioner": split.__name__, "activation_memory_budget": budget})
        return fw, bw
    return partition


def make_backend(plan: Plan):
    from torch._dynamo.backends.common import aot_autograd

    _refuse_whole_step_fields(plan)

    lowering_name = resolve_backend(plan.backend)
    pipeline = Pipeline.parse(plan.pipeline) if plan.pipeline else Pipeline.of("cleanup", *plan.extra_passes)
    pipeline = with_required_passes(pipeline, lowering_name)
    records: list = []

    def compiler(region: Region):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            if not gm.graph.output_node().args[0]:
                return gm
            graph = _as_train_graph(gm, region, f"{region.value}{len(records)}")
            manager = PassManager(pipeline, verify_level=plan.verify)
            graph = manager.run(graph, PassContext())
            records.append((graph.name, manager.records))
            if lowering_name == "inductor":
                from torch._inductor.compile_fx import compile_fx_inner
                from .lowering.cpp_kernel_batches import batched
                with batched():
                    return compile_fx_inner(graph.gm, example_inputs)
            from functorch.compile import make_boxed_func
            return make_boxed_func(get_lowering(lowering_name).compile(graph, example_inputs, plan))
        return compile_graph

    # Inductor lowers only graphs already decomposed by its own table (an op with a decomposition
    # has no lowering of its own, and compile_fx_inner refuses to fall back on it), as
    # torch.compile's inductor backend decomposes them while AOTAutograd traces.
    decompositions = {}
    if lowering_name == "inductor":
        from torch._inductor.decomposition import select_decomp_table
        decompositions = select_decomp_table()
    partitions: list = []
    aot_kwargs = {}
    if plan.recompute != "none" or lowering_name == "inductor":
        aot_kwargs["partition_fn"] = make_partition(plan, lowering_name, partitions)
    aot_backend = aot_autograd(fw_compiler=compiler(Region.FORWARD), bw_compiler=compiler(Region.BACKWARD),
                               decompositions=decompositions, **aot_kwargs)
    dtype = _AUTOCAST.get(plan.precision)

    def backend_fn(gm, example_inputs):
        if dtype is None:
            return aot_backend(gm, example_inputs)
        device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
        # AOTAutograd traces here: autocast's dispatch key inserts eager autocast's casts.
        with torch.autocast(device, dtype=dtype):
            return aot_backend(gm, example_inputs)

    backend_fn.records = records        # what each compiled graph went through
    backend_fn.partitions = partitions  # per joint graph: what the partition kept (recompute)
    return backend_fn
