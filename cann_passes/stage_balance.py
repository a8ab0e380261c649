"""Pipeline stage balancing: an exact contiguous partition under a memory limit.

Units (layers, or finer: embedding, blocks, head) are given in model order with a cost
(seconds of forward + backward) and optionally static bytes (weights, gradients, optimizer
state) and activation bytes per microbatch. :func:`balance` cuts them into ``n_stages``
contiguous stages minimizing the largest stage cost, subject to each stage's memory,
``static + in_flight[stage] * activations``, staying within ``memory_limit``; in_flight is
how many microbatches the schedule keeps alive on that stage (:func:`in_flight_for`, from
the schedule simulator).

Cut points may differ in what they send: with ``cut_seconds`` (the transfer time of what
crosses a cut before each unit, :func:`cut_transfer_seconds`) a stage's cost is its compute
plus the transfers at both its ends, so a cut inside an MLP (the 4x hidden crossing) is taken
only where the balance gains more than the send costs; among the splits with the least
largest stage cost the one sending least is returned (a second exact pass).

Why our own: this is the linear-partition problem, solved exactly by a dynamic program
(``best[k][j]`` = the smallest max cost of the first ``j`` units in ``k`` stages) in
O(n^2 p) with numpy over the split point; the memory rule is one mask per stage. No
maintained library in reach does contiguous partitioning (networkx has none; a scipy MILP
would solve it approximately and slower), and the DP is exact and a page long.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Split:
    """Stages as contiguous unit ranges: stage k runs units boundaries[k]..boundaries[k+1]-1."""
    boundaries: tuple[int, ...]       # start unit index of each stage
    n_units: int
    stage_costs: tuple[float, ...]    # compute seconds (the units' costs)
    stage_bytes: tuple[float, ...]    # static + in_flight * activation bytes
    stage_transfer_s: tuple[float, ...] = ()   # the transfers at the stage's cuts (with cut_seconds)

    @property
    def n_stages(self) -> int:
        return len(self.boundaries)

    @property
    def imbalance(self) -> float:
        """Largest stage compute cost over the mean (1.0 is perfect)."""
        mean = sum(self.stage_costs) / len(self.stage_costs)
        return max(self.stage_costs) / mean if mean > 0 else 1.0

    @property
    def largest_seconds(self) -> float:
        """What the balancer minimizes: the largest stage's compute plus its cuts' transfers."""
        transfer = self.stage_transfer_s or (0.0,) * len(self.stage_costs)
        return max(c + t for c, t in zip(self.stage_costs, transfer))

    def ranges(self) -> list[range]:
        ends = list(self.boundaries[1:]) + [self.n_units]
        return [range(b, e) for b, e in zip(self.boundaries, ends)]

    def stage_of_unit(self) -> list[int]:
        return [k for k, r in enumerate(self.ranges()) for _ in r]

    def table(self) -> str:
        lines = [f"{'stage':>5}{'units':>12}{'cost':>14}{'bytes':>14}"]
        for k, r in enumerate(self.ranges()):
            lines.append(f"{k:>5}{f'{r.start}-{r.stop - 1}':>12}{self.stage_costs[k]:>14.6g}"
                         f"{self.stage_bytes[k]:>14.6g}")
        lines.append(f"imbalance (max/mean cost): {self.imbalance:.4f}")
        return "\n".join(lines)


def _arrays(unit_costs, n_stages, unit_static_bytes, unit_activation_bytes, in_flight):
    costs = np.asarray(unit_costs, dtype=np.float64)
    n = len(costs)
    if costs.ndim != 1 or n == 0:
        raise ValueError("unit_costs: must be a non-empty list of numbers")
    if not (isinstance(n_stages, int) and n_stages >= 1):
        raise ValueError(f"n_stages: must be an integer >= 1 (got {n_stages!r})")
    if n_stages > n:
        raise ValueError(f"n_stages = {n_stages}: more stages than units ({n}); every stage needs "
                         "at least one unit")
    if not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError("unit_costs: must be finite and >= 0")

    def per_unit(values, what):
        if values is None:
            return np.zeros(n)
        arr = np.asarray(values, dtype=np.float64)
        if arr.shape != (n,) or np.any(arr < 0) or not np.all(np.isfinite(arr)):
            raise ValueError(f"{what}: must be {n} finite numbers >= 0, one per unit")
        return arr

    static = per_unit(unit_static_bytes, "unit_static_bytes")
    act = per_unit(unit_activation_bytes, "unit_activation_bytes")
    flights = np.ones(n_stages) if in_flight is None else np.asarray(in_flight, dtype=np.float64)
    if flights.shape != (n_stages,) or np.any(flights < 0):
        raise ValueError(f"in_flight: must be {n_stages} counts >= 0, one per stage")
    return costs, static, act, flights


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(x)])


def balance(unit_costs: Sequence[float], n_stages: int, *, unit_static_bytes=None,
            unit_activation_bytes=None, in_flight=None, memory_limit: float | None = None,
            cut_seconds: Sequence[float] | None = None) -> Split:
    """The contiguous split of units into ``n_stages`` minimizing the largest stage cost.

    Exact (dynamic program). Memory per stage = its units' static bytes + ``in_flight[stage]``
    x their activation bytes, at most ``memory_limit``. ``cut_seconds[i]`` (i >= 1) is what a
    cut just before unit i costs each of the two stages it separates (sending and receiving
    what crosses it; ``cut_seconds[0]`` is unused): a stage's cost is then its compute plus
    its cuts, and among the splits with the least largest cost the one whose cuts cost least
    in total is returned. Without ``cut_seconds`` the split found first among equals (earliest
    stages as full as allowed) is returned. Raises ValueError naming the stage and its bytes
    when no split fits.
    """
    costs, static, act, flights = _arrays(unit_costs, n_stages, unit_static_bytes,
                                          unit_activation_bytes, in_flight)
    n, p = len(costs), n_stages
    cut = np.zeros(n + 1)
    if cut_seconds is not None:
        given = np.asarray(cut_seconds, dtype=np.float64)
        if given.shape != (n,) or np.any(given < 0) or not np.all(np.isfinite(given)):
            raise ValueError(f"cut_seconds: must be {n} finite numbers >= 0, one per unit (the cut before it)")
        cut[1:n] = given[1:]
    C, S, A = _prefix(costs), _prefix(static), _prefix(act)
    limit = np.inf if memory_limit is None else float(memory_limit)
    inf = np.inf

    def stage_terms(k: int, j: int):
        """Stage k-1 running units i..j-1 for every possible start i: cost and memory fit."""
        i = np.arange(k - 1, j)
        stage_cost = C[j] - C[i] + cut[i] + cut[j]
        fits = (S[j] - S[i]) + flights[k - 1] * (A[j] - A[i]) <= limit * (1 + 1e-12)
        return i, stage_cost, fits

    # best[k, j]: smallest max cost placing units 0..j-1 in stages 0..k-1; arg[k, j]: where
    # stage k-1 starts in that split.
    best = np.full((p + 1, n + 1), inf)
    arg = np.zeros((p + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            i, stage_cost, fits = stage_terms(k, j)
            cand = np.maximum(best[k - 1, i], stage_cost)
            cand[~fits] = inf
            t = int(np.argmin(cand))
            best[k, j], arg[k, j] = cand[t], i[t]
    if not np.isfinite(best[p, n]):
        raise ValueError(_infeasible(n, p, S, A, flights, limit))
    if cut_seconds is not None:
        # Second pass: every stage within the optimum, the least total spent at cuts.
        bound = best[p, n] * (1 + 1e-9)
        spent = np.full((p + 1, n + 1), inf)
        spent[0, 0] = 0.0
        for k in range(1, p + 1):
            for j in range(k, n - (p - k) + 1):
                i, stage_cost, fits = stage_terms(k, j)
                cand = spent[k - 1, i] + cut[i]
                cand[~fits | (stage_cost > bound)] = inf
                t = int(np.argmin(cand))
                spent[k, j], arg[k, j] = cand[t], i[t]
    starts = [0] * p
    j = n
    for k in range(p, 0, -1):
        starts[k - 1] = int(arg[k, j])
        j = starts[k - 1]
    return _split(starts, n, C, S, A, flights, cut)


def _split(starts, n, C, S, A, flights, cut=None) -> Split:
    ends = list(starts[1:]) + [n]
    stage_costs = tuple(float(C[e] - C[b]) for b, e in zip(starts, ends))
    stage_bytes = tuple(float(S[e] - S[b] + f * (A[e] - A[b]))
                        for b, e, f in zip(starts, ends, flights))
    transfer = () if cut is None else tuple(float(cut[b] + cut[e]) for b, e in zip(starts, ends))
    return Split(tuple(int(s) for s in starts), n, stage_costs, stage_bytes, transfer)


def cut_transfer_seconds(cut_bytes: Sequence[float], link, pp: int = 2, microbatches: int = 1, *,
                         tensors: Sequence[int] | None = None) -> list[float]:
    """Per unit, the seconds a cut just before it costs each of the two stages it separates: one
    direction's transfer of what crosses it (the later stage receives the activations, the earlier
    one their gradients; sends are asynchronous), per microbatch, over ``link`` (a DeviceProfile
    or (latency, bandwidth)), one message (one latency) per tensor (``tensors[i]``, default 1),
    times ``microbatches``. Counted as exposed, which the schedule simulator (overlapping transfers
    with compute) refines; for the split it is the price of a cut."""
    from .schedules import _link_params
    latency, bandwidth = _link_params(link, pp)
    counts = [1] * len(cut_bytes) if tensors is None else list(tensors)
    if len(counts) != len(cut_bytes):
        raise ValueError(f"tensors: {len(counts)} counts for {len(cut_bytes)} cuts")
    return [0.0 if i == 0 else microbatches * (max(1, k) * latency + float(b) / bandwidth)
            for i, (b, k) in enumerate(zip(cut_bytes, counts))]


def _infeasible(n, p, S, A, flights, limit) -> str:
    """Name the first stage that cannot hold what it must: greedy fill by memory alone.

    Filling each stage with as many units as fit is the split that gets furthest (a stage
    range inside a fitting one fits too), so the stage where it stalls is the culprit.
    """
    start = 0
    for k in range(p):
        last_allowed = n - (p - k - 1)       # leave one unit for each later stage
        stop = start
        while stop < last_allowed and (S[stop + 1] - S[start]) + flights[k] * (A[stop + 1] - A[start]) <= limit:
            stop += 1
        if stop == start:
            need = (S[start + 1] - S[start]) + flights[k] * (A[start + 1] - A[start])
            return (f"no split into {p} stages fits memory_limit = {limit:.6g} bytes: stage {k} cannot "
                    f"hold unit {start} alone ({S[start + 1] - S[start]:.6g} static + {flights[k]:g} "
                    f"in flight x {A[start + 1] - A[start]:.6g} activation = {need:.6g} bytes)")
        if k == p - 1 and stop < n:
            need = (S[n] - S[start]) + flights[k] * (A[n] - A[start])
            return (f"no split into {p} stages fits memory_limit = {limit:.6g} bytes: with every earlier "
                    f"stage as full as it can be, stage {k} must hold units {start}-{n - 1}: "
                    f"{S[n] - S[start]:.6g} static + {flights[k]:g} in flight x "
                    f"{A[n] - A[start]:.6g} activation = {need:.6g} bytes")
        start = stop
    return f"no split into {p} stages fits memory_limit = {limit:.6g} bytes"


def layer_count_split(unit_layers: Sequence[int | None], counts: Sequence[int], *, unit_costs=None,
                      unit_static_bytes=None, unit_activation_bytes=None, in_flight=None) -> Split:
    """The user's override: stage k takes the next ``counts[k]`` layers.

    ``unit_layers[i]`` is the layer index of unit i (non-decreasing), or None for a unit outside
    the repeated layers (embedding, final norm, head): those before the first layer go to the
    first stage, the others with the layer before them.
    """
    counts = list(counts)
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
        raise ValueError(f"pipeline_split = {counts!r}: every stage needs a whole number >= 1 of layers")
    layers = []
    for u in unit_layers:
        if u is not None and u not in layers:
            if layers and u < layers[-1]:
                raise ValueError(f"unit_layers: layer {u} appears after layer {layers[-1]}; units must "
                                 "be in model order")
            layers.append(u)
    if sum(counts) != len(layers):
        raise ValueError(f"pipeline_split = {counts!r}: {sum(counts)} layers for {len(counts)} stages, "
                         f"but the model has {len(layers)} layers")
    stage_of_layer = {}
    idx = 0
    for k, c in enumerate(counts):
        for _ in range(c):
            stage_of_layer[layers[idx]] = k
            idx += 1
    starts = [None] * len(counts)
    current = 0
    for i, u in enumerate(unit_layers):
        if u is not None:
            current = stage_of_layer[u]
        if starts[current] is None:
            starts[current] = i
    n = len(unit_layers)
    costs, static, act, flights = _arrays(unit_costs if unit_costs is not None else [0.0] * n,
                                          len(counts), unit_static_bytes, unit_activation_bytes,
                                          in_flight)
    return _split(starts, n, _prefix(costs), _prefix(static), _prefix(act), flights)


def in_flight_for(name: str, pp: int, microbatches: int, v: int = 1) -> list[int]:
    """Microbatches whose activations each stage holds at its peak under schedule ``name``.

    From the schedule simulator with equal stage costs (the counts are a property of the
    order: 1F1B keeps pp - s on stage s, GPipe all m).
    """
    from .schedules import simulate
    peaks = simulate(name, pp, microbatches, v=v).in_flight()
    return [peaks.get(s, 0) for s in range(max(peaks) + 1)]


# -- a split per schedule, and the dynamic choice over both ------------------------------------

@dataclass
class PipelinePlan:
    """A schedule, its stages per rank, the split into stages and its simulated timeline."""
    schedule: str
    v: int
    split: Split
    timeline: object                  # schedules.Timeline
    rank_bytes: dict[int, float]
    table: str = ""


def plan_pipeline(unit_costs: Sequence[float], pp: int, microbatches: int, *, schedule: str = "dynamic",
                  v: int = 1, unit_static_bytes=None, unit_activation_bytes=None,
                  memory_limit: float | None = None, forward_fraction: float = 1 / 3,
                  weight_fraction: float = 1 / 3, send_bytes: int = 0, link=None,
                  candidates=None) -> PipelinePlan:
    """Split the units for a schedule and simulate it; with ``dynamic``, for every candidate.

    Each candidate schedule keeps its own number of microbatches alive per stage
    (:func:`in_flight_for`), so the memory-constrained split differs per schedule; each split
    is simulated and the fastest whose ranks fit ``memory_limit`` is returned. ``unit_costs``
    are forward + backward seconds per unit, divided into forward, input-gradient and
    weight-gradient parts by ``forward_fraction`` and ``weight_fraction`` (1/3 each: the
    backward is twice the forward, half of it for weights). With several stages per rank the
    balancer gives each stage an equal share of the rank's limit; the simulated per-rank
    peak (static + activations its stages hold together) is then checked against the whole
    limit. Raises ValueError with the comparison table when nothing fits.
    """
    from . import schedules as S
    cands = list(candidates or S.DEFAULT_CANDIDATES) if schedule == "dynamic" else [(schedule, v)]
    static = np.zeros(len(unit_costs)) if unit_static_bytes is None else np.asarray(unit_static_bytes, float)

    def evaluate(name: str, cv: int):
        spr = S.stages_per_rank(name, cv)
        S.check(name, pp, microbatches, cv)
        flights = in_flight_for(name, pp, microbatches, cv)
        # One stage per rank: the stage's limit is the rank's. Several: a stage's own peak may
        # exceed its share while the rank's combined peak fits (the stages peak at different
        # times), so try the whole limit first and shrink towards an equal share.
        shares = [1.0] if spr == 1 or memory_limit is None else [(1 / spr) ** (i / 4) for i in range(5)]
        tried = None
        for share in shares:
            try:
                split = balance(unit_costs, pp * spr, unit_static_bytes=unit_static_bytes,
                                unit_activation_bytes=unit_activation_bytes, in_flight=flights,
                                memory_limit=None if memory_limit is None else memory_limit * share)
            except ValueError as exc:
                tried = tried or S.Candidate(name, cv, verdict=f"refused: {exc}")
                continue
            tl, rank_bytes = _simulate_split(S, name, cv, pp, microbatches, split, static,
                                             unit_activation_bytes, forward_fraction, weight_fraction,
                                             send_bytes, link)
            tried = S.Candidate(name, spr, tl, max(rank_bytes.values()), split.imbalance,
                                detail=(split, rank_bytes))
            if memory_limit is None or tried.peak_bytes <= memory_limit * (1 + 1e-12):
                break
        return tried

    best, _, table = S.choose(cands, evaluate, memory_limit=memory_limit)
    if best is None:
        raise ValueError(f"no pipeline schedule and split for pp = {pp}, microbatches = {microbatches} fits\n"
                         + table)
    split, rank_bytes = best.detail
    return PipelinePlan(best.schedule, best.virtual_stages, split, best.timeline, rank_bytes, table)


def _simulate_split(S, name, v, pp, microbatches, split, static, unit_activation_bytes, forward_fraction,
                    weight_fraction, send_bytes, link):
    """The split's timeline and each rank's peak bytes (static + activations held together)."""
    costs = [S.StageCost(c * forward_fraction, c * (1 - forward_fraction - weight_fraction),
                         c * weight_fraction, send_bytes) for c in split.stage_costs]
    tl = S.simulate(name, pp, microbatches, costs, v, link)
    act = [0.0] * split.n_stages
    if unit_activation_bytes is not None:
        A = _prefix(np.asarray(unit_activation_bytes, float))
        act = [float(A[r.stop] - A[r.start]) for r in split.ranges()]
    P = _prefix(static)
    held = tl.peak_activation_bytes(act)
    owner = S.stage_to_rank(name, pp, v)
    return tl, {rk: held.get(rk, 0.0) + sum(float(P[r.stop] - P[r.start])
                                            for s, r in enumerate(split.ranges()) if owner[s] == rk)
                for rk in range(pp)}
