"""Which forward values to keep for backward, and which to recompute: the optimisation.

The model, over forward values ``i`` (one per FX node, plus three virtual
values per random 0/1 mask, below):

- ``s_i`` (saved): value ``i`` is kept alive from forward to backward, costing
  ``bytes_i``. Only buffers can be saved; a view is available when its buffer is.
- ``r_i`` (recomputed): ``i`` is computed again in backward, costing ``cost_i``
  seconds, and needs every forward input available (saved or recomputed).
- A value a backward node reads must be available: ``s_i + r_i >= 1``.
- Budget: ``sum bytes_i s_i <= B``. Objective: ``min sum cost_i r_i``, ties
  broken towards fewer bytes.

Random 0/1 masks (``bernoulli``, what dropout decomposes to) are never drawn
again: a second draw would give other numbers and shift the RNG stream. Their
mask is kept in one of three forms: packed bits (1/8 byte per element, unpacked
by shifts), bool (1 byte, what ``native_dropout`` saves) or the float mask
itself (the forward's own tensor, no conversion in backward). The virtual chain
``bits -> bool -> float mask`` lets the solver choose, and a float value
computed from the mask alone (``mask / (1 - p)``) may be kept in its place; the
forward users of the mask read the float mask. Bitwise, all forms round-trip
exactly.

Solvers: ``milp`` is exact (``scipy.optimize.milp``, HiGHS); ``mincut`` solves
the Lagrangian ``min cost + lambda * bytes`` exactly as a min s-t cut
(networkx; saving ``i`` cuts ``i_in -> i_out``, recomputing cuts
``source -> i_in``), searches lambda for the budget, and closes the gap between
the two bracketing cuts with a MILP over the values they disagree on;
``greedy`` starts from the feasible cut and adds the saves that buy back most
recompute time per byte.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import networkx as nx
import numpy as np


@dataclass
class Value:
    name: str
    deps: list[int]
    bytes: int = 0
    savable: bool = False
    recomputable: bool = True
    cost: float = 0.0            # seconds to recompute
    flops: int = 0
    written: int = 0             # bytes a recompute writes
    needed: bool = False         # read by a backward node
    kept: bool = False           # available anyway (read by the output or the optimizer)
    reason: str = ""             # why it may not be saved or recomputed


@dataclass
class Problem:
    values: list[Value]

    def index(self) -> dict[str, int]:
        return {v.name: i for i, v in enumerate(self.values)}


@dataclass
class Solution:
    saved: set[int]
    recomputed: set[int]
    cost: float
    bytes: int
    solver: str
    notes: list[str] = field(default_factory=list)


class Infeasible(ValueError):
    pass


# -- evaluation ---------------------------------------------------------------------------------

def evaluate(problem: Problem, saved: set[int], solver: str = "") -> Solution:
    """The recompute set a choice of saved values implies, and what it costs.

    Only saves that something actually reads count; a value neither saved nor
    recomputable that is needed makes the choice infeasible.
    """
    values = problem.values
    recomputed: set[int] = set()
    used_saves: set[int] = set()
    stack = [i for i, v in enumerate(values) if v.needed]
    seen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        v = values[i]
        if v.kept:
            continue
        if i in saved and v.savable:
            used_saves.add(i)
            continue
        if not v.recomputable:
            raise Infeasible(f"value {v.name} is needed in backward but can be neither saved nor "
                             f"recomputed ({v.reason or 'no reason recorded'})")
        recomputed.add(i)
        stack.extend(v.deps)
    return Solution(used_saves, recomputed, sum(values[i].cost for i in recomputed),
                    sum(values[i].bytes for i in used_saves), solver)


def relevant(problem: Problem) -> list[int]:
    """Values that can matter: the needed ones and their forward ancestors."""
    values = problem.values
    out, stack, seen = [], [i for i, v in enumerate(values) if v.needed], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        out.append(i)
        if not values[i].kept:
            stack.extend(values[i].deps)
    return sorted(out)


# -- exact MILP ---------------------------------------------------------------------------------

def _milp(problem: Problem, budget: float, *, fixed: dict[tuple[str, int], int] | None = None,
          time_limit: float = 60.0, rel_gap: float = 1e-6) -> set[int] | None:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    values = problem.values
    idx = relevant(problem)
    svar, rvar = {}, {}
    for i in idx:
        v = values[i]
        if v.kept:
            continue
        if v.savable:
            svar[i] = len(svar) + len(rvar)
        if v.recomputable:
            rvar[i] = len(svar) + len(rvar)
    n = len(svar) + len(rvar)
    if n == 0:
        return set()
    total_bytes = max(1, sum(values[i].bytes for i in svar))
    total_cost = max(1e-30, sum(values[i].cost for i in rvar))
    c = np.zeros(n)
    for i, k in rvar.items():
        c[k] = values[i].cost / total_cost
    for i, k in svar.items():
        c[k] = 1e-6 * values[i].bytes / total_bytes     # tie-break: fewer bytes
    rows, cols, data, lo, hi = [], [], [], [], []

    def available(row: int, i: int) -> bool:
        """Add s_i + r_i to a row; False when i can be neither (and is not kept)."""
        if values[i].kept:
            return True
        any_var = False
        for table in (svar, rvar):
            if i in table:
                rows.append(row), cols.append(table[i]), data.append(1.0)
                any_var = True
        return any_var

    row = 0
    for i in idx:
        v = values[i]
        if v.kept:
            continue
        if v.needed:
            if not available(row, i):
                raise Infeasible(f"value {v.name} is needed in backward but can be neither saved "
                                 f"nor recomputed ({v.reason})")
            lo.append(1), hi.append(np.inf)
            row += 1
        if i in rvar:
            for d in set(v.deps):
                if values[d].kept:
                    continue
                available(row, d)   # with neither variable the row reads -r_i >= 0
                rows.append(row), cols.append(rvar[i]), data.append(-1.0)
                lo.append(0), hi.append(np.inf)
                row += 1
    for i, k in svar.items():
        rows.append(row), cols.append(k), data.append(float(values[i].bytes))
    lo.append(-np.inf), hi.append(budget if math.isfinite(budget) else np.inf)
    row += 1
    A = coo_matrix((data, (rows, cols)), shape=(row, n)).tocsr()
    lb, ub = np.zeros(n), np.ones(n)
    for (kind, i), value in (fixed or {}).items():
        table = svar if kind == "s" else rvar
        if i in table:
            lb[table[i]] = ub[table[i]] = value
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=np.ones(n),
               bounds=Bounds(lb, ub), options={"time_limit": time_limit, "mip_rel_gap": rel_gap})
    if res.x is None:
        return None
    return {i for i, k in svar.items() if res.x[k] > 0.5}


def solve_milp(problem: Problem, budget: float, time_limit: float = 60.0, rel_gap: float = 1e-6) -> Solution:
    saved = _milp(problem, budget, time_limit=time_limit, rel_gap=rel_gap)
    if saved is None:
        raise Infeasible(f"no selection of saved values fits a budget of {budget:.0f} bytes")
    return evaluate(problem, saved, "milp")


# -- Lagrangian min cut -------------------------------------------------------------------------

_PS = 1e12   # capacities are integers: seconds -> picoseconds


def _cut(problem: Problem, idx: list[int], byte_weight: float, cost_weight: float = _PS) -> set[int]:
    """Saved set minimising ``cost_weight * cost + byte_weight * bytes`` (a min s-t cut)."""
    values = problem.values
    g = nx.DiGraph()
    g.add_node("source"), g.add_node("sink")
    for i in idx:
        v = values[i]
        a, b = ("in", i), ("out", i)
        if v.kept:
            g.add_edge(a, b, capacity=0)
            g.add_edge("source", a)       # never recomputed, free to read
        else:
            if v.savable:
                g.add_edge(a, b, capacity=int(round(byte_weight * v.bytes)))
            else:
                g.add_edge(a, b)          # infinite: a view or an unsavable value
            if not v.recomputable:
                g.add_edge("source", a)
            elif v.cost > 0:
                g.add_edge("source", a, capacity=max(1, int(round(cost_weight * v.cost))))
        if v.needed:
            g.add_edge(b, "sink")
        for d in set(v.deps):
            g.add_edge(("out", d), a)
    try:
        cut_value, (reachable, _) = nx.minimum_cut(g, "source", "sink")
    except nx.NetworkXUnbounded:
        cut_value = float("inf")
    if cut_value == float("inf"):
        raise Infeasible("some value needed in backward can be neither saved nor recomputed")
    return {i for i in idx if values[i].savable and not values[i].kept
            and ("in", i) in reachable and ("out", i) not in reachable}


def _lagrangian_bracket(problem: Problem, budget: float, steps: int = 30):
    """The cheapest cut within budget and the cut just over it, by bisection on lambda."""
    idx = relevant(problem)
    loose = evaluate(problem, _cut(problem, idx, 1e-3), "mincut")
    if loose.bytes <= budget:
        return loose, None
    tight = evaluate(problem, _cut(problem, idx, 1e9, 1.0), "mincut")
    if tight.bytes > budget:
        raise Infeasible(f"budget {budget:.0f} bytes is below the {tight.bytes} bytes that must be saved")
    lo, hi = math.log(1e-3), math.log(1e9)      # lambda in picoseconds per byte
    best_in, best_out = tight, loose
    for _ in range(steps):
        mid = (lo + hi) / 2
        sol = evaluate(problem, _cut(problem, idx, math.exp(mid)), "mincut")
        if sol.bytes <= budget:
            hi = mid
            if sol.cost < best_in.cost or (sol.cost == best_in.cost and sol.bytes < best_in.bytes):
                best_in = sol
        else:
            lo = mid
            best_out = sol
        if hi - lo < 1e-3:
            break
    return best_in, best_out


def _states(problem: Problem, sol: Solution) -> dict[tuple[str, int], int]:
    out = {}
    for i in relevant(problem):
        v = problem.values[i]
        if v.savable:
            out[("s", i)] = int(i in sol.saved)
        if v.recomputable:
            out[("r", i)] = int(i in sol.recomputed)
    return out


def solve_mincut(problem: Problem, budget: float, refine: bool = True) -> Solution:
    feasible, over = _lagrangian_bracket(problem, budget)
    if over is None or not refine:
        return feasible
    a, b = _states(problem, feasible), _states(problem, over)
    agree = {k: v for k, v in a.items() if b.get(k) == v}
    saved = _milp(problem, budget, fixed=agree, time_limit=20.0)
    best = feasible
    if saved is not None:
        refined = evaluate(problem, saved, "mincut")
        if refined.bytes <= budget and refined.cost < best.cost:
            best = refined
    best.notes.append(f"lagrangian cut {feasible.cost:.3e}s, refined over "
                      f"{len(a) - len(agree)} disagreeing variables")
    best.solver = "mincut"
    return best


def solve_greedy(problem: Problem, budget: float) -> Solution:
    best, _ = _lagrangian_bracket(problem, budget, steps=20)
    while True:
        candidates = [i for i in best.recomputed if problem.values[i].savable]
        step = None
        for i in candidates:
            trial = evaluate(problem, best.saved | {i}, "greedy")
            gain = best.cost - trial.cost
            if trial.bytes <= budget and gain > 0:
                ratio = gain / max(1, trial.bytes - best.bytes)
                if step is None or ratio > step[0]:
                    step = (ratio, trial)
        if step is None:
            best.solver = "greedy"
            return best
        best = step[1]


def min_bytes(problem: Problem) -> Solution:
    """The fewest bytes any feasible selection saves (ties: the fewest recomputed values).

    Only what descends from a value that can be neither recomputed nor is kept anyway (a
    random mask, a collective's result) can force a save: everything else is rebuilt from
    the step's inputs for free in bytes. So the min cut is taken over those descendants
    alone, the rest counted as available (a step without such values saves nothing at its
    floor, with no cut at all); on a 7B-shaped step the cut over every value took seconds.
    """
    values = problem.values
    idx = relevant(problem)
    forced = [i for i in idx if not values[i].kept and not values[i].recomputable]
    if not forced:
        return evaluate(problem, set(), "floor")
    users: dict[int, list[int]] = {}
    for i in idx:
        for d in values[i].deps:
            users.setdefault(d, []).append(i)
    below, stack = set(), list(forced)
    while stack:
        i = stack.pop()
        if i in below:
            continue
        below.add(i)
        stack.extend(users.get(i, ()))
    restricted = Problem([v if i in below else replace(v, kept=True) for i, v in enumerate(values)])
    return evaluate(problem, _cut(restricted, relevant(restricted), 1e9, 1.0), "floor")


# The auto solver stops the MILP once HiGHS proves it within 5% of the optimum's recompute cost,
# the bound the fast solvers are held to: on a stack of identical layers the root bound sits about
# 2% under the optimum (symmetric blocks), a heuristic finds the optimum early, and proving the last
# percent is most of the time. A 32-layer 7B-shaped step solves in 0.3 s instead of 0.7 s at 0.5%
# (the same solution; 7.6 s exact), an 80-layer one in 1.6 s instead of 2.7 s with 0.07% more
# recompute time, where the Lagrangian min cut (networkx) took 140 s and its cut alone, on scipy's
# max flow, still leaves a 25% duality gap to close; hence the MILP up to AUTO_MILP_VARS variables.
# ``solver="milp"`` stays exact.
AUTO_MILP_GAP = 5e-2
AUTO_MILP_VARS = 16000


def solve(problem: Problem, budget: float, solver: str = "auto") -> Solution:
    if solver == "auto":
        n_vars = sum(problem.values[i].savable + problem.values[i].recomputable
                     for i in relevant(problem))
        solver = "milp" if n_vars <= AUTO_MILP_VARS else "mincut"
        try:
            sol = solve_milp(problem, budget, time_limit=30.0, rel_gap=AUTO_MILP_GAP) if solver == "milp" else None
        except Infeasible:
            sol = None
        return sol or solve_mincut(problem, budget)
    return {"milp": solve_milp, "mincut": solve_mincut, "greedy": solve_greedy}[solver](problem, budget)
