"""FLOPs and bytes per node.

FLOPs come from ``torch.utils.flop_counter``'s registry (the formulas torch
itself uses for matmul, convolution and attention, forward and backward);
elementwise and reduction ops count one FLOP per output element, so a
roofline model can tell vector-unit time from matrix-unit time. Bytes are the
tensors read plus the tensors written; views read and write nothing.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..meta import Region, nbytes, region_of, tensors_of

aten = torch.ops.aten

# The CPU flash kernel's aten form (what the capture records for SDPA on CPU, and on meta:
# graph_ir.meta_attention) is missing from torch's registry; its FLOPs are those of the other
# fused kernels (full scores, as torch counts them). Under is_causal a flash kernel skips the
# tiles wholly above the diagonal, so the work the cost model prices is cut to the tiles it
# computes (causal_tile_fraction); model FLOPs (MFU's numerator) keep the full count.
_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda q, k, v, *_, **__: sdpa_flop_count(q.shape, k.shape, v.shape),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda grad, q, k, v, *_, **__: sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape),
}
ATTENTION_OPS = frozenset(_ATTENTION_FLOPS)
# Where the flash op and its backward take is_causal and the query (the key follows it); the
# mask is their keyword-only attn_mask.
IS_CAUSAL_AT = {aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 7}
QUERY_AT = {aten._scaled_dot_product_flash_attention_for_cpu.default: 0,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 1}
# The square tile a flash kernel skips or computes whole (the NPU's FlashAttentionScore and
# FlashAttention-2 work in tiles of 128 query and key rows).
ATTENTION_TILE = 128


def causal_tile_fraction(queries: int, keys: int, tile: int = ATTENTION_TILE) -> float:
    """The share of a ``queries x keys`` score grid's tiles a flash kernel computes under torch's
    ``is_causal`` (query ``i`` sees keys ``j <= i``): the tiles with a key at or before their last query."""
    q_tiles, k_tiles = -(-queries // tile), -(-keys // tile)
    if not q_tiles or not k_tiles:
        return 1.0
    computed = sum(min(k_tiles, min(queries - 1, (t + 1) * tile - 1) // tile + 1) for t in range(q_tiles))
    return computed / (q_tiles * k_tiles)


def attention_flops(node: torch.fx.Node, *, causal_skips: bool = True) -> int:
    """A fused attention node's FLOPs: the full scores, or (``causal_skips``) the tiles it computes."""
    args = torch.fx.node.map_aggregate(node.args, _val)
    flops = _ATTENTION_FLOPS[node.target](*args)
    position = IS_CAUSAL_AT[node.target]
    if causal_skips and len(args) > position and args[position] is True:
        q, k = args[QUERY_AT[node.target]], args[QUERY_AT[node.target] + 1]
        flops *= causal_tile_fraction(q.shape[-2], k.shape[-2])
    return int(flops)

# A grouped matmul over experts multiplies each of its S rows by one expert's [in, out] weight:
# 2*S*in*out forward, twice that backward (input and weight gradients). Keyed by name: the op is
# transformers' (a custom op, defined once transformers' MoE module is imported).
_GROUPED_MM_FLOPS = {
    "transformers.grouped_mm_fallback.default":
        lambda x, w, offs: 2 * x.shape[0] * w.shape[1] * w.shape[2],
    "transformers.grouped_mm_fallback_backward.default":
        lambda x, w, offs, grad: 4 * x.shape[0] * w.shape[1] * w.shape[2],
}

# Ops that only move or re-describe data, costing no arithmetic.
_DATA_MOVEMENT = {
    aten.clone.default, aten._to_copy.default, aten.copy.default, aten.cat.default,
    aten.stack.default, aten.index_select.default, aten.embedding.default, aten.where.self,
    aten.zeros_like.default, aten.ones_like.default, aten.full.default, aten.zeros.default,
    aten.empty.memory_format, aten.scalar_tensor.default, aten.arange.start, aten.arange.default,
}


def is_view_op(node: torch.fx.Node) -> bool:
    """True for nodes whose output aliases an input: they allocate and compute nothing."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    known = _VIEW_OPS.get(node.target)
    if known is None:
        schema = getattr(node.target, "_schema", None)
        alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
        known = alias is not None and not alias.is_write
        if isinstance(node.target, torch._ops.OpOverload):   # its schema never changes
            _VIEW_OPS[node.target] = known
    return known


_VIEW_OPS: dict = {}


@dataclass(frozen=True)
class NodeCost:
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    matmul: bool = False   # counted on the matrix unit (Cube on Ascend, tensor cores on GPU)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def node_cost(node: torch.fx.Node) -> NodeCost:
    if node.op != "call_function" or is_view_op(node):
        return NodeCost()
    out = node.meta.get("val")
    read = sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes)
    written = nbytes(out)
    if node.target in _ATTENTION_FLOPS:
        return NodeCost(attention_flops(node), read, written, matmul=True)
    grouped = _GROUPED_MM_FLOPS.get(str(node.target))
    if grouped is not None:
        args = torch.fx.node.map_aggregate(node.args, _val)
        return NodeCost(int(grouped(*args)), read, written, matmul=True)
    packet = getattr(node.target, "overloadpacket", None)
    if packet in flop_registry:
        args = torch.fx.node.map_aggregate(node.args, _val)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, _val)
        try:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            return NodeCost(flops, read, written, matmul=True)
        except Exception:  # a formula that does not accept this overload's arguments
            pass
    if node.target in _DATA_MOVEMENT or not tensors_of(out):
        return NodeCost(0, read, written)
    elements = max(sum(t.numel() for t in tensors_of(out)),
                   max((t.numel() for a in node.all_input_nodes for t in tensors_of(a.meta.get("val"))),
                       default=0))
    return NodeCost(elements, read, written)


def is_matmul(node: torch.fx.Node) -> bool:
    """``node_cost(node).matmul``, pricing only the nodes whose op has a matmul-class FLOP formula
    (block detection asks it of every forward node; most are pointwise)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target in _ATTENTION_FLOPS or getattr(target, "overloadpacket", None) in flop_registry \
            or str(target) in _GROUPED_MM_FLOPS:
        return node_cost(node).matmul
    return False


def layout_key(node: torch.fx.Node):
    """What a node's cost depends on, hashable: its op, its arguments with every node replaced by
    its value's layout (dtype, shape, strides), and its own value's layout; None when some
    argument has no such description. Nodes of identical layers share it, so whatever is priced
    from it (FLOPs, bytes, a roofline's time) is priced once per layer shape, not once per node."""
    def layout(v):
        if isinstance(v, torch.Tensor):
            return ("T", v.dtype, tuple(v.shape), v.stride())
        if isinstance(v, (list, tuple)):
            return tuple(layout(x) for x in v)
        if isinstance(v, torch.fx.Node):
            return layout(v.meta.get("val"))
        if isinstance(v, dict):
            return tuple(sorted((k, layout(x)) for k, x in v.items()))
        return (type(v).__name__, v)
    try:
        key = (node.op, node.target, layout(node.args), layout(node.kwargs), layout(node.meta.get("val")))
        hash(key)
    except TypeError:
        return None
    return key


@dataclass
class GraphCost:
    per_node: dict[str, NodeCost] = field(default_factory=dict)
    flops_by_region: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_by_region: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_flops(self) -> int:
        return sum(self.flops_by_region.values())

    @property
    def matmul_flops(self) -> int:
        return sum(c.flops for c in self.per_node.values() if c.matmul)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_region.values())


def graph_cost(graph: torch.fx.Graph) -> GraphCost:
    result = GraphCost()
    for node in graph.nodes:
        cost = node_cost(node)
        result.per_node[node.name] = cost
        region = str(region_of(node) if node.op != "placeholder" else Region.IO)
        result.flops_by_region[region] += cost.flops
        result.bytes_by_region[region] += cost.bytes
    result.flops_by_region = dict(result.flops_by_region)
    result.bytes_by_region = dict(result.bytes_by_region)
    return result
