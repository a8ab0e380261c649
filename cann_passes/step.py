"""The step driver: a whole training step, compiled, bound to a live model and optimizer.

``CompiledStep`` sits above every other layer: it captures (graph_ir), resolves the plan's open
choices (:mod:`cann_passes.planning`), compiles (:mod:`cann_passes.compile`), lowers
(:mod:`cann_passes.lowering`) and hands the runners to the runtime (:mod:`cann_passes.runtime`:
binding, accumulation, pipeline stages, sharded state), which only binds and runs.

Each call feeds the graph the model's current parameters and buffers, the
optimizer's state in torch.optim's own format, the current learning rates
and the batch; then it writes the new parameters and state back. So
``model.state_dict()`` and ``optimizer.state_dict()`` are always those of the
last step, and an LR scheduler that edits ``param_groups`` takes effect on
the next call without recompiling. A new batch shape or structure, a changed
``requires_grad`` or training mode, or a changed baked hyperparameter
(one the graph does not take as an input) compiles anew; each compilation is
kept, keyed by what it was specialised on.

Compiling is :func:`cann_passes.planning.compile_planned` for this rank's
mesh description, which gives a :class:`~graph_ir.program.Program`; each of
its graphs is lowered and run as its schedule says (the whole step, or the
grad graph per microbatch and the apply graph per optimizer step). Values a
graph holds sharded (ZeRO) are kept by a :class:`ShardStore`: optimizer
state shards are also what ``optimizer.state`` holds; stage-3 parameter
shards live in the store and :meth:`CompiledStep.sync_model` gathers them.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from graph_ir import TrainGraph, capture_train_step, gather_inputs
from graph_ir.capture import initial_optimizer_state
from graph_ir.guards import GuardRecorder
from graph_ir.analysis import GraphCost, MemoryProfile
from graph_ir.capture import StepLayout
from graph_ir.mesh import MeshDesc
from graph_ir.meta import GraphAttr
from graph_ir.optimizers import rule_for
from graph_ir.placement import gather
from graph_ir.program import Program
from graph_ir.signature import InputKind, OutputKind

from . import compile_cache
from .dump import dump_dir_from
from .lowering import get_lowering, resolve_backend
from .pass_manager import PassContext, PassRecord, Pipeline
from .plan import Plan
from .planning import compile_planned
from .runtime import accumulation, distributed, pipeline_parallel, user_state
from . import background_lowering
from .background_lowering import BackgroundLowering
from .runtime.binding import ShardStore, StepState, autocast_off, bind_inputs, source_token, write_back

log = logging.getLogger("cann_passes")


@dataclass
class Compilation:
    """What compiling for one batch signature produced: the program and a runner per graph."""

    captured: TrainGraph
    program: Program
    layout: StepLayout
    pipeline: Pipeline
    backend: str
    records: list[PassRecord]
    runners: dict[str, Callable[..., Any]]
    capture_seconds: float
    compile_seconds: float
    cost: GraphCost
    memory: MemoryProfile
    context: PassContext = field(repr=False, default=None)
    # The Python values the trace read and baked in (graph_ir.guards), checked before every call.
    guards: list = field(repr=False, default_factory=list)
    # The persistent compile cache: "hit <key>", "stored <key>", or why it was not used.
    cache: str = ""
    # plan.background_lowering: the backend's lowering, running while the step runs on eager's.
    background: "BackgroundLowering | None" = field(repr=False, default=None)

    def failed_guard(self):
        """The first guard that no longer holds, or None."""
        return next((g for g in self.guards if not g.holds()), None)

    @property
    def graph(self) -> TrainGraph:
        """The graph that computes the loss: the whole step, or the grad graph when accumulating."""
        return self.program.main

    @property
    def parts(self) -> dict[str, TrainGraph]:
        """With gradient accumulation: the per-microbatch ``grad`` and per-step ``apply`` graphs."""
        return dict(self.program.graphs) if set(self.program.graphs) == {"grad", "apply"} else {}

    @property
    def runner(self) -> Callable[..., Any] | None:
        return self.runners.get("step")


class _Flag:
    """Sets ``obj.<name>`` for the duration of a ``with`` block."""

    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def __enter__(self):
        setattr(self.obj, self.name, True)

    def __exit__(self, *exc):
        setattr(self.obj, self.name, False)
        return False


def _batch_key(batch: Any) -> tuple:
    leaves, spec = pytree.tree_flatten(batch)
    return (str(spec), tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor)
                             else type(t) for t in leaves))


def _autocast_state() -> tuple:
    """The caller's autocast: a step called inside ``torch.autocast`` is captured under it (its casts
    become nodes of the graph), so each autocast state is a compilation of its own."""
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in ("cpu", "cuda"))


class _ModuleTree:
    """The model's modules, parameters and buffers, walked once per call of the step.

    What ``modules()``, ``named_parameters()`` and ``named_buffers()`` give, in their order and
    with their deduplication, from one ``named_modules()`` walk: a call of the step read the
    tree six times (the cache key, binding, writing back, clearing ``.grad``, the failure
    snapshot), each a recursive walk, which on a small model cost more than its ops. The step
    itself changes no module attribute (parameters are updated through ``.data``), so one
    walk holds for the call.
    """

    __slots__ = ("modules", "params", "buffers")

    def __init__(self, model: torch.nn.Module):
        self.modules: list[torch.nn.Module] = []
        self.params: dict[str, torch.nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        seen_params, seen_buffers = set(), set()
        for prefix, module in model.named_modules():
            self.modules.append(module)
            dot = f"{prefix}." if prefix else ""
            for name, param in module._parameters.items():
                if param is not None and id(param) not in seen_params:
                    seen_params.add(id(param))
                    self.params[dot + name] = param
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in seen_buffers:
                    seen_buffers.add(id(buffer))
                    self.buffers[dot + name] = buffer


class CompiledStep:
    """``step(batch) -> loss``: one whole training step per call."""

    def __init__(self, model: torch.nn.Module, plan: Plan, *, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]):
        self.model, self.plan, self.optimizer, self.loss_fn = model, plan, optimizer, loss_fn
        self._warned_background = False
        self.rule = rule_for(optimizer)  # refuses unsupported optimizers before any work
        # Expert parallelism runs on the eager backend only (the plan refuses the others by name).
        self.backend = "eager" if plan.ep > 1 and plan.backend == "auto" else resolve_backend(plan.backend)
        self._compiled: dict[tuple, Compilation] = {}
        self.recompile_reasons: list[str] = []
        self.step_state = StepState()
        self.metrics: dict[str, torch.Tensor] = {}
        self.steps_run = 0
        self.world = distributed.current()
        if (plan.dp > 1 or plan.zero_stage) and self.world is None:
            raise RuntimeError(f"plan dp={plan.dp}, zero_stage={plan.zero_stage} needs the process groups to "
                               "run: call cann_passes.runtime.distributed.init_distributed(plan) first, in a "
                               "process launched by torchrun (to compile without processes, use "
                               "cann_passes.compile_program with a MeshDesc.fake mesh)")
        self.mesh = self.world.info if self.world is not None else MeshDesc.single()
        if self.world is None and plan.pp > 1:   # every stage in this process (runtime/pipeline_parallel.py)
            self.mesh = MeshDesc.fake(pp=plan.pp)
        self.shards = ShardStore(self.mesh)
        self.accumulation = accumulation.AccumulationState(plan)
        # True while the model's parameters are older than the step's shards (ZeRO-3 after a step);
        # the hooks of user_state gather them when the user reads the model.
        self.model_stale = False
        self.capturing = False
        self._call_tree: _ModuleTree | None = None   # the module tree of the call running now
        user_state.install(self)

    @property
    def param_shards(self) -> dict[str, torch.Tensor]:
        """ZeRO-3: this rank's parameter shards, by parameter name."""
        return self.shards.params()

    # -- compilation --------------------------------------------------------------------------
    def _baked_hparams(self) -> tuple:
        # The rule's key: its baked options and what else of a group shapes the graph (weight decay zero or not).
        return tuple(self.rule.key(group) for group in self.optimizer.param_groups)

    def cache_key(self, batch: Any) -> tuple:
        """What a compilation is specialised on: the batch's structure and shapes, which parameters
        train, every module's training mode, and the hyperparameters baked into the graph."""
        tree = self._tree()
        return (_batch_key(batch), tuple(p.requires_grad for p in tree.params.values()),
                tuple(m.training for m in tree.modules), self._baked_hparams(), _autocast_state())

    def _tree(self) -> _ModuleTree:
        return self._call_tree if self._call_tree is not None else _ModuleTree(self.model)

    def compile(self, batch: Any) -> Compilation:
        """Compile for this batch's structure and shapes (done by the first call anyway); a
        compilation whose guards no longer hold (a Python value the trace read has changed) is not
        used: the step compiles anew and says why in ``recompile_reasons``."""
        base = self.cache_key(batch)
        variants = [k for k in self._compiled if k[0] == base]
        key = next((k for k in variants if self._compiled[k].failed_guard() is None), None)
        if key is None:
            reason = None
            if variants:   # said of the compilation this step ran most recently
                reason = self._compiled[variants[-1]].failed_guard().describe_change()
            elif self._compiled:
                reason = self._key_change(next(reversed(self._compiled))[0], base)
            if reason is not None:
                self.recompile_reasons.append(reason)
                log.info("recompiling: %s", reason)
            key = (base, len(variants))
            self._compiled[key] = self._compile(batch)
        # Most recently used last: ``step.last`` is the compilation the last call ran.
        self._compiled[key] = comp = self._compiled.pop(key)
        if comp.background is not None:
            comp.background.take_over(comp, self.steps_run)
        return comp

    def _key_change(self, before: tuple, now: tuple) -> str:
        """What differs between two :meth:`cache_key` values, in the user's words."""
        (batch_a, grads_a, modes_a, hparams_a, autocast_a), (batch_b, grads_b, modes_b, hparams_b, autocast_b) = \
            before, now

        def first(names: list[str]) -> str:
            return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if batch_a != batch_b:
            return f"the batch's structure, shapes or dtypes changed (now {batch_b})"
        if grads_a != grads_b:
            names = [n for (n, p), a, b in zip(self.model.named_parameters(), grads_a, grads_b) if a != b]
            return f"requires_grad changed for {first(names)}"
        if modes_a != modes_b:
            paths = [n or "the model" for (n, m), a, b in zip(self.model.named_modules(), modes_a, modes_b) if a != b]
            state = "train" if modes_b[0] else "eval"
            return f"training mode changed for {first(paths)} (the model is now in {state} mode)"
        if hparams_a != hparams_b:
            groups = [str(i) for i, (a, b) in enumerate(zip(hparams_a, hparams_b)) if a != b] or ["(count)"]
            return f"an optimizer option baked into the graph changed in param group {first(groups)}"
        if autocast_a != autocast_b:
            on = [f"{device} {str(dtype).replace('torch.', '')}" for device, enabled, dtype in autocast_b if enabled]
            return f"the caller's autocast changed (now {', '.join(on) if on else 'off'})"
        return "the step's specialisation changed"

    def _compile(self, batch: Any) -> Compilation:
        t0 = time.perf_counter()
        # A process's first compile of a model and plan already compiled once: the captured step and
        # the program come from the compile cache (single process; cann_passes/compile_cache.py).
        cache = compile_cache.for_step(self)
        key, facts = cache.key(self, batch) if cache else (None, None)
        entry = cache.load(key, self.model, self.loss_fn) if cache else None
        cache_note = "off" if cache is None else "not keyable" if key is None else ""
        if entry is not None:
            captured, layout, program, guards = entry.captured, entry.layout, entry.program, entry.guards
            initial_optimizer_state(self.model, self.optimizer, layout, self.rule)
            program.captured, program.records = captured, entry.records
            program.context = compile_cache.context_for(self.mesh)
            capture_seconds = time.perf_counter() - t0
            cache_note = f"hit {key[:16]}"
        else:
            recorder = GuardRecorder()
            with accumulation.full_shape_state(self.model, self.optimizer, self.shards), _Flag(self, "capturing"):
                captured, layout = capture_train_step(self.model, self.optimizer, self.loss_fn, batch, guards=recorder)
                directory = dump_dir_from(self.plan.dump_dir)
                inputs = gather_inputs(self.model, self.optimizer, layout, batch) if directory else None
            guards = recorder.guards()
            capture_seconds = time.perf_counter() - t0
            program = compile_planned(captured, self.plan, self.mesh, backend=self.backend, dump_dir=directory,
                                      inputs=inputs)
            if cache and key is not None:
                cache_note = cache.store(key, facts, captured, program, layout, guards)
        t1 = time.perf_counter()
        lowering = get_lowering(self.backend)
        background = None
        # Only inductor keeps what a child process compiled in caches this process can read.
        off = background_lowering.caches_off() if self.plan.background_lowering and self.backend == "inductor" \
            else None
        in_background = self.plan.background_lowering and self.backend == "inductor" and off is None
        if self.plan.background_lowering and self.backend != "eager" and not in_background \
                and not self._warned_background:
            self._warned_background = True
            why = f"{off} is off" if off else f"backend {self.backend!r} keeps no such caches"
            warnings.warn("background_lowering needs inductor's on-disk caches, which let this process take over "
                          f"what a child process compiled: {why}, so the step is lowered before it first runs",
                          RuntimeWarning, stacklevel=4)
        skipped = pipeline_parallel.not_run_here(self, program)
        here = {name: graph for name, graph in program.graphs.items() if name not in skipped}
        if in_background:
            # Run at once on the eager lowering of this very program; the backend's runners take
            # over between two steps once compiled (BackgroundLowering).
            examples = {name: self._inputs(graph, batch) for name, graph in here.items()}
            try:
                background = BackgroundLowering(self.backend, lowering, here, examples, self.plan)
            except Exception as exc:     # the request could not be written or the child not started
                warnings.warn(f"background lowering could not start ({background_lowering.describe_error(exc)}); "
                              "the step is lowered before it first runs", RuntimeWarning, stacklevel=4)
                in_background = False
            else:
                runners = {name: get_lowering("eager").compile(graph, examples[name], self.plan)
                           for name, graph in here.items()}
        if not in_background:
            with compile_cache.lowering_context(self.backend):
                runners = {name: lowering.compile(graph, self._inputs(graph, batch), self.plan)
                           for name, graph in here.items()}
        runners.update({name: pipeline_parallel.NotRunHere(name, why) for name, why in skipped.items()})
        compile_seconds = time.perf_counter() - t1
        ctx = program.context
        main = program.main
        log.info("compiled %s: %d -> %d nodes in %d graph(s), backend %s, %.2fs passes, %.2fs lowering",
                 captured.name, captured.num_nodes(), program.num_nodes(), len(program.graphs), self.backend,
                 sum(r.seconds for r in program.records), compile_seconds)
        return Compilation(captured, program, layout, Pipeline.parse(program.attrs[GraphAttr.PASS_PIPELINE]), self.backend,
                           program.records, runners, capture_seconds, compile_seconds,
                           ctx.analyses.get("cost", main), ctx.analyses.get("memory", main), ctx, guards,
                           cache_note, background)

    # -- running ------------------------------------------------------------------------------
    def _init_state(self, name: str) -> None:
        """Optimizer state for ``name`` as a fresh optimizer makes it (after loading an empty state)."""
        params = dict(self.model.named_parameters())
        group = next(g for g in self.optimizer.param_groups if any(p is params[name] for p in g["params"]))
        self.optimizer.state[params[name]].update(self.rule.init_state(params[name].detach(), group))

    def _inputs(self, graph: TrainGraph, batch: Any, params: dict | None = None,
                buffers: dict | None = None) -> list[torch.Tensor]:
        if pipeline_parallel.takes_stage_values(graph):
            return pipeline_parallel.example_inputs(self, graph, batch)
        store = pipeline_parallel.shards_for(self, graph)
        return bind_inputs(graph, self.model, self.optimizer, batch, self.step_state, store, self._init_state,
                           own=store is self.shards, params=params, buffers=buffers)

    def _run(self, graph: TrainGraph, runner, batch: Any) -> torch.Tensor | None:
        tree = self._tree()
        params, buffers = tree.params, tree.buffers
        with autocast_off():
            outputs = runner(*self._inputs(graph, batch, params, buffers))
        self.metrics = write_back(graph, outputs, self.model, self.optimizer, self.step_state, self.shards,
                                  params, buffers)
        if self.shards.params():
            self.model_stale = True
        loss = [o for spec, o in zip(graph.signature.outputs, outputs) if spec.kind == OutputKind.LOSS]
        return loss[0].detach() if loss else None

    def __call__(self, batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch``; with ``plan.microbatches`` N the batch is split into N
        microbatches; with ``plan.accumulate_target`` the batch is one microbatch and the optimizer
        runs once the accumulated samples reach the target (see ``step.accumulation``)."""
        if torch.is_inference_mode_enabled():
            raise RuntimeError("a training step cannot run under torch.inference_mode(): it differentiates the "
                               "loss and updates the parameters in place, which inference tensors forbid; call "
                               "the step outside the inference_mode block")
        self._call_tree = tree = _ModuleTree(self.model)
        try:
            with self._no_state_left_on_failure(tree):
                loss = self._step(batch)
        finally:
            self._call_tree = None
        self._clear_grads(tree)
        return loss

    @staticmethod
    def _clear_grads(tree: _ModuleTree) -> None:
        """``p.grad`` is None after a step: the step's gradients live inside the graph, and a gradient
        left from an earlier eager backward would be stale (what ``optimizer.zero_grad()`` leaves)."""
        for param in tree.params.values():
            if param.grad is not None:
                param.grad = None

    @contextlib.contextmanager
    def _no_state_left_on_failure(self, tree: _ModuleTree):
        """Capture initialises optimizer state before tracing (as torch.optim would on its first
        step); a step that then fails has updated nothing, so that state is dropped and the
        optimizer is left exactly as the user gave it. Every module attribute holding a parameter
        or buffer holds the same object afterwards (a failure inside tracing, which binds tracing
        tensors to the modules, cannot leave one there)."""
        had_state = {id(p) for p, s in self.optimizer.state.items() if s}
        held = [(m, dict(m._parameters), dict(m._buffers)) for m in tree.modules]
        try:
            yield
        except BaseException:
            for param in [p for p, s in self.optimizer.state.items() if s and id(p) not in had_state]:
                del self.optimizer.state[param]
            for module, params, buffers in held:
                module._parameters.update(params)
                module._buffers.update(buffers)
            raise

    def _step(self, batch: Any) -> torch.Tensor:
        if self.plan.pp > 1:
            return pipeline_parallel.step(self, batch)
        if self.plan.accumulate_target is not None:
            return self.accumulation.dynamic_step(self, batch)
        if self.plan.microbatches > 1:
            return self.accumulate(accumulation.split_batch(batch, self.plan.microbatches))
        comp = self.compile(batch)
        if "step" not in comp.runners:
            raise RuntimeError(f"the compiled program has graphs {', '.join(comp.program.graphs)} but no whole "
                               "step: a pipeline that splits the step needs microbatches or accumulate_target")
        loss = self._run(comp.program["step"], comp.runners["step"], batch)
        self.steps_run += 1
        # The step performed the optimizer's update: tell LR schedulers, which
        # otherwise warn that they stepped before the optimizer did.
        self.optimizer._opt_called = True
        return loss

    def accumulate(self, batches: list) -> torch.Tensor:
        """One optimizer step over the given microbatches (gradients accumulated, synchronized once)."""
        return self.accumulation.static_step(self, batches)

    def sync_model(self) -> None:
        """The model's parameters become the trained ones (every rank must call: collectives): ZeRO-3
        and tensor-parallel shards all-gathered; under pp every stage's parameters and updated
        buffers broadcast from the pipeline rank that trains them."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, shard in self.param_shards.items():
                key = f"{InputKind.PARAM.value}:{name}"
                placement = self.shards.placements[key]
                params[name].data = gather(shard, placement, self.world.group)
                # The model now holds exactly what the shard holds: no need to cut it again.
                self.shards.sources[key] = source_token(params[name])
            if self.world is not None and self._compiled and pipeline_parallel.is_pipelined(self.last.program):
                # (and the buffers the step updates, BatchNorm's statistics: their stage's too)
                pipeline_parallel.share_trained_parameters(self, {**dict(self.model.named_buffers()), **params})
        self.model_stale = False

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (padded shards under ZeRO)."""
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor))

    # -- what compilation did -----------------------------------------------------------------
    def wait_for_lowering(self) -> None:
        """Wait for every lowering still compiling in the background (``plan.background_lowering``,
        a child process each); the backend's runners take over at the next step."""
        for comp in self._compiled.values():
            if comp.background is not None:
                comp.background.wait()

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
        return list(comp.program.graphs.values())

    def summary(self) -> str:
        comp = self.last
        backend = comp.backend if comp.background is None else f"{comp.backend} ({comp.background.describe()})"
        lines = [f"pipeline: {comp.pipeline}", f"backend: {backend}",
                 f"capture: {comp.captured.num_nodes()} nodes in {comp.capture_seconds:.2f}s",
                 f"compile cache: {comp.cache or 'miss'}; {len(comp.guards)} guards on Python values the trace read; "
                 f"{len(self._compiled)} compilation(s)"]
        lines += [f"  recompiled: {reason}" for reason in self.recompile_reasons]
        for r in comp.records:
            lines.append(f"  {r.index:>3} {r.spec:<40} {r.seconds * 1e3:8.1f} ms  "
                         f"{'changed' if r.changed else 'unchanged':<9} nodes {r.nodes_before} -> {r.nodes_after}")
        lines.append(f"estimated peak memory {comp.memory.peak_bytes / 2**20:.1f} MiB, saved activations "
                     f"{comp.memory.saved_bytes / 2**20:.1f} MiB, {comp.cost.total_flops / 1e9:.3f} GFLOP")
        return "\n".join(lines)
