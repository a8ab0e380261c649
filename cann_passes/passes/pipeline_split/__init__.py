"""pipeline_split: cut the whole step into pipeline stages, each with forward, backward and apply graphs.

A program pass. It takes the accumulating whole step (``grad_accumulation`` ran:
the optimizer reads ``scale * acc``) and replaces it with, per stage ``s``:

- ``stage<s>.forward``: its parameters, the boundary activations from stage
  ``s-1`` (or only the batch, on the first stage) -> boundary activations for
  stage ``s+1`` (the loss on the last stage) and the values its backward reads;
- ``stage<s>.backward``: saved values + the backward boundary values from stage
  ``s+1`` -> the backward boundary values for stage ``s-1`` and the updated
  gradient accumulators (``acc = acc_in + weight * grad``, per microbatch);
- ``stage<s>.backward_input`` / ``stage<s>.backward_weight``: the same backward,
  split for zero-bubble schedules: the first computes only what stage ``s-1``
  waits for, the second the parameter gradients (from values the first hands it);
- ``stage<s>.apply``: the optimizer update of the stage's parameters, once per step.

Everything is decided from the graph: the forward region in node order is cut
only where few bytes cross (between blocks and between the halves of a block,
wherever the residual stream alone is live; where those leave the stages more
than 5% apart, also inside blocks, each cut priced by its transfer time), giving *units*; each unit is
priced with the cost model (its forward nodes, the backward nodes that belong
to it, its optimizer nodes) and weighed by memory (parameters, gradients,
optimizer state, saved activations); ``cann_passes.stage_balance.balance``
picks the cuts. ``layers=`` (counts per stage) cuts at block boundaries
instead, blocks found by :mod:`graph_ir.analysis.structure`.

Backward nodes belong to a stage by dependence, not by name: a backward node
goes to the lowest stage allowed by what it reads (a parameter pins it to the
parameter's stage, a forward value to a stage no earlier than the value's) and
by who reads it (values flow from later stages to earlier ones in backward);
a node reading only other backward values is placed as late as its inputs
allow, so a residual stream's gradient crosses once, already summed (views
excepted: they stay with their readers). Nodes that
depend only on the batch, hyperparameters, read-only buffers or constants
(masks, positions, rotary tables, ``lr`` arithmetic) are copied into every
graph that needs them instead of being sent. Random ops are never copied.

Where stages meet besides the boundary, the split rewrites the step so that
each stage computes its part and an all-reduce over the pipeline ranks (the
mesh's ``pp`` group, a functional collective in the apply graphs) combines them:

- a weight tied across stages (GPT-2's embedding and head), as Megatron does:
  every stage reading it holds it and accumulates its own part of the
  gradient (its own accumulator, ``<acc>@stage<s>`` off its home stage); each
  of those stages' apply graphs sums the parts and runs the same update;
- an optimizer value combining every stage's (global gradient-norm
  clipping's total norm, a sum or maximum; loss scaling's all-finite flag, a
  logical and): each stage reduces its own terms,
  the all-reduce combines the parts, and each stage computes what follows
  (the clip coefficient) itself.

Tensor parallelism inside stages needs nothing of the split: the stage graphs
keep the rank's tp collectives (never cut between a collective and its wait)
and the boundary values are that rank's pieces.

A tied weight whose stages are some of the pipeline ranks (GPT-2 at pp > 2: the
first and the last) is summed over a process group of just those ranks
(``pp_subgroup_name``, listed in ``attrs['pipeline_parallel']['pp_subgroups']``,
created by the runtime on its members); the ranks between take no part.

A rank holding several stages (interleaved 1F1B, DualPipeV) contributes the
terms of all of them to such a combination: each of its stages' apply graphs
computes the rank's part, reading the other local stages' gradient
accumulators (step state the rank holds), so each of the rank's all-reduces,
one per local stage, sums every stage's terms once.

A tied weight two of whose stages are on one rank (DualPipeV's first and last) is updated once
there: the rank's updating holder adds the other local holders' accumulators (step-state inputs
of its apply graph) before the all-reduce over the holding ranks, which a single holding rank
skips; the other local holders only read the weight.

A weight tied across ranks together with such a combination when a rank holds several stages
(interleaved 1F1B): the rank's stage updating it runs its apply first (``apply_order``) and hands
the all-reduced gradient to the rank's other applies as step state (``<accumulator>@summed``),
whose clip term reads it there instead of all-reducing it again, so every rank issues the same
all-reduces in the same order.

Refused, naming the rule: stages whose apply graphs would make two ranks of a group issue
different all-reduces (checked on the split, for the pp group and its subgroups), an optimizer
value combining stages otherwise than
by a sum, maximum, logical and, 2-norm or sum of squares (ZeRO's shard norms
are one), and more stages than units.

The stage graphs carry ``attrs['stage']`` (index, rank, first/last) and the
program ``attrs['pipeline']`` (stages, stage -> rank, units, cuts, costs); which
rank runs a stage is ``cann_passes.schedules.stage_to_rank`` for the schedule.
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.meta import RECOMPUTE_OF, GraphAttr, GraphKind, Region, graph_kind, region_of
from graph_ir.pipeline_info import PipelineSplit, set_pipeline_split
from graph_ir.program import EVERY_MICROBATCH, EVERY_STEP, Program, Run
from graph_ir.signature import InputKind, OutputKind

from ...cost_model import get_profile
from ...pass_manager import PassContext, PassOptionError, register_pass
from .balance import REFINE_ABOVE, UnitCosts, _choose_cuts
from .cross_stage import TIED_SUFFIX, _share_across_stages, aten, c10d, pp_subgroup_name
from .errors import PipelineSplitError
from .nodes import _classify, _one_parameter_values
from .partition import _assign, _forward_stages
from .stage_builder import _build_stages
from .units import CROSSING_SLACK, RESIDUAL_SLACK, _unit_starts, parse_layers

__all__ = ["CROSSING_SLACK", "REFINE_ABOVE", "RESIDUAL_SLACK", "TIED_SUFFIX", "PipelineSplitError", "UnitCosts",
           "aten", "c10d", "parse_layers", "pipeline_split_pass", "pp_subgroup_name"]


def _target(program: Program) -> str:
    """The whole-step graph to cut: the first one that accumulates gradients."""
    targets = [n for n, g in program.graphs.items()
               if graph_kind(g.attrs) == GraphKind.STEP and GraphAttr.GRAD_ACCUMULATION in g.attrs]
    if not targets:
        raise PipelineSplitError("pipeline_split: no whole-step graph accumulates gradients "
                                 "(rule: run grad_accumulation first; the stages accumulate per microbatch)")
    return targets[0]


def _check_loss_scale_order(graph: TrainGraph) -> None:
    """loss_scale run before grad_accumulation checks each microbatch's gradients in backward, which
    no stage's apply graph can read; after it, the check reads the accumulated gradients."""
    for spec, value in zip(graph.signature.outputs, graph.output_values()):
        if spec.kind == OutputKind.METRIC and spec.name == "loss_scale:found_inf" \
                and isinstance(value, torch.fx.Node) and region_of(value) == Region.BACKWARD:
            raise PipelineSplitError("the loss-scale overflow check is in the backward region, per microbatch "
                                     "(rule: with pp > 1 loss_scale runs after grad_accumulation, so that it checks "
                                     "the accumulated gradients once per step; the plan's own pipeline does)")


def _default_ranks(n_stages: int, pp: int, schedule: str) -> list[int]:
    try:
        from ... import schedules
        return list(schedules.stage_to_rank(schedule, pp, n_stages // pp))
    except (ImportError, AttributeError):
        if schedule in ("dualpipev", "zbv"):
            return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
        return [s % pp for s in range(n_stages)]


def _stage_seconds(unit_seconds: list[float], unit_of_stage: list[int], n_stages: int) -> list[float]:
    stage_cost = [0.0] * n_stages
    for u, t in enumerate(unit_seconds):
        stage_cost[max(s for s in range(n_stages) if unit_of_stage[s] <= u)] += t
    return stage_cost


def _one_parameter_values_with_their_readers(nodes, fstage: dict[torch.fx.Node, int]) -> dict:
    """A forward value computed from one parameter alone (ZeRO-3's gather of its shard, the wait,
    the unpadding views) goes to the stage of its first reader: cut by position it could fall in
    an earlier stage (ZeRO-3 gathers ahead of use), make that stage the parameter's home and send
    the whole parameter across the cut. A tied weight read by several stages (an embedding tied
    to the output head) is gathered in each of them: every later reading stage gets its own copy
    of the chain, so each holder gathers its shard where it reads it and no whole weight crosses a
    cut (the holders' gradients are then summed as any tied weight's). Returns the copies,
    ``(original, stage) -> copy``."""
    graph = nodes.graph
    params = {n for n, spec in zip(graph.placeholders(), graph.signature.inputs) if spec.kind == InputKind.PARAM}
    source = _one_parameter_values(fstage, params)
    read_in: dict[torch.fx.Node, set[int]] = {}
    for node in fstage:
        if node in source:
            read_in.setdefault(source[node], set()).update(
                fstage[u] for u in node.users if u in fstage and u not in source)
    copies: dict = {}
    for param, stages in read_in.items():
        for s in sorted(stages)[1:]:
            copies.update({(n, s): c for n, c in _gather_again_in(nodes, fstage, source, param, s).items()})
    if copies:
        nodes.forward[:] = [n for n in graph.graph.nodes if n in fstage]
        nodes.order.clear()
        nodes.order.update({n: i for i, n in enumerate(graph.graph.nodes)})
        source = _one_parameter_values(fstage, params)
    _to_their_readers(nodes.forward, source, fstage)
    return copies


def _to_their_readers(forward: list, source: dict, fstage: dict[torch.fx.Node, int]) -> None:
    """Each value of ``source`` to the earliest stage reading it (latest first, so a chain follows)."""
    for node in reversed(forward):
        if node in source:
            readers = [fstage[u] for u in node.users if u in fstage]
            if readers:
                fstage[node] = min(readers)


def _buffer_values_with_their_readers(nodes, fstage: dict[torch.fx.Node, int]) -> None:
    """A forward value computed from one buffer the step updates (data_parallel's broadcast of
    BatchNorm's statistics from dp rank 0, taken at the first microbatch) goes to the stage of its
    readers: a cut by position may fall between the broadcast and the normalisation reading it,
    which would make the earlier stage the buffer's home."""
    updated = {n for n, spec in nodes.spec_of.items() if spec.kind == InputKind.BUFFER and n in nodes.owner}
    copied = nodes.free | {n for n in nodes.spec_of if n not in nodes.owner}
    _to_their_readers(nodes.forward, _one_parameter_values(nodes.forward, updated, copied), fstage)


def _read_own_copies(stage: dict, copies: dict) -> None:
    """A node of stage ``s`` (backward's input gradient through a tied head) reading a tied
    weight's gathered value reads the copy gathered in ``s``, not one sent from another stage."""
    for (original, s), copy in copies.items():
        for user in list(original.users):
            if stage.get(user) == s:
                user.replace_input_with(original, copy)


def _gather_again_in(nodes, fstage: dict, source: dict, param: torch.fx.Node, stage: int) -> dict:
    """Copies of ``param``'s one-parameter chain for the readers in ``stage``, placed before the
    first of them and in that stage; the readers read the copies."""
    chain = [n for n in nodes.forward if source.get(n) is param]
    readers = [u for n in chain for u in n.users if u in fstage and u not in source and fstage[u] == stage]
    needed: set = set()
    stack = [a for u in readers for a in u.all_input_nodes if source.get(a) is param]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(a for a in n.all_input_nodes if source.get(a) is param)
    first = min(readers, key=lambda u: nodes.order[u])
    copies: dict = {}
    g = nodes.graph.graph
    for n in chain:
        if n not in needed:
            continue
        with g.inserting_before(first):
            copy = g.node_copy(n, lambda a: copies.get(a, a))
        copies[n] = copy
        fstage[copy] = stage
    for u in set(readers):
        for n, copy in copies.items():
            u.replace_input_with(n, copy)
    for n in reversed(chain):   # (what only the readers moved to the copies read)
        if not n.users:
            del fstage[n]
            copies.pop(n, None)
            g.erase_node(n)
    return copies


@register_pass("pipeline_split", preserves=(), on="program")
def pipeline_split_pass(program: Program, ctx: PassContext, *, stages: int = 2, pp: int = 0,
                        schedule: str = "1f1b", layers: str = "", in_flight: str = "",
                        cut_slack: float = CROSSING_SLACK, profile: str = "ascend_910b") -> Program:
    """Cut the accumulating whole step into ``stages`` pipeline stages (forward, backward, apply each).

    ``profile`` names the device profile that prices the units the balancer splits.
    """
    name = _target(program)
    if stages < 1:
        raise PassOptionError("pipeline_split", "stages", f"pipeline_split needs stages >= 1 (got {stages})", stages)
    pp = pp or stages
    graph = program.graphs[name]
    _check_loss_scale_order(graph)
    nodes = _classify(graph)
    if not nodes.forward:
        raise PipelineSplitError("pipeline_split: the step has no forward computation to cut")
    if cut_slack < 1.0:
        raise PipelineSplitError(f"pipeline_split option cut_slack={cut_slack} must be >= 1 (a multiple of the "
                                 "fewest bytes crossing anywhere)")
    units = _unit_starts(nodes, min(cut_slack, RESIDUAL_SLACK))
    if len(units) < stages:
        replayed = any(n.meta.get(RECOMPUTE_OF) for n in nodes.backward)
        where = ", outside the spans recompute replays whole" if replayed else ""
        raise PassOptionError("pipeline_split", "stages", f"the step has {len(units)} cuttable unit(s) (cut points where only the residual "
                              f"stream crosses{where}), fewer than the {stages} stages asked for (rule: at most one "
                              "stage per unit)", stages)
    try:
        device = get_profile(profile)
    except ValueError as exc:
        raise PassOptionError("pipeline_split", "profile", str(exc), profile) from None
    cuts = _choose_cuts(nodes, units, device, stages=stages, pp=pp, schedule=schedule, layers=layers,
                        in_flight=in_flight, cut_slack=cut_slack)
    fstage = _forward_stages(nodes, [cuts.units[u] for u in cuts.unit_of_stage])
    _buffer_values_with_their_readers(nodes, fstage)
    copies = {}
    if graph.attrs.get(GraphAttr.ZERO, {}).get("stage") == 3:
        copies = _one_parameter_values_with_their_readers(nodes, fstage)
    stage, homes, shared, mixed = _assign(nodes, fstage, stages)
    _read_own_copies(stage, copies)
    ranks = _default_ranks(stages, pp, schedule)
    tied, reduced, subgroups, extra_cuts, apply_order = _share_across_stages(
        nodes, stage, homes, shared, mixed, ranks, stages, pp, schedule, ctx, program)
    base = {k: v for k, v in graph.attrs.items() if k != GraphAttr.KIND}
    graphs, flows, built = _build_stages(nodes, stage, homes, stages, ranks, base, extra_cuts)
    stage_cost = _stage_seconds(cuts.costs.seconds, cuts.unit_of_stage, stages)
    mean = sum(stage_cost) / stages
    schedule_runs = [Run(g, EVERY_MICROBATCH) for g in graphs if not g.endswith(".apply")]
    schedule_runs += [Run(g, EVERY_STEP) for g in graphs if g.endswith(".apply")]
    program.replace(name, graphs, schedule_runs, flows)
    costs = cuts.costs
    split = PipelineSplit(
        stages=stages, pp=pp, schedule=schedule, stage_to_rank=ranks, split=cuts.method, units=len(cuts.units),
        unit_starts=cuts.unit_of_stage, unit_seconds=costs.seconds, unit_static_bytes=costs.static_bytes,
        unit_activation_bytes=costs.activation_bytes, stage_seconds=stage_cost, stage_bytes=cuts.stage_bytes,
        imbalance=max(stage_cost) / mean if mean else 1.0, boundary_tensors=[len(st.acts_in) for st in built],
        param_stage=homes, microbatches=graph.attrs[GraphAttr.GRAD_ACCUMULATION]["microbatches"],
        shared_params={n: info["holders"] for n, info in tied.items()}, stage_reductions=reduced,
        pp_subgroups=subgroups, apply_order=apply_order)
    set_pipeline_split(program, split)
    ctx.stat("stages", stages)
    ctx.stat("units", len(cuts.units))
    ctx.stat("imbalance", round(split.imbalance, 4))
    return program
