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
import os
import time
from typing import Any

from graph_ir import TrainGraph
from graph_ir.meta import GraphAttr, GraphKind, graph_kind
from graph_ir.mesh import MeshDesc
from graph_ir.program import Program

from .dump import DumpWriter
from .lowering import required_passes
from .pass_manager import PassContext, PassFailure, PassManager, Pipeline, PipelineError
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
    choice = None
    if plan.pp > 1 and plan.pipeline_schedule == "dynamic" and plan.pipeline is None:
        choice = choose_pipeline_schedule(captured, plan, mesh, backend)
        plan = plan.replace(pipeline_schedule=choice["schedule"], pipeline_virtual_stages=choice["virtual_stages"])
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
    if choice is not None:
        program.attrs[GraphAttr.PIPELINE_PARALLEL]["dynamic"] = choice
        log.info("pipeline_schedule dynamic: %s (v=%d) chosen by simulation\n%s", choice["schedule"],
                 choice["virtual_stages"], choice["table"])
    program.captured, program.records, program.context = captured, manager.records, ctx
    if dump:
        dump.write_program(program)
        if choice is not None:
            with open(os.path.join(dump.directory, "pipeline_schedule.txt"), "w", encoding="utf-8") as f:
                f.write(f"pipeline_schedule: dynamic -> {choice['schedule']} (v={choice['virtual_stages']})\n"
                        f"{choice['table']}\n")
    log.info("compiled %s for %s: %d -> %d nodes in %d graph(s), %.2fs", captured.name, mesh,
             captured.num_nodes(), program.num_nodes(), len(program.graphs), time.perf_counter() - start)
    return program


# -- pipeline_schedule: dynamic ----------------------------------------------------------------

def dynamic_candidates(plan: Plan) -> list[tuple[str, int]]:
    """The schedules ``dynamic`` compares: every one, with the plan's virtual stages where it takes
    them (interleaving needs at least 2; DualPipeV runs exactly 2)."""
    v = plan.pipeline_virtual_stages
    out = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", max(2, v)), ("zb1p", v), ("dualpipev", 2)]
    if v > 1:
        out.insert(4, ("zb1p", 1))
    return out


def choose_pipeline_schedule(captured: TrainGraph, plan: Plan, mesh: MeshDesc, backend: str) -> dict:
    """``pipeline_schedule: dynamic``: split the step for every candidate schedule, simulate each
    over its real stage graphs, and take the fastest whose ranks fit the device's memory.

    The passes before ``pipeline_split`` do not depend on the schedule, so they run once; then
    per candidate the split (its own stage count and in-flight microbatches), the stage graphs
    priced by the cost model (:func:`cann_passes.simulate.stage_program_figures`: forward, input
    and weight gradient seconds, bytes sent, static and per-microbatch bytes) and torch's action
    list replayed with those costs (:func:`cann_passes.schedules.simulate`). A rank's memory is
    its stages' static bytes plus the peak of the activations they hold together, against the
    profile's capacity. Returns the choice (schedule, v, per-candidate figures, a table); raises
    PlanError on ``pipeline_schedule`` with the table when no candidate runs and fits.
    """
    from . import schedules as S
    from .cost_model import get_profile
    from .simulate import stage_program_figures
    profile = get_profile(plan.device_profile)
    m = plan.microbatches
    rows: list[dict] = []
    prefix = program = None
    for name, v in dynamic_candidates(plan):
        row = {"schedule": name, "virtual_stages": v, "makespan_s": None, "bubble": None,
               "peak_bytes": None, "imbalance": None, "verdict": ""}
        rows.append(row)
        try:
            S.check(name, plan.pp, m, v)
            candidate = plan.replace(pipeline_schedule=name, pipeline_virtual_stages=v, verify="off",
                                     dump_dir=None)
        except (ValueError, PlanError) as exc:
            row["verdict"] = f"refused: {exc}"
            continue
        passes = with_required_passes(build_pipeline(candidate, backend), backend).passes
        cut = next(i for i, p in enumerate(passes) if p.name == "pipeline_split")
        ctx = PassContext(plan=candidate, mesh=mesh, rank=mesh.rank, world_size=mesh.world_size)
        if prefix is None:   # the schedule-independent passes, once
            graph = captured.copy()
            graph.attrs[GraphAttr.MESH] = mesh.to_json()
            prefix = PassManager(Pipeline.of(*passes[:cut]), verify_level="off").run_program(
                Program.of_step(graph, mesh), ctx)
        try:
            program = PassManager(Pipeline.of(*passes[cut:]), verify_level="off").run_program(prefix.copy(), ctx)
        except PassFailure as exc:   # the split refuses this stage count (more stages than units, ...)
            if not isinstance(exc.__cause__, ValueError):   # PlanError and the split's own errors
                raise
            row["verdict"] = f"refused: {exc.__cause__}"
            continue
        figs, costs = stage_program_figures(program, candidate, profile)
        timeline = S.simulate(name, plan.pp, m, costs, v, link=profile)
        static = [sum(f[k] for k in ("params", "grads", "optimizer_state", "buffers", "step_state")) for f in figs]
        held = timeline.peak_activation_bytes([f["activations"] + f["param_copies"] for f in figs])
        owner = S.stage_to_rank(name, plan.pp, v)
        per_rank = [held.get(r, 0.0) + sum(static[s] for s in range(len(figs)) if owner[s] == r)
                    for r in range(plan.pp)]
        row.update(makespan_s=timeline.makespan, bubble=timeline.bubble_fraction, peak_bytes=max(per_rank),
                   imbalance=program.attrs[GraphAttr.PIPELINE_PARALLEL]["imbalance"],
                   virtual_stages=timeline.v)
        capacity = getattr(profile, "memory_capacity", None)
        if capacity is not None and max(per_rank) > capacity:
            row["verdict"] = f"refused: a rank needs {max(per_rank):.4g} bytes > {capacity:.4g} ({profile.name})"
    fits = [r for r in rows if r["makespan_s"] is not None and not r["verdict"]]
    best = min(fits, key=lambda r: r["makespan_s"]) if fits else None
    for r in fits:
        r["verdict"] = "chosen" if r is best else f"{r['makespan_s'] / best['makespan_s']:.3f}x slower"
    lines = [f"{'schedule':<18}{'v':>3}{'makespan s':>14}{'bubble':>9}{'imbalance':>11}{'peak bytes':>14}  verdict"]
    for r in rows:
        if r["makespan_s"] is None:
            lines.append(f"{r['schedule']:<18}{r['virtual_stages']:>3}{'-':>14}{'-':>9}{'-':>11}{'-':>14}  "
                         f"{r['verdict']}")
        else:
            lines.append(f"{r['schedule']:<18}{r['virtual_stages']:>3}{r['makespan_s']:>14.6g}{r['bubble']:>9.3f}"
                         f"{r['imbalance']:>11.4f}{r['peak_bytes']:>14.4g}  {r['verdict']}")
    table = "\n".join(lines)
    if best is None:
        raise PlanError("pipeline_schedule", f"dynamic: no schedule runs and fits for pp = {plan.pp}, "
                                             f"microbatches = {m}\n{table}", "dynamic")
    return {"schedule": best["schedule"], "virtual_stages": best["virtual_stages"],
            "profile": profile.name, "candidates": rows, "table": table}
