"""Planning: the choices a plan leaves open, resolved by simulation, above compiling.

Compiling (:func:`cann_passes.compile.compile_program`) takes a plan whose choices are made;
this layer makes them. Today the open choice is ``pipeline_schedule: dynamic``: the step is
split for every candidate schedule, each candidate's real stage graphs are priced by the cost
model and its schedule replayed (:func:`cann_passes.schedules.choose`, the one place a
dynamic schedule is chosen), and the fastest whose ranks fit the device's memory is taken.

:func:`compile_planned` is what a front end calls: resolve, compile, and record the choice
(and, with dumps on, this rank's simulated memory and time) beside the program.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from graph_ir import TrainGraph
from graph_ir.meta import GraphAttr
from graph_ir.mesh import MeshDesc
from graph_ir.pipeline_info import pipeline_split_of, set_pipeline_split
from graph_ir.program import Program

from . import schedules as S
from .compile import compile_program, with_required_passes
from .cost_model import get_profile
from .pass_manager import PassContext, PassFailure, PassManager, Pipeline
from .pass_pipeline import build_pipeline
from .plan import Plan, PlanError
from .figures import stage_program_figures, write_simulation

log = logging.getLogger("cann_passes")


def needs_planning(plan: Plan) -> bool:
    return plan.pp > 1 and plan.pipeline_schedule == "dynamic" and plan.pipeline is None


def resolve_plan(captured: TrainGraph, plan: Plan, mesh: MeshDesc, backend: str) -> tuple[Plan, dict | None]:
    """``plan`` with its open choices made, and the record of how (None when nothing was open)."""
    if not needs_planning(plan):
        return plan, None
    choice = choose_pipeline_schedule(captured, plan, mesh, backend)
    resolved = plan.replace(pipeline_schedule=choice["schedule"], pipeline_virtual_stages=choice["virtual_stages"])
    log.info("pipeline_schedule dynamic: %s (v=%d) chosen by simulation\n%s", choice["schedule"],
             choice["virtual_stages"], choice["table"])
    return resolved, choice


def compile_planned(captured: TrainGraph, plan: Plan, mesh: MeshDesc | None = None, *,
                    backend: str | None = None, dump_dir: str | None = None,
                    inputs: list[Any] | None = None) -> Program:
    """:func:`resolve_plan`, then :func:`compile_program`; the choice is kept in the program's
    ``pipeline_parallel`` attrs and, with ``dump_dir``, written beside the dump with this rank's
    simulation (``pipeline_schedule.txt``, ``simulation.json``)."""
    mesh = mesh or MeshDesc.single()
    backend = backend or ("eager" if plan.backend == "auto" else plan.backend)
    resolved, choice = resolve_plan(captured, plan, mesh, backend)
    program = compile_program(captured, resolved, mesh, backend=backend, dump_dir=dump_dir, inputs=inputs)
    if choice is not None:
        split = pipeline_split_of(program)
        split.dynamic = choice
        set_pipeline_split(program, split)
    if dump_dir:
        write_simulation(dump_dir, program, resolved)
        if choice is not None:
            with open(os.path.join(dump_dir, "pipeline_schedule.txt"), "w", encoding="utf-8") as f:
                f.write(f"pipeline_schedule: dynamic -> {choice['schedule']} (v={choice['virtual_stages']})\n"
                        f"{choice['table']}\n")
    return program


def choose_pipeline_schedule(captured: TrainGraph, plan: Plan, mesh: MeshDesc, backend: str) -> dict:
    """``pipeline_schedule: dynamic`` over the step's real stage graphs.

    The passes before ``pipeline_split`` do not depend on the schedule, so they run once; then
    per candidate the split (its own stage count and in-flight microbatches), the stage graphs
    priced by the cost model (:func:`cann_passes.figures.stage_program_figures`: forward, input
    and weight gradient seconds, bytes sent, static and per-microbatch bytes) and torch's action
    list replayed with those costs (:func:`cann_passes.schedules.simulate`). A rank's memory is
    its stages' static bytes plus the peak of the activations they hold together, against the
    profile's capacity. Returns the choice (schedule, v, per-candidate figures, a table); raises
    PlanError on ``pipeline_schedule`` with the table when no candidate runs and fits.
    """
    profile = get_profile(plan.device_profile)
    m = plan.microbatches
    prefix: list[Program] = []

    def evaluate(name: str, v: int) -> S.Candidate:
        S.check(name, plan.pp, m, v)
        candidate = plan.replace(pipeline_schedule=name, pipeline_virtual_stages=v, verify="off", dump_dir=None)
        passes = with_required_passes(build_pipeline(candidate, backend), backend, mesh).passes
        cut = next(i for i, p in enumerate(passes) if p.name == "pipeline_split")
        ctx = PassContext(mesh=mesh)
        if not prefix:   # the schedule-independent passes, once
            graph = captured.copy()
            graph.attrs[GraphAttr.MESH] = mesh.to_json()
            prefix.append(PassManager(Pipeline.of(*passes[:cut]), verify_level="off").run_program(
                Program.of_step(graph, mesh), ctx))
        try:
            program = PassManager(Pipeline.of(*passes[cut:]), verify_level="off").run_program(prefix[0].copy(), ctx)
        except PassFailure as exc:   # the split refuses this stage count (more stages than units, ...)
            if not isinstance(exc.__cause__, ValueError):
                raise
            raise ValueError(str(exc.__cause__)) from exc
        figs, costs = stage_program_figures(program, candidate, profile)
        timeline = S.simulate(name, plan.pp, m, costs, v, link=profile)
        static = [sum(f[k] for k in ("params", "grads", "optimizer_state", "buffers", "step_state")) for f in figs]
        held = timeline.peak_activation_bytes([f["activations"] + f["param_copies"] for f in figs])
        owner = S.stage_to_rank(name, plan.pp, v)
        per_rank = [held.get(r, 0.0) + sum(static[s] for s in range(len(figs)) if owner[s] == r)
                    for r in range(plan.pp)]
        return S.Candidate(name, timeline.v, timeline, max(per_rank),
                           pipeline_split_of(program).imbalance)

    best, rows, table = S.choose(S.dynamic_candidates(plan.pipeline_virtual_stages), evaluate,
                                 memory_limit=getattr(profile, "memory_capacity", None),
                                 limit_name=f"{profile.name} capacity")
    if best is None:
        raise PlanError("pipeline_schedule", f"dynamic: no schedule runs and fits for pp = {plan.pp}, "
                                             f"microbatches = {m}\n{table}", "dynamic")
    candidates = [{"schedule": r.schedule, "virtual_stages": r.virtual_stages, "makespan_s": r.makespan,
                   "bubble": None if r.timeline is None else r.timeline.bubble_fraction,
                   "peak_bytes": r.peak_bytes, "imbalance": r.imbalance, "verdict": r.verdict} for r in rows]
    return {"schedule": best.schedule, "virtual_stages": best.virtual_stages, "profile": profile.name,
            "candidates": candidates, "table": table}
