"""Which forward values to keep for backward, and which to recompute: the optimisation.

The model, over forward values ``i`` (one per FX node, plus three virtual
values per random 0/1 mask, below):

- ``s_i`` (saved): value ``i`` is kept alive from forward to backward, costing
  ``bytes_i``. Only buffers can be saved; a view is available when its buffer is.
- ``r_i`` (recomputed): ``i`` is computed again in backward, costing ``cost_i``
  seconds, and needs every forward input available (saved or recomputed).
- A value a backward node reads must be available: ``s_i + r_i >= 1``.
- A view is available when its buffer (``base``) is saved or kept, for free; else it is
  recomputed, costing its op, from its buffer recomputed.
- Budget: ``sum bytes_i s_i <= B``. Objective: ``min sum cost_i r_i``, ties
  broken towards fewer bytes.

The rewriter recomputes a value once per block whose backward needs it (copies are
not shared between blocks, so that a recomputed value dies with the block that
asked for it). The model above counts one copy; it agrees with the rewriter unless a
block's recomputation reaches into another block (an unsaved block input rebuilt
from the block before, and so on down the stack: each later block rebuilds the
chain again). :func:`evaluate` prices a choice as the rewriter runs it, block by
block. The block model (``_model(..., hops=True)``, what ``milp``, ``folded`` and
``auto`` solve) adds ``y_i``, value ``i`` rebuilt in the blocks one away that read
it, each copy counted, and lets recomputation reach one block back, never further.
Where a budget leaves no room for that, :func:`solve` solves the one-copy model and
again with the values where its chains start saved, and keeps the cheaper as run.

Random 0/1 masks (``bernoulli``, what dropout decomposes to) are never drawn
again: a second draw would give other numbers and shift the RNG stream. Their
mask is kept in one of three forms: packed bits (1/8 byte per element, unpacked
by shifts), bool (1 byte, what ``native_dropout`` saves) or the float mask
itself (the forward's own tensor, no conversion in backward). The virtual chain
``bits -> bool -> float mask`` lets the solver choose, and a float value
computed from the mask alone (``mask / (1 - p)``) may be kept in its place; the
forward users of the mask read the float mask. Bitwise, all forms round-trip
exactly.

Solvers: ``folded`` solves a stack's identical blocks as one (an LP, what it leaves open decided
down the stack by a DP, see :func:`solve_folded`), what ``auto`` keeps where it is proven within
5% of the LP bound;
``milp`` is exact (``scipy.optimize.milp``, HiGHS); ``mincut`` solves
the Lagrangian ``min cost + lambda * bytes`` exactly as a min s-t cut
(networkx; saving ``i`` cuts ``i_in -> i_out``, recomputing cuts
``source -> i_in``), searches lambda for the budget, and closes the gap between
the two bracketing cuts with a MILP over the values they disagree on;
``greedy`` starts from the feasible cut and adds the saves that buy back most
recompute time per byte.
"""
from __future__ import annotations

import contextvars
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
    base: int | None = None      # a view's buffer value: the view is available when it is
    home: str = ""               # the block the value lies in ("" outside every block)
    read_in: tuple[str, ...] = ()   # the blocks whose backward reads it
    far: tuple[int, ...] = ()    # deps that lie in another block
    hops: int = 0                # other blocks whose recomputation may rebuild it, one block away

    def read_at_home(self) -> bool:
        return not self.read_in or self.home in self.read_in

    def read_away(self) -> bool:
        return any(scope != self.home for scope in self.read_in)


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
    copies: int = 0              # recomputations, one per block that needs the value


class Infeasible(ValueError):
    pass


class NoFolding(ValueError):
    pass


# -- evaluation ---------------------------------------------------------------------------------

def _free(values: list[Value], i: int) -> bool:
    """Available whatever is chosen: kept anyway, or a view of a buffer kept anyway."""
    v = values[i]
    return v.kept or (v.base is not None and values[v.base].kept)


def evaluate(problem: Problem, saved: set[int], solver: str = "", per_block: bool = True) -> Solution:
    """The recompute set a choice of saved values implies, and what it costs, as the rewriter
    runs it: in each block whose backward reads a value, what that value needs and is not
    saved is recomputed there, once per block (a value no block is recorded for counts once).
    ``per_block=False``: one copy of each, as the solvers' model counts.

    Only saves that something actually reads count; a value neither saved nor
    recomputable that is needed makes the choice infeasible.
    """
    values = problem.values
    recomputed: set[int] = set()
    used_saves: set[int] = set()
    cost, copies = 0.0, 0
    for stack in _starts(problem, per_block).values():
        cost, copies = _walk(values, stack, saved, recomputed, used_saves, cost, copies)
    return Solution(used_saves, recomputed, cost, sum(values[i].bytes for i in used_saves), solver,
                    copies=copies)


def _starts(problem: Problem, per_block: bool = True) -> dict[str, list[int]]:
    """Per block whose backward reads them (``""`` outside every block), the values it reads."""
    starts: dict[str, list[int]] = {}
    for i, v in enumerate(problem.values):
        if v.needed:
            for scope in (v.read_in or ("",)) if per_block else ("",):
                starts.setdefault(scope, []).append(i)
    return starts


def _walk(values: list[Value], start: list[int], saved: set[int], recomputed: set[int],
          used_saves: set[int], cost: float = 0.0, copies: int = 0) -> tuple[float, int]:
    """One block's backward: what it reads (``start``) and is not saved, recomputed, with what that
    needs; ``cost`` and ``copies`` with its seconds and copies added. Adds to ``recomputed`` and
    ``used_saves``."""
    stack, seen = list(start), set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        v = values[i]
        if _free(values, i):
            continue
        if i in saved and v.savable:
            used_saves.add(i)
            continue
        if v.base is not None and v.base in saved and values[v.base].savable:
            used_saves.add(v.base)
            continue
        if not v.recomputable:
            raise Infeasible(f"value {v.name} is needed in backward but can be neither saved nor "
                             f"recomputed ({v.reason or 'no reason recorded'})")
        recomputed.add(i)
        cost += v.cost
        copies += 1
        stack.extend(v.deps)
    return cost, copies


def chain_starts(problem: Problem, saved: set[int]) -> set[int]:
    """Values that a block's recomputation rebuilds although they lie in another block, where the
    rebuilding starts: read by that block's backward, or by a value of its own it recomputes.

    Saving them stops recomputation at the block's edge, as checkpointing each block's input does.
    """
    values = problem.values
    out: set[int] = set()
    sol = evaluate(problem, saved)
    if sol.copies == len(sol.recomputed):
        return out
    for i, v in enumerate(values):
        if v.needed:
            for scope in v.read_in:
                if v.home != scope and i in sol.recomputed:
                    out.add(i)
    for i in sol.recomputed:
        v = values[i]
        for d in v.deps:
            if d in sol.recomputed and values[d].home != v.home:
                out.add(d)
    return out


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
            if values[i].base is not None:
                stack.append(values[i].base)
    return sorted(out)


# -- exact MILP ---------------------------------------------------------------------------------

def _model(problem: Problem, budget: float, fixed: dict[tuple[str, int], int] | None = None,
           hops: bool = False):
    """The MILP's arrays: objective, constraint matrix and bounds, and which column is which value
    (``fixed``: variables held at a value). Built once per problem, budget and model within one
    :func:`solve` (the LP bound and the MILPs of one call share it)."""
    from scipy.optimize import Bounds

    built_here = _BUILT.get()
    key = (id(problem), budget, hops)
    cached = built_here.get(key) if built_here is not None else None
    if cached is None or cached[0] is not problem:
        cached = (problem, _arrays(problem, budget, hops))
        if built_here is not None:
            built_here[key] = cached
    built = cached[1]
    if built is None:
        return None
    c, tie, constraints, svar, rvar, total_cost = built
    lb, ub = np.zeros(len(c)), np.ones(len(c))
    for (kind, i), value in (fixed or {}).items():
        table = svar if kind == "s" else rvar
        if i in table:
            lb[table[i]] = ub[table[i]] = value
    return c, tie, constraints, Bounds(lb, ub), svar, total_cost


# Models built within the current solve() call, by (id(problem), budget, hops); None outside one.
# (A context variable: two threads compiling at once keep their own.) Each entry holds its problem,
# so no other problem can take its id while the call lasts.
_BUILT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("recompute_models", default=None)


def _arrays(problem: Problem, budget: float, hops: bool):
    """The objective, tie-break and constraints of :func:`_model`, before any variable is fixed.

    ``hops``: the model of the rewriter's blocks. Besides ``r_i`` (recomputed in its own
    block's backward) a value has ``y_i``, rebuilt in the backward of the blocks one away that
    read it (``hops`` of them: the next block, or every block for a rotary table), costing
    ``hops`` copies. A recomputed value's dependency in another block must be saved or rebuilt
    there (``y``); one rebuilt there needs its own dependencies the same way, and those in yet
    another block saved: recomputation reaches one block back, never down a chain of them.
    """
    from scipy.optimize import LinearConstraint
    from scipy.sparse import coo_matrix

    values = problem.values
    idx = relevant(problem)
    svar, rvar, yvar = {}, {}, {}
    for i in idx:
        v = values[i]
        if v.kept:
            continue
        if v.savable:
            svar[i] = len(svar) + len(rvar) + len(yvar)
        if v.recomputable:
            rvar[i] = len(svar) + len(rvar) + len(yvar)
            if hops and v.hops:
                yvar[i] = len(svar) + len(rvar) + len(yvar)
    n = len(svar) + len(rvar) + len(yvar)
    if n == 0:
        return None
    total_bytes = max(1, sum(values[i].bytes for i in svar))
    total_cost = max(1e-30, sum(values[i].cost for i in rvar))
    c = np.zeros(n)
    for table, times in ((rvar, 1), (yvar, 0)):
        for i, k in table.items():
            c[k] = values[i].cost * (times or values[i].hops) / total_cost
    tie = np.zeros(n)
    for i, k in svar.items():
        tie[k] = 1e-6 * values[i].bytes / total_bytes     # tie-break: fewer bytes
    rows, cols, data, lo, hi = [], [], [], [], []

    def row(i: int, tables, var: int | None, saved_only: bool = False) -> bool:
        """``i`` available (its variables of ``tables``; a view also through its buffer's save)
        ``>= 1``, or ``>= var``. A view's row comes with its buffer's (a valid cut: a view is
        rebuilt from its buffer): without it the LP would save half a buffer, read the view
        through that half and rebuild the view from the other. False when ``i`` has no variable."""
        base = values[i].base
        any_var = False
        for j in ((i, base) if base is not None else (i,)):
            if j is None or _free(values, j):
                continue
            r = len(lo)
            terms = [svar.get(j), svar.get(base) if j == i and base is not None else None]
            if not saved_only:
                terms += [t.get(j) for t in tables]
            terms = {k for k in terms if k is not None}
            for k in terms:
                rows.append(r), cols.append(k), data.append(1.0)
            if var is not None:
                rows.append(r), cols.append(var), data.append(-1.0)
            lo.append(0 if var is not None else 1), hi.append(np.inf)
            any_var = any_var or (j == i and bool(terms))
        return any_var

    for i in idx:
        v = values[i]
        if _free(values, i):
            continue
        for wanted, table in ((v.needed and (not hops or v.read_at_home()), rvar),
                              (v.needed and hops and v.read_away(), yvar)):
            if wanted and not row(i, (table,), None):
                raise Infeasible(f"value {v.name} is needed in backward but can be neither saved "
                                 f"nor recomputed ({v.reason})")
        far = set(v.far) if hops else set()
        for own, near, away, saved_only in ((rvar, rvar, yvar, False), (yvar, yvar, None, True)):
            if i not in own:
                continue
            for d in set(v.deps):
                if _free(values, d):
                    continue
                if d in far:   # in another block: rebuilt one block away, or (from there) saved
                    row(d, (away,) if away is not None else (), own[i], saved_only=saved_only)
                else:
                    row(d, (near,), own[i])
    row = len(lo)
    for i, k in svar.items():
        rows.append(row), cols.append(k), data.append(float(values[i].bytes))
    lo.append(-np.inf), hi.append(budget if math.isfinite(budget) else np.inf)
    A = coo_matrix((data, (rows, cols)), shape=(len(lo), n)).tocsr()
    return c, tie, LinearConstraint(A, lo, hi), svar, rvar, total_cost


def _milp(problem: Problem, budget: float, *, fixed: dict[tuple[str, int], int] | None = None,
          time_limit: float = 60.0, rel_gap: float = 1e-6, hops: bool = False) -> set[int] | None:
    from scipy.optimize import milp

    model = _model(problem, budget, fixed, hops)
    if model is None:
        return set()
    c, tie, constraints, bounds, svar, _ = model
    res = milp(c + tie, constraints=constraints, integrality=np.ones(len(c)), bounds=bounds,
               options={"time_limit": time_limit, "mip_rel_gap": rel_gap})
    if res.x is None:
        return None
    return {i for i, k in svar.items() if res.x[k] > 0.5}


def lower_bound(problem: Problem, budget: float, hops: bool = False) -> float:
    """The LP relaxation's recompute seconds: no choice within ``budget`` recomputes less (with
    ``hops``, no choice whose recomputation reaches one block back at most, as that model prices)."""
    from scipy.optimize import milp

    model = _model(problem, budget, hops=hops)
    if model is None:
        return 0.0
    c, _, constraints, bounds, _, total_cost = model
    # Without HiGHS' presolve: on these LPs it costs more than it saves (50 -> 35 ms on a 32-layer
    # step, 5586 columns), and the bound moves by 1e-7 of itself, far inside AUTO_MILP_GAP.
    res = milp(c, constraints=constraints, integrality=np.zeros(len(c)), bounds=bounds,
               options={"presolve": False})
    if res.x is None:
        raise Infeasible(f"no selection of saved values fits a budget of {budget:.0f} bytes")
    return float(res.fun) * total_cost


def solve_milp(problem: Problem, budget: float, time_limit: float = 60.0, rel_gap: float = 1e-6,
               hops: bool = False) -> Solution:
    saved = _milp(problem, budget, time_limit=time_limit, rel_gap=rel_gap, hops=hops)
    if saved is None:
        raise Infeasible(f"no selection of saved values fits a budget of {budget:.0f} bytes")
    return evaluate(problem, saved, "milp")


# -- identical blocks folded into one --------------------------------------------------------------

@dataclass
class Folding:
    """A problem whose identical blocks share one set of variables, and how to unfold its answer.

    ``problem`` holds every value outside the folded blocks as it was and, per folded
    stack, one representative block whose bytes and seconds count once per block it
    stands for; ``members[j]`` lists the original values folded value ``j`` stands for.
    """
    problem: Problem
    members: list[list[int]]
    blocks: int                      # blocks folded, over every stack
    groups: list[list[int]] = field(default_factory=list)   # per stack, the blocks folded

    def unfold(self, saved: set[int]) -> set[int]:
        return {i for j in saved for i in self.members[j]}


def fold(problem: Problem, stacks: list[list[list[int]]], min_blocks: int = 3) -> Folding | None:
    """Fold the identical blocks of each stack (``stacks``: per stack, per block, its values in
    forward order) into one, or None when no stack has ``min_blocks`` identical blocks.

    Blocks are identical when value by value they weigh, cost and may be kept or recomputed
    alike, are read by backward alike, and read the same positions of their own block. What
    a block reads outside itself (the block before, the embeddings, a rotary table) may
    differ: the folded value reads all of it. An answer of the folded problem, unfolded (each
    folded block saving alike), is an answer of the original one: a folded value recomputed
    stands for it recomputed in every block, each of which then needs what it reads
    available, which the union of what they read says. Its cost there, one copy of each value
    counted as the solvers count, is at most the folded one's (the last block's copy of a value
    only the next block reads is then not rebuilt).
    The choices that differ between blocks (the best use of a budget that one more saved
    value per block would overrun) are out of its reach; :func:`solve_folded` rounds the LP
    block by block for them and bounds what is left.
    """
    values = problem.values
    owner: dict[int, tuple[int, int, int]] = {}
    for s, blocks in enumerate(stacks):
        for b, members in enumerate(blocks):
            for p, i in enumerate(members):
                owner[i] = (s, b, p)

    def signature(s: int, b: int) -> tuple:
        out = []
        for i in stacks[s][b]:
            v = values[i]
            inside = tuple(sorted({owner[d][2] for d in v.deps if owner.get(d, (None, None))[:2] == (s, b)}))
            base = owner[v.base][2] if owner.get(v.base, (None, None))[:2] == (s, b) else v.base is None
            out.append((v.bytes, v.cost, v.flops, v.written, v.savable, v.recomputable, v.needed, v.kept, inside,
                        base, v.read_at_home(), v.read_away(), v.hops, len(v.far)))
        return tuple(out)

    groups: list[list[int]] = []        # per stack, the blocks folded (those of the commonest signature)
    for s, blocks in enumerate(stacks):
        by_signature: dict[tuple, list[int]] = {}
        for b in range(len(blocks)):
            by_signature.setdefault(signature(s, b), []).append(b)
        common = max(by_signature.values(), key=len, default=[])
        groups.append(common if len(common) >= min_blocks else [])
    if not any(groups):
        return None
    rep: dict[int, int] = {}            # original value -> folded value
    members: list[list[int]] = []
    folded_of: dict[int, tuple[int, int]] = {}   # original value -> (stack, position) when folded
    for s, chosen in enumerate(groups):
        for b in chosen:
            for p, i in enumerate(stacks[s][b]):
                folded_of[i] = (s, p)
    for i in range(len(values)):
        if i not in folded_of:
            rep[i] = len(members)
            members.append([i])
    first: dict[tuple[int, int], int] = {}
    for s, chosen in enumerate(groups):
        for p in range(len(stacks[s][chosen[0]]) if chosen else 0):
            first[(s, p)] = len(members)
            members.append([stacks[s][b][p] for b in chosen])
    for i, key in folded_of.items():
        rep[i] = first[key]
    folded = []
    for j, group in enumerate(members):
        v = values[group[0]]
        n = len(group)
        deps = sorted({rep[d] for i in group for d in values[i].deps})
        # A folded view reads its buffer's save where every block's view stands for one folded
        # buffer (its own block's, or one they share); else it is priced as recomputed, no cheaper.
        bases = {None if values[i].base is None else rep[values[i].base] for i in group}
        base = bases.pop() if len(bases) == 1 else None
        far = tuple(sorted({rep[d] for i in group for d in values[i].far}))
        folded.append(replace(v, deps=deps, bytes=v.bytes * n, cost=v.cost * n, flops=v.flops * n,
                              written=v.written * n, base=base, far=far))
    return Folding(Problem(folded), members, sum(len(g) for g in groups), groups)


def _round(problem: Problem, folding: Folding, budget: float, base: set[int], upgrade: list[int]) -> Solution | None:
    """``base`` saved by every block, ``upgrade`` also by as many blocks as fit ``budget``, spread
    evenly over the stack: a block boundary left unsaved is then rebuilt from the block before,
    whose own is saved, not down a run of unsaved ones (see :func:`evaluate`)."""
    whole = folding.unfold(base)
    try:
        floor = evaluate(problem, whole, "folded")
    except Infeasible:
        return None
    fits = floor if floor.bytes <= budget else None
    if not upgrade:
        return fits
    per_block = sum(problem.values[folding.members[j][0]].bytes for j in upgrade)
    blocks = max(len(folding.members[j]) for j in upgrade)
    k = blocks if per_block == 0 else max(0, min(blocks, int((budget - floor.bytes) // per_block)))
    for k in range(k, 0, -1):
        try:
            picks = {int(t * blocks / k) for t in range(k)}
            sol = evaluate(problem, whole | {i for j in upgrade for b, i in enumerate(folding.members[j])
                                             if b in picks}, "folded")
        except Infeasible:
            continue
        if sol.bytes <= budget:
            return sol
    return fits


def solve_folded(problem: Problem, budget: float, stacks: list[list[list[int]]],
                 hops: bool = False) -> Solution | None:
    """Identical blocks solved as one: the LP over the folded problem, then what it leaves open.

    The LP's answer saves most folded values wholly or not at all; those it saves in part (a
    fraction of each block's, the budget's edge) are what the blocks need not choose alike.
    The LP's whole decisions are fixed in every block and the rest is decided block by block:
    by a dynamic program down the stack (:func:`_chain_dp`) where the open saves are few and in
    one stack (32 layers of a 7B-shaped step fold to 178 values, and 3 stay open), else by a
    MILP over the whole problem with only those free. Where that MILP finds no answer in its
    time, the LP is rounded instead (:func:`_round_shares`).

    None when no stack folds, or nothing fits the budget. The answer is priced on the whole
    problem, block by block (:func:`evaluate`); how far that is from the LP bound, ``solve``
    (``auto``) judges.
    """
    from scipy.optimize import milp

    folding = fold(problem, stacks)
    if folding is None:
        return None
    model = _model(folding.problem, budget, hops=hops)
    if model is None:
        return evaluate(problem, set(), "folded")
    c, tie, constraints, bounds, svar, _ = model
    res = milp(c + tie, constraints=constraints, integrality=np.zeros(len(c)), bounds=bounds)
    if res.x is None:
        return None
    share = {j: float(res.x[k]) for j, k in svar.items()}
    open_saves = [j for j, f in share.items() if 1e-6 <= f <= 1 - 1e-6]
    how = f"{sum(len(folding.members[j]) for j in open_saves)} saves the LP left open decided"
    best = _chain_dp(problem, folding, budget, share, open_saves, stacks) if open_saves else None
    if best is not None:
        how += " block by block down the stack (a DP)"
    else:
        fixed = {("s", i): int(round(f)) for j, f in share.items() if j not in open_saves
                 for i in folding.members[j]}
        saved = _milp(problem, budget, fixed=fixed, time_limit=10.0, rel_gap=1e-3, hops=hops)
        best = evaluate(problem, saved, "folded") if saved is not None else None
        how += " by a MILP"
    if best is None or best.bytes > budget:
        best, how = _round_shares(problem, folding, budget, share), "the LP rounded block by block"
    if best is None:
        return None
    best.notes.append(f"{folding.blocks} identical blocks solved as one; {how}")
    return best


# The most saves a block may leave open for the chain DP (2**k states per block, 8**k probes),
# and the most budget steps it tracks (past that, bytes are counted in coarser steps, rounded up).
CHAIN_DP_OPEN = 3
CHAIN_DP_STEPS = 4000


class _Chain:
    """A choice of saved values: ``base``, and of the open saves, per block, its state's bits."""
    __slots__ = ("base", "where", "states")

    def __init__(self, base: set[int], where: dict[int, tuple[int, int]], states: list[int]):
        self.base, self.where, self.states = base, where, states

    def __contains__(self, i: int) -> bool:
        if i in self.base:
            return True
        at = self.where.get(i)
        return at is not None and bool(self.states[at[0]] >> at[1] & 1)


def _chain_dp(problem: Problem, folding: Folding, budget: float, share: dict[int, float],
              open_saves: list[int], stacks: list[list[list[int]]]) -> Solution | None:
    """The saves the folded LP leaves open, decided block by block down the stack by dynamic
    programming, priced as the rewriter runs them.

    With the LP's whole decisions fixed, a block's state is which of the open saves it keeps.
    A block's backward reads its own values and the block before's (its input; what it
    rebuilds one block back), and what that rebuild needs from the block before that where it
    is not saved there: its recompute time is a function of three blocks' states (a chain
    reaching further back is priced as if the blocks before were alike). The stack is then a
    chain whose bytes share the budget, a knapsack over a chain, solved exactly over (block,
    two blocks' states, bytes used). Each triple of states' time is measured once, on a block
    in the middle of the stack (the blocks are identical); the first two blocks', and what the
    backward outside the stack spends given the last two, separately. An open save outside the
    stack (one value) is tried both ways. The answer is priced on the whole problem
    (:func:`evaluate`).

    None where the open saves lie in more than one stack or number more than
    ``CHAIN_DP_OPEN`` per block, or the stack's folded blocks are not consecutive.
    """
    members, values = folding.members, problem.values
    opens = [j for j in open_saves if len(members[j]) > 1]
    singles = [j for j in open_saves if len(members[j]) == 1]
    if len(opens) > CHAIN_DP_OPEN or len(singles) > 2:
        return None
    down = _down_the_stack(problem, folding, budget, opens, stacks) if opens else (lambda base: base)
    if down is None:
        return None
    whole = folding.unfold({j for j, f in share.items() if f > 1 - 1e-6})
    best = None
    for pick in range(1 << len(singles)):
        saved = down(whole | {members[j][0] for k, j in enumerate(singles) if pick >> k & 1})
        if saved is None:
            continue
        try:
            sol = evaluate(problem, saved, "folded")
        except Infeasible:
            continue
        if sol.bytes <= budget and (best is None or (sol.cost, sol.bytes) < (best.cost, best.bytes)):
            best = sol
    return best


def _down_the_stack(problem: Problem, folding: Folding, budget: float, opens: list[int],
                    stacks: list[list[list[int]]]):
    """:func:`_chain_dp`'s DP for the open saves ``opens`` of one stack: a function from the values
    saved anyway to those plus each block's choice of open saves (None where nothing fits); None
    where the open saves are not all of one stack's consecutive folded blocks."""
    members, values = folding.members, problem.values
    # the stack whose first folded block holds each open save's first member
    stack_of = {i: s for s, g in enumerate(folding.groups) if g for i in stacks[s][g[0]]}
    found = {stack_of.get(members[j][0]) for j in opens}
    if len(found) != 1 or None in found:
        return None
    chosen = folding.groups[found.pop()]
    nb = len(chosen)
    if nb < 4 or chosen != list(range(chosen[0], chosen[0] + nb)) or any(len(members[j]) != nb for j in opens):
        return None
    scope = [values[members[opens[0]][t]].home for t in range(nb)]
    starts = _starts(problem)
    outside = [sc for sc in starts if sc not in set(scope)]
    n = 1 << len(opens)
    where = {members[j][t]: (t, k) for k, j in enumerate(opens) for t in range(nb)}
    weight = [sum(values[members[j][0]].bytes for k, j in enumerate(opens) if state >> k & 1) for state in range(n)]

    def time_of(base: set[int], scopes: list[str], a: int, b: int, c: int, t: int) -> float:
        """The backward of ``scopes`` with the blocks before ``t - 1`` in state ``a``, block ``t - 1``
        in ``b``, the rest in ``c``."""
        saved = _Chain(base, where, [a] * max(0, t - 1) + [b] * min(t, 1) + [c] * (nb - t))
        cost = 0.0
        try:
            for sc in scopes:
                cost, _ = _walk(values, starts.get(sc, []), saved, set(), set(), cost)
        except Infeasible:
            return math.inf
        return cost

    def down(base: set[int]) -> set[int] | None:
        room = budget - sum(values[i].bytes for i in base if values[i].savable)
        if room < 0:
            return None
        unit = math.gcd(*[values[members[j][0]].bytes for j in opens]) or 1
        steps = nb * max(weight) // unit           # every block saving every open save
        if math.isfinite(room):
            steps = min(int(room // unit), steps)
        if steps > CHAIN_DP_STEPS:
            unit = math.ceil(unit * steps / CHAIN_DP_STEPS)
            steps = min(CHAIN_DP_STEPS, int(room // unit)) if math.isfinite(room) else CHAIN_DP_STEPS
        size = [math.ceil(w / unit) for w in weight]
        mid = nb // 2
        triple = np.array([[[time_of(base, [scope[mid]], a, b, c, mid) for c in range(n)]
                            for b in range(n)] for a in range(n)])
        # The first two blocks: block 0's backward and block 1's, block 0 in a, the rest in b.
        start = np.array([[time_of(base, [scope[0]], a, a, a, 0) + time_of(base, [scope[1]], a, a, b, 1)
                           for b in range(n)] for a in range(n)])
        tail = np.array([[time_of(base, outside, b, b, c, nb - 1) for c in range(n)] for b in range(n)])
        cost = np.full((n, n, steps + 1), math.inf)       # (state of block t - 1, of block t, bytes)
        for a in range(n):
            for b in range(n):
                if size[a] + size[b] <= steps:
                    cost[a, b, size[a] + size[b]] = start[a, b]
        back = np.zeros((nb, n, n, steps + 1), dtype=np.int8)
        for t in range(2, nb):
            new = np.full_like(cost, math.inf)
            for c in range(n):
                if size[c] > steps:
                    continue
                cand = cost[:, :, :steps + 1 - size[c]] + triple[:, :, c][:, :, None]
                arg = np.argmin(cand, axis=0)
                new[:, c, size[c]:] = np.take_along_axis(cand, arg[None], axis=0)[0]
                back[t, :, c, size[c]:] = arg
            cost = new
        total = cost + tail[:, :, None]
        low = total.min()
        if not math.isfinite(low):
            return None
        # The least time; of equal times, the fewest bytes.
        b, c, used = min(zip(*np.nonzero(total <= low + 1e-12 * abs(low))), key=lambda x: (x[2], x[0], x[1]))
        states = [0] * nb
        states[nb - 1], states[nb - 2] = int(c), int(b)
        for t in range(nb - 1, 1, -1):
            a = int(back[t, states[t - 1], states[t], used])
            used -= size[states[t]]
            states[t - 2] = a
        return base | {i for i, (t, k) in where.items() if states[t] >> k & 1}
    return down


def _round_shares(problem: Problem, folding: Folding, budget: float, share: dict[int, float]) -> Solution | None:
    """The folded LP's answer rounded: what it saves in part (a fraction ``f`` of each block's)
    saved whole by as many blocks as the budget leaves room for, and not at all by the others."""
    levels = sorted({round(f, 6) for f in share.values() if 1e-6 < f < 1 - 1e-6}, reverse=True)
    boundaries = {d for v in folding.problem.values for d in v.far}
    best = None
    for high, low in zip([1.0, *levels], levels or [None]):
        # Saved by every block: what the LP saves at least ``high`` of; by as many blocks as the
        # budget allows, also what it saves ``low`` of. Each such pair of thresholds is a pair of
        # block patterns the LP mixes (a mask's bits and bool, one share each, take both or one).
        base_set = {j for j, f in share.items() if f >= high - 1e-6}
        band = [] if low is None else [j for j, f in share.items() if low - 1e-6 <= f < high - 1e-6]
        for singles in ((), tuple(j for j in band if len(folding.members[j]) == 1)):
            sol = _round(problem, folding, budget, base_set | set(singles),
                         [j for j in band if len(folding.members[j]) > 1])
            if sol is not None and (best is None or sol.cost < best.cost):
                best = sol
    # Every value the LP saves in part, by its share of the blocks at once, spread over the stack
    # (a boundary's half share: every other block); the others' shares scaled down to fit.
    whole = folding.unfold({j for j, f in share.items() if f >= 1 - 1e-6})
    frac = {j: f for j, f in share.items() if 1e-6 < f < 1 - 1e-6}
    for scale in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5):
        picked = set(whole)
        for j, f in frac.items():
            n = len(folding.members[j])
            k = min(n, math.ceil(f * n) if j in boundaries else int(f * scale * n))
            picked |= {folding.members[j][int(t * n / k)] for t in range(k)}
        try:
            sol = evaluate(problem, picked, "folded")
        except Infeasible:
            break
        if sol.bytes <= budget:
            if best is None or sol.cost < best.cost:
                best = sol
            break
    return best


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
        if _free(values, i):
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


def floor_bytes(problem: Problem) -> int:
    """:func:`min_bytes`' bytes alone. Where nothing forces a save it is 0 without pricing the
    selection that saves nothing: that selection has every block rebuild the forward from the
    step's inputs, a walk that grows with the square of the depth (0.04 s on 80 layers)."""
    idx, forced = _forced(problem)
    return _floor_cut(problem, idx, forced).bytes if forced else 0


def min_bytes(problem: Problem) -> Solution:
    """The fewest bytes any feasible selection saves (ties: the fewest recomputed values).

    Only what descends from a value that can be neither recomputed nor is kept anyway (a
    random mask, a collective's result) can force a save: everything else is rebuilt from
    the step's inputs for free in bytes. So the min cut is taken over those descendants
    alone, the rest counted as available (a step without such values saves nothing at its
    floor, with no cut at all); on a 7B-shaped step the cut over every value took seconds.
    """
    idx, forced = _forced(problem)
    return _floor_cut(problem, idx, forced) if forced else evaluate(problem, set(), "floor")


def _forced(problem: Problem) -> tuple[list[int], list[int]]:
    """The values that can matter (:func:`relevant`), and those of them that force a save."""
    values = problem.values
    idx = relevant(problem)
    return idx, [i for i in idx if not values[i].kept and not values[i].recomputable]


def _floor_cut(problem: Problem, idx: list[int], forced: list[int]) -> Solution:
    values = problem.values
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


def solve(problem: Problem, budget: float, solver: str = "auto",
          stacks: list[list[list[int]]] | None = None) -> Solution:
    """The saved values for ``budget`` bytes. ``stacks`` (per stack of blocks, per block, its values
    in forward order) lets ``auto`` and ``folded`` solve identical blocks once (:func:`solve_folded`).

    ``milp``, ``folded`` and ``auto`` solve the model of the rewriter's blocks (``_model`` with
    ``hops``): recomputation reaches one block back at most, each block's copy counted. Where
    the budget is below what that needs (a block boundary saved every other block), and for
    ``mincut`` and ``greedy``, the model counts one copy of each value; where such an answer
    has a block rebuild the blocks before it (each later block then rebuilds them again, see
    :func:`evaluate`), the problem is solved again with the values where those chains start
    saved, and the answer that costs least as the rewriter runs it is kept.

    ``auto``: the folded answer where it is within ``AUTO_MILP_GAP`` of the LP bound; else the
    MILP (the min cut past ``AUTO_MILP_VARS`` variables), and the cheaper of the two. Past that
    size the folded answer, when there is one, is kept unproven: the min cut took minutes there.
    """
    token = _BUILT.set({} if _BUILT.get() is None else _BUILT.get())
    try:
        return _solve(problem, budget, solver, stacks)
    finally:
        _BUILT.reset(token)


def _solve(problem: Problem, budget: float, solver: str, stacks: list[list[list[int]]] | None) -> Solution:
    if solver == "auto":
        try:
            return _solve_auto(problem, budget, stacks or [], hops=True)
        except Infeasible:
            return _one_copy(_solve_auto(problem, budget, stacks or [], hops=False))

    def run(p: Problem, hops: bool) -> Solution:
        if solver == "folded":
            sol = solve_folded(p, budget, stacks or [], hops=hops)
            if sol is None:
                raise NoFolding("solver 'folded' found no stack of at least 3 identical blocks (or, folding "
                                "one, no answer within the budget): use solver 'auto' or 'milp'")
            return sol
        if solver == "milp":
            return solve_milp(p, budget, hops=hops)
        return {"mincut": solve_mincut, "greedy": solve_greedy}[solver](p, budget)
    if solver not in ("milp", "folded"):
        return _cutting_chains(problem, budget, lambda p: run(p, False))
    try:
        return run(problem, True)
    except (Infeasible, NoFolding):
        return _one_copy(_cutting_chains(problem, budget, lambda p: run(p, False)))


def _one_copy(sol: Solution) -> Solution:
    sol.notes.append("the budget leaves no room for recomputation reaching one block back at most (or that "
                     "model found no answer): solved counting one copy of each value, chains of blocks cut")
    return sol


def _solve_auto(problem: Problem, budget: float, stacks: list[list[list[int]]], hops: bool) -> Solution:
    def chains(run):
        return run(problem) if hops else _cutting_chains(problem, budget, run)

    folded = None
    if stacks:
        def run_folded(p: Problem) -> Solution:
            sol = solve_folded(p, budget, stacks, hops=hops)
            if sol is None:
                raise NoFolding("no identical blocks")
            return sol
        try:
            folded = chains(run_folded)
        except (Infeasible, NoFolding):
            folded = None
        if folded is not None:
            bound = lower_bound(problem, budget, hops=hops)
            if folded.cost - bound <= AUTO_MILP_GAP * max(folded.cost, 1e-30):
                folded.notes.append(f"recompute {folded.cost:.3e}s against the LP bound {bound:.3e}s")
                return folded
    n_vars = sum(problem.values[i].savable + problem.values[i].recomputable for i in relevant(problem))
    if n_vars > AUTO_MILP_VARS and folded is not None:
        folded.notes.append(f"not proven within {AUTO_MILP_GAP:.0%} of the LP bound; the exact solvers over "
                            f"{n_vars} variables were not tried")
        return folded
    if n_vars <= AUTO_MILP_VARS:
        def exact(p: Problem) -> Solution:
            return solve_milp(p, budget, time_limit=30.0, rel_gap=AUTO_MILP_GAP, hops=hops)
    elif hops:
        raise Infeasible("the min cut counts one copy of each value")   # solved without hops
    else:
        def exact(p: Problem) -> Solution:
            return solve_mincut(p, budget)
    try:
        sol = chains(exact)
    except Infeasible:
        if folded is not None:
            return folded
        if hops:
            raise
        return _cutting_chains(problem, budget, lambda p: solve_mincut(p, budget))
    return folded if folded is not None and (folded.cost, folded.bytes) < (sol.cost, sol.bytes) else sol


# Rounds of saving where recomputation chains start (each adds the starts the last answer had).
CHAIN_ROUNDS = 3


def _can_force(problem: Problem, i: int) -> bool:
    v = problem.values[i]
    return v.savable or (v.base is not None and problem.values[v.base].savable)


def _cutting_chains(problem: Problem, budget: float, run) -> Solution:
    """``run(problem)``'s answer, and ``run`` again with the values where its recomputation chains
    start (:func:`chain_starts`) kept from recomputation, up to ``CHAIN_ROUNDS`` times (a round that
    costs more may lead to one that costs less); the one that costs least block by block. The first answer's errors are raised; a later one's ends the rounds."""
    sol = run(problem)
    best, forced = sol, set()
    for _ in range(CHAIN_ROUNDS):
        starts = {i for i in chain_starts(problem, sol.saved) - forced if _can_force(problem, i)}
        if not starts:
            break
        forced |= starts
        pinned = Problem([replace(v, recomputable=False, reason="saved: a block recomputing it would rebuild "
                                  "it again for every block after it") if i in forced else v
                          for i, v in enumerate(problem.values)])
        try:
            sol = run(pinned)
        except (Infeasible, NoFolding):
            break
        sol = replace(evaluate(problem, sol.saved, sol.solver), notes=sol.notes)
        if sol.bytes <= budget and (sol.cost, sol.bytes) < (best.cost, best.bytes):
            best = sol
    if forced:
        best.notes.append(f"{len(forced)} values where recomputation crossed into another block tried saved; "
                          f"{best.copies} recomputations in all")
    return best
