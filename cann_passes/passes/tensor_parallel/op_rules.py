"""Per-op rules where torch's DTensor strategies are missing or too eager.

Each rule takes an op and its (DTensor) operands and returns the op's result computed on the
shards, or None to leave the op to DTensor's own strategy.
"""
from __future__ import annotations

import torch
from torch._prims_common import make_contiguous_strides_for

from graph_ir.meta import MODULE_PATH

from .common import TensorParallelError, aten
from .placements import strided

_HEAD_LOCAL_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


class _NotHeadLocal(Exception):
    pass


def is_pointwise(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _global_meta(target, args, kwargs):
    """``target`` on meta tensors of its operands' global shapes and strides (outside the trace)."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    def meta(v):   # (a plain tensor too: an attention mask made from factories, not a DTensor)
        return (torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) else v)
    with disable_proxy_modes_tracing():
        return target(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})


def _contiguous_strides(shape) -> tuple[int, ...]:
    from torch._prims_common import make_contiguous_strides_for
    return tuple(make_contiguous_strides_for(shape))


def _to_local(v):
    from torch.distributed.tensor import DTensor
    return v.to_local() if isinstance(v, DTensor) else v


class OpRules:
    """The rules, mixed into the re-trace's interpreter: they read its ``mesh``, ``tp``,
    ``current`` node, ``env`` of traced values, ``vocab_backwards`` and ``origins``."""

    def local_rule(self, target, args, kwargs):
        """The first rule's result for this op, or None: DTensor's strategy applies."""
        for rule in (self._vocab_embedding_backward, self._fused_split, self._fused_slice,
                     self._fused_slice_backward, self._fused_cat, self._fused_contraction,
                     self._same_placement, self._batch_local, self._head_local, self._legacy_empty_cat):
            out = rule(target, args, kwargs)
            if out is not None:
                return out
        return None

    def _vocab_embedding_backward(self, target, args, kwargs):
        """The gradient of a vocab-parallel embedding, computed for this rank's rows only
        (Megatron's): the token gradients of ids outside the shard are zeroed and those ids sent
        to row 0, then the dense backward runs over ``vocab / tp`` rows. DTensor's rule builds the
        whole-vocabulary gradient on every rank (a partial sum of it under sequence parallelism,
        all-reduced) and only then cuts it."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        if target is not aten.embedding_dense_backward.default or self.current not in self.vocab_backwards:
            return None
        weight = self.env.get(self.vocab_backwards[self.current])
        grad, ids, num_weights, padding_idx, by_freq = (list(args) + [kwargs.get(k) for k in (
            "grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")][len(args):])[:5]
        if not (isinstance(weight, DTensor) and type(weight.placements[0]) is Shard and weight.placements[0].dim == 0
                and weight.shape[0] == num_weights and num_weights % self.tp == 0 and not by_freq
                and isinstance(grad, DTensor)):
            return None
        whole = lambda v: v.redistribute(self.mesh, [Replicate()]).to_local() \
            if isinstance(v, DTensor) else v  # noqa: E731
        g, token_ids = whole(grad), whole(ids)
        rows = num_weights // self.tp
        start = self.mesh.get_local_rank(0) * rows
        local = aten.sub.Tensor(token_ids, start)
        mine = aten.bitwise_and.Tensor(aten.ge.Scalar(local, 0), aten.lt.Scalar(local, rows))
        local = aten.mul.Tensor(local, mine)
        g = aten.mul.Tensor(g, aten.unsqueeze.default(aten._to_copy.default(mine, dtype=g.dtype), -1))
        pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < rows else -1
        out = aten.embedding_dense_backward.default(g, local, rows, pad, False)
        return DTensor.from_local(out, self.mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([num_weights, out.shape[1]]), stride=(out.shape[1], 1))

    def _fused_split(self, target, args, kwargs):
        """split(x, n, dim) of a per-part shard into its parts: a view [.., parts, n, ..] and unbind."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import _StridedShard
        if target not in (aten.split.Tensor, aten.split_with_sizes.default) or not isinstance(args[0], DTensor):
            return None
        x, sizes = args[0], args[1]
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
        p = x.placements[0]
        if not (isinstance(p, _StridedShard) and p.dim == dim):
            return None
        size = sizes if isinstance(sizes, int) else sizes[0]
        if not (isinstance(sizes, int) or len(set(sizes)) == 1) or size * p.split_factor != x.shape[dim]:
            raise TensorParallelError(self._origin_message(
                x, f"a fused projection split into parts {sizes} along dim {dim}; its rule says "
                   f"{p.split_factor} equal parts"))
        shape = list(x.shape)
        shape[dim:dim + 1] = [p.split_factor, size]
        return list(aten.unbind.int(aten.view.default(x, shape), dim))

    def _fused_slice(self, target, args, kwargs):
        """x[..., a:b] of a per-part shard, [a, b) one whole part (Phi-3's qkv_proj, its gate_up_proj
        sliced rather than split): that part's shard, a view [.., parts, n, ..] and a select."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import _StridedShard
        if target is not aten.slice.Tensor or not isinstance(args[0], DTensor):
            return None
        x = args[0]
        dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
        dim %= x.ndim
        p = x.placements[0]
        if not (isinstance(p, _StridedShard) and p.dim == dim):
            return None
        length, size = x.shape[dim], x.shape[dim] // p.split_factor
        start, end = min(start or 0, length), min(length if end is None else end, length)
        if step != 1 or start % size or end - start != size:
            raise TensorParallelError(self._origin_message(
                x, f"a fused projection sliced [{start}:{end}] along dim {dim}; its rule says "
                   f"{p.split_factor} equal parts of {size}"))
        shape = list(x.shape)
        shape[dim:dim + 1] = [p.split_factor, size]
        return aten.select.int(aten.view.default(x, shape), dim, start // size)

    def _fused_slice_backward(self, target, args, kwargs):
        """The gradient of one part's slice (``_fused_slice``): zeros with the part's shard in its
        place, the per-part shard of the fused value (the parts' gradients then add locally)."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        if target is not aten.slice_backward.default or not isinstance(args[0], DTensor):
            return None
        g, sizes, dim, start, end, step = args[:6]
        dim %= g.ndim
        if g.placements[0] != Shard(dim) or type(g.placements[0]) is not Shard or step != 1:
            return None
        size, length = g.shape[dim], sizes[dim]
        start, end = min(start, length), min(end, length)
        if end - start != size or start % size or length % size or length == size:
            return None
        parts, local = length // size, g.to_local()
        n = local.shape[dim]
        local_sizes = list(local.shape)
        local_sizes[dim] = parts * n
        k = start // size
        out = aten.slice_backward.default(local, local_sizes, dim, k * n, (k + 1) * n, 1)
        return DTensor.from_local(out, self.mesh, [_StridedShard(dim, split_factor=parts)], run_check=False,
                                  shape=torch.Size(sizes), stride=_contiguous_strides(sizes))

    def _fused_cat(self, target, args, kwargs):
        """cat of equal shards along their sharded dim (a fused projection's gradient): stack + view."""
        from torch.distributed.tensor import DTensor, Shard
        if target is not aten.cat.default or not all(isinstance(a, DTensor) for a in args[0]):
            return None
        parts = args[0]
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % parts[0].ndim
        if len(parts) < 2 or not all(t.placements[0] == Shard(dim) for t in parts) \
                or len({tuple(t.shape) for t in parts}) != 1:
            return None
        shape = list(parts[0].shape)
        shape[dim] *= len(parts)
        return aten.view.default(aten.stack.default(parts, dim), shape)

    def _fused_contraction(self, target, args, kwargs):
        """mm contracting two identical per-part shards: each rank's product is a partial sum."""
        from torch.distributed.tensor import DTensor, Partial
        from torch.distributed.tensor.placement_types import _StridedShard
        if target is not aten.mm.default or not all(isinstance(a, DTensor) for a in args[:2]):
            return None
        pa, pb = args[0].placements[0], args[1].placements[0]
        if not (isinstance(pa, _StridedShard) and isinstance(pb, _StridedShard) and pa.dim == 1
                and pb.dim == 0 and pa.split_factor == pb.split_factor):
            return None
        local = aten.mm.default(args[0].to_local(), args[1].to_local())
        return DTensor.from_local(local, self.mesh, [Partial()], run_check=False,
                                  shape=torch.Size([args[0].shape[0], args[1].shape[1]]),
                                  stride=(args[1].shape[1], 1))

    def _same_placement(self, target, args, kwargs):
        """An elementwise op whose tensor operands share one shape and split runs on the shards. Not
        on partial sums: an op that is not linear in them (``rsqrt`` of the mean of squares over
        a split feature dim, OLMoE's q_norm) needs the reduced value, which DTensor's rules give."""
        from torch.distributed.tensor import DTensor, Replicate
        if not is_pointwise(target):
            return None
        flat = list(args) + list(kwargs.values())
        if any(isinstance(a, (list, tuple)) for a in flat):
            return None
        dts = [a for a in flat if isinstance(a, DTensor)]
        big = [a for a in dts if a.ndim > 0]
        if not big or any(isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim > 0
                          for a in flat):
            return None
        first = big[0]
        if first.placements[0] == Replicate() or first.placements[0].is_partial() or not all(
                a.shape == first.shape and a.placements == first.placements for a in big) \
                or not all(a.ndim > 0 or a.placements[0] == Replicate() for a in dts):
            return None
        out = target(*[_to_local(a) for a in args], **{k: _to_local(v) for k, v in kwargs.items()})
        if not isinstance(out, torch.Tensor) or out.shape != first.to_local().shape:
            return None
        whole = _global_meta(target, args, kwargs)
        return DTensor.from_local(out, self.mesh, first.placements, run_check=False,
                                  shape=whole.shape, stride=whole.stride())

    def _batch_local(self, target, args, kwargs):
        """bmm of operands sharded alike on the batch dim (heads folded into it): per-rank bmm."""
        from torch.distributed.tensor import DTensor
        if target is not aten.bmm.default or not all(isinstance(a, DTensor) for a in args[:2]):
            return None
        a, b = args[:2]
        if a.placements != b.placements or not strided(a) or a.placements[0].dim != 0:
            return None
        local = aten.bmm.default(a.to_local(), b.to_local())
        shape = [a.shape[0], a.shape[1], b.shape[2]]
        return DTensor.from_local(local, self.mesh, a.placements, run_check=False, shape=torch.Size(shape),
                                  stride=make_contiguous_strides_for(shape))

    def _legacy_empty_cat(self, target, args, kwargs):
        """cat ignores 1-D empty operands (an empty KV cache); DTensor's rule does not: drop them."""
        if target is not aten.cat.default:
            return None
        kept = [t for t in args[0] if not (t.ndim == 1 and t.shape[0] == 0)]
        if len(kept) == len(args[0]) or not kept:
            return None
        return self.call_function(target, (kept, *args[1:]), kwargs)

    def _head_local(self, target, args, kwargs):
        """Attention kernels without a DTensor rule: independent per head, so head shards run locally.
        A whole operand beside head shards (OPT's output gradient reaches the attention backward
        replicated) is cut to this rank's heads, a local slice; a whole mask broadcast over the
        heads (dim 1 of size 1) is read whole."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        if target not in _HEAD_LOCAL_OPS:
            return None
        tensors = [a for a in args if isinstance(a, DTensor)]
        split = [a for a in tensors if a.placements[0] == Shard(1)]
        if not split:
            return None
        heads = split[0].shape[1]

        def local(a):
            if not isinstance(a, DTensor) or a.placements[0] == Shard(1):
                return _to_local(a)
            if a.placements[0] == Replicate() and a.ndim >= 2 and a.shape[1] == heads:
                return a.redistribute(self.mesh, [Shard(1)]).to_local()
            if a.placements[0] == Replicate() and a.ndim >= 2 and a.shape[1] == 1:
                return a.to_local()
            raise _NotHeadLocal
        try:
            locals_ = [local(a) for a in args]
        except _NotHeadLocal:
            return None
        outs = target(*locals_, **{k: _to_local(v) for k, v in kwargs.items()})
        wholes = _global_meta(target, args, kwargs)
        single = not isinstance(outs, (tuple, list))
        outs, wholes = ([outs], [wholes]) if single else (outs, wholes)
        placed = [DTensor.from_local(t, self.mesh, [Shard(1) if t.ndim > 1 else Shard(0)], run_check=False,
                                     shape=w.shape, stride=w.stride()) if isinstance(t, torch.Tensor) else t
                  for t, w in zip(outs, wholes)]
        return placed[0] if single else tuple(placed)

    def _origin_message(self, x, what: str) -> str:
        origin = self.origins.get(self.current)
        return (f"tensor_parallel: {what} at node {self.current.name} (module "
                f"'{self.current.meta.get(MODULE_PATH, '')}')" + (f", from parameter {origin}" if origin else ""))
