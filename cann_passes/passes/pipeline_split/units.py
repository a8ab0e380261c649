"""Units: the pieces of the forward, in node order, that a stage holds whole. A unit boundary is a
position where few bytes cross; ``layers=`` maps blocks per stage onto those boundaries."""
from __future__ import annotations

import torch

from graph_ir.analysis.collectives import is_collective
from graph_ir.analysis.cost import node_cost
from graph_ir.analysis.memory import aliases_input
from graph_ir.analysis.structure import find_blocks
from graph_ir.meta import RECOMPUTE_OF, GraphAttr, module_path_of, nbytes
from graph_ir.signature import InputKind

from ...pass_manager import PassOptionError
from .nodes import _Nodes, _one_parameter_values

# A position in the forward order is a unit boundary when at most this many times the fewest bytes
# anywhere in the forward cross it (the residual stream, plus small tensors such as a mask). The
# split first uses the residual-only cuts (RESIDUAL_SLACK: between blocks and between a block's
# attention and MLP halves); how many stages a step can have is counted there (about two per
# block). Where those leave the stages unbalanced, CROSSING_SLACK (option cut_slack) admits cuts
# inside an MLP (its 4x hidden beside the residual) and between attention's projections, not across
# attention scores (heads x seq^2); the balancer prices each cut by its transfer time (a message
# per tensor), so a finer cut is taken only where it balances the stages better than it costs.
CROSSING_SLACK = 6.0
RESIDUAL_SLACK = 1.5


def _crossing_bytes(nodes: _Nodes, size=nbytes) -> list[int]:
    """crossing[i]: bytes of forward values made before forward position i and read at or after it
    (``size=lambda v: 1``: how many values)."""
    position = {n: i for i, n in enumerate(nodes.forward)}
    diff = [0] * (len(nodes.forward) + 2)
    moved, _ = _gathered_values(nodes)
    for i, node in enumerate(nodes.forward):
        last = max((position[u] for u in node.users if u in position), default=i)
        if last > i and not aliases_input(node) and node not in moved:
            diff[i + 1] += size(node.meta.get("val"))
            diff[last + 1] -= size(node.meta.get("val"))
    crossing, running = [], 0
    for i in range(len(nodes.forward)):
        running += diff[i]
        crossing.append(running)
    return crossing


def _uncuttable(nodes: _Nodes) -> list[bool]:
    """Per forward position: whether a value that cannot be sent as one plain tensor crosses it.
    A view crossing a cut is sent as its own tensor (counting its base alone would hide that), a
    multi-output node cannot cross at all, and a collective's result is not ready before its wait."""
    position = {n: i for i, n in enumerate(nodes.forward)}
    spans = []
    moved, tied = _gathered_values(nodes)
    for i, node in enumerate(nodes.forward):
        if node in moved or node in tied:
            continue
        if aliases_input(node) or not isinstance(node.meta.get("val"), torch.Tensor) or is_collective(node):
            last = max((position[u] for u in node.users if u in position), default=i)
            if last > i:
                spans.append((i, last))
    return _inside(spans, len(nodes.forward))


def _inside(spans, length: int) -> list[bool]:
    """Per position ``i < length``: whether some span ``(low, high)`` has ``low < i <= high``."""
    marks = [0] * (length + 2)
    for low, high in spans:
        marks[low + 1] += 1
        marks[high + 1] -= 1
    inside, running = [], 0
    for i in range(length):
        running += marks[i]
        inside.append(running > 0)
    return inside


def _unit_starts(nodes: _Nodes, slack: float = CROSSING_SLACK) -> list[int]:
    """Forward positions where a unit starts (0 first): where at most ``slack`` x the fewest bytes cross."""
    crossing = _crossing_bytes(nodes)
    view_cross = [a or b for a, b in zip(_uncuttable(nodes), _inside_recomputation(nodes))]
    # The floor is taken where real work lies on both sides (not after the loss's last reduction,
    # where only a scalar is left), and a unit must hold some arithmetic of its own. Both sides
    # also read parameters: after the last parameter's reader only the loss is left, and a loss
    # combining values of every layer (a mixture of experts' load-balancing loss over every
    # layer's router logits) is cheap to cut there while each layer boundary carries those logits.
    # A position no cut may take (a view crossing, whose base is not counted) sets no floor either.
    flops = [node_cost(n).flops for n in nodes.forward]
    total = sum(flops) or 1
    before, running = [], 0
    for f in flops:
        before.append(running)
        running += f
    readers = _parameter_readers(nodes)
    first, last = (readers[0], readers[-1]) if readers else (0, len(crossing))
    cuttable = [first < i <= last for i in range(len(crossing))]
    interior = [crossing[i] for i in range(1, len(crossing))
                if crossing[i] > 0 and cuttable[i] and not view_cross[i] and 0.02 * total <= before[i] <= 0.98 * total]
    if not interior:
        return [0]
    limit = slack * min(interior)
    starts = [0]
    for i in range(1, len(crossing)):
        if 0 < crossing[i] <= limit and cuttable[i] and not view_cross[i] and before[i] > before[starts[-1]]:
            starts.append(i)
    if len(starts) > 1 and before[starts[-1]] == total:   # the last unit would hold no arithmetic
        starts.pop()
    return starts


def _inside_recomputation(nodes: _Nodes) -> list[bool]:
    """Per forward position: whether it lies inside the forward span of one recomputed chain (the
    copies a backward replays from the values recompute saved, joined where one copy reads another).
    A cut there would leave the chain's first copies, and the parameters they read, on the stage
    before the cut while the backward that needs them runs on the stage after it."""
    position = {n.name: i for i, n in enumerate(nodes.forward)}
    copies = [n for n in nodes.backward if n.meta.get(RECOMPUTE_OF) is not None]
    chain = {n: n for n in copies}

    def root(n):
        while chain[n] is not n:
            chain[n] = chain[chain[n]]
            n = chain[n]
        return n

    for n in copies:
        for a in n.all_input_nodes:
            if a in chain:
                chain[root(a)] = root(n)
    spans: dict = {}
    for n in copies:
        at = position.get(n.meta[RECOMPUTE_OF])
        if at is not None:
            low, high = spans.get(root(n), (at, at))
            spans[root(n)] = (min(low, at), max(high, at))
    return _inside(spans.values(), len(nodes.forward))


def _gathered_values(nodes: _Nodes) -> tuple[set, set]:
    """Under ZeRO-3, the values made from one parameter alone (its shard's gather, the wait, the
    unpadding views, issued ahead of use), as (those of a parameter one node reads, the rest).
    The split puts the first in that reader's stage (``_one_parameter_values_with_their_readers``),
    so they cross no cut; the second (a tied weight read by several nodes) bar no cut either:
    each later stage reading a tied weight gets its own copy of the chain."""
    if nodes.graph.attrs.get(GraphAttr.ZERO, {}).get("stage") != 3:
        return set(), set()
    params = {n for n, spec in nodes.spec_of.items() if spec.kind == InputKind.PARAM}
    source = _one_parameter_values(nodes.forward, params)
    readers: dict = {}
    for node in nodes.forward:
        if node not in source:
            for a in node.all_input_nodes:
                param = a if a in params else source.get(a)
                if param is not None:
                    readers.setdefault(param, set()).add(node)
    chain = [n for n in nodes.forward if n in source]
    moved = {n for n in chain if len(readers.get(source[n], ())) == 1}
    return moved, set(chain) - moved


def _parameter_readers(nodes: _Nodes) -> list[int]:
    """Forward positions of the nodes that combine a parameter with something else: a value made
    from parameters alone (a cast, ZeRO-3's gather and its views, placed ahead of use) is not the
    use; its reader is."""
    from_params = set(nodes.owner)
    readers = []
    for i, node in enumerate(nodes.forward):
        inputs = node.all_input_nodes
        if inputs and all(a in from_params for a in inputs):
            from_params.add(node)
        elif any(a in from_params for a in inputs):
            readers.append(i)
    return readers


def parse_layers(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.replace(";", " ").replace("-", " ").split()]
    except ValueError:
        raise PassOptionError("pipeline_split", "layers", f"layer counts {text!r} must be integers such as '2;1;1'", text) from None
    if any(c < 0 for c in counts):
        raise PassOptionError("pipeline_split", "layers", f"layer counts {counts} must be >= 0", text)
    return counts


def _layer_starts(nodes: _Nodes, units: list[int], layers: list[int]) -> list[int]:
    """Unit indices where each stage starts when stage ``s`` holds ``layers[s]`` blocks."""
    structure = find_blocks(nodes.graph.graph)
    blocks = structure.blocks
    if sum(layers) != len(blocks):
        raise PassOptionError("pipeline_split", "layers", f"the layer counts {layers} sum to {sum(layers)}, but the model has "
                                          f"{len(blocks)} blocks (rule: counts per stage that sum to the "
                                          "number of blocks)", layers)
    first_at: dict[str, int] = {}
    for i, node in enumerate(nodes.forward):
        block = structure.block_of(module_path_of(node))
        if block:
            first_at.setdefault(block, i)
    starts, taken = [0], 0
    for count in layers[:-1]:
        taken += count
        position = first_at[blocks[taken]]
        # The last unit boundary at or before the block's first node.
        unit = max(k for k, start in enumerate(units) if start <= position)
        if unit <= starts[-1]:
            raise PassOptionError("pipeline_split", "layers", f"stage {len(starts)} would be empty: no cut point between "
                                              f"blocks {blocks[taken - count]} and {blocks[taken]}", layers)
        starts.append(unit)
    return starts
