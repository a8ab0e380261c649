"""CompiledStep: a whole training step, compiled, bound to a live model and optimizer.

Each call feeds the graph the model's current parameters and buffers, the
optimizer's state in torch.optim's own format, the current learning rates
and the batch; then it writes the new parameters and state back. So
``model.state_dict()`` and ``optimizer.state_dict()`` are always those of the
last step, and an LR scheduler that edits ``param_groups`` takes effect on
the next call without recompiling. A new batch shape or structure, or a
changed baked hyperparameter (betas, weight decay, ...), compiles anew; each
compilation is kept, keyed by what it was specialised on.
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
        captured, layout = capture_train_step(self.model, self.optimizer, self.loss_fn, batch)
        capture_seconds = time.perf_counter() - t0
        pipeline = build_pipeline(self.plan, self.backend)
        ctx = PassContext(plan=self.plan)
        directory = dump_dir_from(self.plan.dump_dir)
        dump = DumpWriter(directory, str(pipeline)) if directory else None
        if dump:
            dump.write_capture(captured, ctx.analyses,
                               gather_inputs(self.model, self.optimizer, layout, batch))
        manager = PassManager(pipeline, verify_level=self.plan.verify, dump=dump)
        graph = manager.run(captured.copy(), ctx)
        inputs = bind_inputs(graph, self.model, self.optimizer, batch, self.step_state)
        t1 = time.perf_counter()
        runner = get_lowering(self.backend).compile(graph, inputs, self.plan)
        compile_seconds = time.perf_counter() - t1
        log.info("compiled %s: %d -> %d nodes, backend %s, %.2fs passes, %.2fs lowering",
                 graph.name, captured.num_nodes(), graph.num_nodes(), self.backend,
                 sum(r.seconds for r in manager.records), compile_seconds)
        return Compilation(captured, graph, layout, pipeline, self.backend, manager.records, runner,
                           capture_seconds, compile_seconds, ctx.analyses.get("cost", graph),
                           ctx.analyses.get("memory", graph), ctx)

    # -- running ------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> torch.Tensor:
        comp = self.compile(batch)
        inputs = bind_inputs(comp.graph, self.model, self.optimizer, batch, self.step_state)
        outputs = comp.runner(*inputs)
        self.metrics = write_back(comp.graph, outputs, self.model, self.optimizer, self.step_state)
        self.steps_run += 1
        return outputs[comp.graph.signature.output_index(OutputKind.LOSS, "loss")].detach()

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
        return [self.last.graph]

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
