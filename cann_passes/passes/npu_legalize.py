"""npu_legalize: rewrite every op torchair cannot convert into ops it can.

torchair lowers an aten graph node by node with its FX->GE converters; a node
whose op has no converter, or only a stub that raises, cannot reach the NPU.
This pass runs last before lowering and, for each such node, decides with
``supported_ops()`` (the real converters of the torchair in use):

1. fused NPU kernels, where ``torch.ops.npu`` has them (only with torch_npu,
   i.e. on an Ascend host): CPU flash attention forward+backward pairs become
   ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (layout BNSD,
   keep_prob 1, ``sparse_mode`` 0 with an explicit boolean mask -- the option
   set torchair's converter accepts), ``_fused_rms_norm`` pairs become
   ``npu_rms_norm`` / ``npu_rms_norm_backward``. Without torch_npu these ops do
   not exist, so on CPU the same nodes are decomposed instead (step 2), which
   is what keeps the pass testable and numerically checkable here. A graph on
   ``meta`` (a step built to be compiled and priced, never run: the simulator,
   ``cann-plan``) keeps its flash attention pairs without torch_npu: they stand
   for the fused kernel the device runs (its FLOPs, its saved output and
   log-sum-exp, no ``T x T`` scores), counted as
   ``npu.npu_fusion_attention (stand-in on meta)``.
2. a decomposition from :data:`DECOMPOSITIONS` (this file) or, failing that,
   torch's own decomposition table. A decomposition is traced on the node's
   fake inputs and inlined; nodes it produces are legalized in turn.
3. bucketed or coalesced collectives (``*_coalesced``) become one plain
   collective over the concatenation of their inputs, split afterwards.

New nodes inherit the region, module path and torch's ``custom`` annotations
of the node they replace (so a lowering report still names the module) and
get ``meta["val"]`` recomputed in the graph's own fake mode. Anything still
unsupported is listed in the pass statistics and its explanation rather than
raised: the lowering report names it with its module path.

``npu_rotary_mul`` and ``npu_swiglu`` are not introduced: an aten-level
capture contains rotary embedding and SwiGLU only as their elementwise
pieces, all of which torchair converts; matching those patterns is future
work. Decomposed attention is numerically equal to the CPU kernel (fp32
softmax, same mask) but materialises the T x T score matrix.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from graph_ir import TrainGraph
from graph_ir.build import fake_value
from graph_ir.meta import MODULE_PATH, ORIGIN_PASS, REGION

from ..pass_manager import PassContext, register_pass

log = logging.getLogger("cann_passes")
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_INHERITED_META = (REGION, MODULE_PATH, "custom", "stack_trace", "nn_module_stack", "seq_nr")
_MAX_DEPTH = 6  # decompositions of decompositions; deeper means a decomposition loops


# --------------------------------------------------------------------------- decompositions
# Each takes the node's arguments as the op does and returns what the op returns. They are
# traced with make_fx, so they may call torch.* freely; what they produce is legalized again.

def _silu_backward(grad, x):
    sig = torch.sigmoid(x)
    return grad * sig * (1 + x * (1 - sig))


def _amax(x, dim=(), keepdim=False):
    dims = sorted((d % x.dim() for d in dim) if dim else range(x.dim()), reverse=True)
    for d in dims:  # max.dim reduces one dimension and has a converter; amax does not
        x = torch.max(x, d, keepdim=True).values
    return x if keepdim or not dims else x.squeeze(dims)


def _amin(x, dim=(), keepdim=False):
    return -_amax(-x, dim, keepdim)


def _lerp_tensor(start, end, weight):
    return start + weight * (end - start)


def _var(x, dim=None, *, correction=None, keepdim=False):
    dims = list(range(x.dim())) if dim is None else list(dim)
    n = math.prod(x.shape[d] for d in dims) if dims else 1
    centered = x - x.mean(dims, keepdim=True)
    return (centered * centered).sum(dims, keepdim=keepdim) / max(n - (1 if correction is None else correction), 0)


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    dims = list(range(x.dim())) if dim is None else list(dim)
    return _var(x, dims, correction=correction, keepdim=keepdim), x.mean(dims, keepdim=keepdim)


def _convert_element_type(x, dtype):
    return x.to(dtype)


def _attention_bias(q, k, attn_mask, is_causal):
    """Additive fp32 bias (0 or -inf) for scores of shape (..., L, S), or None."""
    L, S = q.shape[-2], k.shape[-2]
    bias = None
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        bias = torch.zeros(L, S, device=q.device).masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        m = (torch.zeros(attn_mask.shape, device=q.device).masked_fill(~attn_mask, float("-inf"))
             if attn_mask.dtype == torch.bool else attn_mask.float())
        bias = m if bias is None else bias + m
    return bias


def _scores(q, k, attn_mask, is_causal, scale):
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    bias = _attention_bias(q, k, attn_mask, is_causal)
    return s if bias is None else s + bias


def _check_sdpa(q, k, dropout_p):
    if dropout_p:
        raise _NoDecomposition("flash attention with dropout (torch only picks it with dropout_p=0 on CPU)")
    if q.shape[-3] != k.shape[-3]:
        raise _NoDecomposition("grouped-query flash attention (query and key head counts differ)")


def _sdpa_cpu_forward(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Softmax attention in fp32, as the CPU flash kernel accumulates; (out, logsumexp)."""
    _check_sdpa(q, k, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, attn_mask, is_causal, scale)
    # logsumexp is only read by the backward below, which recomputes the softmax instead: the
    # logsumexp becomes dead code and GE sees one SoftmaxV2 per direction
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype), torch.logsumexp(s, dim=-1)


def _sdpa_cpu_backward(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                       scale=None):
    """Flash-attention backward, recomputing the probabilities (as the kernel does)."""
    _check_sdpa(q, k, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = torch.softmax(_scores(q, k, attn_mask, is_causal, scale), dim=-1)
    do = grad_out.float()
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.float().transpose(-2, -1)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = (ds @ k.float()) * scale
    dk = (ds.transpose(-2, -1) @ q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _foreach(fn_name: str, overload: str):
    """``_foreach_<op>.<overload>`` as one aten op per list element."""
    per_element = {"List": "Tensor", "Scalar": "Scalar", "ScalarList": "Scalar", "Tensor": "Tensor",
                   "default": "default", "ScalarAndTensor": "Scalar"}[overload]
    op = getattr(getattr(aten, fn_name), per_element)

    def decomposition(*args, **kwargs):
        lists = [a for a in args if isinstance(a, (list, tuple))]
        n = len(lists[0])
        out = []
        for i in range(n):
            out.append(op(*[a[i] if isinstance(a, (list, tuple)) else a for a in args], **kwargs))
        return out

    return decomposition


def _foreach_repeated(fn_name: str):
    """``_foreach_<op>.Tensor(xs, s)`` (one 0-dim tensor for every element, which torchair has no
    converter for) as the converted ``.List`` overload with ``s`` repeated: the same op per element."""
    op = getattr(aten, f"_foreach_{fn_name}").List

    def decomposition(xs, scalar, **kwargs):
        return op(xs, [scalar] * len(xs), **kwargs)

    return decomposition


def _foreach_pow_of(exponent: float):
    # ATen's pow runs exponent 0.5 as sqrt and -1 as reciprocal, so on CPU this is bitwise the op.
    return lambda xs: aten._foreach_pow.Scalar(xs, exponent)


def _flat_cat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _split_like(flat, tensors, leading=None):
    sizes = [t.numel() for t in tensors]
    parts = flat.split(sizes, dim=-1)
    return [p.reshape(((leading,) if leading else ()) + tuple(t.shape)) for p, t in zip(parts, tensors)]


def _all_reduce_coalesced(inputs, reduce_op, group_name):
    flat = c10d.wait_tensor.default(c10d.all_reduce.default(_flat_cat(inputs), reduce_op, group_name))
    return _split_like(flat, inputs)


def _all_gather_coalesced(inputs, group_size, group_name):
    flat = c10d.wait_tensor.default(
        c10d.all_gather_into_tensor.default(_flat_cat(inputs), group_size, group_name))
    # rank r's concatenation is row r: split each row, then stack each piece's rows (dim 0)
    parts = _split_like(flat.reshape(group_size, -1), inputs, leading=group_size)
    return [p.reshape((group_size * t.shape[0],) + tuple(t.shape[1:])) for p, t in zip(parts, inputs)]


def _reduce_scatter_coalesced(inputs, reduce_op, group_size, group_name):
    # every input is group_size chunks along dim 0; rank r receives chunk r of each
    rows = torch.cat([t.reshape(group_size, -1) for t in inputs], dim=1)
    flat = c10d.wait_tensor.default(
        c10d.reduce_scatter_tensor.default(rows.reshape(-1), reduce_op, group_size, group_name))
    shards = [t.new_empty((t.shape[0] // group_size,) + tuple(t.shape[1:])) for t in inputs]
    return _split_like(flat, shards)


def _index_put(x, indices, values, accumulate=False):
    """``x[i0, i1, ...] = values`` (or ``+=``) over the leading dims as one flat row index.

    The backward of advanced indexing (CLIP's pooled token ``h[arange(B), eos]``) is an
    ``index_put`` with ``accumulate=True``, whose torchair converter is a stub;
    ``index_add`` (accumulate) and ``scatter`` (assign) on rows have real ones.
    """
    if any(i is None or i.dtype == torch.bool for i in indices):
        raise _NoDecomposition("index_put with None or boolean indices")
    lead, rest = tuple(x.shape[:len(indices)]), tuple(x.shape[len(indices):])
    idx = torch.broadcast_tensors(*indices)
    flat, stride = None, 1
    for size, i in zip(reversed(lead), reversed(idx)):
        i = torch.where(i < 0, i + size, i).to(torch.int64) * stride
        flat, stride = i if flat is None else flat + i, stride * size
    flat = flat.reshape(-1)
    width = math.prod(rest)
    rows = x.reshape(math.prod(lead), width)
    vals = values.expand(*idx[0].shape, *rest).reshape(-1, width).to(x.dtype)
    if accumulate:
        out = rows.index_add(0, flat, vals)
    else:
        out = rows.scatter(0, flat.unsqueeze(1).expand(-1, width), vals)
    return out.reshape(x.shape)


# Integer shifts. torchair converts bitwise_and/or/not on tensors, but neither shift (its
# bitwise_right_shift converter exists only for the in-place overload) and none of the prims
# torch's decompositions turn them into; recompute's bit-packed dropout masks use both. A shift
# by s is a multiplication or floor division by 2**s, which GE converts (Mul, Pow, FloorDiv),
# with torch's rules for shifts out of range written out: 0, or the sign for a signed right shift.

def _shift_operands(x, shift):
    x, shift = torch.as_tensor(x), torch.as_tensor(shift, device=torch.as_tensor(x).device)
    dtype = torch.result_type(x, shift)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise _NoDecomposition(f"shift of {dtype} values (integer dtypes only)")
    return x.to(dtype), shift.to(dtype), torch.iinfo(dtype).bits, dtype.is_signed


def _shift_left(x, shift):
    x, shift, bits, _ = _shift_operands(x, shift)
    in_range = (shift >= 0) & (shift < bits)
    power = torch.pow(2, torch.where(in_range, shift, torch.zeros_like(shift)))   # wraps like the shift
    return torch.where(in_range, x * power, torch.zeros_like(x))


def _shift_right(x, shift):
    """Arithmetic for signed dtypes, logical for unsigned ones (torch's ``>>``)."""
    x, shift, bits, signed = _shift_operands(x, shift)
    # signed: 2**(bits-1) would overflow, and x >> (bits-1) is the sign anyway
    limit = bits - 1 if signed else bits
    in_range = (shift >= 0) & (shift < limit)
    power = torch.pow(2, torch.where(in_range, shift, torch.zeros_like(shift)))
    out_of_range = (torch.where(x < 0, torch.full_like(x, -1), torch.zeros_like(x)) if signed
                    else torch.zeros_like(x))
    return torch.where(in_range, torch.floor_divide(x, power), out_of_range)


def _bitwise(tensor_op):
    """``op.Scalar`` / ``op.Scalar_Tensor`` / the prim as ``op.Tensor`` on a 0-dim tensor operand."""
    def decomposition(a, b):
        like = a if isinstance(a, torch.Tensor) else b
        dtype = torch.result_type(a, b)
        a, b = (torch.full((), v, dtype=dtype, device=like.device) if not isinstance(v, torch.Tensor)
                else v.to(dtype) for v in (a, b))
        return tensor_op(a, b)
    return decomposition


def _histc(x, bins=100, min=0, max=0):  # noqa: A002 - aten's argument names
    """ATen's CPU histc: bin ``trunc((x - min) * bins / (max - min))`` in the input's precision, the
    right edge in the last bin, NaN and values outside [min, max] not counted; the counts as an
    index_add of ones (exact below 2**24). transformers' routing counts its expert ids so: as float
    on CPU, as int32 on an accelerator (whose kernels take integers), binned here as the float64
    values they equal (exact), the counts in the input's dtype."""
    if not x.dtype.is_floating_point and x.dtype != torch.bool:
        return _histc(x.to(torch.float64), bins, min, max).to(x.dtype)
    if x.dtype not in (torch.float32, torch.float64):
        raise _NoDecomposition(f"histc of {x.dtype} values (float32, float64 and integers only)")
    if not min < max:
        raise _NoDecomposition("histc without an explicit min < max (the range comes from the data)")
    lo, hi = _rounded(min, x.dtype), _rounded(max, x.dtype)
    span = _rounded(hi - lo, x.dtype)        # ATen subtracts the edges in the input's precision
    flat = x.reshape(-1)
    pos = ((flat - lo) * bins / span).to(torch.int64).clamp(0, bins - 1)
    counted = ((flat >= lo) & (flat <= hi)).to(x.dtype)
    return torch.zeros(bins, dtype=x.dtype, device=x.device).index_add(0, pos, counted)


def _rounded(value: float, dtype: torch.dtype) -> float:
    import struct
    return struct.unpack("f", struct.pack("f", value))[0] if dtype == torch.float32 else float(value)


def _argsort(x, dim=-1, descending=False):
    return torch.sort(x, dim, descending).indices


def _expert_major_order(rows, counts):
    """``cann.expert_major_order`` (expert_parallel's stable sort of the received rows by local
    expert) as a sort of unique keys ``expert * rows + row``, the same permutation."""
    n, experts = rows.shape[0], counts.shape[-1]
    ends = torch.cumsum(counts.reshape(-1).to(torch.int64), 0)
    row = torch.arange(n, device=rows.device)
    expert = torch.searchsorted(ends, row, right=True) % experts
    return torch.sort(expert * n + row).indices


# Ops of other namespaces, found by name: they exist only once their module registered them.
_BY_NAME: dict[str, Callable] = {"cann.expert_major_order.default": _expert_major_order}


DECOMPOSITIONS: dict[Any, Callable] = {
    aten.histc.default: _histc,
    aten.argsort.default: _argsort,
    aten.index_put.default: _index_put,
    aten.bitwise_left_shift.Tensor: _shift_left,
    aten.bitwise_left_shift.Tensor_Scalar: _shift_left,
    aten.bitwise_left_shift.Scalar_Tensor: _shift_left,
    aten.bitwise_right_shift.Tensor: _shift_right,
    aten.bitwise_right_shift.Tensor_Scalar: _shift_right,
    aten.bitwise_right_shift.Scalar_Tensor: _shift_right,
    torch.ops.prims.shift_left.default: _shift_left,
    torch.ops.prims.shift_right_arithmetic.default: _shift_right,
    aten.bitwise_and.Scalar: _bitwise(torch.bitwise_and),
    aten.bitwise_and.Scalar_Tensor: _bitwise(torch.bitwise_and),
    aten.bitwise_or.Scalar: _bitwise(torch.bitwise_or),
    aten.bitwise_or.Scalar_Tensor: _bitwise(torch.bitwise_or),
    torch.ops.prims.bitwise_and.default: _bitwise(torch.bitwise_and),
    torch.ops.prims.bitwise_or.default: _bitwise(torch.bitwise_or),
    torch.ops.prims.bitwise_not.default: torch.bitwise_not,
    aten.silu_backward.default: _silu_backward,
    aten.amax.default: _amax,
    aten.amin.default: _amin,
    aten.lerp.Tensor: _lerp_tensor,
    aten.var.correction: _var,
    aten.var_mean.correction: _var_mean,
    torch.ops.prims.convert_element_type.default: _convert_element_type,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_cpu_backward,
    # fuse_optimizer's multi-tensor ops without a converter, kept multi-tensor (the generic
    # _foreach decomposition would split them into one op per element).
    aten._foreach_mul.Tensor: _foreach_repeated("mul"),
    aten._foreach_div.Tensor: _foreach_repeated("div"),
    aten._foreach_add.Tensor: _foreach_repeated("add"),
    aten._foreach_sqrt.default: _foreach_pow_of(0.5),
    aten._foreach_reciprocal.default: _foreach_pow_of(-1.0),
    aten._foreach_neg.default: lambda xs: aten._foreach_mul.Scalar(xs, -1.0),
    c10d.all_reduce_coalesced.default: _all_reduce_coalesced,
    c10d.all_gather_into_tensor_coalesced.default: _all_gather_coalesced,
    c10d.reduce_scatter_tensor_coalesced.default: _reduce_scatter_coalesced,
}


_FLASH_PAIR = (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _restride(t, like):
    """``t`` with the memory layout of ``like``: later ``view`` nodes were traced against it."""
    if not isinstance(t, torch.Tensor) or not isinstance(like, torch.Tensor) or t.stride() == like.stride():
        return t
    order = sorted(range(like.dim()), key=lambda d: (-like.stride()[d], d))
    inverse = sorted(range(like.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


def _same_layout(fn: Callable, like: Any) -> Callable:
    def decomposition(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, (list, tuple)) and isinstance(like, (list, tuple)):
            return type(out)(_restride(o, l) for o, l in zip(out, like))
        return _restride(out, like)
    return decomposition


class _NoDecomposition(Exception):
    """This node, with these arguments, cannot be rewritten (the message says why)."""


def decomposition_for(target) -> Callable | None:
    if target in DECOMPOSITIONS:
        return DECOMPOSITIONS[target]
    if str(target) in _BY_NAME:
        return _BY_NAME[str(target)]
    name = target._schema.name.split("::")[-1]
    if target.namespace == "aten" and name.startswith("_foreach_"):
        return _foreach(name.removeprefix("_foreach_"), target._overloadname)
    from torch._decomp import decomposition_table
    return decomposition_table.get(target)


# --------------------------------------------------------------------------- NPU fused kernels

def npu_op(name: str):
    """``torch.ops.npu.<name>.default`` if torch_npu registered it, else None (never imports it)."""
    try:
        return getattr(getattr(torch.ops.npu, name), "default")
    except (AttributeError, RuntimeError):
        return None


def _fusion_attention_forward(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _check_sdpa(q, k, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = _npu_mask(q, k, attn_mask, is_causal)
    out = npu_op("npu_fusion_attention")(q, k, v, q.shape[-3], "BNSD", atten_mask=mask, scale=scale,
                                         keep_prob=1.0, sparse_mode=0)
    return out[0], out[1], out[2]  # attention_out, softmax_max, softmax_sum


def _fusion_attention_backward(grad_out, q, k, v, out, softmax_max, softmax_sum, is_causal, attn_mask, scale):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    grads = npu_op("npu_fusion_attention_grad")(
        q, k, v, grad_out, q.shape[-3], "BNSD", atten_mask=_npu_mask(q, k, attn_mask, is_causal),
        softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out, scale_value=scale,
        keep_prob=1.0, sparse_mode=0)
    return grads[0], grads[1], grads[2]


def _npu_mask(q, k, attn_mask, is_causal):
    """npu_fusion_attention's mask: boolean, True where a score is dropped."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise _NoDecomposition("npu_fusion_attention takes boolean masks only (pse is not mapped)")
    L, S = q.shape[-2], k.shape[-2]
    drop = None
    if is_causal:
        drop = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
    if attn_mask is not None:
        drop = ~attn_mask if drop is None else drop | ~attn_mask
    return drop


# --------------------------------------------------------------------------- graph surgery

class _Legalizer:
    # The size of a collective's group; the pass sets it from the mesh description when it has one.
    group_size = staticmethod(lambda name: _group_size(name))

    def __init__(self, graph: TrainGraph, supported: set[str], use_npu_kernels: bool):
        self.tg, self.graph, self.supported = graph, graph.graph, supported
        self.use_npu_kernels = use_npu_kernels
        self.mode = graph.fake_mode()
        self.rewritten: dict[str, int] = {}
        self.left: dict[str, str] = {}   # node name -> why it stays

    def is_legal(self, node: torch.fx.Node) -> bool:
        return (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or str(node.target) in self.supported)

    def run(self) -> None:
        if self.use_npu_kernels:
            self._fuse_attention_pairs()
        self._average_as_sum()
        depth = {n: 0 for n in self.graph.nodes}
        stand_in = self._attention_stand_ins()
        work = [n for n in self.graph.nodes if not self.is_legal(n) and n not in stand_in]
        while work:
            node = work.pop(0)
            if node.graph is not self.graph or self.is_legal(node):
                continue
            new_nodes = self._decompose(node, depth.get(node, 0))
            for n in new_nodes:
                depth[n] = depth.get(node, 0) + 1
            work.extend(n for n in new_nodes if not self.is_legal(n))
        self._average_as_sum()      # coalesced collectives decompose into plain ones, maybe averaging

    def _attention_stand_ins(self) -> set[torch.fx.Node]:
        """On a meta graph without torch_npu: the flash attention nodes kept for the fused kernel."""
        if self.use_npu_kernels or not any(
                isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "meta"
                for n in self.graph.nodes if n.op == "placeholder"):
            return set()
        kept = {n for n in self.graph.nodes if n.target in _FLASH_PAIR}
        if kept:
            key = "npu.npu_fusion_attention (stand-in on meta)"
            self.rewritten[key] = sum(n.target is _FLASH_PAIR[0] for n in kept)
        return kept

    def _decompose(self, node: torch.fx.Node, depth: int) -> list[torch.fx.Node]:
        name, target = node.name, str(node.target)
        fn = decomposition_for(node.target)
        if fn is None or depth >= _MAX_DEPTH:
            self.left[name] = (f"{target}: no decomposition" if fn is None
                               else f"{target}: decomposition did not converge after {_MAX_DEPTH} levels")
            return []
        try:
            new_nodes = self.replace_with(node, _same_layout(fn, node.meta.get("val")))
        except _NoDecomposition as e:
            self.left[name] = f"{target}: {e}"
            return []
        self.rewritten[target] = self.rewritten.get(target, 0) + 1
        return new_nodes

    # -- inlining a traced function in place of a node -----------------------------------------
    def replace_with(self, node: torch.fx.Node, fn: Callable, args=None, kwargs=None) -> list[torch.fx.Node]:
        """Trace ``fn`` on the node's fake inputs, inline it before ``node``, rewire its users."""
        self._check_users(node)
        new_nodes, result = self.inline(node, fn, node.args if args is None else args,
                                        node.kwargs if kwargs is None else kwargs)
        self._rewire(node, result)
        return new_nodes

    def inline(self, anchor: torch.fx.Node, fn: Callable, args, kwargs) -> tuple[list[torch.fx.Node], Any]:
        """``fn(*args, **kwargs)`` traced on fake values and inserted before ``anchor``."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        slots = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]

        def call(*tensors):
            values = list(flat)
            for i, t in zip(slots, tensors):
                values[i] = t
            a, kw = pytree.tree_unflatten(values, spec)
            return fn(*a, **kw)

        sub = make_fx(call, tracing_mode="fake")(*[flat[i].meta["val"] for i in slots])
        env: dict[torch.fx.Node, Any] = {}
        placeholders = iter(flat[i] for i in slots)
        new_nodes: list[torch.fx.Node] = []
        result = None
        with self.graph.inserting_before(anchor):
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    env[sn] = next(placeholders)
                elif sn.op == "get_attr":
                    env[sn] = self._copy_constant(sub, sn.target)
                    new_nodes.append(env[sn])
                elif sn.op == "call_function":
                    env[sn] = self.graph.call_function(sn.target, *torch.fx.map_arg((sn.args, sn.kwargs),
                                                                                   lambda x: env[x]))
                    new_nodes.append(env[sn])
                else:
                    result = torch.fx.map_arg(sn.args[0], lambda x: env[x])
        for new in new_nodes:
            self._inherit_meta(new, anchor)
        return new_nodes, result

    def _copy_constant(self, sub: torch.fx.GraphModule, attr: str) -> torch.fx.Node:
        value = getattr(sub, attr)
        i = 0
        while hasattr(self.tg.gm, f"_npu_legalize_const{i}"):
            i += 1
        name = f"_npu_legalize_const{i}"
        self.tg.gm.register_buffer(name, value)
        return self.graph.get_attr(name)

    def _inherit_meta(self, new: torch.fx.Node, old: torch.fx.Node) -> None:
        for key in _INHERITED_META:
            if key in old.meta:
                new.meta[key] = old.meta[key]
        new.meta[ORIGIN_PASS] = "npu_legalize"
        new.meta["val"] = self._fake_value(new)

    def _fake_value(self, node: torch.fx.Node):
        if node.op == "get_attr":
            value = getattr(self.tg.gm, node.target)
            return self.mode.from_tensor(value) if self.mode is not None else value
        return fake_value(node.target, node.args, node.kwargs, mode=self.mode)

    @staticmethod
    def _check_users(node: torch.fx.Node) -> None:
        if isinstance(node.meta.get("val"), (list, tuple)):
            if any(u.op != "call_function" or u.target is not _getitem for u in node.users):
                raise _NoDecomposition(f"{node.name} has a user that is not an indexing of its outputs")

    def _rewire(self, node: torch.fx.Node, result: Any) -> None:
        """Point the node's users at ``result``; a tuple result replaces the ``getitem`` users."""
        if isinstance(result, (list, tuple)):
            for user in list(node.users):
                replacement = result[user.args[1]]
                if replacement is None and not user.users:
                    self.graph.erase_node(user)
                    continue
                if replacement is None:
                    raise RuntimeError(f"decomposition of {node.name} does not produce output {user.args[1]}")
                user.replace_all_uses_with(replacement)
                self.graph.erase_node(user)
        else:
            node.replace_all_uses_with(result)
        self.graph.erase_node(node)

    # -- all_reduce "avg" -> "sum" then divide ------------------------------------------------
    def _average_as_sum(self) -> None:
        """HcomAllReduce and HcomReduceScatter have no average (torchair: "ge unsupported reduce
        type AVG"): sum, then divide what the wait returns by the group size."""
        for node in [n for n in self.graph.nodes if n.target in (c10d.all_reduce.default,
                                                                 c10d.reduce_scatter_tensor.default)
                     and n.args[1] == "avg"]:
            if node.target is c10d.all_reduce.default:
                size = self.group_size(node.args[2])
            else:           # reduce_scatter_tensor(input, reduce_op, group_size, group_name)
                size = node.args[2]
            kind = f"{node.target._schema.name.split('::')[-1]} avg"
            if size is None:
                self.left[node.name] = f"{kind} over group {node.args[-1]!r}, whose size is unknown here"
                continue
            node.args = (node.args[0], "sum", *node.args[2:])
            for wait in [u for u in node.users if u.target is c10d.wait_tensor.default]:
                readers = list(wait.users)
                with self.graph.inserting_after(wait):
                    mean = self.graph.call_function(aten.div.Scalar, (wait, size))
                self._inherit_meta(mean, wait)
                for r in readers:
                    r.replace_input_with(wait, mean)
            self.rewritten[kind] = self.rewritten.get(kind, 0) + 1

    # -- flash attention pairs -> npu_fusion_attention ----------------------------------------
    def _fuse_attention_pairs(self) -> None:
        fwd_op, bwd_op = _FLASH_PAIR
        for fwd in [n for n in self.graph.nodes if n.target is fwd_op]:
            outs = {u.args[1]: u for u in fwd.users if u.target is _getitem}
            bwds = [u for u in outs.get(1, fwd).users if u.target is bwd_op] if 1 in outs else []
            try:
                self._fuse_one(fwd, outs, bwds)
            except _NoDecomposition as e:
                log.info("npu_legalize: %s stays decomposed: %s", fwd.name, e)

    def _fuse_one(self, fwd, outs, bwds) -> None:
        q, k, v = fwd.args[:3]
        dropout_p = fwd.args[3] if len(fwd.args) > 3 else fwd.kwargs.get("dropout_p", 0.0)
        is_causal = fwd.args[4] if len(fwd.args) > 4 else fwd.kwargs.get("is_causal", False)
        mask, scale = fwd.kwargs.get("attn_mask"), fwd.kwargs.get("scale")
        # softmax_max/softmax_sum replace logsumexp: only the paired backward may read it
        if 1 in outs and set(outs[1].users) - set(bwds):
            raise _NoDecomposition("logsumexp is read by something other than the attention backward")
        for bwd in bwds:
            self._check_users(bwd)
        _, (attn_out, smax, ssum) = self.inline(
            fwd, _fusion_attention_forward, (q, k, v, dropout_p, is_causal), {"attn_mask": mask, "scale": scale})
        for bwd in bwds:
            b_args = (bwd.args[0], q, k, v, attn_out, smax, ssum, is_causal, mask, scale)
            self.replace_with(bwd, _fusion_attention_backward, b_args, {})
        self._rewire(fwd, (attn_out, None))
        self.rewritten["npu.npu_fusion_attention"] = self.rewritten.get("npu.npu_fusion_attention", 0) + 1


_getitem = __import__("operator").getitem


def _group_size(group_name: str) -> int | None:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(group_name).size()
    except Exception:  # noqa: BLE001 - no such group in this process
        return None


def _supported_ops() -> set[str]:
    from ..lowering.ge_offline import supported_ops
    return supported_ops()


@register_pass("npu_legalize", preserves=())
def npu_legalize_pass(graph: TrainGraph, ctx: PassContext, *, npu_kernels: bool = True) -> TrainGraph:
    """Rewrite ops without a real torchair converter into ones with a converter.

    ``npu_kernels`` allows fused NPU kernels (npu_fusion_attention, ...) where torch_npu
    registered them; without torch_npu they do not exist and the ops are decomposed.
    """
    fused_available = npu_kernels and npu_op("npu_fusion_attention") is not None
    legalizer = _Legalizer(graph, _supported_ops(), fused_available)
    mesh_group_size = getattr(getattr(ctx, "mesh", None), "group_size", None)
    if mesh_group_size is not None:   # the mesh description, not a live process group
        legalizer.group_size = lambda name: mesh_group_size(name) or _group_size(name)
    legalizer.run()
    graph.graph.lint()
    ctx.stat("rewritten", dict(sorted(legalizer.rewritten.items())))
    ctx.stat("npu_kernels", fused_available)
    ctx.stat("unsupported_left", len(legalizer.left))
    if legalizer.left:
        log.warning("npu_legalize: %d node(s) stay unsupported: %s", len(legalizer.left),
                    "; ".join(f"{k} ({v})" for k, v in legalizer.left.items()))
    ctx.explain({"rewritten": legalizer.rewritten, "unsupported": legalizer.left})
    return graph
