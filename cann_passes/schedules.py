"""Pipeline schedules: torch's own action lists, replayed with the cost model.

The schedules are ``torch.distributed.pipelining``'s (GPipe, 1F1B, interleaved
1F1B, interleaved zero bubble, DualPipeV). Their per-rank orders come from the
schedule classes themselves, built on stand-in stages (an object with the
attributes the constructors read: ``num_stages``, ``group_size``,
``group_rank``, ``submod``), so no process group is needed and the order we
simulate is the order torch runs. Nothing here re-derives a schedule by hand.

:func:`simulate` replays those lists with per-stage costs (forward, input
gradient, weight gradient) and point-to-point transfer times (alpha-beta over
the profile's link): an action starts when its rank is free and its inputs
have arrived; compute on one rank is serial, transfers overlap compute and each other
(no link contention is modelled). It
gives per-rank events, the makespan, the bubble fraction (idle time over
ranks x makespan) and the peak number of microbatches whose activations each
stage holds. torch's own ``_simulate_comms_compute`` counts unit steps only.

Names: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (v >= 2 stages per rank,
looped placement), ``zb1p`` (torch's ``ScheduleInterleavedZeroBubble``, the
zero-bubble schedule of Qi et al. with the backward split into input (I) and
weight (W) gradients; v >= 1), ``dualpipev`` (DeepSeek's V-shaped DualPipe,
exactly 2 stages per rank: v = 1 is read as the implied 2), and ``dynamic``,
the schedule :func:`choose_schedule` picks per plan by simulating each
candidate.
"""
from __future__ import annotations

import json
import math
import os
import types
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "dualpipev")
NAMES = SCHEDULES + ("dynamic",)
KINDS = ("F", "B", "I", "W")
#: schedules whose actions split the backward into I and W (DualPipeV runs full B actions too)
SPLIT_BACKWARD = ("zb1p", "dualpipev")

_CLASS_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                "interleaved_1f1b": "ScheduleInterleaved1F1B",
                "zb1p": "ScheduleInterleavedZeroBubble", "dualpipev": "ScheduleDualPipeV"}


class ScheduleError(ValueError):
    """A schedule cannot run with these sizes; the message names the schedule and the rule.

    ``field`` says which size breaks it: ``schedule``, ``pp``, ``microbatches`` or
    ``virtual_stages``.
    """

    def __init__(self, message: str, field: str = "schedule"):
        super().__init__(message)
        self.field = field


def _known(name: str) -> None:
    if name not in SCHEDULES:
        extra = " ('dynamic' is resolved by choose_schedule first)" if name == "dynamic" else ""
        raise ScheduleError(f"pipeline schedule {name!r}: must be one of {', '.join(SCHEDULES)}{extra}")


def torch_schedule_class(name: str):
    """The ``torch.distributed.pipelining`` schedule class that runs ``name``."""
    _known(name)
    from torch.distributed.pipelining import schedules
    return getattr(schedules, _CLASS_NAMES[name])


def stages_per_rank(name: str, v: int = 1) -> int:
    """Stages each rank holds under ``name`` (v for the multi-stage schedules)."""
    check(name, pp=1, microbatches=None, v=v, sizes=False)
    if name in ("gpipe", "1f1b"):
        return 1
    if name == "dualpipev":
        return 2
    return v


def check(name: str, pp: int, microbatches: int | None, v: int = 1, *, sizes: bool = True) -> None:
    """Raise :class:`ScheduleError` where torch's schedule (or its premise) refuses these sizes."""
    _known(name)
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ScheduleError(f"{name}: virtual stages per rank must be an integer >= 1 (got {v!r})",
                            "virtual_stages")
    if name in ("gpipe", "1f1b") and v != 1:
        raise ScheduleError(f"{name} runs one stage per rank: virtual stages must be 1 (got {v})",
                            "virtual_stages")
    if name == "interleaved_1f1b" and v < 2:
        raise ScheduleError(f"{name} needs at least 2 stages per rank (virtual stages = {v})",
                            "virtual_stages")
    if name == "dualpipev" and v not in (1, 2):
        raise ScheduleError(f"{name} runs exactly 2 stages per rank (virtual stages = {v})",
                            "virtual_stages")
    if not sizes:
        return
    if not (isinstance(pp, int) and not isinstance(pp, bool) and pp >= 2):
        raise ScheduleError(f"{name}: a pipeline needs pp >= 2 ranks (got {pp!r})", "pp")
    m = microbatches
    if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
        raise ScheduleError(f"{name}: microbatches must be an integer >= 1 (got {m!r})", "microbatches")
    if name == "1f1b" and m < pp:
        raise ScheduleError(f"1f1b needs microbatches >= pp to fill the pipeline "
                            f"(microbatches = {m}, pp = {pp})", "microbatches")
    if name in ("interleaved_1f1b", "zb1p"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise ScheduleError(f"{name} needs microbatches to be a multiple of the number of rounds "
                                f"max(1, microbatches // pp) = {rounds} (microbatches = {m}, pp = {pp})",
                                "microbatches")
    if name == "dualpipev" and m < 2 * pp:
        raise ScheduleError(f"dualpipev needs microbatches >= its 2*pp = {2 * pp} stages "
                            f"(microbatches = {m})", "microbatches")


def _v(name: str, v: int) -> int:
    return stages_per_rank(name, v)


def stage_to_rank(name: str, pp: int, v: int = 1) -> list[int]:
    """Rank of each stage: looped (stage s on rank s % pp), V-shaped for DualPipeV."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    n = pp * _v(name, v)
    mapping = generate_stage_to_rank_mapping(pp, n, style="v" if name == "dualpipev" else "loop")
    return [mapping[s] for s in range(n)]


def rank_stages(name: str, pp: int, v: int = 1) -> dict[int, list[int]]:
    """Stages of each rank, in stage order."""
    out: dict[int, list[int]] = {r: [] for r in range(pp)}
    for s, r in enumerate(stage_to_rank(name, pp, v)):
        out[r].append(s)
    return out


@dataclass(frozen=True)
class Action:
    """One compute action of a schedule: stage, kind (F, B, I, W) and microbatch."""
    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:          # torch's spelling: 2F0
        return f"{self.stage}{self.kind}{self.microbatch}"


def _stand_in_stage(num_stages: int, pp: int, rank: int, stage: int):
    """What the schedule constructors read from a stage (no module, no process group)."""
    return types.SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=rank,
                                 stage_index=stage, submod=None, stage_index_to_group_rank={},
                                 is_first=stage == 0, is_last=stage == num_stages - 1)


def torch_pipeline_order(name: str, pp: int, microbatches: int, v: int = 1) -> dict:
    """torch's ``pipeline_order`` (rank -> list of ``_Action`` or None) for these sizes."""
    check(name, pp, microbatches, v)
    cls = torch_schedule_class(name)
    n = pp * _v(name, v)
    owners = rank_stages(name, pp, v)
    if n == pp:
        if name in ("gpipe", "1f1b"):
            sched = cls(_stand_in_stage(n, pp, 0, 0), microbatches)
        else:
            sched = cls([_stand_in_stage(n, pp, 0, 0)], microbatches)
    else:
        sched = cls([_stand_in_stage(n, pp, 0, s) for s in owners[0]], microbatches)
    return sched.pipeline_order


def _compute_groups(raw) -> Iterable[tuple[Action, ...]]:
    """torch's compute actions as groups that start together.

    DualPipeV's OVERLAP_F_B (a forward and a backward of two microbatches) is one group:
    torch's runtime posts the receives of both before running either, so the pair starts when
    both inputs are there; one device then computes them one after the other (the overlap
    hides communication, which the transfers model).
    """
    from torch.distributed.pipelining.schedules import _ComputationType as T
    for a in raw:
        if a is None:
            continue
        if a.computation_type == T.OVERLAP_F_B:
            yield tuple(Action(s.stage_index, s.computation_type.value, s.microbatch_index)
                        for s in a.sub_actions or ())
        elif a.computation_type.value in KINDS:
            yield (Action(a.stage_index, a.computation_type.value, a.microbatch_index),)


def _grouped_lists(name: str, pp: int, microbatches: int, v: int) -> dict[int, list[tuple[Action, ...]]]:
    order = torch_pipeline_order(name, pp, microbatches, v)
    groups = {r: list(_compute_groups(order[r])) for r in range(pp)}
    if name == "1f1b":
        groups = _renumber_forwards(groups)
    _validate(name, {r: [a for g in gs for a in g] for r, gs in groups.items()},
              pp * _v(name, v), microbatches)
    return groups


def torch_actions(name: str, pp: int, microbatches: int, v: int = 1) -> dict[int, list]:
    """torch ``_Action`` lists (compute only) to load into ``_PipelineScheduleRuntime``.

    The schedule's own order with its idle slots and ``REDUCE_GRAD`` entries dropped (the
    runtime's ``_prepare_schedule_with_comms(actions, format="compute_only")`` refuses
    anything but compute actions and adds the sends, receives and gradient reductions itself),
    OVERLAP_F_B pairs kept, and 1F1B's last-rank forwards renumbered (see
    :func:`_renumber_forwards`).
    """
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as T
    order = torch_pipeline_order(name, pp, microbatches, v)
    lists = {r: [a for a in order[r] if a is not None and a.is_compute_op] for r in range(pp)}
    if name == "1f1b":
        for r, acts in lists.items():
            count: dict[int, int] = defaultdict(int)
            fixed = []
            for a in acts:
                if a.computation_type == T.FORWARD:
                    a = _Action(a.stage_index, T.FORWARD, count[a.stage_index])
                    count[a.stage_index] += 1
                fixed.append(a)
            lists[r] = fixed
    return lists


def action_lists(name: str, pp: int, microbatches: int, v: int = 1) -> dict[int, list[Action]]:
    """Compute actions of each rank in torch's order (no bubbles, no comms, no REDUCE_GRAD)."""
    return {r: [a for g in gs for a in g] for r, gs in _grouped_lists(name, pp, microbatches, v).items()}


def _renumber_forwards(lists: dict[int, list[tuple[Action, ...]]]) -> dict[int, list[tuple[Action, ...]]]:
    """Number each stage's forwards 0, 1, ... in order.

    torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards from 1
    (it has no warm-up forward, so its counter is incremented before first use: F1..Fm). Its
    runtime does not read that list (it runs its own loop, forwards 0..m-1 in order), so the
    order is right and only the numbering is off.
    """
    out = {}
    for r, acts in lists.items():
        count: dict[int, int] = defaultdict(int)
        fixed = []
        for group in acts:
            new = []
            for a in group:
                if a.kind == "F":
                    a = Action(a.stage, "F", count[a.stage])
                    count[a.stage] += 1
                new.append(a)
            fixed.append(tuple(new))
        out[r] = fixed
    return out


def _validate(name: str, lists: dict[int, list[Action]], n_stages: int, m: int) -> None:
    """Every stage runs F and B (or I and W) once per microbatch, nothing else."""
    seen: dict[tuple, int] = defaultdict(int)
    for acts in lists.values():
        for a in acts:
            seen[(a.stage, a.kind, a.microbatch)] += 1
    for s in range(n_stages):
        for mb in range(m):
            f = seen.pop((s, "F", mb), 0)
            b = seen.pop((s, "B", mb), 0)
            i = seen.pop((s, "I", mb), 0)
            w = seen.pop((s, "W", mb), 0)
            if f != 1 or not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                raise ScheduleError(f"{name}: torch's action list runs stage {s} microbatch {mb} "
                                    f"as F x{f}, B x{b}, I x{i}, W x{w}")
    if seen:
        raise ScheduleError(f"{name}: torch's action list has actions outside the stages and "
                            f"microbatches: {sorted(seen)[:4]}")


# -- simulation --------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageCost:
    """Seconds of one microbatch through one stage, and the bytes it sends to the next.

    ``backward_input_s`` + ``backward_weight_s`` is the full backward (B); schedules that split
    the backward run them as I and W. ``send_bytes`` is the activation sent forward to the
    next stage (its gradient comes back with the same size).
    """
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    send_bytes: int = 0

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s

    def seconds(self, kind: str) -> float:
        return {"F": self.forward_s, "B": self.backward_s, "I": self.backward_input_s,
                "W": self.backward_weight_s}[kind]

    def scaled(self, factor: float) -> "StageCost":
        return StageCost(self.forward_s * factor, self.backward_input_s * factor,
                         self.backward_weight_s * factor, self.send_bytes)


UNIT_COST = StageCost(1.0, 1.0, 1.0)


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


def _link_params(link, pp: int) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of a stage-to-stage transfer; None means free."""
    if link is None:
        return 0.0, math.inf
    if isinstance(link, tuple):
        latency, bandwidth = link
        return float(latency), float(bandwidth)
    # a DeviceProfile: neighbours within a node use its intra-node link
    if pp <= link.devices_per_node:
        return link.intra_node_latency, link.intra_node_bandwidth
    return link.inter_node_latency, link.inter_node_bandwidth


def transfer_seconds(nbytes: int, link, pp: int = 2) -> float:
    latency, bandwidth = _link_params(link, pp)
    if nbytes <= 0 and latency == 0.0:
        return 0.0
    return latency + nbytes / bandwidth


@dataclass
class Timeline:
    """Per-rank events of one step's pipeline schedule (simulated or measured)."""
    events: list[Event]
    name: str = ""
    pp: int = 0
    microbatches: int = 0
    v: int = 1
    n_stages: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    @property
    def start_s(self) -> float:
        return min(e.start_s for e in self.events)

    @property
    def makespan(self) -> float:
        return max(e.end_s for e in self.events) - self.start_s

    def busy_s(self, rank: int) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.rank == rank)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all ranks / (ranks x makespan)."""
        ranks = self.ranks
        total = len(ranks) * self.makespan
        return 0.0 if total == 0 else 1.0 - sum(self.busy_s(r) for r in ranks) / total

    def in_flight(self) -> dict[int, int]:
        """Peak number of microbatches whose activations each stage holds.

        A microbatch's activations are held from the start of its forward to the end of its
        backward (W when the backward is split: the weight gradient still reads them).
        """
        done_kind = {}
        for e in self.events:
            if e.kind in ("B", "W"):
                done_kind[(e.stage, e.microbatch)] = e.kind
        deltas: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for e in self.events:
            if e.kind == "F":
                deltas[e.stage].append((e.start_s, 1))
            elif e.kind == done_kind.get((e.stage, e.microbatch)):
                deltas[e.stage].append((e.end_s, -1))
        peaks = {}
        for s, ds in deltas.items():
            held = peak = 0
            for _, d in sorted(ds, key=lambda x: (x[0], x[1])):   # frees before allocations at a tie
                held += d
                peak = max(peak, held)
            peaks[s] = peak
        return dict(sorted(peaks.items()))

    def peak_activation_bytes(self, stage_activation_bytes: Sequence[float]) -> dict[int, float]:
        """Per rank, the peak over time of the activation bytes its stages hold together."""
        rank_of = {e.stage: e.rank for e in self.events}
        done_kind = {(e.stage, e.microbatch): e.kind for e in self.events if e.kind in ("B", "W")}
        deltas: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for e in self.events:
            per_mb = float(stage_activation_bytes[e.stage])
            if e.kind == "F":
                deltas[e.rank].append((e.start_s, per_mb))
            elif e.kind == done_kind.get((e.stage, e.microbatch)):
                deltas[e.rank].append((e.end_s, -per_mb))
        out = {}
        for r in sorted(set(rank_of.values())):
            held = peak = 0.0
            for _, d in sorted(deltas[r], key=lambda x: (x[0], x[1])):
                held += d
                peak = max(peak, held)
            out[r] = peak
        return out

    def summary(self) -> str:
        return (f"{self.name or 'timeline'}: pp={self.pp} m={self.microbatches} v={self.v} "
                f"makespan={self.makespan:.6g}s bubble={self.bubble_fraction:.3f}")

    def to_chrome_trace(self, path: str | os.PathLike) -> str:
        """Chrome-trace JSON (opens in Perfetto / chrome://tracing): one track per rank."""
        colors = {"F": "thread_state_running", "B": "thread_state_iowait",
                  "I": "thread_state_iowait", "W": "thread_state_unknown"}
        trace = []
        for r in self.ranks:
            trace.append({"ph": "M", "name": "process_name", "pid": 0, "tid": r,
                          "args": {"name": self.name or "pipeline"}})
            trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r,
                          "args": {"name": f"rank {r}"}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": r,
                          "args": {"sort_index": r}})
        t0 = self.start_s
        for e in self.events:
            trace.append({"ph": "X", "pid": 0, "tid": e.rank, "cat": e.kind,
                          "name": f"{e.kind}{e.microbatch} s{e.stage}",
                          "ts": (e.start_s - t0) * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                          "cname": colors[e.kind],
                          "args": {"stage": e.stage, "microbatch": e.microbatch, "kind": e.kind}})
        doc = {"traceEvents": trace, "displayTimeUnit": "ms",
               "otherData": {"schedule": self.name, "pp": self.pp, "microbatches": self.microbatches,
                             "virtual_stages": self.v, "makespan_s": self.makespan,
                             "bubble_fraction": self.bubble_fraction}}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        return str(path)


def save_events(timeline: Timeline, path: str | os.PathLike) -> str:
    """The timeline's events as JSON (``load_events`` reads it back): for measured runs."""
    doc = {"schedule": timeline.name, "pp": timeline.pp, "microbatches": timeline.microbatches,
           "v": timeline.v, "events": [[e.rank, e.stage, e.microbatch, e.kind, e.start_s, e.end_s]
                                       for e in timeline.events]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return str(path)


def load_events(path: str | os.PathLike) -> Timeline:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    tl = timeline_from_events(doc["events"], name=doc.get("schedule", "measured"))
    tl.pp = doc.get("pp", tl.pp)
    tl.microbatches = doc.get("microbatches", tl.microbatches)
    tl.v = doc.get("v", 1)
    return tl


def stage_costs_from_timeline(timeline: Timeline) -> list[StageCost]:
    """Mean measured seconds per stage and kind, as StageCosts to re-simulate with.

    A full backward (B) measured without its I / W halves is divided evenly between them.
    """
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in timeline.events:
        sums[(e.stage, e.kind)].append(e.end_s - e.start_s)

    def mean(stage: int, kind: str) -> float | None:
        xs = sums.get((stage, kind))
        return sum(xs) / len(xs) if xs else None

    out = []
    for s in range(max(e.stage for e in timeline.events) + 1):
        f, b, i, w = (mean(s, k) for k in KINDS)
        if i is None or w is None:
            i = w = (b or 0.0) / 2
        out.append(StageCost(f or 0.0, i, w))
    return out


def timeline_from_events(events: Iterable[tuple], name: str = "measured") -> Timeline:
    """A Timeline from measured ``(rank, stage, microbatch, kind, start_s, end_s)`` tuples."""
    evs = []
    for item in events:
        rank, stage, mb, kind, start, end = item
        if kind not in KINDS:
            raise ValueError(f"event {item!r}: kind must be one of {KINDS}")
        if end < start:
            raise ValueError(f"event {item!r}: ends before it starts")
        evs.append(Event(int(rank), int(stage), int(mb), kind, float(start), float(end)))
    if not evs:
        raise ValueError("timeline_from_events: no events")
    ranks = {e.rank for e in evs}
    return Timeline(sorted(evs, key=lambda e: (e.rank, e.start_s)), name=name, pp=len(ranks),
                    microbatches=len({e.microbatch for e in evs}), n_stages=len({e.stage for e in evs}))


def _expand_costs(stage_costs, n_stages: int) -> list[StageCost]:
    """Per-stage costs for ``n_stages`` stages.

    ``stage_costs`` is a list with one cost per stage, or a callable ``n_stages -> list`` (the
    balancer re-split for that many stages), or a list for fewer stages that divides
    ``n_stages``: then each of its stages is cut into equal parts (an estimate).
    """
    if callable(stage_costs):
        costs = list(stage_costs(n_stages))
    elif isinstance(stage_costs, StageCost):
        costs = [stage_costs] * n_stages
    else:
        costs = list(stage_costs)
        if len(costs) != n_stages and costs and n_stages % len(costs) == 0:
            k = n_stages // len(costs)
            costs = [c.scaled(1.0 / k) for c in costs for _ in range(k)]
    if len(costs) != n_stages:
        raise ValueError(f"stage_costs: {len(costs)} costs for {n_stages} stages")
    return costs


def simulate(name: str, pp: int, microbatches: int, stage_costs=UNIT_COST, v: int = 1,
             link=None) -> Timeline:
    """Replay torch's action lists for ``name`` with per-stage costs and transfer times.

    F(s, m) waits for F(s-1, m) (plus the transfer when s-1 is on another rank); B or I(s, m)
    for F(s, m) and for B or I(s+1, m); W(s, m) for I(s, m). Ranks compute one action at a
    time in torch's order; a schedule whose order deadlocks raises ScheduleError.
    """
    lists = _grouped_lists(name, pp, microbatches, v)
    n = pp * _v(name, v)
    costs = _expand_costs(stage_costs, n)
    owner = stage_to_rank(name, pp, v)
    end: dict[tuple, float] = {}
    heads = {r: 0 for r in range(pp)}
    free = {r: 0.0 for r in range(pp)}
    events: list[Event] = []

    def grad_key(s: int, mb: int):
        return (s, "B", mb) if (s, "B", mb) in end else (s, "I", mb)

    def ready(a: Action) -> float | None:
        """When the action's inputs are on its rank; None if they are not computed yet."""
        deps = []
        if a.kind == "F":
            if a.stage > 0:
                deps.append(((a.stage - 1, "F", a.microbatch), a.stage - 1))
        elif a.kind in ("B", "I"):
            deps.append(((a.stage, "F", a.microbatch), a.stage))
            if a.stage < n - 1:
                deps.append((grad_key(a.stage + 1, a.microbatch), a.stage + 1))
        else:
            deps.append(((a.stage, "I", a.microbatch), a.stage))
        t = 0.0
        for key, src in deps:
            if key not in end:
                return None
            arrive = end[key]
            if owner[src] != owner[a.stage]:
                nbytes = costs[min(src, a.stage)].send_bytes
                arrive += transfer_seconds(nbytes, link, pp)
            t = max(t, arrive)
        return t

    remaining = sum(len(x) for x in lists.values())   # groups left
    while remaining:
        progressed = False
        for r in range(pp):
            while heads[r] < len(lists[r]):
                group = lists[r][heads[r]]
                times = [ready(a) for a in group]
                if any(t is None for t in times):
                    break
                start = max([free[r], *times])
                for a in group:
                    stop = start + costs[a.stage].seconds(a.kind)
                    end[(a.stage, a.kind, a.microbatch)] = stop
                    events.append(Event(r, a.stage, a.microbatch, a.kind, start, stop))
                    start = stop
                free[r] = start
                heads[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: "+".join(map(str, lists[r][heads[r]])) for r in range(pp) if heads[r] < len(lists[r])}
            raise ScheduleError(f"{name}: the action lists deadlock (each rank waits at {stuck})")
    return Timeline(events, name=name, pp=pp, microbatches=microbatches, v=_v(name, v), n_stages=n)


def bubble_fraction_formula(name: str, pp: int, m: int, v: int = 1,
                            cost: StageCost = UNIT_COST) -> float:
    """The papers' closed-form bubble, as idle / (idle + compute) per rank.

    With p ranks, m microbatches, per-stage forward F, full backward B = I + W:

    - GPipe (Huang et al. 2019) and 1F1B (PipeDream-flush, Narayanan et al. 2021): bubble time
      (p-1)(F+B) against m(F+B) of compute: the ratio (p-1)/m, the fraction (p-1)/(m+p-1).
    - interleaved 1F1B (Narayanan et al. 2021) with v stages per rank: ratio (p-1)/(v m),
      fraction (p-1)/(v m + p-1).
    - ZB1P (Qi et al., "Zero Bubble Pipeline Parallelism", 2023; the form DeepSeek-V3's Table 2
      quotes): bubble (p-1)(F+B-2W) = (p-1)(F+I-W); with v stages per rank divided by v as for
      interleaving (an extrapolation: the paper states v = 1).
    - DualPipeV (DeepSeek-V3 report 2024, DualPipe's V-shaped half): DualPipe's bubble
      (P/2-1)(F&B+B-3W) with P = 2p stages, F&B = F+B here (no overlap of compute):
      (p-1)(F+2B-3W) on costs of one of the rank's two stages; compute 2m(F+B).

    ``cost`` is one stage's cost (for the schedules with 2 or v stages per rank: one of them).
    The forms hold for m >= p (a multiple of p when interleaving). The zero-bubble forms assume
    a schedule fitted to the costs (the paper's ZB-1p comes from a solver); torch's orders are
    fixed and meet them at F = I = W: with W > F the simulated bubble is larger
    (bench/pipeline_bubbles.py prints the ratios).
    """
    _known(name)
    F, B, W = cost.forward_s, cost.backward_s, cost.backward_weight_s
    I = cost.backward_input_s
    p = pp
    if name in ("gpipe", "1f1b"):
        bubble, work = (p - 1) * (F + B), m * (F + B)
    elif name == "interleaved_1f1b":
        bubble, work = (p - 1) * (F + B), v * m * (F + B)
    elif name == "zb1p":
        bubble, work = (p - 1) * max(0.0, F + I - W), v * m * (F + B)
    else:
        bubble, work = (p - 1) * max(0.0, F + 2 * B - 3 * W), 2 * m * (F + B)
    return bubble / (bubble + work)


# -- the dynamic schedule ----------------------------------------------------------------------

def dynamic_candidates(v: int = 1) -> list[tuple[str, int]]:
    """The schedules ``dynamic`` compares: every one, with ``v`` virtual stages where it takes them
    (interleaving needs at least 2; DualPipeV runs exactly 2)."""
    out = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", max(2, v)), ("zb1p", v), ("dualpipev", 2)]
    if v > 1:
        out.insert(4, ("zb1p", 1))
    return out


DEFAULT_CANDIDATES = tuple(dynamic_candidates(1))


@dataclass
class Candidate:
    """One schedule the dynamic choice weighs: its simulated figures, or why it was refused."""
    schedule: str
    virtual_stages: int
    timeline: Timeline | None = None
    peak_bytes: float | None = None
    imbalance: float | None = None
    verdict: str = ""               # "refused: ..." before the choice; then "chosen" / "1.234x slower"
    detail: object = None           # what the evaluation built (a split, a compiled program's figures)

    @property
    def makespan(self) -> float | None:
        return None if self.timeline is None else self.timeline.makespan


def choose(candidates: Sequence, evaluate, *, memory_limit: float | None = None,
           limit_name: str = "memory limit") -> tuple[Candidate | None, list[Candidate], str]:
    """The ``dynamic`` schedule choice, made here and nowhere else: ``evaluate(name, v)`` simulates
    each candidate (a name or a ``(name, v)`` pair) and returns its :class:`Candidate`, already
    refused where it knows why; one that raises ValueError, or whose peak exceeds
    ``memory_limit``, is refused; the fastest of the rest is chosen. Returns the chosen candidate
    (None when nothing runs and fits), every row, and the comparison table.
    """
    rows: list[Candidate] = []
    for cand in candidates:
        name, v = (cand, 1) if isinstance(cand, str) else cand
        try:
            row = evaluate(name, v)
        except ValueError as exc:            # ScheduleError and PlanError are ValueErrors
            row = Candidate(name, v, verdict=f"refused: {exc}")
        if (not row.verdict and memory_limit is not None and row.peak_bytes is not None
                and row.peak_bytes > memory_limit * (1 + 1e-12)):
            row.verdict = f"refused: a rank needs {row.peak_bytes:.4g} bytes > {limit_name} {memory_limit:.4g}"
        rows.append(row)
    fits = [r for r in rows if r.timeline is not None and not r.verdict]
    best = min(fits, key=lambda r: r.timeline.makespan) if fits else None
    for r in fits:
        r.verdict = "chosen" if r is best else f"{r.timeline.makespan / best.timeline.makespan:.3f}x slower"
    return best, rows, choice_table(rows)


def choice_table(rows: list[Candidate]) -> str:
    lines = [f"{'schedule':<18}{'v':>3}{'makespan s':>14}{'bubble':>9}{'imbalance':>11}{'peak bytes':>14}  verdict"]
    for c in rows:
        if c.timeline is None:
            lines.append(f"{c.schedule:<18}{c.virtual_stages:>3}{'-':>14}{'-':>9}{'-':>11}{'-':>14}  {c.verdict}")
            continue
        imbalance = "-" if c.imbalance is None else f"{c.imbalance:.4f}"
        peak = "-" if c.peak_bytes is None else f"{c.peak_bytes:.4g}"
        lines.append(f"{c.schedule:<18}{c.virtual_stages:>3}{c.timeline.makespan:>14.6g}"
                     f"{c.timeline.bubble_fraction:>9.3f}{imbalance:>11}{peak:>14}  {c.verdict}")
    return "\n".join(lines)


def choose_schedule(pp: int, microbatches: int, stage_costs, *, memory_limit: float | None = None,
                    stage_activation_bytes=None, stage_static_bytes=None, link=None,
                    candidates: Sequence = DEFAULT_CANDIDATES) -> tuple[str, Timeline]:
    """``dynamic`` over fixed per-stage costs (:func:`choose`).

    ``stage_costs`` (and the optional ``stage_activation_bytes`` / ``stage_static_bytes``, bytes
    per microbatch / per stage) are per-stage lists or callables of the stage count (see
    :func:`simulate`). A rank's memory is its stages' static bytes plus the peak of the
    activations its stages hold together. The returned timeline's ``extra['table']`` explains
    the choice; ``extra['v']`` is the chosen number of stages per rank. Raises ScheduleError
    when no candidate runs or fits.
    """
    def evaluate(name: str, v: int) -> Candidate:
        tl = simulate(name, pp, microbatches, stage_costs, 2 if name == "dualpipev" else v, link)
        peak = None
        if stage_activation_bytes is not None or stage_static_bytes is not None:
            n = tl.n_stages
            act = _expand_bytes(stage_activation_bytes, n, per_microbatch=True)
            static = _expand_bytes(stage_static_bytes, n, per_microbatch=False)
            owner = stage_to_rank(name, pp, tl.v)
            held = tl.peak_activation_bytes(act)
            peak = max(held.get(r, 0.0) + sum(static[s] for s in range(n) if owner[s] == r) for r in range(pp))
        return Candidate(name, tl.v, tl, peak)

    best, _, table = choose(candidates, evaluate, memory_limit=memory_limit)
    if best is None:
        raise ScheduleError("dynamic schedule: no candidate runs and fits\n" + table)
    best.timeline.extra.update(table=table, v=best.virtual_stages)
    return best.schedule, best.timeline


def _expand_bytes(values, n: int, *, per_microbatch: bool) -> list[float]:
    if values is None:
        return [0.0] * n
    if callable(values):
        out = [float(x) for x in values(n)]
    else:
        out = [float(x) for x in values]
        if len(out) != n and out and n % len(out) == 0:
            k = n // len(out)
            out = [x / k for x in out for _ in range(k)]
    if len(out) != n:
        raise ValueError(f"{len(out)} byte counts for {n} stages")
    return out


