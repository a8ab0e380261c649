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
stages, and reading the model (``model.state_dict()``, ``model(x)``) first
broadcasts every stage's trained parameters from the rank owning it
(:func:`share_trained_parameters`, a collective over pp), so every rank reads the
trained model.

``run_local`` runs every stage in one process, in order, for checking the
split without processes.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from graph_ir.meta import (ACCUMULATION_FIRST, ACCUMULATION_SCALE, ACCUMULATION_WEIGHT, ACCUMULATOR_PREFIX,
                           GraphAttr, StageValue)
from graph_ir.pipeline_info import pipeline_split_of
from graph_ir.program import Program
from graph_ir.signature import OutputKind, StepSignature

from .binding import ShardStore, autocast_off, bind_inputs, write_back


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
    runners: Mapping[str, Any]      # part -> callable
    step: Any                       # the CompiledStep (model, optimizer, step state, shards)
    values: dict[int, dict] = field(default_factory=dict)   # microbatch -> spec -> tensor
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    first_call: bool = True         # this call's microbatch 0 starts an optimizer step

    def _run(self, part: str, mb: int, batch: Any) -> dict:
        graph = self.graphs[part]
        held = self.values.setdefault(mb, {})
        standard = [s for s in graph.signature.inputs if s.kind not in StageValue.KINDS]
        bound = iter(bind_inputs(_Inputs(graph, standard), self.step.model, self.step.optimizer, batch,
                                 self.step.step_state, self.step.shards, self.step._init_state))
        flat = []
        for spec, node in zip(graph.signature.inputs, graph.placeholders()):
            if spec.kind in StageValue.KINDS:
                if spec not in held:
                    raise PipelineRuntimeError(f"stage {self.index} {part} (microbatch {mb}) needs "
                                               f"{spec.kind} '{spec.name}', which nothing handed it")
                flat.append(_as_recorded(held[spec], node.meta.get("val")))
            else:
                flat.append(next(bound))
        with autocast_off():
            outputs = self.runners[part](*flat)
        # Metrics (loss scaling's overflow flag and scale, the clip's norm) come from this rank's
        # apply graphs; a microbatch graph's would be its last microbatch's.
        self.step.metrics.update(write_back(graph, outputs, self.step.model, self.step.optimizer,
                                            self.step.step_state, self.step.shards))
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
        # The first microbatch of an optimizer step takes data-parallel rank 0's buffers (DDP's
        # broadcast_buffers, which no_sync skips for the others).
        self.step.step_state.values[ACCUMULATION_FIRST] = torch.tensor(1.0 if mb == 0 and self.first_call else 0.0)
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


def _as_recorded(value: torch.Tensor, recorded) -> torch.Tensor:
    """``value`` laid out with the strides the graph was traced with. A boundary value arrives
    contiguous (that is how it is sent), but a graph may read it through views that are valid only
    on its original layout (attention's output, transposed, viewed back to tokens x features)."""
    if not isinstance(recorded, torch.Tensor) or not isinstance(value, torch.Tensor) \
            or value.shape != recorded.shape or value.stride() == recorded.stride():
        return value
    out = torch.empty_strided(recorded.shape, recorded.stride(), dtype=value.dtype, device=value.device)
    return out.copy_(value)


class _StageRunners(Mapping):
    """One stage's runners, read from the compilation's at each call: runners that replace them
    (plan.background_lowering's take-over between two steps) run from the next action on, although
    the schedule and its stages were built once."""

    def __init__(self, runners: dict[str, Any], index: int):
        self._runners, self._prefix = runners, f"stage{index}."

    def __getitem__(self, part: str):
        return self._runners[self._prefix + part]

    def __iter__(self):
        return (name[len(self._prefix):] for name in self._runners if name.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


_PART_OF_KIND = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def not_run_here(step, program: Program) -> dict[str, str]:
    """The graphs of ``program`` this process never calls, and so does not lower: name -> why.

    A pipelined program cuts every stage into forward, backward, backward_input, backward_weight and
    apply graphs, and its schedule runs some of them: 1F1B a stage's backward whole, zero-bubble
    schedules its two parts, DualPipeV both. Under processes each pipeline rank runs its own
    stages' actions (``schedules.action_lists``) and their apply graphs; in one process
    (:func:`run_local`) every stage's forward and apply, and its backward whole or split as the
    schedule splits it. Lowering the rest would cost a compile each (inductor: seconds apiece)."""
    if not is_pipelined(program):
        return {}
    out = {}
    for name in program.graphs:
        why = _why_not_here(step, program, name)
        if why is not None:
            out[name] = why
    return out


def _why_not_here(step, program: Program, name: str) -> str | None:
    from ..schedules import SPLIT_BACKWARD
    stage, part = _stage_part(name)
    if stage is None:
        return None
    info = pipeline_split_of(program)
    if step.world is None:
        backward = ("backward_input", "backward_weight") if info.schedule in SPLIT_BACKWARD else ("backward",)
        return None if part in ("forward", *backward, "apply") else \
            f"{info.schedule} runs stage {stage}'s backward as {' and '.join(backward)} in one process"
    rank, pp = step.mesh.local_rank("pp"), max(info.stage_to_rank) + 1
    if info.stage_to_rank[stage] != rank:
        return f"stage {stage} is run by pipeline rank {info.stage_to_rank[stage]}"
    if part == "apply":
        return None
    if (stage, part) in _parts_run(info.schedule, pp, info.microbatches, info.stages // pp, rank):
        return None
    return f"the {info.schedule} schedule runs no {part} of stage {stage}"


@functools.lru_cache(maxsize=32)
def _parts_run(schedule: str, pp: int, microbatches: int, virtual: int, rank: int) -> frozenset:
    """(stage, part) of every compute action of ``rank`` under the schedule."""
    from ..schedules import action_lists
    return frozenset((a.stage, _PART_OF_KIND[a.kind]) for a in action_lists(schedule, pp, microbatches, virtual)[rank])


def _stage_part(name: str) -> tuple[int | None, str]:
    head, dot, part = name.partition(".")
    index = head[len("stage"):]
    return (int(index), part) if dot and head.startswith("stage") and index.isdigit() else (None, name)


class NotRunHere:
    """Stands for a stage graph this process does not run, and so did not lower (:func:`not_run_here`)."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def __call__(self, *args):
        raise PipelineRuntimeError(f"graph '{self.name}' was not lowered in this process ({self.why})")


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
    info = pipeline_split_of(program)
    n = info.stages
    across = [f"weight '{name}' tied across stages {holders}" for name, holders in info.shared_params.items()]
    across += [f"{what} reduced over every stage" for what in info.stage_reductions]
    if across:
        raise PipelineRuntimeError(f"the stages all-reduce over the pipeline ranks ({'; '.join(across)}), which one "
                                   "process holding every stage has no group for (rule: run pp > 1 with tied weights, "
                                   "gradient clipping or loss scaling under init_distributed, one process per "
                                   "pipeline rank)")
    stages = [StageExecutor(s, stage_graphs(program, s), {p: runners[f"stage{s}.{p}"] for p in
                                                           stage_graphs(program, s)}, step) for s in range(n)]
    rows = [_rows(mb) for mb in microbatches]
    step.metrics = {}
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


def shards_for(step, graph) -> ShardStore:
    """The store a graph's sharded inputs are cut into: the step's, or, for a stage of another
    pipeline rank (compiled here too), one of its own, dropped after compiling: those shards
    (ZeRO-3's parameter pieces) are that rank's to keep. It takes the step's own pieces as they
    are (a tied weight's optimizer state, cut by a stage of this rank that holds it too)."""
    owner = graph.attrs.get(GraphAttr.STAGE, {}).get("rank")
    if step.world is None or owner is None or owner == step.mesh.local_rank("pp"):
        return step.shards
    return ShardStore(step.mesh, beside=step.shards)


def takes_stage_values(graph) -> bool:
    return any(s.kind in StageValue.KINDS for s in graph.signature.inputs)


def example_inputs(step, graph, batch: Any) -> list[torch.Tensor]:
    """Inputs to compile a stage graph with: the model's and batch's where they exist, zeros of the
    recorded shape and strides for values another stage graph hands it (the runner is given them so
    laid out, :func:`_as_recorded`, and a lowering such as inductor's specialises on the strides)."""
    standard = [s for s in graph.signature.inputs if s.kind not in StageValue.KINDS]
    store = shards_for(step, graph)
    bound = iter(bind_inputs(_Inputs(graph, standard), step.model, step.optimizer, batch, step.step_state,
                             store, step._init_state, own=store is step.shards))
    out = []
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        if spec.kind in StageValue.KINDS:
            val = node.meta["val"]
            out.append(torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="cpu").zero_())
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
        if step.plan.accumulate_target is not None:
            raise PipelineRuntimeError("accumulate_target with pp > 1 runs under processes (torchrun); the "
                                       "single-process stage run is for checking a split")
        from ..schedules import SPLIT_BACKWARD
        loss = run_local(step, comp.program, comp.runners, microbatches,
                         split_backward=pipeline_split_of(comp.program).schedule in SPLIT_BACKWARD)
    else:
        loss = run_schedule(step, comp, microbatches)
    if step.world is not None and not comp.pipeline_runtime.applied:   # accumulate_target not reached yet
        return loss
    step.steps_run += 1
    step.optimizer._opt_called = True   # LR schedulers check that the optimizer stepped
    # Each rank trained only its stages' parameters (tensor-parallel ones as shards): the user's model
    # is brought up to date when read, from the ranks that own them.
    if step.shards.params() or step.world is not None:
        step.model_stale = True
    return loss


def share_trained_parameters(step, params: dict[str, torch.Tensor]) -> None:
    """Every rank's copy of every parameter (and buffer the step updates) becomes the trained
    value, sent by the pipeline rank that updates it (its home stage's rank): one broadcast per
    pipeline rank and dtype over this rank's pp group, a collective every rank of the group calls
    (like ZeRO-3's gather). ``params``: name -> the model's tensor; names no stage holds are left."""
    import torch.distributed as dist
    info = pipeline_split_of(step.last.program)
    group = step.world.group("pp")
    owner = {name: info.stage_to_rank[stage] for name, stage in info.param_stage.items() if name in params}
    for k in range(info.pp):
        src = dist.get_global_rank(group, k) if group is not None else k
        names = sorted(n for n, r in owner.items() if r == k)
        for dtype in sorted({params[n].dtype for n in names}, key=str):
            same = [n for n in names if params[n].dtype == dtype]
            flat = torch.cat([params[n].detach().reshape(-1) for n in same])
            dist.broadcast(flat, src, group=group)
            if k != step.mesh.local_rank("pp"):
                for n, piece in zip(same, flat.split([params[n].numel() for n in same])):
                    params[n].data = piece.view_as(params[n]).clone()


# -- torch.distributed.pipelining ---------------------------------------------------------------

def _slot_count(program: Program, s: int) -> int:
    """Slots between stage ``s`` and ``s + 1``: enough for either direction's values (at least one)."""
    acts = [x for x in program[f"stage{s + 1}.forward"].signature.inputs if x.kind == StageValue.ACTIVATION]
    grads = [x for x in program[f"stage{s}.backward"].signature.inputs if x.kind == StageValue.GRADIENT]
    return max(len(acts), len(grads), 1)


def _example(graph, kind: str, *, inputs: bool) -> list[torch.Tensor]:
    """Zero tensors shaped like ``graph``'s inputs (or outputs) of a stage-value kind, in order."""
    if inputs:
        pairs = zip(graph.signature.inputs, graph.placeholders())
    else:
        pairs = zip(graph.signature.outputs, graph.output_values())
    return [torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype) for spec, n in pairs if spec.kind == kind]


def _padded(values: list, slots: int, filler) -> tuple:
    return tuple(values) + tuple(filler() for _ in range(slots - len(values)))


def _slot_filler() -> torch.Tensor:
    return torch.zeros(1)


class PipelineRuntime:
    """This rank's stages as torch ``PipelineStage`` objects under torch's schedule, running our graphs."""

    def __init__(self, step, comp):
        from torch.distributed.pipelining import PipelineStage
        from .. import schedules
        self.step, self.program = step, comp.program
        self.applied = True        # whether the last call updated (accumulate_target: once reached)
        info = pipeline_split_of(self.program)
        self.n, self.ranks = info.stages, info.stage_to_rank
        self.group = step.world.group("pp")
        self.pp_rank = step.mesh.local_rank("pp")
        make_pp_subgroups(step.mesh, info.pp_subgroups)
        self.mine = [s for s in range(self.n) if self.ranks[s] == self.pp_rank]
        # pipeline_split's order: an apply graph handing step state to another local one runs first
        self.apply_order = [s for s in info.apply_order or range(self.n) if s in self.mine]
        self.handed = {f.input.name for f in self.program.flows
                       if f.source.endswith(".apply") and f.target.endswith(".apply")}
        self.executors = {s: StageExecutor(s, stage_graphs(self.program, s), _StageRunners(comp.runners, s), step)
                          for s in self.mine}
        self.stages = {}
        for s in self.mine:
            graphs = self.executors[s].graphs
            kw = {}
            if s > 0:
                slots = _slot_count(self.program, s - 1)
                kw["input_args"] = _padded(_example(graphs["forward"], StageValue.ACTIVATION, inputs=True),
                                           slots, _slot_filler)
                grads = _example(graphs["backward"], StageValue.GRADIENT, inputs=False)
                kw["input_grads"] = _padded(grads, slots, lambda: None)
            else:
                kw["input_args"] = (_slot_filler(),)
            if s < self.n - 1:
                slots = _slot_count(self.program, s)
                kw["output_args"] = _padded(_example(graphs["forward"], StageValue.ACTIVATION, inputs=False),
                                            slots, _slot_filler)
                kw["output_grads"] = _padded(_example(graphs["backward"], StageValue.GRADIENT, inputs=True),
                                             slots, lambda: None)
            else:
                kw["output_args"] = (_slot_filler(),)
            self.stages[s] = PipelineStage(torch.nn.Module(), s, self.n, torch.device("cpu"), group=self.group, **kw)
        self.schedule_name = info.schedule   # the plan's, or the one pipeline_schedule: dynamic chose
        self.schedule = self._schedule(schedules.torch_schedule_class(self.schedule_name), step.plan.microbatches)
        self.events: list[tuple] = []
        self.batches: list = []
        self.in_flight: list = []

    def _schedule(self, cls, m: int):
        from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                            OVERLAP_F_B, REDUCE_GRAD, RESHARD, UNSHARD,
                                                            PipelineScheduleSingle, _PipelineScheduleRuntime)
        stages = [self.stages[s] for s in self.mine]
        loss_fn = _never_called_loss   # torch plans backward actions only for a schedule with a loss function
        if issubclass(cls, PipelineScheduleSingle):
            # GPipe and 1F1B have no custom functions; torch's runtime runs their own action lists.
            from ..schedules import torch_actions
            schedule = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn, scale_grads=False)
            schedule._prepare_schedule_with_comms(torch_actions(self.schedule_name, self.step.plan.pp, m))
        else:
            schedule = cls(stages, m, loss_fn=loss_fn, scale_grads=False)
        schedule.register_custom_function(FORWARD, self._forward)
        schedule.register_custom_function(FULL_BACKWARD, self._backward("backward"))
        schedule.register_custom_function(BACKWARD_INPUT, self._backward("backward_input"))
        schedule.register_custom_function(BACKWARD_WEIGHT, self._backward_weight)
        for kind in (UNSHARD, RESHARD, REDUCE_GRAD):   # nothing sharded by torch; gradients are ours
            schedule.register_custom_function(kind, lambda action, ctx: None)
        compute = {FORWARD: self._forward, FULL_BACKWARD: self._backward("backward"),
                   BACKWARD_INPUT: self._backward("backward_input"), BACKWARD_WEIGHT: self._backward_weight}

        def overlapped(action, ctx):   # DualPipeV's overlapped forward + backward: run one after the other
            for sub in action.sub_actions:
                compute[sub.computation_type](sub, ctx)
        schedule.register_custom_function(OVERLAP_F_B, overlapped)
        return schedule

    def _record(self, stage: int, mb: int, kind: str, start: float) -> None:
        self.events.append((self.pp_rank, stage, mb, kind, start, now()))

    def _forward(self, action, ctx) -> None:
        from torch.distributed.pipelining.schedules import _wait_batch_p2p
        s, mb = action.stage_index, action.microbatch_index
        stage, sched = self.stages[s], ctx.schedule_ref
        if not stage.is_first and s - 1 not in self.stages:
            _wait_batch_p2p(sched.fwd_recv_ops.pop((s, mb)))
        start = now()
        executor = self.executors[s]
        wanted = len([x for x in executor.graphs["forward"].signature.inputs if x.kind == StageValue.ACTIVATION])
        acts = [] if stage.is_first else list(stage._retrieve_recv_activations(mb))[:wanted]
        sent = [t.contiguous() for t in executor.forward(mb, self.batches[mb], acts)]
        slots = _slot_count(self.program, s) if s < self.n - 1 else 1
        output = _padded(sent, slots, _slot_filler)
        stage.fwd_cache[mb] = (output, [])
        self._record(s, mb, "F", start)
        if s + 1 in self.stages:
            self.stages[s + 1].set_local_fwd_input(output, mb)

    def _backward(self, part: str):
        def run(action, ctx) -> None:
            from torch.distributed.pipelining.schedules import _wait_batch_p2p
            s, mb = action.stage_index, action.microbatch_index
            stage, sched = self.stages[s], ctx.schedule_ref
            if not stage.is_last and s + 1 not in self.stages:
                _wait_batch_p2p(sched.bwd_recv_ops.pop((s, mb)))
            start = now()
            executor = self.executors[s]
            grads = [] if stage.is_last else list(stage._retrieve_recv_grads(mb))[:len(executor.grad_inputs)]
            run_part = executor.backward if part == "backward" else executor.backward_input
            sent = [t.contiguous() for t in run_part(mb, self.batches[mb], grads)]
            self._record(s, mb, "B" if part == "backward" else "I", start)
            if stage.is_first:
                return
            # torch pops bwd_cache when it posts the send; gloo's send does not own the tensor, so
            # it is kept alive here until the schedule has waited for every send of the step.
            self.in_flight.append(sent)
            stage.bwd_cache[mb] = _padded(sent, _slot_count(self.program, s - 1), lambda: None)
            if s - 1 in self.stages:
                self.stages[s - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
        return run

    def _backward_weight(self, action, ctx) -> None:
        s, mb = action.stage_index, action.microbatch_index
        start = now()
        self.executors[s].backward_weight(mb, self.batches[mb])
        self._record(s, mb, "W", start)

    def run(self, microbatches: list) -> torch.Tensor:
        import torch.distributed as dist
        m = len(microbatches)
        self.batches, self.events = microbatches, []
        rows = [_rows(b) for b in microbatches]
        dp = self.step.world.dp_size
        set_accumulation_scalars(self.step, rows[0], sum(rows) * dp)
        # What the schedule's step() does before _step_microbatches, which is called directly here
        # because our microbatches are already split and bound to the graphs.
        for st in self.stages.values():
            st.has_backward = True
            st.clear_runtime_states()
        self.step.metrics = {}
        dynamic = self.step.accumulation if self.step.plan.accumulate_target is not None else None
        for executor in self.executors.values():
            executor.first_call = dynamic is None or dynamic.pending_microbatches == 0
        keep = False
        try:
            self.schedule._step_microbatches([(_slot_filler(),)] * m, [{}] * m, None, None)
            # accumulate_target: the accumulators carry over to the next call until the samples of
            # every data-parallel rank reach the target; then one update, scaled by all of them.
            apply = dynamic is None or dynamic.add_samples(self.step, sum(rows), m)
            if dynamic is not None and apply:
                self.step.step_state.values[ACCUMULATION_SCALE] = torch.tensor(1.0 / dynamic.pending_samples)
            if apply:
                self._apply_local_stages()
                if dynamic is not None:
                    dynamic.applied(self.step)
            keep = not apply
            self.applied = apply
        finally:
            self.in_flight = []
            if not keep:    # applied, or failed: nothing of a failed step is kept for the next
                clear_accumulators(self.step)
                if dynamic is not None:
                    dynamic.pending_samples = dynamic.pending_microbatches = 0
            for s in self.mine:
                self.executors[s].values.clear()
        last = self.n - 1
        if last in self.executors:
            losses = self.executors[last].losses
            loss = sum(losses[i] * rows[i] for i in range(m)) / sum(rows)
        else:
            loss = torch.zeros(())
        loss = loss.detach().clone().reshape(())
        dist.broadcast(loss, group=self.group, group_src=self.ranks[last])
        return loss

    def _apply_local_stages(self) -> None:
        """Every apply graph of this rank's stages reads the step state as the step began: a value
        each stage updates alike (loss scaling's scale and growth count, computed by every stage
        from the combined overflow flag) would otherwise be updated once per local stage, and a
        later stage would unscale its gradients by the scale an earlier one already changed. What
        an apply hands a later one (a tied weight's summed gradient) is read as that apply left it."""
        values = self.step.step_state.values
        before = {k: v for k, v in values.items() if k not in self.handed}   # handed on: never restored
        written: dict = {}
        for s in self.apply_order:
            values.update(before)
            self.executors[s].apply()
            written.update((k, v) for k, v in values.items() if before.get(k) is not v)
        values.update(written)

    def timeline(self):
        """The measured timeline of the last step on this rank (``cann_passes.schedules.Timeline``)."""
        from ..schedules import timeline_from_events
        return timeline_from_events(self.events, name=f"measured {self.schedule_name}")


def make_pp_subgroups(mesh, subgroups: dict[str, list[int]]) -> None:
    """Create the process groups the stage graphs name for some of the pipeline ranks (a weight tied
    across the first and last stage at pp > 2), each registered under its name for the graphs'
    functional collectives to resolve.

    ``subgroups``: this rank's name -> the pipeline ranks of its pp group in it. Only members make a
    group (``use_local_synchronization``: ranks outside it take no part), in the same order on each
    (sorted by pipeline ranks); one already registered (an earlier compilation of this run) is kept.
    """
    if not subgroups:
        return
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group
    for name, pp_ranks in sorted(subgroups.items(), key=lambda item: item[1]):
        if mesh.local_rank("pp") not in pp_ranks:
            continue
        try:
            _resolve_process_group(name)
            continue
        except (RuntimeError, ValueError):
            pass
        group = dist.new_group(pp_subgroup_members(mesh, pp_ranks), use_local_synchronization=True,
                               group_desc=f"pipeline ranks {pp_ranks}")
        _register_process_group(name, group)


def pp_subgroup_members(mesh, pp_ranks) -> list[int]:
    """Global ranks of the pipeline ranks ``pp_ranks`` that share this rank's other coordinates
    (its dp and tp coordinates: the pp group it belongs to)."""
    pp = mesh.axes.index("pp")
    members = []
    for k in pp_ranks:
        rank = 0
        for c, size in zip(mesh.coords[:pp] + (k,) + mesh.coords[pp + 1:], mesh.shape):
            rank = rank * size + c
        members.append(rank)
    return members


def _never_called_loss(output, target):
    raise PipelineRuntimeError("the stage graphs compute the loss; torch's loss function is never called")


def run_schedule(step, comp, microbatches: list) -> torch.Tensor:
    """One step on torch's schedule; the PipelineStages and schedule are built once per compilation."""
    runtime = getattr(comp, "pipeline_runtime", None)
    if runtime is None:
        runtime = comp.pipeline_runtime = PipelineRuntime(step, comp)
    step.pipeline_timeline = runtime.timeline
    return runtime.run(microbatches)


def _rows(batch: Any) -> int:
    import torch.utils._pytree as pytree
    return int(pytree.tree_leaves(batch)[0].shape[0])


def now() -> float:
    return time.perf_counter()
