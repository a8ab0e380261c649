"""Compiling: a captured step + a resolved plan + a mesh description -> a Program.

:func:`compile_program` is the one sequence every front end runs — the step
driver, the planning layer, the dump tool, the benches: build the plan's
pipeline (plus the passes the backend requires), run it over the program with
the plan's verifier and dumps, and check the result. It never needs a process
group: the passes read only the mesh description, so ``MeshDesc.fake(dp=64)``
compiles rank 0's program of a 64-rank run in one process. It imports nothing
of planning: a plan whose choices are open (``pipeline_schedule: dynamic``) is
resolved first by :func:`cann_passes.planning.resolve_plan`. Lowering the
program's graphs to a backend is the caller's step (it needs example inputs).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from graph_ir import TrainGraph
from graph_ir.gc_pause import gc_paused
from graph_ir.meta import GraphAttr, GraphKind, graph_kind
from graph_ir.mesh import MeshDesc
from graph_ir.program import Program
from graph_ir.stack_room import with_stack_room

from .dump import DumpWriter
from .lowering import required_passes
from .pass_manager import PassContext, PassFailure, PassManager, PassOptionError, Pipeline, PipelineError
from .pass_pipeline import build_pipeline, plan_field_of
from .plan import Plan, PlanError

log = logging.getLogger("cann_passes")


# Passes whose marks hold only in the node order they were made in: they end every pipeline, in this
# order (plan_buffers reads the in-place chains reuse_dead_operands marks).
LAST_PASSES = ("reuse_dead_operands", "plan_buffers")


def required(backend: str, mesh: MeshDesc | None = None) -> Pipeline:
    """What ``backend`` and ``mesh`` need at the end of every pipeline: the lowering's passes, and
    ``gloo_reduce_scatter_as_all_reduce`` and ``gloo_all_gathers_alone`` where an axis of the mesh
    runs on gloo (``MeshDesc.backends``)."""
    passes = list(Pipeline.of(*required_passes(backend)).passes)
    if mesh is not None and "gloo" in mesh.backends:
        at = next((i for i, p in enumerate(passes) if p.name in LAST_PASSES), len(passes))
        passes[at:at] = Pipeline.of("gloo_reduce_scatter_as_all_reduce", "gloo_all_gathers_alone").passes
    return Pipeline(tuple(passes))


def with_required_passes(pipeline: Pipeline, backend: str, mesh: MeshDesc | None = None) -> Pipeline:
    """``pipeline`` with the passes ``backend`` and ``mesh`` need appended where they are missing;
    the passes of :data:`LAST_PASSES` the backend needs end the pipeline, in that order, even where
    the text has them earlier (with the text's options)."""
    needed = required(backend, mesh).passes
    have = {p.name: p for p in pipeline.passes}
    wanted = {p.name: p for p in needed if p.name in LAST_PASSES}
    # one the text names but the backend does not need still goes last: its marks read the final order
    last = [have.get(name, wanted.get(name)) for name in LAST_PASSES if name in wanted or name in have]
    in_place = not last or [p.name for p in pipeline.passes[-len(last):]] == [p.name for p in last]
    missing = [p for p in needed if p.name not in have and p.name not in LAST_PASSES]
    if not missing and in_place:
        return pipeline
    return Pipeline.of(*pipeline.passes, *missing, *([] if in_place else last))


def as_plan_error(failure: PassFailure, plan: Plan) -> PlanError | None:
    """A pass's refusal of an option, as the error of the plan field that set it (None: not one)."""
    cause = failure.__cause__
    if not isinstance(cause, PassOptionError):
        return None
    field = plan_field_of(plan, cause.pass_name, cause.option)
    if field is None:
        return None
    where = f"; the graph it was given is in {failure.reproducer_dir}" if failure.reproducer_dir else ""
    error = PlanError(field, f"{cause.rule} (pass '{cause.pass_name}' option '{cause.option}'{where})",
                      getattr(plan, field))
    error.__cause__ = failure
    return error


def check_mesh(plan: Plan, mesh: MeshDesc) -> None:
    """The plan's parallel degrees against the mesh's axes."""
    for axis in ("dp", "cp", "tp", "pp"):
        want = getattr(plan, axis)
        have = mesh.size(axis) if axis in mesh.axes else 1
        if want != have:
            raise PlanError(axis, f"the mesh has {axis}={have} ({mesh}); compile with a mesh of "
                                  f"{axis}={want}, e.g. MeshDesc.fake({axis}={want})", want)
    # A mesh with ep sub-axes runs plans without expert parallelism too (the sub-axes go unused).
    have = mesh.size("ep") if mesh.has_axis("ep") else 1
    if plan.ep > 1 and plan.ep != have:
        raise PlanError("ep", f"the mesh has ep={have} ({mesh}); compile with a mesh of ep={plan.ep}, e.g. "
                              f"MeshDesc.fake(dp={plan.dp}, ep={plan.ep})", plan.ep)


@gc_paused()
@with_stack_room
def compile_program(captured: TrainGraph, plan: Plan, mesh: MeshDesc | None = None, *,
                    backend: str | None = None, dump_dir: str | None = None,
                    inputs: list[Any] | None = None) -> Program:
    """Run the plan's pipeline on ``captured`` (left unchanged) for ``mesh``'s rank.

    ``backend`` decides the backend-specific passes (default: the plan's, eager for ``auto``;
    nothing is lowered here). ``dump_dir`` writes every pass's graphs, ``inputs`` (the captured
    graph's flat inputs) makes the dumps runnable.
    """
    mesh = mesh or MeshDesc.single()
    check_mesh(plan, mesh)
    backend = backend or ("eager" if plan.backend == "auto" else plan.backend)
    fused = bool(captured.attrs.get(GraphAttr.OPTIMIZER_FUSED))
    if fused and plan.pp > 1 and not plan.pipeline and plan.optimizer_kernel == "auto":
        raise PlanError("pp", f"the optimizer ({captured.attrs.get('optimizer')}) was made with fused=True, whose "
                              "kernel the step runs only at pp = 1 (each stage updates its own parameters "
                              "one by one): make it with fused=False, or set optimizer_kernel: none to run "
                              "the single-tensor update (within 1e-6 of the fused one)", plan.pp)
    pipeline = with_required_passes(build_pipeline(plan, backend, optimizer_fused=fused), backend, mesh)
    ctx = PassContext(mesh=mesh)
    dump = DumpWriter(dump_dir, str(pipeline)) if dump_dir else None
    if dump:
        dump.write_capture(captured, ctx.analyses, inputs)
    start = time.perf_counter()

    def start_program() -> Program:
        graph = captured.copy()
        graph.attrs[GraphAttr.MESH] = mesh.to_json()
        return Program.of_step(graph, mesh)

    # ``captured`` stays unchanged, so a failing pass's reproducer is rebuilt from it (no copy per pass).
    manager = PassManager(pipeline, verify_level=plan.verify, dump=dump, source=start_program)
    try:
        program = manager.run_program(start_program(), ctx)
    except PassFailure as failure:
        raise as_plan_error(failure, plan) or failure
    unsplit = [n for n, g in program.graphs.items()
               if graph_kind(g.attrs) == GraphKind.STEP and GraphAttr.GRAD_ACCUMULATION in g.attrs]
    if unsplit:
        raise PipelineError(f"the pipeline '{pipeline}' makes graph '{unsplit[0]}' accumulate gradients but "
                            "never splits it (rule: add split_grad_apply after the passes that need the "
                            "whole step)")
    program.attrs.update({GraphAttr.PASS_PIPELINE: str(pipeline), GraphAttr.BACKEND: backend})
    program.captured, program.records, program.context = captured, manager.records, ctx
    if dump:
        dump.write_program(program)
    log.info("compiled %s for %s: %d -> %d nodes in %d graph(s), %.2fs", captured.name, mesh,
             captured.num_nodes(), program.num_nodes(), len(program.graphs), time.perf_counter() - start)
    return program
