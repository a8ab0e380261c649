"""attention_masks_as_flags: an attention mask made from no input becomes the attention kernel's
``is_causal`` flag where it is the causal pattern, and goes where it hides nothing.

transformers builds its causal mask from ``arange``s of the sequence length. Run eagerly without
a padding mask it checks for that case and calls SDPA with ``is_causal=True`` and no mask; traced,
the check is left out (one graph serves padded and unpadded batches), so the captured step hands
the kernel the materialized mask: a ``[batch, 1, q, k]`` float tensor of 0 and -inf built every
step (at sequence 4096 and batch 8, 512 MiB), which the kernel adds to every score block,
including the blocks wholly above the diagonal that ``is_causal`` skips (about half the work at
long sequences, and what context parallelism's balanced chunks are built for). An encoder run
without a padding mask (BERT, BART's encoder) gets an all-zero mask the same way.

The rewrite is decided by the mask's values, not by how the model spells it. A mask qualifies when

- no graph input reaches it (no placeholder among its ancestors: a padding mask from the batch
  makes it data, and it stays), and every op that makes it is a deterministic aten op;
- evaluated on CPU (the ops run again on real tensors, whatever device the graph is on; a batch
  ``expand`` followed only by pointwise ops is skipped, since the value is the same for every row),
  it broadcasts to the kernel's ``[..., q, k]`` as exactly torch's ``is_causal`` pattern: query
  ``i`` sees key ``j`` iff ``j <= i``. A boolean mask must be True there and False elsewhere; a
  float one 0 there and ``-inf`` (or the dtype's lowest value, whose weight also rounds to exactly
  0) elsewhere. A mask that hides no key (all True, or all 0) is simply dropped.

Then each attention op reading a causal mask (the CPU flash kernel's forward and backward, the
aten form the capture records for SDPA on CPU and on meta) gets ``is_causal=True`` and no mask,
one reading a mask that hides nothing gets no mask, and the mask's ops, now unread, are removed.

The check costs the mask's ``q x k`` elements of compute at compile time (batch rows not counted),
not that much memory: a pointwise value larger than 2^24 elements (transformers' comparison of
two ``arange``s and all after it) is made a block of query rows at a time (1.25 s for a
32768-token mask on one core); another op's value is made whole up to 2^28 elements. A mask with
more than ``max_elements`` elements, or made otherwise, is not checked and stays.

Numerics: the kernel's two paths compute the same softmax (a masked score's weight is exactly 0
either way) and the step is what eager PyTorch runs without a padding mask. The unmasked path's
block loop ends at the diagonal, so sums can round otherwise than the masked path's; tests hold
steps to 1e-5 of eager.
"""
from __future__ import annotations

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.cost import IS_CAUSAL_AT, QUERY_AT
from graph_ir.build import eliminate_dead_code

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten

_MAX_ELEMENTS = 1 << 32          # a 65536 x 65536 grid: about 5 s of checking on one CPU core
_BLOCK = 1 << 24                 # elements made at once: a block of query rows of a larger mask
_WHOLE = 1 << 28                 # the largest value that is not pointwise made whole (1 GiB as float32)


class _NotConstant(Exception):
    """The mask depends on an input or on an op this pass does not run at compile time."""


class _TooLarge(Exception):
    """A value on the way is too large to make whole and cannot be made a block of rows at a time."""


def _ancestors(mask: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes ``mask`` is computed from, in graph order; raises if one is an input."""
    seen, stack = {}, [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
                or node.target.namespace not in ("aten", "prims") or node.target._schema.is_mutable \
                or torch.Tag.nondeterministic_seeded in node.target.tags:
            raise _NotConstant(node.format_node())
        seen[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _pointwise(node: torch.fx.Node) -> bool:
    return torch.Tag.pointwise in node.target.tags


def _broadcast_only(node: torch.fx.Node, within: set, keeps_rank: bool) -> bool:
    """Every node between ``node`` and the mask is pointwise (or another broadcast), so that the
    value computed without ``node``'s expand broadcasts to the one computed with it. Where the
    expand adds dims, no unsqueeze may follow: it would insert at another place of the smaller value."""
    later = (aten.expand.default, aten.unsqueeze.default) if keeps_rank else (aten.expand.default,)
    for user in node.users:
        if user in within and not (_pointwise(user) or user.target in later):
            return False
        if user in within and not _broadcast_only(user, within, keeps_rank):
            return False
    return True


def _on_cpu(value):
    return torch.device("cpu") if isinstance(value, torch.device) else value


class _Rows:
    """A pointwise value too large to make whole, made a block of query rows (its dim -2) at a
    time: every operand of a pointwise op lines up with its output from the right, so a block of
    its rows reads the same block of each operand's rows (all of an operand that broadcasts)."""

    def __init__(self, node: torch.fx.Node, shape: torch.Size):
        self.node, self.shape = node, shape


def _values(nodes: list[torch.fx.Node]) -> dict:
    """Each node's value on CPU, in a shape that broadcasts to its own (an expand of the batch
    followed only by pointwise ops is skipped), or a :class:`_Rows` where it is too large."""
    within = set(nodes)
    values: dict = {}
    for node in nodes:
        inputs = [values[n] for n in node.all_input_nodes]
        if node.target is aten.expand.default and \
                _broadcast_only(node, within, len(node.args[1]) == len(inputs[0].shape)):
            values[node] = inputs[0]
            continue
        if _pointwise(node) and inputs:
            shape = torch.broadcast_shapes(*(v.shape for v in inputs))
            if shape.numel() > _BLOCK or any(isinstance(v, _Rows) for v in inputs):
                if len(shape) < 2:
                    raise _TooLarge(node.format_node())
                values[node] = _Rows(node, shape)
                continue
        elif any(isinstance(v, _Rows) for v in inputs) or (
                isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].numel() > _WHOLE
                and node.target is not aten.unsqueeze.default):
            raise _TooLarge(node.format_node())
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: values[n])
        result = node.target(*args, **{k: _on_cpu(v) for k, v in kwargs.items()})
        if not isinstance(result, torch.Tensor):
            raise _NotConstant(node.format_node())
        values[node] = result
    return values


def _block(value, values: dict, first: int, last: int, rows: int) -> torch.Tensor:
    """Query rows ``[first, last)`` of ``value`` (of a mask with ``rows`` query rows)."""
    if isinstance(value, _Rows):
        args, kwargs = torch.fx.map_arg((value.node.args, value.node.kwargs),
                                        lambda n: _block(values[n], values, first, last, rows))
        return value.node.target(*args, **{k: _on_cpu(v) for k, v in kwargs.items()})
    if value.dim() >= 2 and value.shape[-2] == rows:
        return value[..., first:last, :]
    return value


def _classify(value: torch.Tensor, first: int, rows: int, keys: int) -> tuple[bool, bool, bool]:
    """(valid, hides nothing, causal) for ``rows`` mask rows from query ``first`` on, ``value``
    broadcasting to them (a value that does not vary over rows or keys is not causal unless
    there is one of them)."""
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        allowed = value == 0
        if not bool((allowed | (value == float("-inf")) | (value == torch.finfo(value.dtype).min)).all()):
            return False, False, False
    else:
        return False, False, False
    if bool(allowed.all()):
        return True, True, first == 0 and rows == 1 and keys == 1
    if tuple(allowed.shape[-2:]) != (rows, keys):
        return True, False, False
    return True, False, bool((allowed == torch.ones(rows, keys, dtype=torch.bool).tril(first)).all())


def _pattern_of(value, values: dict, shape: torch.Size, max_elements: int) -> str | None:
    try:
        if len(value.shape) > len(shape) or torch.broadcast_shapes(value.shape, shape) != shape:
            return None
    except RuntimeError:
        return None
    rows, keys = shape[-2], shape[-1]
    if value.shape.numel() > max_elements:
        raise _TooLarge(f"{value.shape.numel()} elements")
    if not isinstance(value, _Rows):
        blocks = [(0, rows, value.reshape((1,) * (2 - value.dim()) + tuple(value.shape)))]
    elif value.shape[-2] != rows:
        raise _TooLarge(value.node.format_node())
    else:
        step = max(1, _BLOCK * rows // value.shape.numel())
        blocks = ((a, min(step, rows - a), _block(value, values, a, min(a + step, rows), rows))
                  for a in range(0, rows, step))
    visible = causal = True
    for first, count, block in blocks:
        ok, block_visible, block_causal = _classify(block, first, count, keys)
        if not ok:
            return None
        visible, causal = visible and block_visible, causal and block_causal
        if not (visible or causal):
            return None
    return "none" if visible else "causal" if causal else None


def pattern(value: torch.Tensor, shape: torch.Size) -> str | None:
    """What ``value``, broadcast to ``shape`` (``[..., q, k]``), is as an attention mask: ``causal``
    (torch's ``is_causal``: query ``i`` sees key ``j`` iff ``j <= i``), ``none`` (it hides nothing),
    or None (anything else, a float mask with any value but 0 and -inf among them)."""
    return _pattern_of(value, {}, shape, _MAX_ELEMENTS)


def _spelling(nodes: list[torch.fx.Node]) -> tuple:
    """The computation ``nodes`` spell, with node arguments as positions: equal for the same mask
    in two copies of a graph (the planner compiles one captured step once per candidate plan)."""
    index = {n: i for i, n in enumerate(nodes)}

    def spell(a: torch.fx.Node) -> str:
        return f"%{index[a]}"
    return tuple((str(n.target), repr(torch.fx.map_arg((n.args, n.kwargs), spell))) for n in nodes)


_OUTCOME_OF: dict[tuple, str] = {}    # (spelling, grid shape, max_elements) -> outcome, this process


def _outcome(node: torch.fx.Node, mask: torch.fx.Node, max_elements: int) -> str:
    try:
        nodes = _ancestors(mask)
    except _NotConstant:
        return "kept_not_constant"
    grid = _grid_shape(node)
    key = (_spelling(nodes), tuple(grid), max_elements)
    if key not in _OUTCOME_OF:
        try:
            values = _values(nodes)
            found = _pattern_of(values[mask], values, grid, max_elements)
            outcome = {"causal": "causal", "none": "dropped"}.get(found, "kept_other")
        except _NotConstant:
            outcome = "kept_not_constant"
        except _TooLarge:
            outcome = "kept_too_large"
        if len(_OUTCOME_OF) > 256:
            _OUTCOME_OF.clear()
        _OUTCOME_OF[key] = outcome
    return _OUTCOME_OF[key]


OUTCOMES = ("causal", "dropped", "kept_not_constant", "kept_too_large", "kept_other")


def attention_masks_as_flags(graph: torch.fx.Graph, max_elements: int = _MAX_ELEMENTS) -> dict[str, int]:
    """Rewrite every attention op whose mask is made from no input and is the causal pattern
    (``causal``) or hides nothing (``dropped``); returns how many attention ops had each of
    :data:`OUTCOMES`."""
    outcomes: dict[torch.fx.Node, str] = {}      # per mask: a forward and its backward read one
    counts = dict.fromkeys(OUTCOMES, 0)
    for node in list(graph.nodes):
        position = IS_CAUSAL_AT.get(node.target) if node.op == "call_function" else None
        mask = node.kwargs.get("attn_mask") if position is not None else None
        if not isinstance(mask, torch.fx.Node):
            continue
        if mask not in outcomes:
            outcomes[mask] = _outcome(node, mask, max_elements)
        counts[outcomes[mask]] += 1
        if outcomes[mask] not in ("causal", "dropped"):
            continue
        if outcomes[mask] == "causal":
            args = list(node.args)
            while len(args) < position:            # the forward's dropout_p may be left out
                args.append(0.0)
            args[position:position + 1] = [True]
            node.args = tuple(args)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
    if counts["causal"] or counts["dropped"]:
        eliminate_dead_code(graph)
    return counts


def _grid_shape(node: torch.fx.Node) -> torch.Size:
    """The scores' ``[batch, heads, q, k]`` the mask is added to."""
    first = QUERY_AT[node.target]
    qv, kv = node.args[first].meta["val"], node.args[first + 1].meta["val"]
    return torch.Size([*qv.shape[:-2], qv.shape[-2], kv.shape[-2]])


@register_pass("attention_masks_as_flags")
def attention_masks_as_flags_pass(graph: TrainGraph, ctx: PassContext, *,
                                  max_elements: int = _MAX_ELEMENTS) -> TrainGraph:
    """An attention mask made from no input becomes ``is_causal=True`` where it is exactly the causal
    pattern and goes where it hides nothing (what eager SDPA gets from transformers without a
    padding mask)."""
    for key, value in attention_masks_as_flags(graph.graph, max_elements).items():
        ctx.stat(key, value)
    return graph
