"""The dispatch of a mixture-of-experts layer, read off the values: the nodes that compute on a
layer's rows in the order its router's sort put them, and what leaves that order again.

transformers' experts (``grouped_mm_fallback``, its registered backward) dispatch rows so: the
flattened top-k expert ids are sorted; the rows are gathered in the sort's order (indexed by the
sort's indices floor-divided by ``k``); the counts per expert (``histc`` of the sorted ids, then
``cumsum``) are the grouped matmul's offsets; the result goes back to token order by the inverse
permutation (``index_put`` of an ``arange`` at the sort's indices). Backward scatters the
gradients the same ways. As a whole this is row-equivariant: a token's output reads its own row
and the weights, whichever other tokens are present, though the ops in it (a sort, a histogram)
are not. So a rewrite that gives each rank a subset of whole tokens (context parallelism) may run
the region on its own rows alone, and sum the weight gradients over the ranks.

:func:`dispatch_regions` follows each sort through a table of what an op does to the row order
and returns the state of every node of the regions; a node reading the sorted rows in a way the
table does not know raises :class:`DispatchError` naming it (it could mix rows). States:

- ``SORTED``: rows (dim 0) in the sort's order, this rank's rows only;
- ``ORDER`` / ``TOKEN_OF`` / ``INVERSE``: the sort's indices, the token each sorted row belongs to,
  the inverse permutation (row indices into this rank's rows);
- ``COUNTS``: per-expert counts or offsets of the region's rows (a sum over ranks is the whole's);
- ``FRESH`` / ``ARANGE``: a new buffer or ``arange`` with one element per row;
- ``TOKENS``: a result back in token order (it leaves the region);
- ``WEIGHT_GRAD``: a weight gradient of a grouped matmul, a sum over the region's rows (it leaves);
- ``SORT`` / ``PIECES`` / ``GMM_BACKWARD``: a tuple or list of the above, taken apart by getitem.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten

SORTED, ORDER, TOKEN_OF, INVERSE, COUNTS = "sorted", "order", "token_of", "inverse", "counts"
FRESH, ARANGE, TOKENS, WEIGHT_GRAD = "fresh", "arange", "tokens", "weight_grad"
SORT, PIECES, GMM_BACKWARD = "sort", "pieces", "gmm_backward"
# States whose dim 0 is one element per row of the region (a rank's share of the rows).
ROW_STATES = frozenset({SORTED, ORDER, TOKEN_OF, INVERSE, FRESH, ARANGE, TOKENS})
# States whose readers are outside the region.
EXITS = frozenset({TOKENS, WEIGHT_GRAD})

_SORTS = (aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)
_FLOOR_DIVIDES = (aten.floor_divide.default, aten.floor_divide.Scalar)
_INDEX_PUTS = (aten.index_put.default, aten.index_put_.default)
_COUNTERS = (aten.histc.default, aten.bincount.default)
_FACTORIES_LIKE = (aten.empty_like.default, aten.zeros_like.default, aten.new_zeros.default,
                   aten.new_empty.default, aten.new_full.default, aten.full_like.default, aten.ones_like.default)
_FACTORIES = (aten.zeros.default, aten.empty.memory_format, aten.full.default)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_SAME_ROWS = (aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
              aten.fill.Scalar, aten.contiguous.default)
_LAST_DIM_CUTS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
_CUTS = (aten.slice.Tensor, aten.narrow.default, aten.cat.default)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class DispatchError(ValueError):
    """A node reads an expert dispatch's sorted rows in a way that may mix rows."""


def grouped_mm_ops() -> tuple[object, object] | None:
    """transformers' grouped matmul and its backward, once transformers' MoE code registered them."""
    ns = getattr(torch.ops, "transformers", None)
    try:
        return ns.grouped_mm_fallback.default, ns.grouped_mm_fallback_backward.default
    except (AttributeError, RuntimeError):
        return None


def dispatch_regions(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """Every node of the graph's expert dispatches with its state (above); empty when the graph
    has no grouped matmul. A sort that feeds no grouped matmul is not a dispatch and is left out."""
    ops = grouped_mm_ops()
    if ops is None or not any(n.target in ops for n in graph.nodes):
        return {}
    regions: dict[torch.fx.Node, str] = {}
    for seed in graph.nodes:
        if seed.target in _SORTS and seed not in regions and _one_dim(seed.args[0]):
            states, failure = _follow(graph, seed, ops)
            if failure is not None and _feeds(seed, ops):
                raise failure
            if failure is None and any(n.target in ops for n in states):
                regions.update(states)
    for node, state in regions.items():
        outside = [u.name for u in node.users if u not in regions]
        if state in (FRESH, ARANGE) and outside:
            raise DispatchError(f"node {node.name} ({node.target}), a new buffer an expert dispatch scatters "
                                f"into, is read outside it too, by {', '.join(outside)} (rule: a dispatch's own "
                                "buffers hold one element per row of it)")
    return regions


def _feeds(seed: torch.fx.Node, ops) -> bool:
    """Whether a grouped matmul reads a value computed from ``seed``."""
    seen, stack = set(), [seed]
    while stack:
        node = stack.pop()
        if node.target in ops:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(node.users)
    return False


def _one_dim(value) -> bool:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.ndim == 1


def _shape(value) -> tuple | None:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _follow(graph: torch.fx.Graph, seed: torch.fx.Node, ops) -> tuple[dict, DispatchError | None]:
    """The states reached from ``seed`` in graph order, and the first node the table refuses."""
    states: dict[torch.fx.Node, str] = {}
    reached = False
    for node in graph.nodes:
        if node is seed:
            reached = True
            states[node] = SORT if node.target in (aten.sort.default, aten.sort.stable) else ORDER
            continue
        if not reached or node.op == "output":
            continue
        # (an arange is read by each layer's dispatch once CSE has merged them: not a reason to be in one)
        inside = [a for a in node.all_input_nodes if states.get(a) not in (None, ARANGE, *EXITS)]
        if not inside:
            continue
        try:
            states[node] = _transition(node, states, ops)
        except DispatchError as exc:
            return states, exc
    return states, None


def _refuse(node: torch.fx.Node, why: str) -> DispatchError:
    return DispatchError(f"node {node.name} ({node.target}) reads the rows of an expert dispatch (sorted by "
                         f"the router's expert ids) and {why} (rule: between the sort and the way back to "
                         "token order only row-wise ops, the grouped matmuls and the dispatch's own "
                         "gathers and scatters may read them)")


def _transition(node: torch.fx.Node, states: dict, ops) -> str:
    gmm, gmm_backward = ops
    target, args = node.target, node.args

    def state(a):
        return states.get(a) if isinstance(a, torch.fx.Node) else None

    if target is operator.getitem:
        source = state(args[0])
        if source == SORT:
            return SORTED if args[1] == 0 else ORDER
        if source == GMM_BACKWARD:
            return SORTED if args[1] == 0 else WEIGHT_GRAD
        if source == PIECES:
            return SORTED
        raise _refuse(node, "takes an element of it")
    if target in _SORTS:
        raise _refuse(node, "sorts them again")
    if target in _FLOOR_DIVIDES and state(args[0]) == ORDER and isinstance(args[1], int):
        return TOKEN_OF
    if target is aten.index.Tensor:
        return _index(node, state)
    if target in _INDEX_PUTS:
        return _index_put(node, states, state)
    if target in _COUNTERS and state(args[0]) == SORTED:
        return COUNTS
    if target in (aten.cumsum.default, aten._to_copy.default) and state(args[0]) == COUNTS:
        return COUNTS
    if target is gmm:
        if state(args[0]) == SORTED and state(args[2]) == COUNTS and state(args[1]) is None:
            return SORTED
        raise _refuse(node, "is a grouped matmul whose rows, weight or offsets are not the dispatch's")
    if target is gmm_backward:
        if state(args[0]) == SORTED and state(args[2]) == COUNTS and state(args[3]) == SORTED \
                and state(args[1]) is None:
            return GMM_BACKWARD
        raise _refuse(node, "is a grouped matmul backward whose operands are not the dispatch's")
    if target in _FACTORIES_LIKE and state(args[0]) in ROW_STATES:
        return FRESH
    return _row_wise(node, state)


def _index(node: torch.fx.Node, state) -> str:
    source, indices = node.args[0], node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        raise _refuse(node, "indexes them by more than one index")
    where, what = state(indices[0]), state(source)
    if where in (ORDER, TOKEN_OF) and what is None:
        return SORTED      # the layer's rows gathered in the sort's order
    if where == INVERSE and what == SORTED:
        return TOKENS      # back in token order
    raise _refuse(node, f"indexes {what or 'an outside value'} by {where or 'an outside index'}")


def _index_put(node: torch.fx.Node, states: dict, state) -> str:
    dest, indices, values = node.args[0], node.args[1], node.args[2]
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        raise _refuse(node, "scatters by more than one index")
    if state(dest) != FRESH:
        if state(dest) is not None or not _fresh(dest):
            raise _refuse(node, "scatters into a buffer that is not a new one")
        states[dest] = FRESH
    where, what = state(indices[0]), state(values)
    if where == ORDER and what is None and values.target in _ARANGES and _counts_from_zero(values):
        states[values] = ARANGE
        return INVERSE     # position of each row in the sorted order
    if where == INVERSE and what is None:
        return SORTED      # token-order values (a gradient) scattered to the sorted rows
    if where in (ORDER, TOKEN_OF) and what == SORTED:
        return TOKENS      # sorted rows scattered back to their tokens (summed over k with TOKEN_OF)
    raise _refuse(node, f"scatters {what or 'an outside value'} by {where or 'an outside index'}")


def _fresh(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and node.target in _FACTORIES_LIKE + _FACTORIES and len(node.users) == 1


def _counts_from_zero(node: torch.fx.Node) -> bool:
    if node.target is aten.arange.default:
        return True
    step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
    return node.args[0] == 0 and step == 1


def _row_wise(node: torch.fx.Node, state) -> str:
    """An op on sorted rows that keeps each row's own values: pointwise, copies, cuts and joins of a
    dim after the first, sums over such dims, views that keep dim 0."""
    target, args = node.target, node.args
    if not isinstance(target, torch._ops.OpOverload):
        raise _refuse(node, "is not an aten op")
    for a in node.all_input_nodes:
        if state(a) not in (None, SORTED, FRESH):
            raise _refuse(node, f"reads {a.name} ({state(a)}) beside the rows")
    out = _shape(node)
    rows = None if out is None or not out else out[0]
    for a in node.all_input_nodes:
        shape = _shape(a)
        if state(a) is None and shape and rows is not None and len(shape) == len(out) and shape[0] == rows \
                and rows > 1:
            raise _refuse(node, f"combines them with {a.name}, a value with as many rows from outside the "
                                "dispatch (in token order, not the sort's)")
    if torch.Tag.pointwise in target.tags or target in _SAME_ROWS:
        return SORTED
    first = args[0][0] if target is aten.cat.default else args[0]
    ndim = len(_shape(first) or ())
    if target in _LAST_DIM_CUTS:
        dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
        if ndim and dim % ndim:
            return PIECES
    elif target in _CUTS:
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
        if ndim and dim % ndim:
            return SORTED
    elif target in (aten.unsqueeze.default, aten.squeeze.dim):
        if args[1] % (ndim + (target is aten.unsqueeze.default)):
            return SORTED
    elif target is aten.sum.dim_IntList:
        if ndim and all(d % ndim for d in args[1]):
            return SORTED
    elif target in _VIEWS + (aten.expand.default,):
        if out and _shape(first) and out[0] == _shape(first)[0]:
            return SORTED
    raise _refuse(node, "may mix rows (it is not row-wise)")
