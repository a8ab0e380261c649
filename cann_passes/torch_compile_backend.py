"""A ``torch.compile`` backend: the plan's passes on AOTAutograd's forward and backward graphs.

For users who keep their own training loop and optimizer: Dynamo captures
the model, AOTAutograd splits forward and backward, and each half becomes a
TrainGraph (every node tagged with its region) that runs through the same
pass manager and lowering as a whole step. Passes that need the whole step
(optimizer sharding, gradient all-reduce placement) do not apply here; the
pipeline is the plan's ``pipeline`` text, else ``cleanup`` plus the plan's
extra passes. A plan that asks for a whole-step capability (precision,
recompute, parallelism, accumulation) is refused here rather than ignored:
those passes rewrite the step, which this backend never sees whole.
"""
from __future__ import annotations

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


_APPLIES = {"backend", "pipeline", "extra_passes", "verify", "device_profile", "torchair", "dump_dir"}


def _refuse_whole_step_fields(plan: Plan) -> None:
    default = Plan()
    for name, value in plan.to_dict().items():
        if name not in _APPLIES and value != getattr(default, name):
            raise PlanError(name, "applies to whole compiled steps (compile_for_npu), not to the "
                            "torch.compile backend's forward/backward graphs", value)


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
    backend_fn = aot_autograd(fw_compiler=compiler(Region.FORWARD), bw_compiler=compiler(Region.BACKWARD),
                              decompositions=decompositions)
    backend_fn.records = records  # what each compiled graph went through
    return backend_fn
