"""Running a pipelined program: its stage graphs on torch.distributed.pipelining's schedules.

``pipeline_split`` gives every stage a forward, backward (and its input / weight
halves) and apply graph. Here torch's schedule classes decide the order of
actions and do the send/recv: each rank builds one ``PipelineStage`` per stage
it holds (static metadata, from the stage graphs' boundary values) and
registers custom functions for ``FORWARD`` / ``FULL_BACKWARD`` /
``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT`` that run our compiled graphs instead of
autograd. GPipe and 1F1B are single-stage schedules in torch, without custom
functions; their own action lists (``_get_pipeline_order``) are run by torch's
``_PipelineScheduleRuntime``, so every schedule goes through the same runtime.

Torch's stages pair the i-th gradient with the i-th activation. Our backward
boundary is not always the gradients of the forward boundary one for one (a
residual's gradient and a branch's gradient may cross separately, or a value
no activation corresponds to), so each stage exchanges a fixed number of
*slots*: slot i carries the i-th forward boundary value and, backwards, the
i-th backward boundary value, each with its own static metadata (a slot
without a value carries a one-element placeholder forward and nothing
backward).

Per rank and step: each microbatch's batch leaves are bound to every stage
graph that reads them (every rank is given the same batch), the gradient
accumulators live in the step's ``StepState`` under their own names, and the
apply graphs of this rank's stages run once after the schedule. The user's
model keeps every parameter; each rank updates only the parameters of its own
stages (the others keep their initial values there).

``run_local`` runs every stage in one process, in order, for checking the
split without processes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from graph_ir.meta import ACCUMULATION_SCALE, ACCUMULATION_WEIGHT, ACCUMULATOR_PREFIX, GraphAttr, StageValue
from graph_ir.program import Program
from graph_ir.signature import OutputKind, StepSignature

from .binding import bind_inputs, write_back


class PipelineRuntimeError(RuntimeError):
    pass


class _Inputs:
    """A graph seen only through its standard inputs (for ``bind_inputs``)."""

    def __init__(self, graph, specs):
        self.signature = StepSignature(specs, [])
        self.attrs = graph.attrs


@dataclass
class StageExecutor:
    """One stage's graphs, their runners, and what each microbatch leaves between its actions."""

    index: int
    graphs: dict[str, Any]          # part -> TrainGraph (forward, backward, backward_input, ...)
    runners: dict[str, Any]         # part -> callable
    step: Any                       # the CompiledStep (model, optimizer, step state, shards)
    values: dict[int, dict] = field(default_factory=dict)   # microbatch -> spec -> tensor
    losses: dict[int, torch.Tensor] = field(default_factory=dict)

    def _run(self, part: str, mb: int, batch: Any) -> dict:
        graph = self.graphs[part]
        held = self.values.setdefault(mb, {})
        standard = [s for s in graph.signature.inputs if s.kind not in StageValue.KINDS]
        bound = iter(bind_inputs(_Inputs(graph, standard), self.step.model, self.step.optimizer, batch,
                                 self.step.step_state, self.step.shards, self.step._init_state))
        flat = []
        for spec in graph.signature.inputs:
            if spec.kind in StageValue.KINDS:
                if spec not in held:
                    raise PipelineRuntimeError(f"stage {self.index} {part} (microbatch {mb}) needs "
                                               f"{spec.kind} '{spec.name}', which nothing handed it")
                flat.append(held[spec])
            else:
                flat.append(next(bound))
        outputs = self.runners[part](*flat)
        write_back(graph, outputs, self.step.model, self.step.optimizer, self.step.step_state, self.step.shards)
        produced = {}
        for spec, value in zip(graph.signature.outputs, outputs):
            if spec.kind in StageValue.KINDS:
                produced[spec] = value
            elif spec.kind == OutputKind.LOSS:
                self.losses[mb] = value.detach()
        return produced

    def forward(self, mb: int, batch: Any, acts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run the forward on boundary activations ``acts`` (in the graph's order); returns those it sends."""
        graph = self.graphs["forward"]
        held = self.values.setdefault(mb, {})
        for spec, value in zip([s for s in graph.signature.inputs if s.kind == StageValue.ACTIVATION], acts):
            held[spec] = value
        produced = self._run("forward", mb, batch)
        held.update((s, v) for s, v in produced.items() if s.kind == StageValue.SAVED)
        return [produced[s] for s in graph.signature.outputs if s.kind == StageValue.ACTIVATION]

    def _take_grads(self, part: str, mb: int, grads: list[torch.Tensor]) -> None:
        held = self.values.setdefault(mb, {})
        for spec, value in zip(self.grad_inputs, grads):
            held[spec] = value

    @property
    def grad_inputs(self) -> list:
        """The backward boundary values this stage receives, in slot order."""
        return [s for s in self.graphs["backward"].signature.inputs if s.kind == StageValue.GRADIENT]

    @property
    def grad_outputs(self) -> list:
        return [s for s in self.graphs["backward"].signature.outputs if s.kind == StageValue.GRADIENT]

    def backward(self, mb: int, batch: Any, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        self._take_grads("backward", mb, grads)
        produced = self._run("backward", mb, batch)
        self.values.pop(mb, None)
        return [produced[s] for s in self.grad_outputs]

    def backward_input(self, mb: int, batch: Any, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        self._take_grads("backward_input", mb, grads)
        produced = self._run("backward_input", mb, batch)
        self.values[mb].update((s, v) for s, v in produced.items() if s.kind == StageValue.INTERMEDIATE)
        return [produced[s] for s in self.grad_outputs]

    def backward_weight(self, mb: int, batch: Any) -> None:
        self._run("backward_weight", mb, batch)
        self.values.pop(mb, None)

    def apply(self) -> None:
        self._run("apply", -1, None)
        self.values.clear()


def stage_graphs(program: Program, index: int) -> dict[str, Any]:
    prefix = f"stage{index}."
    return {name[len(prefix):]: g for name, g in program.graphs.items() if name.startswith(prefix)}


def is_pipelined(program: Program) -> bool:
    return GraphAttr.PIPELINE_PARALLEL in program.attrs


def set_accumulation_scalars(step, rows: int, total_rows: int) -> None:
    """Each microbatch's gradient enters the accumulator weighted by its rows; apply divides by all rows."""
    step.step_state.values[ACCUMULATION_WEIGHT] = torch.tensor(float(rows))
    step.step_state.values[ACCUMULATION_SCALE] = torch.tensor(1.0 / total_rows)


def clear_accumulators(step) -> None:
    for name in [n for n in step.step_state.values if n.startswith(ACCUMULATOR_PREFIX)]:
        del step.step_state.values[name]


def run_local(step, program: Program, runners: dict[str, Any], microbatches: list, *,
              split_backward: bool = False) -> torch.Tensor:
    """Every stage in this process: per microbatch all forwards in order, then all backwards in reverse;
    then every stage's apply. ``split_backward`` runs backward_input then backward_weight instead of
    the full backward (the zero-bubble parts)."""
    n = program.attrs[GraphAttr.PIPELINE_PARALLEL]["stages"]
    stages = [StageExecutor(s, stage_graphs(program, s), {p: runners[f"stage{s}.{p}"] for p in
                                                           stage_graphs(program, s)}, step) for s in range(n)]
    rows = [_rows(mb) for mb in microbatches]
    try:
        for mb, batch in enumerate(microbatches):
            set_accumulation_scalars(step, rows[mb], sum(rows))
            acts: list = []
            for st in stages:
                acts = st.forward(mb, batch, acts)
            grads: list = []
            for st in reversed(stages):
                if split_backward:
                    grads_out = st.backward_input(mb, batch, grads)
                    st.backward_weight(mb, batch)
                    grads = grads_out
                else:
                    grads = st.backward(mb, batch, grads)
        for st in stages:
            st.apply()
    finally:
        clear_accumulators(step)
    losses = stages[-1].losses
    return sum(losses[i] * rows[i] for i in range(len(microbatches))) / sum(rows)


def takes_stage_values(graph) -> bool:
    return any(s.kind in StageValue.KINDS for s in graph.signature.inputs)


def example_inputs(step, graph, batch: Any) -> list[torch.Tensor]:
    """Inputs to compile a stage graph with: the model's and batch's where they exist, zeros of the
    recorded shape for values another stage graph hands it."""
    standard = [s for s in graph.signature.inputs if s.kind not in StageValue.KINDS]
    bound = iter(bind_inputs(_Inputs(graph, standard), step.model, step.optimizer, batch, step.step_state,
                             step.shards, step._init_state))
    out = []
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        if spec.kind in StageValue.KINDS:
            val = node.meta["val"]
            out.append(torch.zeros(val.shape, dtype=val.dtype, device="cpu"))
        else:
            out.append(next(bound))
    return out


def step(step, batch: Any) -> torch.Tensor:
    """One optimizer step of a pipelined plan: ``plan.microbatches`` microbatches through the stages."""
    from .accumulation import split_batch
    microbatches = split_batch(batch, step.plan.microbatches)
    comp = step.compile(microbatches[0])
    if not is_pipelined(comp.program):
        raise PipelineRuntimeError(f"plan pp = {step.plan.pp} but the compiled program has no pipeline stages "
                                   f"(graphs {', '.join(comp.program.graphs)}): a plan pipeline given as text "
                                   "must include grad_accumulation and pipeline_split")
    if step.world is None:
        from ..schedules import SPLIT_BACKWARD
        loss = run_local(step, comp.program, comp.runners, microbatches,
                         split_backward=step.plan.pipeline_schedule in SPLIT_BACKWARD)
    else:
        loss = run_schedule(step, comp, microbatches)
    step.steps_run += 1
    step.optimizer._opt_called = True   # LR schedulers check that the optimizer stepped
    return loss


def _rows(batch: Any) -> int:
    import torch.utils._pytree as pytree
    return int(pytree.tree_leaves(batch)[0].shape[0])


def now() -> float:
    return time.perf_counter()
