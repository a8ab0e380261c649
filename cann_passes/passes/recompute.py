"""recompute: choose which forward values backward keeps, and recompute the rest in backward.

Policies:

- ``none``: keep every activation (dropout masks as bool, as ``native_dropout`` keeps them
  and as Megatron's activation count assumes).
- ``full``: checkpoint every transformer block (module paths ``<list>.<N>``, e.g.
  ``layers.3``): keep only values that cross a block boundary.
- ``every_n_layers``: as ``full`` over groups of ``every_n`` consecutive blocks
  (Megatron's "uniform" method): keep only what crosses a group boundary.
- ``selective``: recompute the attention core (Korthikanti et al. 2022): the
  score matmul, scale, mask, softmax, dropout and attention x V; its dropout
  mask is kept as packed bits.
- ``budget``: keep at most ``budget`` (a fraction of the no-recompute saved
  bytes, or bytes when > 1) and recompute the cheapest rest, timed by the
  device profile's roofline (see :mod:`cann_passes.recompute_solver`). Per
  dropout mask it chooses between packed bits, bool, the float mask and the
  float values computed from the mask alone (``mask / (1 - p)``): a loose
  budget keeps the float and spares backward the conversions.

The fixed policies keep masks compact (bits or bool, converted back in
backward), so their saved bytes follow the published activation counts.

Recomputed values are copied into the backward region just before their first
use, tagged ``meta[RECOMPUTE] = True``. Never recomputed: random ops (a second
draw gives other numbers; the eager backend would also shift the RNG stream of
every later draw), collectives other than all-gathers, and what ``plan.recompute_bans``
names (op names like ``aten.mm`` or module path prefixes). An all-gather inside a block
(context parallelism's K/V, sequence parallelism's activations) may be re-run in backward
instead of keeping its gathered result: it is exact and every rank runs the same
graph. So a recomputed step is bitwise identical to the original one.
"""
from __future__ import annotations

import math
import operator
import time
import warnings
from typing import Literal

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.cost import layout_key, node_cost
from graph_ir.analysis.effects import communicates, draws_random, random_op, regathers
from graph_ir.analysis.memory import aliases_input, buffer_bytes, memory_profile, saved_activations, storage_roots
from graph_ir.analysis.structure import Structure, attention_cores, find_blocks
from graph_ir.build import eliminate_dead_code, fake_value
from graph_ir.meta import (MODULE_PATH, ORIGIN_PASS, RECOMPUTE, RECOMPUTE_OF, REGION, Region, module_path_of,
                           nbytes, region_of)
from graph_ir.placement import RANDOM_PIECE

from ..cost_model import get_profile, node_time
from ..cost_model.profiles import DeviceProfile
from ..pass_manager import PassContext, PassOptionError, register_pass
from ..recompute_solver import NoFolding, Problem, Value, floor_bytes, solve

aten = torch.ops.aten
POLICIES = ("none", "full", "selective", "every_n_layers", "budget")
SOLVERS = ("auto", "folded", "milp", "mincut", "greedy")
_MASK_OPS = {aten.bernoulli.p, aten.bernoulli.default}


# -- the problem ----------------------------------------------------------------------------------

def _is_float_mask(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    # (or this rank's piece of a whole draw: tensor parallelism keeps the piece, graph_ir.placement)
    return (node.target in _MASK_OPS or RANDOM_PIECE in node.meta) and isinstance(val, torch.Tensor) \
        and val.dtype.is_floating_point


def _ban_reason(node: torch.fx.Node, bans: tuple[str, ...]) -> str:
    op = str(node.target)
    path = module_path_of(node)
    for ban in bans:
        if op == ban or op.startswith(ban + "."):
            return f"banned by recompute_bans {ban!r} (op)"
        if path and (path == ban or path.startswith(ban + ".")):
            return f"banned by recompute_bans {ban!r} (module path)"
    return ""


def _check_bans(graph: TrainGraph, bans: tuple[str, ...]) -> None:
    """A ban that names neither an op nor a module path of the forward would be ignored: refused."""
    forward = list(graph.compute_nodes(Region.FORWARD))
    for ban in bans:
        if not any(_ban_reason(n, (ban,)) for n in forward):
            paths = sorted({module_path_of(n) for n in forward} - {""})
            sample = ", ".join([p for p in paths if p.count(".") <= 1][:6])
            raise PassOptionError("recompute", "bans", f"{ban!r} names no op ('aten.<op>' or 'aten.<op>.<overload>') "
                                  f"and no module path of the forward (module paths include: {sample})", bans)


def _elementwise_time(profile: DeviceProfile, elements: int, moved: int, ops: int) -> float:
    return ops * profile.op_overhead + max(elements / profile.vector_rate(torch.float32),
                                           moved / profile.memory_bandwidth)


class _Builder:
    """Turns a TrainGraph into a solver Problem, remembering which value is which node."""

    def __init__(self, graph: TrainGraph, profile: DeviceProfile, bans: tuple[str, ...], world_size: int,
                 structure: Structure | None = None):
        self.graph, self.profile, self.bans, self.world = graph, profile, bans, world_size
        self.structure = structure
        self.root = storage_roots(graph.graph)
        self.values: list[Value] = []
        self.node_of: dict[int, torch.fx.Node] = {}
        self.index: dict[torch.fx.Node, int] = {}
        self.masks: dict[torch.fx.Node, dict[str, int]] = {}   # bernoulli node -> {"bits","bool","float"}
        self.derived: set[int] = set()   # values computed from masks alone
        self.priced: dict = {}           # layout_key -> (NodeCost, seconds): once per layer shape

    def build(self) -> Problem:
        forward = [n for n in self.graph.graph.nodes
                   if n.op == "call_function" and region_of(n) == Region.FORWARD]
        for node in forward:
            if _is_float_mask(node):
                self._add_mask(node)
            else:
                self._add_node(node)
        self._mark_uses()
        self._mark_mask_derived(forward)
        self._mark_blocks()
        return Problem(self.values)

    def _mark_blocks(self) -> None:
        """Per value, its dependencies in another block (``far``) and how many other blocks'
        backward may rebuild it one block away (``hops``): the blocks that read it, the blocks
        its users of the same block may be rebuilt for, and the blocks of its users elsewhere."""
        users: dict[int, list[int]] = {}
        for i, v in enumerate(self.values):
            v.far = tuple(d for d in v.deps if self.values[d].home != v.home)
            for d in set(v.deps):
                users.setdefault(d, []).append(i)
        away: list[frozenset] = [frozenset()] * len(self.values)
        for i in range(len(self.values) - 1, -1, -1):    # values are in forward order
            v = self.values[i]
            out = {scope for scope in v.read_in if scope != v.home}
            for u in users.get(i, ()):
                home = self.values[u].home
                if home == v.home:
                    out |= away[u]
                else:
                    out.add(home)
            away[i] = frozenset(out)
            v.hops = len(out)

    def _dep(self, node: torch.fx.Node) -> int | None:
        if node in self.masks:
            return self.masks[node]["float"]
        return self.index.get(node)

    def _add_node(self, node: torch.fx.Node) -> None:
        deps = [d for d in (self._dep(a) for a in node.all_input_nodes) if d is not None]
        key = layout_key(node)
        priced = self.priced.get(key) if key is not None else None
        if priced is None:
            priced = (node_cost(node), node_time(node, self.profile, world_size=self.world))
            if key is not None:
                self.priced[key] = priced
        cost, seconds = priced
        v = Value(node.name, deps, flops=cost.flops, written=cost.bytes_written, cost=seconds)
        is_root = self.root[node] is node
        v.bytes = buffer_bytes(node) if is_root else 0
        v.savable = is_root and not aliases_input(node) and not isinstance(node.meta.get("val"), (tuple, list))
        source = self.values[self.index[node.args[0]]] if node.target is operator.getitem \
            and node.args[0] in self.index else None
        if source is not None and not source.recomputable:
            # An output of a random op (or a collective) exists only as the forward made it.
            v.recomputable, v.reason = False, source.reason
        elif aliases_input(node) or node.target is operator.getitem:
            pass   # a view or an item of a tuple computes nothing: rebuilding it is always allowed
        elif draws_random(node):
            v.recomputable, v.reason = False, "random op: saved so that backward sees the same draw"
        # (FX calls a seeded op impure; one given dropout_p=0 draws nothing and recomputes bitwise)
        elif (communicates(node) and not self._regathers_in_block(node)) \
                or (node.is_impure() and not random_op(node.target) and not communicates(node)):
            v.recomputable, v.reason = False, "collective or side effect: never recomputed"
        elif (why := _ban_reason(node, self.bans)):
            v.recomputable, v.reason = False, why
        if not is_root and self._dep(self.root[node]) is not None:
            v.base = self._dep(self.root[node])
        v.home = self._block(node)
        self.index[node] = len(self.values)
        self.node_of[len(self.values)] = node
        self.values.append(v)

    def _block(self, node: torch.fx.Node) -> str:
        """The block whose backward scope ``node`` belongs to, as the rewriter scopes its copies."""
        return self.structure.block_of(module_path_of(node)) if self.structure is not None else ""

    def stacks(self) -> list[list[list[int]]]:
        """Per stack of blocks, per block, its values in forward order (a mask's three with it)."""
        if self.structure is None or not self.structure.blocks:
            return []
        values_of: dict[str, list[int]] = {}
        for node, i in self.index.items():
            chain = self.masks.get(node)
            values_of.setdefault(self.structure.block_of(module_path_of(node)), []).extend(
                sorted(chain.values()) if chain else [i])
        return [[sorted(values_of.get(block, [])) for block in blocks] for blocks in self.structure.stacks.values()]

    def _regathers_in_block(self, node: torch.fx.Node) -> bool:
        """An all-gather inside a transformer block (cp's K/V, sp's activations) may be re-run in
        backward; one outside every block (vocab-parallel logits) stays as forward made it."""
        return regathers(node) and self.structure is not None and bool(self.structure.block_of(module_path_of(node)))

    def _add_mask(self, node: torch.fx.Node) -> None:
        """bits (saved, never recomputed) -> bool (unpack) -> float mask (cast)."""
        val = node.meta["val"]
        n = val.numel()
        p = self.profile
        bits = Value(f"{node.name}.bits", [], bytes=math.ceil(n / 8), savable=True, recomputable=False,
                     reason="random mask: kept (as packed bits) so backward sees the same draw")
        boolean = Value(f"{node.name}.bool", [len(self.values)], bytes=n, savable=True,
                        cost=_elementwise_time(p, 2 * n, n // 8 + 2 * n, 4), written=n)
        # Saving the float mask means keeping the forward node itself: the same draw.
        floating = Value(node.name, [len(self.values) + 1], bytes=nbytes(val), savable=True,
                         cost=_elementwise_time(p, n, n + n * val.element_size(), 1),
                         written=n * val.element_size())
        base = len(self.values)
        bits.home = boolean.home = floating.home = self._block(node)
        self.values += [bits, boolean, floating]
        self.masks[node] = {"bits": base, "bool": base + 1, "float": base + 2}
        self.node_of[base + 2] = node
        self.index[node] = base + 2

    def _mark_uses(self) -> None:
        for node in self.graph.graph.nodes:
            region = region_of(node)
            if region == Region.FORWARD or node.op == "placeholder":
                continue
            scope = self._block(node) if region == Region.BACKWARD else None
            for arg in node.all_input_nodes:
                i = self._dep(arg)
                if i is None:
                    continue
                if region == Region.BACKWARD:
                    v = self.values[i]
                    v.needed = True
                    if scope not in v.read_in:
                        v.read_in += (scope,)
                else:  # the output node or the optimizer: alive anyway
                    self._keep(arg)

    def _keep(self, node: torch.fx.Node) -> None:
        for n in (node, self.root[node]):
            i = self._dep(n)
            if i is not None:
                self.values[i].kept = True

    def _mark_mask_derived(self, forward: list[torch.fx.Node]) -> None:
        """Record the values computed from one mask alone (``mask / (1 - p)``)."""
        from_masks = {chain["float"] for chain in self.masks.values()}
        for node in forward:
            i = self.index.get(node)
            if i is None or i in from_masks:
                continue
            v = self.values[i]
            if v.deps and all(d in from_masks for d in v.deps) and not v.kept:
                from_masks.add(i)
                self.derived.add(i)

    def compact_masks(self, problem: Problem) -> None:
        """Keep masks as bits or bool only: no float mask, nor float value derived from it alone."""
        for chain in self.masks.values():
            v = problem.values[chain["float"]]
            v.savable, v.reason = False, "random mask: kept as bool or bits, never in float"
        for i in self.derived:
            v = problem.values[i]
            if v.savable and v.recomputable:   # a banned one stays savable
                v.savable = False
                v.reason = "computed from a random mask alone: the mask is kept instead"


# -- policies --------------------------------------------------------------------------------------

def _forbid_saving(problem: Problem, indices, reason: str) -> None:
    for i in indices:
        v = problem.values[i]
        if v.savable and v.recomputable and not v.kept:
            v.savable, v.reason = False, reason


def _groups(graph: TrainGraph, structure: Structure, every_n: int) -> dict[torch.fx.Node, tuple]:
    """Forward node -> its checkpoint group: ``every_n`` consecutive blocks of one stack, or a segment.

    Segments are the runs of forward nodes outside every block (the embeddings before a
    stack, the head and the loss after it, what lies between an encoder and a decoder):
    they are checkpointed like blocks, so backward keeps only what crosses a boundary.
    """
    index = {blk: (stack, k // every_n) for stack, blocks in structure.stacks.items()
             for k, blk in enumerate(blocks)}
    out: dict[torch.fx.Node, tuple] = {}
    segment, inside = 0, False
    for node in graph.graph.nodes:
        if node.op != "call_function" or region_of(node) != Region.FORWARD:
            continue
        blk = structure.block_of(module_path_of(node))
        if blk:
            out[node], inside = ("block", *index[blk]), True
        else:
            if inside:
                segment, inside = segment + 1, False
            out[node] = ("segment", segment)
    return out


def _apply_groups(b: _Builder, problem: Problem, structure: Structure, every_n: int) -> None:
    """Checkpoint groups of ``every_n`` blocks and the segments between: keep only what crosses."""
    group = _groups(b.graph, structure, every_n)
    rebuilt = _rebuilt_from_inputs(b.graph)
    inside, side = [], []
    for i, node in b.node_of.items():
        g = group.get(node)
        if g is None:
            continue
        crosses = any(region_of(u) == Region.FORWARD and group.get(u) != g
                      for v in {node, *[x for x in node.users if aliases_input(x)]} for u in v.users)
        if not crosses:
            inside.append(i)
        elif node in rebuilt:
            side.append(i)
    for node, chain in b.masks.items():
        if node in group:
            inside.append(chain["bool"])
    _forbid_saving(problem, inside, f"inside a checkpointed group of {every_n} block(s) or a segment")
    # What crosses a boundary but is rebuilt from the step's inputs without a matmul (an
    # attention mask, T5's relative position bias, an embedding lookup) is recomputed in each
    # group's backward: only values that cost the model's work to rebuild stay saved.
    _forbid_saving(problem, side, "crosses a checkpoint boundary but is rebuilt from the step's inputs "
                                  "without a matmul (a mask, a position bias, a lookup): recomputed")


def _rebuilt_from_inputs(graph: TrainGraph) -> set[torch.fx.Node]:
    """Forward values computed from graph inputs and constants alone, through no matmul-class,
    random or collective op (so rebuilding one in backward is cheap and bitwise the same)."""
    out: set[torch.fx.Node] = set()
    for node in graph.graph.nodes:
        if node.op != "call_function" or region_of(node) != Region.FORWARD:
            continue
        if node_cost(node).matmul or draws_random(node) or communicates(node):
            continue
        if all(a in out or a.op in ("placeholder", "get_attr") for a in node.all_input_nodes):
            out.add(node)
    return out


def _apply_selective(b: _Builder, problem: Problem, cores: list[set[torch.fx.Node]]) -> None:
    core_nodes = set().union(set(), *cores)
    # The core's inputs (Q, K, V) stay saved: only what the core computes is recomputed.
    inner = [i for i, node in b.node_of.items() if node in core_nodes]
    core_idx = set(inner)
    inner += [chain["bool"] for chain in b.masks.values()
              if _mask_feeds(b, problem, chain["float"], core_idx)]
    _forbid_saving(problem, inner, "attention core: recomputed (selective)")


def _mask_feeds(b: _Builder, problem: Problem, mask: int, core: set[int]) -> bool:
    """True when the mask, through values derived from it alone, feeds the attention core."""
    frontier, seen = {mask}, set()
    users: dict[int, list[int]] = {}
    for i, v in enumerate(problem.values):
        for d in v.deps:
            users.setdefault(d, []).append(i)
    while frontier:
        i = frontier.pop()
        if i in seen:
            continue
        seen.add(i)
        for u in users.get(i, []):
            if u in core:
                return True
            if u in b.derived:
                frontier.add(u)
    return False


def _apply_none(b: _Builder, problem: Problem) -> None:
    for i, v in enumerate(problem.values):
        node = b.node_of.get(i)
        if v.kept or not v.recomputable:
            continue
        if node is not None and (node in b.masks or aliases_input(node) or not v.savable):
            continue   # views, float masks and mask-derived values are rebuilt for free
        if v.savable:
            v.recomputable, v.reason = False, "policy none: every activation is kept"
    for chain in b.masks.values():
        problem.values[chain["bits"]].savable = False


# -- rewriting -------------------------------------------------------------------------------------

class _Rewriter:
    def __init__(self, tg: TrainGraph, builder: _Builder, saved: set[int], structure: Structure):
        self.tg, self.b = tg, builder
        self.structure = structure
        self.mode = tg.fake_mode()
        self.saved_nodes = {builder.node_of[i] for i in saved if i in builder.node_of}
        self.kept_nodes = {builder.node_of[i] for i, v in enumerate(builder.values)
                           if v.kept and i in builder.node_of}
        self.mask_form = {}
        for node, chain in builder.masks.items():
            form = "bits" if chain["bits"] in saved else "bool" if chain["bool"] in saved else None
            self.mask_form[node] = form
        self.copies: dict[torch.fx.Node, torch.fx.Node] = {}
        self.forward_masks: dict[torch.fx.Node, torch.fx.Node] = {}
        self.added: list[torch.fx.Node] = []
        self.source_of: dict[torch.fx.Node, torch.fx.Node] = {}   # recomputed copy -> forward node

    def _new(self, target, args, kwargs, *, region: Region, path: str, recompute: bool) -> torch.fx.Node:
        node = self.tg.graph.call_function(target, args, kwargs)
        node.meta["val"] = fake_value(target, args, kwargs, mode=self.mode)
        node.meta.update({REGION: region.value, MODULE_PATH: path, ORIGIN_PASS: "recompute"})
        if recompute:
            node.meta[RECOMPUTE] = True
            self.added.append(node)
        return node

    def available(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or region_of(node) != Region.FORWARD:
            return True
        base = self.b.root[node]
        return node in self.saved_nodes or node in self.kept_nodes or \
            (base is not node and (base in self.saved_nodes or base in self.kept_nodes)
             and (base not in self.b.masks or not self.mask_form.get(base)))

    def materialize(self, node: torch.fx.Node, before: torch.fx.Node, scope: str) -> torch.fx.Node:
        # Copies are shared within one block's backward only: a value recomputed for the
        # loss's backward and read again by layer 0's would otherwise stay alive across the
        # whole backward, and recomputing would save no memory at all.
        key = (node, scope)
        if key in self.copies:
            return self.copies[key]
        if node in self.b.masks and self.mask_form.get(node):
            out = self._decompress(node, before)
        elif self.available(node):
            return node
        else:
            args = torch.fx.node.map_arg(node.args, lambda a: self.materialize(a, before, scope))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: self.materialize(a, before, scope))
            with self.tg.graph.inserting_before(before):
                out = self.tg.graph.call_function(node.target, args, kwargs)
            out.meta.update({k: v for k, v in node.meta.items() if k != ORIGIN_PASS})
            out.meta.update({REGION: Region.BACKWARD.value, RECOMPUTE: True, RECOMPUTE_OF: node.name,
                             ORIGIN_PASS: "recompute"})
            self.added.append(out)
            self.source_of[out] = node
        self.copies[key] = out
        return out

    # forward: mask -> bool (-> packed bits); backward: the reverse, then the float mask.
    def _forward_mask(self, mask: torch.fx.Node) -> torch.fx.Node:
        if mask in self.forward_masks:
            return self.forward_masks[mask]
        path = module_path_of(mask)
        new = lambda t, a, k=None: self._new(t, a, k or {}, region=Region.FORWARD, path=path, recompute=False)
        with self.tg.graph.inserting_after(mask):
            boolean = new(aten._to_copy.default, (mask,), {"dtype": torch.bool})
        out = boolean
        if self.mask_form[mask] == "bits":
            n = mask.meta["val"].numel()
            pad = (-n) % 8
            device = mask.meta["val"].device
            with self.tg.graph.inserting_after(boolean):
                u8 = new(aten._to_copy.default, (boolean,), {"dtype": torch.uint8})
            with self.tg.graph.inserting_after(u8):
                flat = new(aten.view.default, (u8, [n]))
            cur = flat
            if pad:
                with self.tg.graph.inserting_after(cur):
                    cur = new(aten.constant_pad_nd.default, (cur, [0, pad], 0.0))
            with self.tg.graph.inserting_after(cur):
                rows = new(aten.view.default, (cur, [(n + pad) // 8, 8]))
            with self.tg.graph.inserting_after(rows):
                shifts = new(aten.arange.default, (8,), {"dtype": torch.uint8, "device": device})
            with self.tg.graph.inserting_after(shifts):
                weighted = new(aten.bitwise_left_shift.Tensor, (rows, shifts))
            with self.tg.graph.inserting_after(weighted):
                out = new(aten.sum.dim_IntList, (weighted, [1]), {"dtype": torch.uint8})
        self.forward_masks[mask] = out
        return out

    def _decompress(self, mask: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
        stored = self._forward_mask(mask)
        val = mask.meta["val"]
        path = module_path_of(mask)
        new = lambda t, a, k=None: self._new(t, a, k or {}, region=Region.BACKWARD, path=path, recompute=True)
        with self.tg.graph.inserting_before(before):
            boolean = stored
            if self.mask_form[mask] == "bits":
                n = val.numel()
                shifts = new(aten.arange.default, (8,), {"dtype": torch.uint8, "device": val.device})
                column = new(aten.unsqueeze.default, (stored, 1))
                bits = new(aten.bitwise_and.Scalar, (new(aten.bitwise_right_shift.Tensor, (column, shifts)), 1))
                flat = new(aten.view.default, (bits, [bits.meta["val"].numel()]))
                if flat.meta["val"].numel() != n:
                    flat = new(aten.slice.Tensor, (flat, 0, 0, n))
                boolean = new(aten.view.default, (flat, list(val.shape)))
            return new(aten._to_copy.default, (boolean,), {"dtype": val.dtype})

    def run(self) -> None:
        for node in list(self.tg.graph.nodes):
            if region_of(node) != Region.BACKWARD or node.op != "call_function" or node.meta.get(RECOMPUTE):
                continue
            for arg in list(node.all_input_nodes):
                if arg.op == "call_function" and region_of(arg) == Region.FORWARD:
                    new = self.materialize(arg, node, self.structure.block_of(module_path_of(node)))
                    if new is not arg:
                        node.replace_input_with(arg, new)


# -- the pass --------------------------------------------------------------------------------------

def _profile(name: str) -> DeviceProfile:
    try:
        return get_profile(name)
    except ValueError as exc:
        raise PassOptionError("recompute", "profile", str(exc), name) from None


def _budget_bytes(budget: float | None, base: int) -> float:
    if budget is None:
        raise PassOptionError("recompute", "budget", "is required when policy is 'budget' (a fraction <= 1.0 "
                              "of the saved bytes, or bytes when > 1)", budget)
    if budget < 0:
        raise PassOptionError("recompute", "budget", "must be >= 0", budget)
    return budget * base if budget <= 1.0 else budget


def _explain(b: _Builder, problem: Problem, sol, policy: str) -> list[dict]:
    out = []
    forms = {i: form for chain in b.masks.values() for form, i in chain.items()}
    touched = sol.saved | sol.recomputed
    for i in sorted(touched | {i for i, v in enumerate(problem.values) if v.needed}):
        v = problem.values[i]
        if v.kept or (v.bytes == 0 and i not in sol.recomputed) or (v.cost == 0 and v.bytes == 0):
            continue
        recomputed = i in sol.recomputed
        if i in forms:
            reason = (f"random mask: rebuilt as {forms[i]} from a compact copy, never drawn again"
                      if recomputed else f"random mask: kept as {forms[i]} so backward sees the same draw")
        elif recomputed:
            reason = v.reason if v.reason and not v.savable else \
                f"recomputed: {policy} selection (cheaper than keeping {v.bytes} bytes)"
        else:
            reason = v.reason or f"saved: {policy} selection (recompute would take {v.cost:.3e}s)"
        out.append({"value": v.name, "bytes": v.bytes, "recompute_flops": v.flops,
                    "recompute_time_s": v.cost, "decision": "recomputed" if recomputed else "saved",
                    "reason": reason})
    return out


@register_pass("recompute", preserves=())
def recompute_pass(graph: TrainGraph, ctx: PassContext, *, policy: Literal[POLICIES] = "budget",
                   budget: float | None = None, every_n: int = 1, solver: Literal[SOLVERS] = "auto",
                   profile: str = "auto", bans: tuple[str, ...] = (), blocks: tuple[str, ...] = (),
                   attention_ops: tuple[str, ...] = ()) -> TrainGraph:
    """Keep a subset of forward activations for backward; recompute the rest in backward.

    ``profile`` names the device profile that prices recomputation (``auto``: this machine);
    ``bans`` are module-path globs whose values are never recomputed; ``blocks`` (module-path
    globs) and ``attention_ops`` (``aten.<op>``) name the model's blocks and attention where
    detection from the graph cannot find them.
    """
    _check_options(policy, solver, every_n, budget)
    _check_bans(graph, bans)
    device = _profile(profile)
    structure = find_blocks(graph.graph, blocks)
    builder = _Builder(graph, device, bans, ctx.world_size, structure)
    saved_before = saved_activations(graph.graph, builder.root)
    before = sum(saved_before.values())
    problem = builder.build()
    limit = math.inf
    if policy != "budget":
        builder.compact_masks(problem)
    if policy == "none":
        _apply_none(builder, problem)
    elif policy in ("full", "every_n_layers"):
        if not structure.blocks:
            raise PassOptionError("recompute", "blocks", _nothing_found(policy, graph, structure), blocks)
        _apply_groups(builder, problem, structure, every_n if policy == "every_n_layers" else 1)
        ctx.stat("blocks", {k: len(v) for k, v in structure.stacks.items()})
    elif policy == "selective":
        cores = attention_cores(graph.graph, attention_ops)
        if not cores:
            raise PassOptionError("recompute", "attention_ops", _nothing_found(policy, graph, structure),
                                  attention_ops)
        _apply_selective(builder, problem, cores)
        ctx.stat("attention_cores", len(cores))
    else:
        limit = _budget_limit(saved_before, builder, problem, budget, before, ctx)
    start = time.perf_counter()
    try:
        sol = solve(problem, limit, solver, builder.stacks())
    except NoFolding as exc:
        raise PassOptionError("recompute", "solver", str(exc), solver) from exc
    ctx.stat("solve_seconds", time.perf_counter() - start)
    ctx.stat("solver_recompute_time_s", sol.cost)
    ctx.stat("solver_notes", list(sol.notes))
    rewriter = _Rewriter(graph, builder, sol.saved, structure)
    rewriter.run()
    eliminate_dead_code(graph.graph)
    graph.graph.lint()
    ctx.explain(_explain(builder, problem, sol, policy))
    ctx.stat("policy", policy)
    ctx.stat("solver", sol.solver)
    _report(graph, builder, rewriter, device, ctx, policy, before)
    return graph


def _check_options(policy: str, solver: str, every_n: int, budget: float | None) -> None:
    if policy not in POLICIES:
        raise PassOptionError("recompute", "policy", f"must be one of {', '.join(POLICIES)}", policy)
    if solver not in SOLVERS:
        raise PassOptionError("recompute", "solver", f"must be one of {', '.join(SOLVERS)}", solver)
    if every_n < 1:
        raise PassOptionError("recompute", "every_n", "must be >= 1", every_n)
    if policy != "budget" and budget is not None:
        raise PassOptionError("recompute", "budget", f"applies only to policy 'budget' (policy is {policy!r})",
                              budget)


def _budget_limit(saved: dict[str, int], builder: _Builder, problem: Problem, budget: float | None,
                  before: int, ctx: PassContext) -> float:
    """The solver's byte limit: the budget, raised to the fewest bytes any selection keeps; values
    alive anyway (the loss) that backward reads count against the budget too."""
    kept = {builder.node_of[i].name for i, v in enumerate(problem.values) if v.kept and i in builder.node_of}
    kept_bytes = sum(b for name, b in saved.items() if name in kept)
    start = time.perf_counter()
    floor = floor_bytes(problem) + kept_bytes
    ctx.stat("floor_seconds", time.perf_counter() - start)
    limit = _budget_bytes(budget, before)
    if limit < floor:
        ctx.stat("budget_raised_to_floor", True)
    limit = max(limit, floor)
    ctx.stat("budget_bytes", int(limit))
    ctx.stat("floor_bytes", floor)
    return limit - kept_bytes


def _report(graph: TrainGraph, builder: _Builder, rewriter: _Rewriter, device: DeviceProfile, ctx: PassContext,
            policy: str, before: int) -> None:
    after = memory_profile(graph.graph)
    recomputed = [n for n in graph.graph.nodes if n.meta.get(RECOMPUTE)]
    ctx.stat("saved_bytes_before", before)
    ctx.stat("saved_bytes_after", after.saved_bytes)
    ctx.stat("recomputed_nodes", len(recomputed))
    # A value recomputed in several blocks' backward costs the same each time (same op, same
    # metadata): priced once per forward node, not once per copy, as the solver priced it.
    priced: dict[torch.fx.Node, tuple[int, float]] = {}
    for n in recomputed:
        source = rewriter.source_of.get(n, n)
        if source not in priced:
            i = builder.index.get(source)
            priced[source] = (builder.values[i].flops, builder.values[i].cost) if i is not None \
                else (node_cost(n).flops, node_time(n, device, world_size=ctx.world_size))
    costs = [priced[rewriter.source_of.get(n, n)] for n in recomputed]
    ctx.stat("recompute_flops", sum(f for f, _ in costs))
    ctx.stat("recompute_time_s", sum(t for _, t in costs))
    ctx.stat("estimated_peak_bytes", after.peak_bytes)
    if policy != "none" and after.saved_bytes >= before:
        message = (f"recompute policy {policy!r} saved no activation bytes ({before} before and after): "
                   "nothing it selects is needed by the backward")
        ctx.stat("warning", message)
        warnings.warn(message, stacklevel=3)


def _nothing_found(policy: str, graph: TrainGraph, structure: Structure) -> str:
    paths = sorted({module_path_of(n) for n in graph.compute_nodes(Region.FORWARD)} - {""})
    sample = ", ".join([p for p in paths if p.count(".") <= 2][:8])
    if policy == "selective":
        return ("policy 'selective' found no attention core in the model (rule: a softmax "
                "between two matmuls, or a fused attention op such as aten._scaled_dot_product_"
                "flash_attention_for_cpu); name the model's attention ops in 'attention_ops' "
                "(e.g. aten.my_attention), or use policy 'budget'")
    return (f"policy {policy!r} found no repeated transformer blocks in the model (rule: "
            f"modules '<stack>.<N>' or same-shaped sibling modules, each with at least two matmuls); "
            f"name them in 'blocks' as module-path globs (module paths of this "
            f"model include: {sample}), or use policy 'budget'")
