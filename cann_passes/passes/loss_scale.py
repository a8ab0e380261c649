"""loss_scale: fp16 loss scaling inside the step, with overflow skipping and the scale as step state.

fp16 has 5 exponent bits: gradients below about 6e-8 flush to zero. Scaling the
backward seed (the ``ones_like(loss)`` that starts the backward) by ``S``
scales every gradient by ``S`` and lifts them into range; the gradients that
reach the optimizer are divided by ``S`` again before the update.

Overflow is detected in the graph: if any gradient is non-finite the step is
skipped: every parameter and optimizer-state output (Adam's ``step`` too)
is ``where(found_inf, old, new)``, so it is bitwise the input. Nothing
leaves the graph for a host-side check, so the step stays one graph.

Modes (``mode``):

- ``static``: the scale is ``init`` for ever; overflowing steps are still skipped.
- ``dynamic``: ``torch.amp.GradScaler``'s rule: on overflow multiply the scale
  by ``backoff_factor`` and reset the counter of clean steps; after
  ``growth_interval`` clean steps in a row multiply it by ``growth_factor``.
- ``adaptive``: backs off on overflow like ``dynamic``, but grows from the
  gradients themselves instead of waiting a fixed interval: after a clean step
  whose largest scaled gradient, times ``growth_factor``, still stays
  :data:`ADAPTIVE_HEADROOM` (2**8) times below the fp16 maximum, the scale grows
  by ``growth_factor``. The margin is there because values inside the backward
  (activation gradients) run larger than the parameter gradients that are
  measured. The scale never grows above 2**24. It finds a good scale in a
  few steps where ``dynamic`` needs ``growth_interval`` steps per doubling.

With gradient accumulation (the pass runs after ``grad_accumulation``, which
left every update reading ``scale * acc``), the loss of every microbatch is
scaled and the accumulators sum *scaled* gradients, as ``.grad`` does under
``torch.amp.GradScaler``; the unscale, the overflow check and the scale update
read the accumulated gradients in the optimizer region, once per optimizer
step (``unscale_`` before ``step``). A non-finite microbatch gradient stays
non-finite in the sum, so the step skips exactly when GradScaler's does. These
nodes being optimizer nodes, ``split_grad_apply`` puts them in the apply graph
and ``pipeline_split`` gives every stage its part: each stage checks its own
gradients and an all-reduce over the pipeline ranks combines the flags (a
logical and of "all finite"), so every stage skips, and updates its copy of the
scale, alike. ``data_parallel`` / ``optimizer_shard`` (after this pass) combine
the flag over dp, and with tensor parallelism it is combined over tp here.
The scale multiplies each microbatch's own (unweighted) loss, whose gradient
``grad_accumulation`` weighs after the backward; an eager loop that divides
each loss by the microbatch count before ``scaler.scale`` backpropagates
values that many times smaller, so its dynamic scale settles that many times
higher (the applied updates are the same).

State: ``loss_scale:scale`` and ``loss_scale:growth_tracker`` (float32 scalars,
declared in ``graph.attrs["step_state"]``, ``persistent`` unless the mode is static: a
checkpoint carries them, as ``GradScaler.state_dict()`` does). Metrics: ``loss_scale:found_inf``
(bool) and ``loss_scale:scale`` (the scale this step used).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.gradients import GradientNotFound, backward_seed, find_gradients
from graph_ir.build import add_node
from graph_ir.meta import GRADIENT_OF, GraphAttr, Region, region_of
from graph_ir.signature import InputKind, OutputKind, Spec

from ..pass_manager import PassContext, register_pass
from ._distributed import agree_on_overflow, mesh_dim

aten = torch.ops.aten
MODES = ("static", "dynamic", "adaptive")
FP16_MAX = 65504.0
ADAPTIVE_HEADROOM = 2.0 ** 8
MAX_SCALE = 2.0 ** 24
SCALE, TRACKER = "loss_scale:scale", "loss_scale:growth_tracker"
FOUND_INF = "loss_scale:found_inf"


class LossScaleError(ValueError):
    pass


class _Emitter:
    """Adds nodes with region, module path and a fake value computed from their inputs."""

    def __init__(self, tg: TrainGraph):
        self.graph, self.mode = tg.graph, tg.fake_mode()

    def __call__(self, target, args: tuple, region: Region, kwargs: dict | None = None) -> torch.fx.Node:
        return add_node(self.graph, target, args, kwargs, region=region, module_path="",
                        origin="loss_scale", mode=self.mode)


def _backward_seed(tg: TrainGraph) -> torch.fx.Node:
    try:
        return backward_seed(tg)
    except GradientNotFound as exc:
        raise LossScaleError(f"loss_scale needs {exc}") from None


def _gradients(tg: TrainGraph) -> list[torch.fx.Node]:
    """Backward values the optimizer reads: the gradients, in graph order."""
    grads: dict[torch.fx.Node, None] = {}
    for node in tg.compute_nodes(Region.OPTIMIZER):
        for arg in node.all_input_nodes:
            if region_of(arg) == Region.BACKWARD:
                grads[arg] = None
    if not grads:
        raise LossScaleError("loss_scale found no gradient read by the optimizer region")
    return list(grads)


def _accumulated_gradients(tg: TrainGraph) -> dict[str, torch.fx.Node]:
    """Parameter -> the accumulated gradient its update reads (``scale * acc``, marked by grad_accumulation)."""
    try:
        return find_gradients(tg)
    except GradientNotFound as exc:
        raise LossScaleError(f"loss_scale on an accumulating step: {exc}") from None


def _declare_state(tg: TrainGraph, name: str, value: float, *, persistent: bool) -> torch.fx.Node:
    # persistent: the value one step leaves is the next step's (a checkpoint carries it); a static
    # scale is the plan's constant and is not.
    tg.attrs.setdefault("step_state", {})[name] = {"value": float(value), "dtype": "float32", "shape": [],
                                                   "persistent": persistent}
    return tg.add_input(Spec(InputKind.STEP_STATE, name), torch.tensor(float(value)),
                        name=name.replace(":", "_"))


def _scale_seed(tg: TrainGraph, emit: _Emitter, scale: torch.fx.Node) -> None:
    seed = _backward_seed(tg)
    users = list(seed.users)
    with tg.graph.inserting_after(seed):
        scaled = emit(aten.mul.Tensor, (seed, scale), Region.BACKWARD)
    for user in users:
        user.replace_input_with(seed, scaled)


def _unscale_and_check(tg: TrainGraph, emit: _Emitter, scale: torch.fx.Node, grads: list[torch.fx.Node],
                       region: Region = Region.BACKWARD):
    """Unscaled gradients for the optimizer, the overflow flag and the largest scaled gradient.
    ``region``: backward for a whole step's gradients; optimizer for accumulated ones (read once
    per optimizer step, after the last microbatch)."""
    order = {n: i for i, n in enumerate(tg.graph.nodes)}
    made = set(grads)
    first_update = min((u for g in grads for u in g.users if region_of(u) == Region.OPTIMIZER and u not in made),
                       key=order.__getitem__, default=None) if region == Region.OPTIMIZER else None
    first_update = first_update or next(tg.compute_nodes(Region.OPTIMIZER))
    late = [g.name for g in grads if order[g] > order[first_update]]
    if late:
        raise LossScaleError(f"gradients {late[:3]} are computed after the optimizer starts "
                             f"({first_update.name}); loss_scale needs every gradient first")
    readers = {g: [u for u in g.users if region_of(u) == Region.OPTIMIZER] for g in grads}
    with tg.graph.inserting_before(first_update):
        inv = emit(aten.reciprocal.default, (scale,), region)
        all_finite, amax = None, None
        for g in grads:
            finite = emit(aten.all.default, (emit(aten.isfinite.default, (g,), region),), region)
            all_finite = finite if all_finite is None else emit(
                aten.logical_and.default, (all_finite, finite), region)
            g_max = emit(aten.amax.default, (emit(aten.abs.default, (g,), region), []), region)
            amax = g_max if amax is None else emit(aten.maximum.default, (amax, g_max), region)
            unscaled = emit(aten.mul.Tensor, (g, inv), region)
            for reader in readers[g]:
                reader.replace_input_with(g, unscaled)
            if GRADIENT_OF in g.meta:   # the update reads the unscaled value now: that is its gradient
                unscaled.meta[GRADIENT_OF] = g.meta.pop(GRADIENT_OF)
        found_inf = emit(aten.logical_not.default, (all_finite,), region)
    return found_inf, amax


def _skip_on_overflow(tg: TrainGraph, emit: _Emitter, found_inf: torch.fx.Node) -> int:
    outputs = tg.output_values()
    skipped = 0
    with tg.graph.inserting_before(tg.output_node()):
        for i, spec in enumerate(tg.signature.outputs):
            in_kind = {OutputKind.PARAM: InputKind.PARAM, OutputKind.OPT_STATE: InputKind.OPT_STATE}.get(
                OutputKind(spec.kind))
            if in_kind is None:
                continue
            old = tg.input_node(in_kind, spec.name)
            outputs[i] = emit(aten.where.self, (found_inf, old, outputs[i]), Region.OPTIMIZER)
            skipped += 1
    tg.set_outputs(outputs)
    return skipped


def _next_scale(emit: _Emitter, mode: str, scale, tracker, found_inf, amax, *, growth_interval: int,
                growth_factor: float, backoff_factor: float):
    """(new scale, new growth tracker) for ``mode``; emitted before the output node."""
    opt = Region.OPTIMIZER
    clean = emit(aten.where.ScalarSelf, (found_inf, 0.0, emit(aten.add.Tensor, (tracker, 1.0), opt)), opt)
    if mode == "dynamic":
        grow = emit(aten.ge.Scalar, (clean, float(growth_interval)), opt)
    else:
        needed = FP16_MAX / (ADAPTIVE_HEADROOM * growth_factor)
        below = emit(aten.lt.Scalar, (amax, needed), opt)
        under_cap = emit(aten.lt.Scalar, (scale, MAX_SCALE / growth_factor), opt)
        grow = emit(aten.logical_and.default, (emit(aten.logical_and.default, (below, under_cap), opt),
                                               emit(aten.logical_not.default, (found_inf,), opt)), opt)
    grown = emit(aten.where.self, (grow, emit(aten.mul.Tensor, (scale, growth_factor), opt), scale), opt)
    new_scale = emit(aten.where.self, (found_inf, emit(aten.mul.Tensor, (scale, backoff_factor), opt),
                                       grown), opt)
    new_tracker = emit(aten.where.ScalarSelf, (grow, 0.0, clean), opt)
    return new_scale, new_tracker


def _check_options(mode: str, init: float, growth_interval: int, growth_factor: float,
                   backoff_factor: float) -> None:
    rules: list[tuple[bool, str, Any]] = [
        (mode in MODES, f"mode must be one of {', '.join(MODES)}", mode),
        (init > 0, "init must be positive", init),
        (growth_interval >= 1, "growth_interval must be >= 1", growth_interval),
        (growth_factor > 1, "growth_factor must be > 1", growth_factor),
        (0 < backoff_factor < 1, "backoff_factor must be in (0, 1)", backoff_factor),
    ]
    for ok, rule, value in rules:
        if not ok:
            raise LossScaleError(f"loss_scale option {rule.split()[0]}={value!r}: {rule}")


@register_pass("loss_scale", preserves=())
def loss_scale_pass(graph: TrainGraph, ctx: PassContext, *, mode: Literal[MODES] = "dynamic", init: float = 65536.0,
                    growth_interval: int = 2000, growth_factor: float = 2.0,
                    backoff_factor: float = 0.5) -> TrainGraph:
    """Scale the backward seed, unscale gradients, skip overflowing steps, update the scale."""
    _check_options(mode, init, growth_interval, growth_factor, backoff_factor)
    if any(s.name == SCALE for s in graph.signature.inputs):
        raise LossScaleError("loss_scale already ran on this graph (it has a loss_scale:scale input)")
    emit = _Emitter(graph)
    accumulating = GraphAttr.GRAD_ACCUMULATION in graph.attrs
    if accumulating and any(k in graph.attrs for k in (GraphAttr.DATA_PARALLEL, GraphAttr.ZERO)):
        raise LossScaleError("loss_scale on an accumulating step must run before data_parallel and "
                             "optimizer_shard (rule: they combine its overflow flag over dp)")
    if accumulating:
        found = _accumulated_gradients(graph)
        position = {n: i for i, n in enumerate(graph.graph.nodes)}
        grads = sorted(set(found.values()), key=position.__getitem__)
    else:
        grads = _gradients(graph)
    scale = _declare_state(graph, SCALE, init, persistent=mode != "static")
    tracker = _declare_state(graph, TRACKER, 0.0, persistent=True) if mode != "static" else None
    _scale_seed(graph, emit, scale)
    found_inf, amax = _unscale_and_check(graph, emit, scale, grads,
                                         Region.OPTIMIZER if accumulating else Region.BACKWARD)
    ctx.stat("guarded_outputs", _skip_on_overflow(graph, emit, found_inf))
    with graph.graph.inserting_before(graph.output_node()):
        if mode == "static":
            new_scale, new_tracker = scale, tracker
        else:
            new_scale, new_tracker = _next_scale(emit, mode, scale, tracker, found_inf, amax,
                                                 growth_interval=growth_interval,
                                                 growth_factor=growth_factor, backoff_factor=backoff_factor)
        used_scale = emit(aten.clone.default, (scale,), Region.OPTIMIZER)
    if mode != "static":
        graph.add_output(Spec(OutputKind.STEP_STATE, SCALE), new_scale)
        graph.add_output(Spec(OutputKind.STEP_STATE, TRACKER), new_tracker)
    graph.add_output(Spec(OutputKind.METRIC, FOUND_INF), found_inf)
    graph.add_output(Spec(OutputKind.METRIC, SCALE), used_scale)
    mesh = getattr(ctx, "mesh", None)
    if accumulating and mesh is not None and "tp" in mesh.axes and mesh.size("tp") > 1:
        # After tensor_parallel a split weight's gradient is this rank's shard: one rank's shard may
        # overflow alone, and every tp rank must skip with it.
        agree_on_overflow(graph, mesh_dim(ctx, "tp", "loss_scale"), "loss_scale")
    ctx.stat("gradients", len(grads))
    ctx.stat("mode", mode)
    return graph
