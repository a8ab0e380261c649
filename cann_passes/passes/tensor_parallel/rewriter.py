"""The interpreter that runs the captured graph on DTensors, with Megatron's layouts where
torch's sharding propagation would choose otherwise."""
from __future__ import annotations

import torch
import torch.fx
import torch.fx.traceback as fx_traceback

from graph_ir import TrainGraph
from graph_ir.analysis.effects import draws_random, random_op
from graph_ir.meta import MODULE_PATH, RECOMPUTE, REGION
from graph_ir.signature import InputKind

from .common import TensorParallelError, aten
from .op_rules import OpRules, is_pointwise
from .placements import all_partial, strided

_WEIGHT_VIEWS = (aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
                 aten.clone.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
                 aten.reshape.default)

# DTensor places these by decomposing them: on operands split other than by heads the
# decomposition's search does not end, so such operands are refused here, at once, naming the rule.
_ATTENTION_OPS = tuple(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, name))

_ATTENTION_BACKWARD_OPS = tuple(getattr(aten, f"{op._overloadpacket.__name__}_backward").default
                                for op in _ATTENTION_OPS if hasattr(aten, f"{op._overloadpacket.__name__}_backward"))

_VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)

_LAYOUT_OPS = (aten.t.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
               aten.reshape.default, aten.alias.default)


class Rewriter(torch.fx.Interpreter, OpRules):
    """Runs the captured graph on DTensors; the extra rules torch's registry lacks live here."""

    def __init__(self, gm, mesh, *, sequence_parallel: bool, origins: dict, grad_places: dict | None = None,
                 weights: set | None = None, whole_grads: set | None = None):
        super().__init__(gm, garbage_collect_values=False)   # (_whole reads a view's input later)
        self.mesh, self.sp, self.origins = mesh, sequence_parallel, origins
        self.grad_places = grad_places or {}
        self.whole_grads = whole_grads or set()     # whole parameters' gradients: a split one is gathered
        self.weights = weights or set()
        self.vocab_backwards = _vocab_embedding_backwards(gm.graph, self.weights)
        self.product_places = _weight_gradient_products(self.grad_places)
        self.tp = mesh.size(0)

    def run_node(self, n):
        # The source node's tags travel to every node traced for it (make_fx copies "custom").
        n.meta["custom"] = {REGION: n.meta.get(REGION), MODULE_PATH: n.meta.get(MODULE_PATH, ""),
                            RECOMPUTE: n.meta.get(RECOMPUTE)}
        self.current = n
        try:
            out = super().run_node(n)
            with fx_traceback.set_current_meta(n):
                return self._as_param_shard(n, self._shard_random(n, self._reduce_shared_partial(n, out)))
        finally:
            n.meta.pop("custom", None)

    def _as_param_shard(self, n, out):
        """A split parameter's gradient takes the parameter's placement where backward yields it
        (a partial sum is reduce-scattered, a whole one cut), so the optimizer, and ZeRO over dp
        after it, read this rank's shard; left to the optimizer's first op, the cut would be
        traced there, after some whole-gradient arithmetic. A whole parameter's gradient that
        backward yields split (the weight of a norm over a column-parallel projection's output
        features, as OLMoE's q_norm) is gathered there too, not after the update; a partial sum
        of it is left to the reduction DTensor places."""
        from torch.distributed.tensor import DTensor, Replicate
        want = self.grad_places.get(n)
        if want is None and n in self.whole_grads and isinstance(out, DTensor) and out.placements[0].is_shard():
            want = Replicate()
        if want is None or not isinstance(out, DTensor) or out.placements[0] == want or strided(out):
            return out
        return out.redistribute(self.mesh, [want])

    def _shard_random(self, n, out):
        """A random draw (a dropout mask) is made whole on every rank, so its numbers are the
        single-process ones; it is cut to the shard of the value it multiplies right away, so
        only the shard lives on (and is saved for backward)."""
        from torch.distributed.tensor import DTensor, Replicate
        if not (isinstance(out, torch.Tensor) and out.ndim > 0 and random_op(n.target)):
            return out
        if not isinstance(out, DTensor):   # drawn from a factory: the same on every rank
            out = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
        elif out.placements[0] != Replicate():
            return out
        frontier = [n]
        for _ in range(4):   # through the mask's scaling and casts to the op that applies it
            frontier = [u for f in frontier for u in f.users
                        if is_pointwise(u.target) or u.target is aten._to_copy.default]
            for user in frontier:
                for other in (self.env.get(a) for a in user.all_input_nodes):
                    if isinstance(other, DTensor) and other.shape == out.shape \
                            and other.placements[0].is_shard() and not strided(other):
                        return out.redistribute(self.mesh, other.placements)
        return out

    def _reduce_shared_partial(self, n, out):
        """A partial sum read by several ops is reduced once, here, rather than once per reader (or
        carried partial through one reader and reduced again after it)."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        if not (isinstance(out, DTensor) and isinstance(out.placements[0], Partial) and len(n.users) > 1):
            return out
        if self.sp and out.ndim == 3 and out.shape[1] % self.tp == 0:
            return out.redistribute(self.mesh, [Shard(1)])
        return out.redistribute(self.mesh, [Replicate()])

    def call_function(self, target, args, kwargs):
        from torch.distributed.tensor import DTensor, Replicate
        if self.sp and not (target in (aten.add.Tensor, aten.sub.Tensor) and all_partial(args)):
            # (a sum of partial sums stays partial: q/k/v's input gradients are reduced once)
            args = tuple(self._sequence_shard(a) for a in args)
        args = self._megatron_operands(target, args)
        args = self._replicated_kv_heads(target, args)
        if target in _ATTENTION_OPS and not _whole_heads(args[:3]):
            raise self._cannot_run(target, args[:3], TensorParallelError(
                "attention's query, key and value must be split alike by whole heads (dim 1) or not "
                "at all; a split of the head features means the projection's rule does not cut its "
                "output into whole heads (a rule 'column:N' cuts it in N contiguous parts; a projection "
                "that interleaves q, k and v per head, as GPT-NeoX's query_key_value, takes plain "
                "'column')"))
        out = self.local_rule(target, args, kwargs)
        if out is not None:
            return out
        try:
            try:
                out = super().call_function(target, args, kwargs)
            except Exception:
                if target in _VIEW_OPS and isinstance(args[0], DTensor) and args[0].placements[0].is_shard():
                    # A view DTensor cannot cut (a query-head shard of replicated kv heads' gradient
                    # unflattened to [kv heads, repeats], fewer kv heads than ranks): view it whole.
                    return super().call_function(target, (args[0].redistribute(self.mesh, [Replicate()]),
                                                          *args[1:]), kwargs)
                if not any(strided(a) for a in args):
                    raise
                # DTensor cannot move a per-part shard; move the other operands instead (a
                # sequence shard read by a fused projection's weight gradient: gather it).
                args = tuple(a.redistribute(self.mesh, [Replicate()])
                             if isinstance(a, DTensor) and not strided(a) and a.placements[0].is_shard()
                             else a for a in args)
                out = super().call_function(target, args, kwargs)
            if strided(out) and out.ndim == 2 and not any(strided(a) for a in args):
                # A flatten into a matmul operand of a shard on a non-leading dim (the sequence-
                # sharded residual viewed [batch*seq, hidden]): gather it first, as Megatron's SP does.
                args = tuple(a.redistribute(self.mesh, [Replicate()]) if isinstance(a, DTensor) else a
                             for a in args)
                out = super().call_function(target, args, kwargs)
            return out
        except TensorParallelError:
            raise
        except Exception as exc:
            out = self._replicated(target, args, kwargs)
            if out is None:
                raise self._cannot_run(target, args, exc) from None
            return out

    def _replicated(self, target, args, kwargs):
        """An op DTensor cannot place, on whole values only: every rank runs it on its whole local
        copies and holds the same whole result, which is what a replicated value is. So run
        transformers' grouped expert matmul (a custom op with no sharding strategy) and an
        integer ``histc`` (DTensor checks it as if on the mesh's device type, CPU here, whose
        kernel takes floats only; the model's own device took the integer path), and an attention
        whose projections no rule split (BART's cross-attention). Not for an op that draws random
        numbers (its draws would differ per rank) nor for any split or partial operand."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.utils._pytree import tree_flatten, tree_map
        if draws_random(self.current) or not all(a.placements[0] == Replicate()
                                         for a in tree_flatten((args, kwargs))[0] if isinstance(a, DTensor)):
            return None

        def local(a):
            return a.to_local() if isinstance(a, DTensor) else a

        def whole(t):
            return DTensor.from_local(t, self.mesh, [Replicate()], run_check=False) \
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
        return tree_map(whole, target(*tree_map(local, args), **tree_map(local, kwargs)))

    def _replicated_kv_heads(self, target, args):
        """Replicated kv heads (fewer kv heads than tp ranks, see ``layouts.check_heads``): after
        GQA's head repeat K and V are whole, and each rank cuts the heads of its query shard from
        them (no communication), in forward and in the attention's backward."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        first = 0 if target in _ATTENTION_OPS else 1 if target in _ATTENTION_BACKWARD_OPS else None
        if first is None:
            return args
        q, k, v = args[first:first + 3]
        if not (isinstance(q, DTensor) and q.placements[0] == Shard(1)) or not all(
                isinstance(t, DTensor) and t.placements[0] == Replicate() and t.shape[1] == q.shape[1]
                for t in (k, v)):
            return args
        k, v = (t.redistribute(self.mesh, [Shard(1)]) for t in (k, v))
        return (*args[:first + 1], k, v, *args[first + 3:])

    def _cannot_run(self, target, args, exc: Exception) -> TensorParallelError:
        from torch.distributed.tensor import DTensor
        placed = [f"{tuple(a.shape)} {a.placements[0]}" for a in args if isinstance(a, DTensor)]
        origin = self.origins.get(self.current)
        return TensorParallelError(
            f"tensor_parallel: node {self.current.name} ({target}, module "
            f"'{self.current.meta.get(MODULE_PATH, '')}') cannot run on inputs placed "
            f"{', '.join(placed) or 'replicated'}" + (f" (split by the rule of parameter '{origin}')"
                                                      if origin else "")
            + f": {type(exc).__name__}: {str(exc).splitlines()[0]}")

    def _megatron_operands(self, target, args):
        """Megatron's layout for a projection's products: the weight shard never moves; the
        activation does. DTensor's mm strategy is chosen by the bytes each redistribution moves,
        so where a weight shard is smaller than a sequence-sharded activation (GQA's K and V
        projections at 70B scale: 1/8 of the q projection) it would gather the weight and lay
        out K and V as sequence shards over every kv head, and a weight gradient as a partial
        sum of the whole weight (one all-reduce of all of it). So:

        - a weight sharded on its output features (column-parallel ``x @ W.T``; a row-parallel
          weight in its input gradient ``g @ W``) is multiplied by the whole other operand:
          a sequence shard is all-gathered (Megatron's sequence-parallel all-gather);
        - a product that is (a view of) a split parameter's gradient is computed as that
          parameter's shard: each operand is laid out so the product is local
          (``Shard(0)`` = (S(0), R), ``Shard(1)`` = (R, S(1))), never a partial sum of it.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard
        if target not in (aten.mm.default, aten.addmm.default):
            return args
        off = 1 if target is aten.addmm.default else 0
        a, b = args[off:off + 2]
        if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
            return args
        na, nb = self.current.args[off:off + 2]
        want = self.product_places.get(self.current)
        if want is not None and not strided(a) and not strided(b):
            place = {0: (Shard(0), Replicate()), 1: (Replicate(), Shard(1))}.get(want.dim)
            if place is None:
                return args
            a, b = (v if v.placements[0] == p else self._whole(n, v) if p == Replicate()
                    else v.redistribute(self.mesh, [p]) for n, v, p in zip((na, nb), (a, b), place))
        elif nb in self.weights and b.placements[0].is_shard(1) and a.placements[0].is_shard():
            a = self._whole(na, a)
        elif na in self.weights and a.placements[0].is_shard(0) and b.placements[0].is_shard():
            b = self._whole(nb, b)
        else:
            return args
        return (*args[:off], a, b, *args[off + 2:])

    def _whole(self, node, value):
        """``value`` all-gathered. Through layout-only ops (views, transposes) the input is gathered
        and the op applied to the whole copy, so each of q/k/v's views of one normed hidden
        state, and a gradient read transposed by the weight's gradient and as it is by the
        input's, is gathered once."""
        from torch.distributed.tensor import DTensor, Replicate
        if isinstance(node, torch.fx.Node) and node.target in _LAYOUT_OPS and node.args \
                and isinstance(node.args[0], torch.fx.Node) and not any(
                    isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
            source = self.env.get(node.args[0])
            if isinstance(source, DTensor) and source.placements[0].is_shard() and not strided(source):
                return node.target(self._whole(node.args[0], source), *node.args[1:], **node.kwargs)
        return value.redistribute(self.mesh, [Replicate()])

    # Sequence parallelism: a partial sum of the residual stream ([batch, seq, hidden]) is
    # reduce-scattered onto the sequence rather than all-reduced; the next column-parallel
    # matmul all-gathers it back (DTensor's mm rules), the norms between run on the shard.
    def _sequence_shard(self, a):
        from torch.distributed.tensor import DTensor, Partial, Shard
        if isinstance(a, DTensor) and a.ndim == 3 and isinstance(a.placements[0], Partial) \
                and a.shape[1] % self.tp == 0:
            return a.redistribute(self.mesh, [Shard(1)])
        return a


def weight_nodes(graph: TrainGraph) -> set:
    """Parameters and what reads them unchanged but for layout or dtype (transposes, casts, views)."""
    found = {n for spec, n in zip(graph.signature.inputs, graph.placeholders()) if spec.kind == InputKind.PARAM}
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in _WEIGHT_VIEWS and node.args and node.args[0] in found:
            found.add(node)
    return found


def _vocab_embedding_backwards(graph: torch.fx.Graph, weights: set) -> dict:
    """embedding_dense_backward -> the (view of the) weight its forward embedding read (same ids)."""
    found = {}
    for node in graph.nodes:
        if node.target is aten.embedding_dense_backward.default and len(node.args) > 1 \
                and isinstance(node.args[1], torch.fx.Node):
            forward = [u for u in node.args[1].users if u.target is aten.embedding.default and u.args[0] in weights]
            if len(forward) == 1:
                found[node] = forward[0].args[0]
    return found


def _weight_gradient_products(grad_places: dict) -> dict:
    """The matmul each split parameter's gradient is (a transpose, cast or view of), with the
    placement the gradient must have, carried back through the transposes."""
    from torch.distributed.tensor import Shard
    products = {}
    for node, place in grad_places.items():
        if not isinstance(place, Shard) or type(place) is not Shard:
            continue
        dim, ndim = place.dim, node.meta["val"].ndim
        while node.target in _WEIGHT_VIEWS and ndim == 2 and node.args[0].meta["val"].ndim == 2:
            if node.target in (aten.t.default, aten.transpose.int, aten.permute.default):
                dim = 1 - dim
            elif node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) \
                    and tuple(node.meta["val"].shape) != tuple(node.args[0].meta["val"].shape):
                break
            node = node.args[0]
        if node.target in (aten.mm.default, aten.addmm.default) and ndim == 2:
            products[node] = Shard(dim)
    return products


def _whole_heads(qkv) -> bool:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    places = {a.placements[0] if isinstance(a, DTensor) else Replicate() for a in qkv}
    return len(places) == 1 and places.pop() in (Replicate(), Shard(1))
