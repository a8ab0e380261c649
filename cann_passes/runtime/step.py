"""CompiledStep: a whole training step, compiled, bound to a live model and optimizer.

Each call feeds the graph the model's current parameters and buffers, the
optimizer's state in torch.optim's own format, the current learning rates
and the batch; then it writes the new parameters and state back. So
``model.state_dict()`` and ``optimizer.state_dict()`` are always those of the
last step, and an LR scheduler that edits ``param_groups`` takes effect on
the next call without recompiling. A new batch shape or structure, or a
changed baked hyperparameter (betas, weight decay, ...), compiles anew; each
compilation is kept, keyed by what it was specialised on.

Distributed plans (dp > 1, ZeRO) compile per rank: the passes get the mesh
of :func:`cann_passes.runtime.distributed.init_distributed` and may make the
graph rank-specific. A ZeRO graph's optimizer state is kept sharded in
``optimizer.state`` (each rank's padded 1-D shard); with stage 3 the
parameter shards live in ``step.param_shards`` and the model's own
parameters are left as they were until :meth:`CompiledStep.sync_model`
gathers them. With gradient accumulation the final graph is split into a
"grad" graph run per microbatch and an "apply" graph run once per optimizer
step (``step.graphs`` lists both).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from graph_ir import TrainGraph, capture_train_step, gather_inputs
from graph_ir.analysis import GraphCost, MemoryProfile
from graph_ir.capture import StepLayout
from graph_ir.optimizers import rule_for
from graph_ir.signature import OutputKind

from ..dump import DumpWriter, dump_dir_from
from ..lowering import get_lowering, resolve_backend
from ..pass_manager import PassContext, PassManager, PassRecord, Pipeline
from ..pipeline import build_pipeline
from ..plan import Plan
from . import accumulation, distributed
from .binding import StepState, bind_inputs, write_back

log = logging.getLogger("cann_passes")


@dataclass
class Compilation:
    """What compiling for one batch signature produced."""

    captured: TrainGraph
    graph: TrainGraph
    layout: StepLayout
    pipeline: Pipeline
    backend: str
    records: list[PassRecord]
    runner: Callable[..., Any]
    capture_seconds: float
    compile_seconds: float
    cost: GraphCost
    memory: MemoryProfile
    context: PassContext = field(repr=False, default=None)
    # With gradient accumulation: the per-microbatch and the per-optimizer-step parts of ``graph``.
    parts: dict[str, TrainGraph] = field(default_factory=dict)
    part_runners: dict[str, Callable[..., Any]] = field(repr=False, default_factory=dict)


def _batch_key(batch: Any) -> tuple:
    leaves, spec = pytree.tree_flatten(batch)
    return (str(spec), tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor)
                             else type(t) for t in leaves))


class CompiledStep:
    """``step(batch) -> loss``: one whole training step per call."""

    def __init__(self, model: torch.nn.Module, plan: Plan, *, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]):
        self.model, self.plan, self.optimizer, self.loss_fn = model, plan, optimizer, loss_fn
        self.rule = rule_for(optimizer)  # refuses unsupported optimizers before any work
        self.backend = resolve_backend(plan.backend)
        self._compiled: dict[tuple, Compilation] = {}
        self.step_state = StepState()
        self.metrics: dict[str, torch.Tensor] = {}
        self.steps_run = 0
        self.world = distributed.current()
        if (plan.dp > 1 or plan.zero_stage) and self.world is None:
            raise RuntimeError(f"plan dp={plan.dp}, zero_stage={plan.zero_stage} needs the process groups: "
                               "call cann_passes.runtime.distributed.init_distributed(plan) first, in a "
                               "process launched by torchrun")
        self.param_shards: dict[str, torch.Tensor] = {}
        self.accumulation = accumulation.AccumulationState(plan)

    # -- compilation --------------------------------------------------------------------------
    def _baked_hparams(self) -> tuple:
        return tuple(tuple(group.get(k) for k in self.rule.baked) for group in self.optimizer.param_groups)

    def compile(self, batch: Any) -> Compilation:
        """Compile for this batch's structure and shapes (done by the first call anyway)."""
        key = (_batch_key(batch), self._baked_hparams())
        if key not in self._compiled:
            self._compiled[key] = self._compile(batch)
        return self._compiled[key]

    def _compile(self, batch: Any) -> Compilation:
        t0 = time.perf_counter()
        with accumulation.full_shape_state(self.model, self.optimizer):
            captured, layout = capture_train_step(self.model, self.optimizer, self.loss_fn, batch)
        capture_seconds = time.perf_counter() - t0
        pipeline = build_pipeline(self.plan, self.backend)
        ctx = PassContext(plan=self.plan)
        if self.world is not None:
            ctx.mesh, ctx.rank, ctx.world_size = self.world.info, self.world.rank, self.world.world_size
        directory = dump_dir_from(self.plan.dump_dir)
        dump = DumpWriter(directory, str(pipeline)) if directory else None
        if dump:
            dump.write_capture(captured, ctx.analyses,
                               gather_inputs(self.model, self.optimizer, layout, batch))
        manager = PassManager(pipeline, verify_level=self.plan.verify, dump=dump)
        graph = manager.run(captured.copy(), ctx)
        t1 = time.perf_counter()
        parts, part_runners, runner = {}, {}, None
        if accumulation.is_split(graph):
            parts = dict(zip(("grad", "apply"), accumulation.split_grad_apply(graph)))
            for part_name, part in parts.items():
                part_runners[part_name] = get_lowering(self.backend).compile(part, self._inputs(part, batch),
                                                                             self.plan)
        else:
            runner = get_lowering(self.backend).compile(graph, self._inputs(graph, batch), self.plan)
        compile_seconds = time.perf_counter() - t1
        log.info("compiled %s: %d -> %d nodes, backend %s, %.2fs passes, %.2fs lowering",
                 graph.name, captured.num_nodes(), graph.num_nodes(), self.backend,
                 sum(r.seconds for r in manager.records), compile_seconds)
        return Compilation(captured, graph, layout, pipeline, self.backend, manager.records, runner,
                           capture_seconds, compile_seconds, ctx.analyses.get("cost", graph),
                           ctx.analyses.get("memory", graph), ctx, parts, part_runners)

    # -- running ------------------------------------------------------------------------------
    def _inputs(self, graph: TrainGraph, batch: Any) -> list[torch.Tensor]:
        return bind_inputs(graph, self.model, self.optimizer, batch, self.step_state, self.param_shards)

    def _run(self, graph: TrainGraph, runner, batch: Any) -> torch.Tensor | None:
        outputs = runner(*self._inputs(graph, batch))
        self.metrics = write_back(graph, outputs, self.model, self.optimizer, self.step_state,
                                  self.param_shards)
        loss = [o for spec, o in zip(graph.signature.outputs, outputs) if spec.kind == OutputKind.LOSS]
        return loss[0].detach() if loss else None

    def __call__(self, batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch``; with ``plan.microbatches`` N the batch is split into N
        microbatches; with ``plan.accumulate_target`` the batch is one microbatch and the optimizer
        runs once the accumulated samples reach the target (see ``step.accumulation``)."""
        if self.plan.accumulate_target is not None:
            return self.accumulation.dynamic_step(self, batch)
        if self.plan.microbatches > 1:
            return self.accumulate(accumulation.split_batch(batch, self.plan.microbatches))
        comp = self.compile(batch)
        loss = self._run(comp.graph, comp.runner, batch)
        self.steps_run += 1
        # The step performed the optimizer's update: tell LR schedulers, which
        # otherwise warn that they stepped before the optimizer did.
        self.optimizer._opt_called = True
        return loss

    def accumulate(self, batches: list) -> torch.Tensor:
        """One optimizer step over the given microbatches (gradients accumulated, synchronized once)."""
        return self.accumulation.static_step(self, batches)

    def sync_model(self) -> None:
        """ZeRO-3: all-gather the parameter shards into the model's parameters (every rank must call)."""
        comp = self.last
        zero = comp.graph.attrs.get("zero")
        if not zero or zero["stage"] != 3:
            return
        from .checkpoint import gather_full
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, shard in self.param_shards.items():
                params[name].data = gather_full(shard, params[name].shape, self.world.group("dp"))

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (padded shards under ZeRO)."""
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor))

    # -- what compilation did -----------------------------------------------------------------
    @property
    def last(self) -> Compilation:
        if not self._compiled:
            raise RuntimeError("nothing compiled yet: call the step (or .compile(batch)) first")
        return next(reversed(self._compiled.values()))

    @property
    def records(self) -> list[PassRecord]:
        return self.last.records

    @property
    def graphs(self) -> list[TrainGraph]:
        comp = self.last
        return list(comp.parts.values()) if comp.parts else [comp.graph]

    def summary(self) -> str:
        comp = self.last
        lines = [f"pipeline: {comp.pipeline}", f"backend: {comp.backend}",
                 f"capture: {comp.captured.num_nodes()} nodes in {comp.capture_seconds:.2f}s"]
        for r in comp.records:
            lines.append(f"  {r.index:>3} {r.spec:<40} {r.seconds * 1e3:8.1f} ms  "
                         f"{'changed' if r.changed else 'unchanged':<9} nodes {r.nodes_before} -> {r.nodes_after}")
        lines.append(f"estimated peak memory {comp.memory.peak_bytes / 2**20:.1f} MiB, saved activations "
                     f"{comp.memory.saved_bytes / 2**20:.1f} MiB, {comp.cost.total_flops / 1e9:.3f} GFLOP")
        return "\n".join(lines)
