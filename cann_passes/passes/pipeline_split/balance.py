"""Where the stages start: each unit priced with the cost model and weighed by memory, and the cuts
picked by ``cann_passes.stage_balance`` (or by ``layers=``, blocks per stage)."""
from __future__ import annotations

from dataclasses import dataclass

from graph_ir.analysis.memory import aliases_input
from graph_ir.meta import GraphAttr, nbytes

from ...cost_model import node_time
from ...pass_manager import PassOptionError
from .nodes import _Nodes
from .partition import _assign, _forward_stages
from .units import RESIDUAL_SLACK, _crossing_bytes, _layer_starts, _unit_starts, parse_layers

REFINE_ABOVE = 1.05   # stage imbalance (max / mean) at residual-only cuts above which finer cuts are tried


@dataclass
class UnitCosts:
    seconds: list[float]          # forward + backward + optimizer, per unit
    forward_seconds: list[float]
    static_bytes: list[int]       # parameters, gradient accumulators, optimizer state
    activation_bytes: list[int]   # saved for backward, per microbatch in flight
    cut_seconds: list[float] | None = None   # a cut just before the unit: its transfers (stage_balance)


@dataclass
class _Cuts:
    units: list[int]               # forward positions where the units start
    costs: UnitCosts
    unit_of_stage: list[int]       # the unit each stage starts at
    method: str                    # "layers" or "cost"
    stage_bytes: list[float] | None


def _unit_costs(nodes: _Nodes, starts: list[int], profile) -> UnitCosts:
    n = len(starts)
    fstage = _forward_stages(nodes, starts)
    stage, homes, _, _ = _assign(nodes, fstage, n, strict=False)
    seconds, fwd = [0.0] * n, [0.0] * n
    for node in (*nodes.forward, *nodes.backward, *nodes.optimizer):
        t = node_time(node, profile)
        seconds[stage[node]] += t
        if node in fstage:
            fwd[stage[node]] += t
    static = [0] * n
    for node, name in nodes.owner.items():
        static[homes[name]] += nbytes(node.meta.get("val"))
    saved = [0] * n
    back = set(nodes.backward)
    for node in nodes.forward:
        readers = {stage[u] for u in node.users if u in back}
        if readers and not aliases_input(node):
            saved[max(readers)] += nbytes(node.meta.get("val"))
    return UnitCosts(seconds, fwd, static, saved)


def _pricer(nodes: _Nodes, profile, pp: int):
    """``priced(starts)``: the costs of the units starting there, each cut's transfers included."""
    from ... import stage_balance
    crossing, tensors = _crossing_bytes(nodes), _crossing_bytes(nodes, size=lambda v: 1)

    def priced(starts):
        unit_costs = _unit_costs(nodes, starts, profile)
        unit_costs.cut_seconds = stage_balance.cut_transfer_seconds(
            [crossing[u] for u in starts], profile, pp, tensors=[tensors[u] for u in starts])
        return unit_costs
    return priced


def _balance(costs: UnitCosts, n_stages: int, in_flight: list[int] | None, *, schedule: str, pp: int,
             microbatches: int, memory_limit: float | None):
    """The cuts: least largest stage cost, each stage's static bytes + in-flight activations within
    the device's memory (in flight: how many microbatches the schedule keeps alive on each stage)."""
    from ... import stage_balance
    if in_flight is None and schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "dualpipev"):
        try:
            in_flight = stage_balance.in_flight_for(schedule, pp, microbatches, n_stages // pp)[:n_stages]
        except ValueError:   # sizes the schedule refuses: the plan's own check names them
            in_flight = None
    if in_flight is not None and len(in_flight) != n_stages:
        in_flight = None
    return stage_balance.balance(costs.seconds, n_stages, unit_static_bytes=costs.static_bytes,
                                 unit_activation_bytes=costs.activation_bytes, in_flight=in_flight,
                                 memory_limit=memory_limit, cut_seconds=costs.cut_seconds)


def _choose_cuts(nodes: _Nodes, units: list[int], profile, *, stages: int, pp: int, schedule: str,
                 layers: str, in_flight: str, cut_slack: float) -> _Cuts:
    """The unit each stage starts at, by ``layers`` or by the balancer over ``units`` (residual-only
    cuts), refined with the finer cuts ``cut_slack`` admits where those leave the stages apart."""
    priced = _pricer(nodes, profile, pp)
    costs = priced(units)
    flights = [int(x) for x in in_flight.split(";")] if in_flight else None
    if layers:
        unit_of_stage = _layer_starts(nodes, units, parse_layers(layers))
        if len(unit_of_stage) != stages:
            raise PassOptionError("pipeline_split", "layers", f"{len(unit_of_stage)} layer counts for {stages} stages "
                                              "(rule: one count per stage, pp x virtual stages)", layers)
        return _Cuts(units, costs, unit_of_stage, "layers", None)

    def balanced(unit_costs):
        return _balance(unit_costs, stages, flights, schedule=schedule, pp=pp,
                        microbatches=nodes.graph.attrs[GraphAttr.GRAD_ACCUMULATION]["microbatches"],
                        memory_limit=getattr(profile, "memory_capacity", None))
    try:
        split = balanced(costs)
        # Residual-only cuts send one tensor and are the simplest; finer ones (more sent) are
        # admitted only when those leave the stages more than REFINE_ABOVE apart, and kept only
        # when the largest stage, transfers included, comes out smaller.
        if split.imbalance > REFINE_ABOVE and cut_slack > RESIDUAL_SLACK:
            fine = _unit_starts(nodes, cut_slack)
            fine_costs = priced(fine)
            fine_split = balanced(fine_costs)
            if fine_split.largest_seconds < split.largest_seconds:
                units, costs, split = fine, fine_costs, fine_split
    except ValueError as exc:
        raise PassOptionError("pipeline_split", "stages", f"no split of {len(units)} units into {stages} stages fits: {exc}", stages) from None
    return _Cuts(units, costs, list(split.boundaries), "cost", [float(b) for b in split.stage_bytes])
