"""eager: run the FX graph op by op with PyTorch's own kernels.

The reference backend: no compilation, so every other backend is checked
against it, and the one that runs anywhere torch runs. It runs the graph's
generated Python code (``GraphModule.forward``), not an interpreter.

The captured step is functional. Its pipeline ends with the passes that make
the eager run reuse buffers as eager PyTorch does (``required_passes``):
``wait_for_reductions_first`` (the optimizer waits for every gradient
reduction before its first update) and ``reuse_dead_operands`` (marks each
pointwise op whose first operand's buffer dies there, parameters and
optimizer state included where the step returns them as their own new value;
its docstring has the rule and why a failing step loses nothing). The lowered
copy switches the marked ops to their in-place variants (``add`` -> ``add_``);
a call whose written inputs share storage with another input (a user's
optimizer state aliasing a parameter, a flattened parameter buffer) runs the
unmarked, functional graph instead (``base.GuardedRunner``). With
``$CANN_PASSES_INPLACE_UPDATES=0`` the driver asks for
``reuse_dead_operands{inputs=false}`` and no input is written.

A gradient bucket whose flattened buffer dies at its all-reduce is reduced in
place (``all_reduce_``), as DDP reduces its bucket, instead of by the
functional ``all_reduce``, which copies the bucket first. The same kernels run
on the same values, so results are bitwise those of the functional graph.

Buffers whose sizes the step knows live in slots allocated once per lowered graph and reused by
every call (``plan_buffers`` marks them and packs them into slots; ``held_buffers`` calls each
planned op's ``out=`` overload on a view of its slot): no fresh pages per step for them
(``$CANN_PASSES_BUFFER_PLAN=0`` leaves the pass out).

The optimizer's step-count arithmetic (bias corrections, step sizes: 0-dim float64 chains, one per
parameter) runs as Python floats, as torch.optim computes it, instead of as about eight 0-dim
tensor ops per parameter: ``scalars_on_host`` marks it, the lowered copy applies the marks
(``$CANN_PASSES_HOST_SCALARS=0`` leaves the pass out).
"""
from __future__ import annotations

from graph_ir import TrainGraph
from graph_ir.meta import GraphAttr

from ..passes.reuse_dead_operands import apply_reuse, reuse_dead_operands
from ..passes.scalars_on_host import apply_scalars_on_host
from .base import GuardedRunner, buffer_plan_enabled, host_scalars_enabled, inplace_updates_enabled
from .held_buffers import apply_buffer_plan


class EagerLowering:
    name = "eager"

    def available(self) -> tuple[bool, str]:
        return True, ""

    @staticmethod
    def required_passes() -> tuple[str, ...]:
        scalars = ("scalars_on_host",) if host_scalars_enabled() else ()
        held = ("plan_buffers",) if buffer_plan_enabled() else ()
        if inplace_updates_enabled():
            return ("wait_for_reductions_first", *scalars, "reuse_dead_operands", *held)
        return (*scalars, "reuse_dead_operands{inputs=false}", *held)

    def compile(self, graph: TrainGraph, example_inputs, plan):
        # (how many nodes each pass marked is in its pass record's statistics)
        lowered = graph.copy()
        apply_scalars_on_host(lowered.gm)
        apply_reuse(lowered.gm)
        names = set(graph.attrs.get(GraphAttr.WRITTEN_INPUTS, ()))
        lowered.recompile()
        apply_buffer_plan(lowered.gm, graph.attrs.get(GraphAttr.BUFFER_PLAN))
        written = [i for i, p in enumerate(lowered.placeholders()) if p.name in names]
        def functional():
            # Writes no input: the marks are made again for the graph's own buffers only.
            copy = graph.copy()
            apply_scalars_on_host(copy.gm)
            reuse_dead_operands(copy.gm)
            return copy.gm

        return GuardedRunner(lowered.gm, lowered, written, functional)
