"""The compile driver: a captured step + a plan + a mesh description -> a Program.

:func:`compile_program` is the one sequence every front end runs — the
runtime's ``CompiledStep``, the dump tool, the benches, and the planner to
come: build the plan's pipeline (plus the passes the backend requires), run
it over the program with the plan's verifier and dumps, and check the
result. It never needs a process group: the passes read only the mesh
description, so ``MeshDesc.fake(dp=64)`` compiles rank 0's program of a
64-rank run in one process. Lowering the program's graphs to a backend is
the caller's step (it needs example inputs).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from graph_ir import TrainGraph
from graph_ir.meta import GraphAttr, GraphKind, graph_kind
from graph_ir.mesh import MeshDesc
from graph_ir.program import Program

from .dump import DumpWriter
from .lowering import required_passes
from .pass_manager import PassContext, PassManager, Pipeline, PipelineError
from .pipeline import build_pipeline
from .plan import Plan, PlanError

log = logging.getLogger("cann_passes")


def with_required_passes(pipeline: Pipeline, backend: str) -> Pipeline:
    """``pipeline`` with the passes ``backend`` needs appended where they are missing."""
    have = {p.name for p in pipeline.passes}
    missing = [name for name in required_passes(backend) if name not in have]
    return Pipeline.of(*pipeline.passes, *missing) if missing else pipeline


def check_mesh(plan: Plan, mesh: MeshDesc) -> None:
    """The plan's parallel degrees against the mesh's axes."""
    for axis in ("dp", "tp", "pp"):
        want = getattr(plan, axis)
        have = mesh.size(axis) if axis in mesh.axes else 1
        if want != have:
            raise PlanError(axis, f"the mesh has {axis}={have} ({mesh}); compile with a mesh of "
                                  f"{axis}={want}, e.g. MeshDesc.fake({axis}={want})", want)


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
    pipeline = with_required_passes(build_pipeline(plan, backend), backend)
    ctx = PassContext(plan=plan, mesh=mesh, rank=mesh.rank, world_size=mesh.world_size)
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
    program = manager.run_program(start_program(), ctx)
    unsplit = [n for n, g in program.graphs.items()
               if graph_kind(g.attrs) == GraphKind.STEP and GraphAttr.GRAD_ACCUMULATION in g.attrs]
    if unsplit:
        raise PipelineError(f"the pipeline '{pipeline}' makes graph '{unsplit[0]}' accumulate gradients but "
                            "never splits it (rule: add split_grad_apply after the passes that need the "
                            "whole step)")
    program.attrs.update(pipeline=str(pipeline), backend=backend)
    program.captured, program.records, program.context = captured, manager.records, ctx
    if dump:
        dump.write_program(program)
    log.info("compiled %s for %s: %d -> %d nodes in %d graph(s), %.2fs", captured.name, mesh,
             captured.num_nodes(), program.num_nodes(), len(program.graphs), time.perf_counter() - start)
    return program
