"""context_parallel: the sequence split over the mesh's ``cp`` axis, attention over the whole of it.

Every rank of a context-parallel group is fed the same (data-parallel) batch
and keeps ``1/cp`` of each sequence: the graph cuts its part of every batch
input's sequence dimension (dim 1) and from there the residual stream, the
projections, the MLP and the loss run on ``seq / cp`` tokens per rank. The
part is two chunks of ``seq / 2cp``, ``r`` and ``2cp - 1 - r`` (``_Layout``;
one contiguous chunk where ``2cp`` does not divide the sequence, or with
``balance=false``), so that under a causal mask every rank's queries see
as many keys. Only
attention needs the other ranks' tokens: before it, K and V are all-gathered
over ``cp`` (Llama 3's all-gather context parallelism); each rank computes
the attention of its query rows against every key, the mask's rows cut to
its positions. Under ``is_causal`` each chunk is computed against the keys up
to its own end only (the later ones are masked for all its queries), with
the explicit mask of its positions past the first chunk: the masked blocks
are skipped, and the balanced chunks give every rank the same work. In backward the
gradients of K and V, partial sums over the query chunks, are
reduce-scattered back to the chunks (under grouped-query attention at the kv
head count: gathered before the repeat to the query's heads, scattered after
its backward sums them back). Parameter gradients are partial sums
over the chunks and are all-reduced over ``cp`` where backward yields them
(``data_parallel`` then reduces them over ``dp``, as for any gradient). The
loss is exact: a mean cross-entropy is the all-reduced sum over the all-reduced
count of counted tokens (each rank's own mean would weigh the chunks' padding
wrongly).

The rewrite re-traces the captured step with every value a ``DTensor`` on a
1-D ``cp`` mesh (as ``tensor_parallel`` does on ``tp``): the batch inputs
are sequence shards, everything else replicated, and torch's sharding
propagation places every op; the rules below add what it lacks for a
sequence split:

- a flatten of ``[batch, seq, ...]`` (the tokens into a matmul or the loss)
  keeps the shard: each rank's rows are its own tokens, rank-major
  (``[b, s_local]``), and the inverse view puts the shard back on ``seq``.
  DTensor would gather the sequence instead. A redistribution of such a
  token-row shard in positional order (which is not the rank-major one when
  ``batch > 1``) is refused, never traced;
- the attention kernel (above), and ``nll_loss`` (above; DTensor's rule
  averages the chunks' means).

Refused: dropout inside attention (a random draw on a sequence-split value:
the ranks would draw other numbers than the single-process step), batch inputs of different sequence lengths or a
length ``cp`` does not divide, tensor-parallel sequence parallelism (both
split the sequence), and attention kernels other than the CPU flash
kernel's aten form that the captured step uses (``_scaled_dot_product_
flash_attention_for_cpu``: the capture decomposes SDPA into it on every
backend; an efficient/cudnn kernel would be refused by name).

With ``attention=ring`` a self-attention passes K and V round the cp ranks
instead (``_ring_attention``): each rank computes the blocks its chunks need
of the K and V it holds, passes them on with a functional
``all_to_all_single``, and merges each chunk's blocks by their log-sum-exps;
backward passes them round again with dK and dV travelling beside them, and
one more step hands those home. No rank holds the whole K and V. Under an
explicit mask each block reads the mask's columns of its keys, and a block's
row the mask hides entirely is weighed out of the merge.

The next step's K and V are issued before a step's blocks and waited for after
them, so the exchange overlaps the compute (dK and dV, which the blocks produce,
go after them). Masked blocks are skipped for ``is_causal``
only: an explicit mask is data, so a rank computes every block under it.
"""
from __future__ import annotations

import contextlib
import math
import operator
import warnings

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from graph_ir import TrainGraph
from graph_ir.analysis.effects import random_op
from graph_ir.analysis.expert_dispatch import EXITS, ROW_STATES, TOKENS, DispatchError, dispatch_regions
from graph_ir.analysis.gradients import GradientNotFound, find_gradients
from graph_ir.meta import MODULE_PATH, GraphAttr, region_of
from graph_ir.signature import InputKind

from ..pass_manager import PassContext, PassOptionError, register_pass
from .tensor_parallel.cleanup import finish
from .tensor_parallel.common import TensorParallelError
from .tensor_parallel.op_rules import _contiguous_strides, _global_meta
from .tensor_parallel.rewriter import _VIEW_OPS, Rewriter
from .tensor_parallel.tracing_mesh import tracing_mesh

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ATTR = GraphAttr.CONTEXT_PARALLEL

_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_OTHER_ATTENTION = tuple(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention") if hasattr(aten, name))
# Collectives of an earlier pass (tensor_parallel's, on its own group), run on each rank's tokens.
_LOCAL_COLLECTIVES = (c10d.all_reduce.default, c10d.wait_tensor.default, c10d.all_gather_into_tensor.default,
                      c10d.reduce_scatter_tensor.default)


# Values whose rows are all one row: an expand of a single row, a new constant buffer.
_UNIFORM_ROWS = (aten.expand.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
                 aten.new_empty.default)


# Ops that hand on their one input's value (a cast, a copy).
_SAME_VALUE = (aten._to_copy.default, aten.clone.default, aten.alias.default, aten.contiguous.default)


class ContextParallelError(ValueError):
    pass


@register_pass("context_parallel", preserves=())
def context_parallel_pass(graph: TrainGraph, ctx: PassContext, *, balance: bool = True,
                          attention: str = "gather", gradients: str = "reduced") -> TrainGraph:
    """Split every sequence over the mesh's ``cp`` axis; one per-rank graph with collectives.
    ``balance``: each rank holds two chunks of ``seq / 2cp`` tokens, ``r`` and ``2cp - 1 - r``
    (where ``2cp`` divides the sequence), so that causal attention gives every rank as many
    visible keys; otherwise one contiguous chunk. ``attention``: ``gather`` (K and V all-gathered)
    or ``ring`` (passed round the cp ranks, for attention without an explicit mask).
    ``gradients``: ``reduced`` (all-reduced over cp where backward yields them) or ``partial`` (each
    rank's part left for ``data_parallel`` to sum over dp and cp in one all-reduce; recorded as
    ``attrs['context_parallel']['partial_gradients']``)."""
    if attention not in ("gather", "ring"):
        raise PassOptionError("context_parallel", "attention", "must be 'gather' or 'ring'", attention)
    if gradients not in ("reduced", "partial"):
        raise PassOptionError("context_parallel", "gradients", "must be 'reduced' or 'partial'", gradients)
    mesh = getattr(ctx, "mesh", None)
    if mesh is None or "cp" not in mesh.axes:
        raise ContextParallelError("pass 'context_parallel' needs ctx.mesh (a mesh description with a 'cp' axis)")
    cp = int(mesh.size("cp"))
    if cp == 1:
        return graph
    for later in (GraphAttr.DATA_PARALLEL, GraphAttr.ZERO, GraphAttr.GRAD_ACCUMULATION):
        if later in graph.attrs:
            raise ContextParallelError(f"context_parallel must run before {later} (rule: the "
                                       "data-parallel and accumulation rewrites see the sequence split)")
    if graph.attrs.get(GraphAttr.TENSOR_PARALLEL, {}).get("sequence_parallel"):
        raise ContextParallelError("context_parallel with tensor_parallel's sequence_parallel: both split "
                                   "the sequence dimension; use one of them")
    seq = _sequence_length(graph, cp)
    group_name = mesh.group_name("cp")
    coord = int(mesh.local_rank("cp"))
    layout = _Layout(seq, cp, coord, balanced=bool(balance) and seq % (2 * cp) == 0)
    with tracing_mesh(group_name, cp, coord, getattr(mesh, "device_type", "cpu"), axis="cp") as device_mesh:
        traced_group = device_mesh.get_group(0).group_name
        gm = _retrace(graph, device_mesh, layout, ring=attention == "ring", partial=gradients == "partial")
    if attention == "ring" and not any(n.target is _ATTENTION for n in graph.graph.nodes):
        # (SDPA's math path, taken for some shapes and masks, is matmuls and a softmax: DTensor's
        # rules gather K for the score matmul as for any other contraction)
        warnings.warn("context_parallel attention=ring: this step has no fused attention kernel "
                      f"({_ATTENTION}) to pass K and V round the ring for: its attention's keys and "
                      "values are all-gathered", stacklevel=2)
    finish(gm, graph, traced_group, group_name, origin=ATTR)
    out = TrainGraph(gm, graph.signature, graph.attrs)
    out.attrs[ATTR] = {"cp": cp, "rank": coord, "seq": seq, "local_seq": seq // cp,
                       "chunks": [list(c) for c in layout.spans(coord)], "partial_gradients": gradients == "partial"}
    counts: dict[str, int] = {}
    for node in out.graph.nodes:
        if node.meta.get("origin_pass") == ATTR and node.target is not c10d.wait_tensor.default:
            name = f"{region_of(node)}.{node.target._overloadpacket.__name__}"
            counts[name] = counts.get(name, 0) + 1
    for name, n in counts.items():
        ctx.stat(name, n)
    return out


# What GQA's head repeat of K and V is made of (transformers' ``repeat_kv``: unsqueeze, expand,
# a copy, a view to the query's head count), and its backward (a view, the sum over the repeat).
_REPEAT_OPS = (aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten._unsafe_view.default,
               aten.view.default, aten.reshape.default)
_REPEAT_BACKWARD_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                        aten.sum.dim_IntList, aten.squeeze.dim)


def _kv_head_repeats(graph: torch.fx.Graph) -> tuple[set, dict, dict, set]:
    """Where K and V cross ranks at their own head count rather than the query's: the first node of
    each head repeat feeding the attention kernel (its input is gathered), per attention backward
    and key/value operand the repeat it reads (replayed there on a second gather), and per
    attention backward the key/value gradients left partial until the nodes where the repeat's
    backward has summed them back (there reduce-scattered). A repeat is recognised by its values alone: a chain
    of view-like ops with an expand, read only by itself and the attention kernels, from
    ``[b, kv, s, d]`` to ``[b, heads, s, d]``; with as many kv heads as heads there is none."""
    attention = {n for n in graph.nodes if n.target in (_ATTENTION, _ATTENTION_BACKWARD)}
    gather_before, chains, partial, scatter_after = set(), {}, {}, set()
    for node in attention:
        for i in ((1, 2) if node.target is _ATTENTION else (2, 3)):
            chain = _repeat_chain(node.args[i], attention)
            if chain:
                gather_before.add(chain[-1])
                if node.target is _ATTENTION_BACKWARD:
                    chains[(node, i)] = chain
        if node.target is _ATTENTION_BACKWARD:
            for user in node.users:
                if user.target is operator.getitem and user.args[1] in (1, 2):
                    end = _repeat_backward_end(user)
                    if end is not None:
                        partial.setdefault(node, set()).add(user.args[1])
                        scatter_after.add(end)
    return gather_before, chains, partial, scatter_after


def _shape(node) -> list[int] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return list(val.shape) if isinstance(val, torch.Tensor) else None


def _repeat_chain(value, attention: set) -> list:
    """The repeat's nodes from the kernel's operand back to the first (or [] when it is none)."""
    chain, node = [], value
    while isinstance(node, torch.fx.Node) and node.target in _REPEAT_OPS:
        chain.append(node)
        node = node.args[0]
    root, out = _shape(node), _shape(value)
    if not chain or root is None or out is None or len(root) != 4 or len(out) != 4 \
            or aten.expand.default not in {n.target for n in chain}:
        return []
    heads, kv = out[1], root[1]
    if kv >= heads or heads % kv or [root[0], root[2], root[3]] != [out[0], out[2], out[3]]:
        return []
    inside = set(chain) | attention
    if any(u not in inside for n in chain for u in n.users):
        return []
    return chain


def _repeat_backward_end(grad) -> torch.fx.Node | None:
    """The node where a repeated key's gradient ``[b, heads, s, d]`` is summed back to ``[b, kv, s, d]``."""
    start, node, summed = _shape(grad), grad, False
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target not in _REPEAT_BACKWARD_OPS:
            break
        summed = summed or user.target is aten.sum.dim_IntList
        node = user
        shape = _shape(node)
        if summed and shape is not None and len(shape) == 4 and start is not None \
                and [shape[0], shape[2], shape[3]] == [start[0], start[2], start[3]] and shape[1] < start[1]:
            return node
    return None


def _sequence_length(graph: TrainGraph, cp: int) -> int:
    """The one sequence length of the batch inputs (dim 1 of each with two or more dims)."""
    lengths = {}
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        val = node.meta.get("val")
        if spec.kind == InputKind.BATCH and isinstance(val, torch.Tensor) and val.ndim >= 2:
            lengths[spec.name] = int(val.shape[1])
    if not lengths:
        raise ContextParallelError("context_parallel: the step has no batch input with a sequence "
                                   "dimension (dim 1 of a [batch, seq, ...] tensor)")
    if len(set(lengths.values())) > 1:
        raise ContextParallelError(
            "context_parallel: the batch inputs' dim 1 must be one sequence length; they are "
            + ", ".join(f"{k}: {v}" for k, v in lengths.items()))
    seq = next(iter(lengths.values()))
    if seq % cp:
        raise ContextParallelError(f"context_parallel: sequence length {seq} (dim 1 of the batch inputs "
                                   f"{', '.join(lengths)}) is not divisible by cp={cp} (rule: cp splits "
                                   "token sequences laid out [batch, seq, ...]; an image's channel dim is not a sequence)")
    return seq


class _Layout:
    """Which positions of the sequence each cp rank holds. Balanced: the sequence in ``2cp`` chunks
    of ``L`` tokens, rank ``r`` holding chunks ``r`` and ``2cp - 1 - r`` (in that order), so that
    under a causal mask every rank's queries see as many keys (Llama 3's and torch's
    ``context_parallel`` head-tail split); otherwise chunk ``r`` of ``cp``.

    A value split over the sequence holds the rank's positions in this order. DTensor's own
    redistributions assume contiguous chunks; ``_sequence_redistribution`` adjusts the three that
    touch a sequence dim: a whole value cut to the rank's chunks, a gather put back in position
    order, and a partial sum reordered to the ranks' chunks before it is reduce-scattered."""

    def __init__(self, seq: int, cp: int, rank: int, balanced: bool):
        self.seq, self.cp, self.rank, self.balanced = seq, cp, rank, balanced
        self.chunk = seq // (2 * cp) if balanced else seq // cp
        # chunk indices in the order the ranks' shards lie one after another
        self.order = [c for r in range(cp) for c in self.chunks_of(r)]

    def chunks_of(self, rank: int) -> list[int]:
        return [rank, 2 * self.cp - 1 - rank] if self.balanced else [rank]

    def spans(self, rank: int) -> list[tuple[int, int]]:
        """The rank's positions as [start, end) spans, in its order."""
        return [(c * self.chunk, (c + 1) * self.chunk) for c in self.chunks_of(rank)]

    def _pieces(self, x, dim: int, chunks) -> torch.Tensor:
        parts = [aten.slice.Tensor(x, dim, c * self.chunk, (c + 1) * self.chunk) for c in chunks]
        return parts[0] if len(parts) == 1 else aten.cat.default(parts, dim)

    def local(self, whole, dim: int):
        """The rank's positions of a value whole along ``dim``."""
        return self._pieces(whole, dim, self.chunks_of(self.rank))

    def in_rank_order(self, whole, dim: int):
        """A value in position order laid out as the ranks' shards follow one another."""
        return self._pieces(whole, dim, self.order) if self.balanced else whole

    def in_position_order(self, gathered, dim: int):
        """The ranks' shards, gathered one after another, back in position order."""
        if not self.balanced:
            return gathered
        slot = {c: i for i, c in enumerate(self.order)}
        return self._pieces(gathered, dim, [slot[c] for c in range(2 * self.cp)])

    def positions(self, device) -> torch.Tensor:
        """The rank's positions, in its order (int64)."""
        parts = [aten.arange.start(a, b, dtype=torch.int64, device=device) for a, b in self.spans(self.rank)]
        return parts[0] if len(parts) == 1 else aten.cat.default(parts)


def _retrace(graph: TrainGraph, mesh, layout: "_Layout", ring: bool, partial: bool) -> torch.fx.GraphModule:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.fx.experimental.proxy_tensor import make_fx

    kinds = [spec.kind for spec in graph.signature.inputs]
    values = [n.meta["val"] for n in graph.placeholders()]
    try:
        gradients = find_gradients(graph, mark=False)
    except GradientNotFound:
        gradients = {}
    # Each gradient all-reduced over cp where backward yields it, so that what reads gradients
    # after this pass (clipping's norm, data_parallel's buckets) reads whole ones.
    whole = {node: Replicate() for node in gradients.values()}

    def step(*local):
        wrapped = []
        for t, v, kind in zip(local, values, kinds):
            if isinstance(v, torch.Tensor):
                t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                if kind == InputKind.BATCH and v.ndim >= 2:
                    t = t.redistribute(mesh, [Shard(1)])   # (a local slice: every rank has the batch)
            wrapped.append(t)
        with implicit_replication():
            outs = _Rewriter(graph.gm, mesh, layout, whole, ring, partial).run(*wrapped)
        return [o.redistribute(mesh, [Replicate()]).to_local() if isinstance(o, DTensor) else o for o in outs]

    # (lazy, as tensor_parallel's retrace: the code is generated when the graph runs)
    with torch.no_grad(), fx_traceback.preserve_node_meta(), _sequence_redistribution(layout), \
            _use_lazy_graph_module(True):
        return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*values)


class _Rewriter(Rewriter):
    """tensor_parallel's interpreter (its op rules, its tags on every traced node) with the rules
    of a sequence split tried first."""

    def __init__(self, gm, mesh, layout: _Layout, grad_places: dict, ring: bool = False, partial: bool = False):
        super().__init__(gm, mesh, sequence_parallel=False, origins={}, grad_places=grad_places)
        self.layout, self.seq, self.cp, self.ring, self.partial = layout, layout.seq, mesh.size(0), ring, partial
        self._masks: dict = {}
        # (ring attention passes K and V as the kernel reads them, after any head repeat)
        self._gather_before, self._repeats, self._partial_grads, self._scatter_after = (
            (set(), {}, {}, set()) if ring else _kv_head_repeats(gm.graph))
        self._kv_shards: dict = {}   # first node of a head repeat -> the K or V chunk it read
        try:
            self._dispatch = dispatch_regions(gm.graph)
        except DispatchError as exc:
            raise ContextParallelError(f"context_parallel: {exc}") from None

    def _reduce_shared_partial(self, n, out):
        if self.partial and n in self.grad_places:
            return out   # (the gradient's part is this rank's to hand on, below)
        return super()._reduce_shared_partial(n, out)

    def _as_param_shard(self, n, out):
        """``partial``: a gradient leaves as this rank's part of the sum over cp, for data_parallel to
        sum over dp and cp at once. One DTensor has already summed (whole on every rank) is handed
        on as its cp-th part, so the sum over cp gives it back."""
        from torch.distributed.tensor import DTensor, Replicate
        if not (self.partial and n in self.grad_places and isinstance(out, DTensor)):
            return super()._as_param_shard(n, out)
        if out.placements[0].is_partial():
            local = out.to_local()
        elif out.placements[0].is_replicate():
            local = aten.div.Tensor(out.to_local(), self.cp)
        else:
            raise self._refuse(n.target, f"a gradient placed {out.placements[0]} over cp")
        return DTensor.from_local(local, self.mesh, [Replicate()], run_check=False)

    def call_function(self, target, args, kwargs):
        from torch.distributed.tensor import DTensor, Replicate
        node = self.current
        if node in self._dispatch:
            return self._on_own_rows(target, args, kwargs)
        if node in self._gather_before and isinstance(args[0], DTensor):
            # K or V gathered at their own head count, before GQA's repeat to the query's
            self._kv_shards[node] = args[0]
            args = (args[0].redistribute(self.mesh, [Replicate()]), *args[1:])
        out = self._call_function(target, args, kwargs)
        if node in self._scatter_after:
            out = self._scattered(out, node)
        return out

    def _call_function(self, target, args, kwargs):
        for rule in (self._local_collective, self._strided_split, self._attention, self._attention_backward, self._loss,
                     self._loss_backward, self._token_view, self._empty_cat, self._rows_summed_into,
                     self._uniform_rows):
            out = rule(target, args, kwargs)
            if out is not None:
                return out
        if target in _OTHER_ATTENTION and _sharded(args[0]):
            raise self._refuse(target, "only the CPU flash attention kernel's aten form is split over the "
                                       "sequence (the captured step's own attention op)")
        if random_op(target) and any(_sharded(a) for a in args):
            raise self._refuse(target, f"a random draw ({target}) on a value split over the sequence: each "
                                       "rank would draw other numbers than the single-process step (a dropout "
                                       "mask); train with dropout 0")
        args = self._uniform_operands(target, args)
        try:
            return super().call_function(target, args, kwargs)
        except TensorParallelError as exc:   # (the shared interpreter's refusal, in this pass' name)
            raise ContextParallelError(str(exc).replace("tensor_parallel:", "context_parallel:", 1)) from None

    def _refuse(self, target, why: str) -> ContextParallelError:
        node = self.current
        return ContextParallelError(f"context_parallel: node {node.name} ({target}, module "
                                    f"'{node.meta.get(MODULE_PATH, '')}'): {why}")

    def _placed(self, local, placement, like):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local, self.mesh, [placement], run_check=False, shape=like.shape,
                                  stride=like.stride())

    def _uniform_rows(self, target, args, kwargs):
        """A value with the same row repeated as many times as there are token rows, read beside
        token rows: a whole value expanded from one row (a gradient broadcast over the tokens), or
        a new constant buffer. Each rank's share is as many of those rows as it holds tokens,
        whatever their order; DTensor would make it whole and then have to cut it in position order."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        if target not in _UNIFORM_ROWS or not isinstance(args[0], DTensor):
            return None
        x, size = args[0], list(args[1])
        if size[0] % self.cp or size[0] < self.seq:
            return None
        if target is aten.expand.default:
            lead = len(size) - x.ndim
            if x.placements[0].is_shard() or lead < 0 or (lead == 0 and x.shape[0] != 1):
                return None
        node = self.current
        if not self._read_beside_token_rows(node):
            return None
        if target is aten.expand.default and x.placements[0].is_partial():
            x = x.redistribute(self.mesh, [Replicate()])   # (a per-expert sum: each row needs the whole)
        local = target(x.to_local(), [size[0] // self.cp, *size[1:]], *args[2:], **kwargs)
        return self._placed(local, Shard(0), node.meta["val"])

    def _uniform_operands(self, target, args):
        """A pointwise op's whole operand whose rows are all one row (``_uniform_rows``: an expand
        of a single row, through casts), beside token rows: cut to as many of its rows as the
        rank holds tokens. (``_uniform_rows`` places it so where its reader comes later in the
        graph than a token-row operand; here the token rows came later.)"""
        from torch.distributed.tensor import DTensor, Shard
        if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags):
            return args
        rows = next((a.shape[0] for a in args if _sharded(a, 0)), None)
        if rows is None:
            return args
        out = list(args)
        for i, (a, source) in enumerate(zip(args, self.current.args)):
            if isinstance(a, DTensor) and a.placements[0].is_replicate() and a.ndim and a.shape[0] == rows \
                    and rows % self.cp == 0 and _one_row_expanded(source):
                local = aten.slice.Tensor(a.to_local(), 0, 0, rows // self.cp)
                out[i] = self._placed(local, Shard(0), source.meta["val"])
        return tuple(out)

    def _read_beside_token_rows(self, node, depth: int = 3) -> bool:
        """Whether a reader of ``node`` (or of a cast or copy of it: autocast's) also reads a value
        already placed as token rows."""
        frontier = [node]
        for _ in range(depth):
            readers = [u for n in frontier for u in n.users]
            if any(_sharded(self.env.get(a), 0) for u in readers for a in u.all_input_nodes if a not in frontier):
                return True
            frontier = [u for u in readers if len(u.all_input_nodes) == 1 and u.target in _SAME_VALUE]
        return False

    def _rows_summed_into(self, target, args, kwargs):
        """``scatter_add`` / ``index_add`` along dim 0 of token rows into a whole buffer (a count of
        tokens per expert): each rank adds its rows into zeros, a partial sum over cp, and the
        buffer's own value is added once. The order of the rows does not matter to a sum."""
        from torch.distributed.tensor import DTensor, Partial, Replicate
        if target not in (aten.scatter_add.default, aten.index_add.default):
            return None
        dest, dim, index, src = args[:4]
        if dim % max(src.ndim, 1) != 0 or not (_sharded(index, 0) and _sharded(src, 0)) \
                or (isinstance(dest, DTensor) and not dest.placements[0].is_replicate()):
            return None
        if target is aten.scatter_add.default and index.shape != src.shape:
            return None
        whole = dest.to_local() if isinstance(dest, DTensor) else dest
        local = target(aten.zeros_like.default(whole), 0, index.to_local(), src.to_local(), *args[4:], **kwargs)
        summed = self._placed(local, Partial(), self.current.meta["val"])
        return aten.add.Tensor(dest if isinstance(dest, DTensor) else
                               DTensor.from_local(dest, self.mesh, [Replicate()], run_check=False), summed)

    # -- a mixture of experts' dispatch ------------------------------------------------------------
    def _on_own_rows(self, target, args, kwargs):
        """A node of an expert dispatch (``graph_ir.analysis.expert_dispatch``), run on this rank's
        token rows alone: the region is row-equivariant, so its sort, counts and grouped matmuls
        over the rank's rows give each of them the single-process value. Its values stay local
        tensors; what leaves it in token order is this rank's token rows again (``Shard(0)``), a
        weight gradient this rank's part of the sum over cp (``Partial``)."""
        from torch.distributed.tensor import DTensor, Partial, Shard
        from torch.utils._pytree import tree_map
        node = self.current
        state = self._dispatch[node]

        def local(a):
            if not isinstance(a, DTensor):
                return a
            place = a.placements[0]
            if place == Shard(0) or (place.is_replicate() and not _row_valued(a, node)):
                return a.to_local()
            raise self._refuse(target, f"an expert dispatch reads a value placed {place} over cp whose dim 0 "
                                       "is rows; it runs on this rank's token rows (Shard(0)) only")

        args, kwargs = tree_map(local, (args, kwargs))
        if state in ROW_STATES:
            args, kwargs = self._local_sizes(node, args, kwargs)
        out = target(*args, **kwargs)
        if state == TOKENS:
            return self._placed(out, Shard(0), node.meta["val"])
        if state in EXITS:
            return self._placed(out, Partial(), node.meta["val"])
        return out

    def _local_sizes(self, node, args, kwargs):
        """A size the graph spells with the whole's row count (a view's, a new buffer's, an
        ``arange``'s end), in this rank's rows."""
        rows = node.meta["val"].shape[0]
        if rows % self.cp:
            raise self._refuse(node.target, f"an expert dispatch over {rows} rows, which cp={self.cp} does not divide")
        mine = rows // self.cp
        if node.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            at = 0 if node.target is aten.arange.default else 1
            return (*args[:at], mine, *args[at + 1:]), kwargs
        at = next((i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and a and all(
            isinstance(x, int) for x in a)), None)
        if at is not None and args[at][0] == rows:
            args = (*args[:at], [mine, *args[at][1:]], *args[at + 1:])
        return args, kwargs

    # -- the tokens ---------------------------------------------------------------------------------
    def _token_view(self, target, args, kwargs):
        """A view of a sequence shard that flattens ``seq`` behind a dim > 1 (``[b, s] -> [b*s]``)
        keeps it sharded as rank-major token rows; the inverse split puts the shard back on the
        dim of length ``seq``. A replicated value flattened so is cut to the sequence first, so
        that its rows line up with the sharded ones (the labels against the logits)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        if target not in _VIEW_OPS or not isinstance(args[0], DTensor):
            return None
        x = args[0]
        src, dst = list(x.shape), list(self.current.meta["val"].shape)
        place = x.placements[0]
        if place == Replicate():
            dim = _flattened_sequence(src, dst, self.seq)
            if dim is None:
                return None
            x, place = x.redistribute(self.mesh, [Shard(dim)]), Shard(dim)
        if type(place) is not Shard:
            return None
        group = _group_of(src, dst, place.dim)
        if group is None:
            return None
        from_dims, to_dims = group
        if len(from_dims) > 1 and len(to_dims) == 1 and _behind_rows(src, from_dims, place.dim):
            out_dim = to_dims[0]
        elif len(from_dims) == 1 and len(to_dims) > 1:
            out_dim = next((d for d in to_dims[1:] if dst[d] == self.seq and _behind_rows(dst, to_dims, d)),
                           None)
            if out_dim is None:
                return None
        else:
            return None
        local_shape = list(dst)
        local_shape[out_dim] //= self.cp
        local = target(x.to_local(), local_shape)
        return self._placed(local, Shard(out_dim), self.current.meta["val"])

    def _empty_cat(self, target, args, kwargs):
        """cat of one tensor and 1-D empty ones (an empty KV cache) is that tensor, placement kept."""
        if target is not aten.cat.default:
            return None
        kept = [t for t in args[0] if not (t.ndim == 1 and t.shape[0] == 0)]
        if len(kept) != 1 or len(kept) == len(args[0]):
            return None
        return aten.clone.default(kept[0])

    # -- attention ----------------------------------------------------------------------------------
    def _attention(self, target, args, kwargs):
        from torch.distributed.tensor import Shard
        if target is not _ATTENTION or not _sharded(args[0], 2):
            return None
        q, k, v = args[:3]
        dropout = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
        causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        self._no_dropout(target, dropout)
        whole = _global_meta(target, args, kwargs)
        if self._on_ring(causal, kwargs, k):
            mask = self._mask_rows(kwargs.get("attn_mask"), False, q, k)
            out, lse = self._ring_attention(target, q, k, v, causal, kwargs.get("scale"), mask)
        elif self._prefix_only(causal, kwargs, k):
            q, k, v = q.to_local(), self._gathered(k), self._gathered(v)
            outs, lses = [], []
            for part in self._causal_parts():
                blocks = [target(part.rows(q), block.of(k), block.of(v), 0.0, block.causal, scale=kwargs.get("scale"))
                          for block in part.blocks]
                o, lse = _merged(blocks)
                outs.append(o)
                lses.append(lse)
            out, lse = _cat_sequence(outs), (lses[0] if len(lses) == 1 else aten.cat.default(lses, 2))
        else:
            mask = self._mask_rows(kwargs.get("attn_mask"), causal, q, k)
            out, lse = target(q.to_local(), self._gathered(k), self._gathered(v), 0.0, False, attn_mask=mask,
                              scale=kwargs.get("scale"))
        return self._placed(out, Shard(2), whole[0]), self._placed(lse, Shard(2), whole[1])

    # -- ring attention -----------------------------------------------------------------------------
    def _on_ring(self, causal: bool, kwargs, k) -> bool:
        """Ring attention: self-attention over the whole sequence (the blocks a rank skips under
        ``is_causal`` are known from the positions alone; under an explicit mask it computes every
        block, each with the mask's columns of the keys it holds)."""
        return self.ring and k.shape[2] == self.seq and not (causal and kwargs.get("attn_mask") is not None)

    def _block_mask(self, mask, i: int, source: int, j: int):
        """The mask of query chunk ``i`` (of this rank's rows) against key chunk ``j`` of ``source``'s."""
        if mask is None:
            return None
        if mask.shape[-2] != 1:
            mask = self._chunk(mask, i, mask.ndim - 2)
        start, end = self.layout.spans(source)[j]
        return aten.slice.Tensor(mask, mask.ndim - 1, start, end)

    def _ring_blocks(self, source: int, causal: bool):
        """(query chunk, key chunk, diagonal) of the blocks to compute while holding ``source``'s
        K and V: under ``is_causal`` a key chunk before the query chunk whole, the chunk itself
        causally, and a later one not at all."""
        for i, a in enumerate(self.layout.chunks_of(self.layout.rank)):
            for j, b in enumerate(self.layout.chunks_of(source)):
                if not causal or b < a:
                    yield i, j, False
                elif b == a:
                    yield i, j, True

    def _chunk(self, t, i: int, dim: int = 2):
        return aten.slice.Tensor(t, dim, i * self.layout.chunk, (i + 1) * self.layout.chunk)

    def _ring_pass(self, t):
        """``t`` sent to the next cp rank; the previous rank's, received (one step round the ring)."""
        return self._ring_receive(self._ring_send(t))

    def _ring_send(self, t):
        """One step round the ring issued and not waited for: what runs before ``_ring_receive``
        (the blocks of the K and V held) overlaps the exchange."""
        n, r = t.numel(), self.layout.rank
        send, receive = [0] * self.cp, [0] * self.cp
        send[(r + 1) % self.cp], receive[(r - 1) % self.cp] = n, n
        flat = aten.view.default(aten.clone.default(t, memory_format=torch.contiguous_format), [n])
        return c10d.all_to_all_single.default(flat, receive, send, self.mesh.get_group(0).group_name), list(t.shape)

    def _ring_receive(self, sent):
        moved, shape = sent
        return aten.view.default(c10d.wait_tensor.default(moved), shape)

    def _ring_attention(self, target, q, k, v, causal: bool, scale, mask=None):
        """This rank's query chunks against every rank's K and V, passed round the ring: at step t
        the rank holds rank ``r - t``'s, computes the blocks it needs and passes them on; each
        chunk's blocks are merged by their log-sum-exps. No rank holds more than two ranks' K and V.
        ``mask``: this rank's rows of an explicit mask over every key, cut per block."""
        q, k, v = q.to_local(), self._local(k, 2), self._local(v, 2)
        blocks: list[list] = [[] for _ in self.layout.chunks_of(self.layout.rank)]
        for step in range(self.cp):
            source = (self.layout.rank - step) % self.cp
            # (the next K and V are on their way while this step's blocks run)
            sent = (self._ring_send(k), self._ring_send(v)) if step < self.cp - 1 else None
            for i, j, diagonal in self._ring_blocks(source, causal):
                block_mask = self._block_mask(mask, i, source, j)
                o, lse = target(self._chunk(q, i), self._chunk(k, j), self._chunk(v, j), 0.0, diagonal,
                                attn_mask=block_mask, scale=scale)
                blocks[i].append((o, _without_masked_rows(lse, block_mask)))
            if sent is not None:
                k, v = (self._ring_receive(t) for t in sent)
        parts = [_merged(b, hidden_rows=mask is not None) for b in blocks]
        lses = [lse for _, lse in parts]
        return _cat_sequence([o for o, _ in parts]), (lses[0] if len(lses) == 1 else aten.cat.default(lses, 2))

    def _ring_attention_backward(self, target, grad, q, k, v, out, lse, causal: bool, scale, mask=None):
        """The blocks again, round the ring: dQ summed on the rank; each rank's dK and dV travel
        with its K and V, every holder adding its queries' share, and a last step hands them home."""
        grad, q, out, lse = self._local(grad, 2), q.to_local(), self._local(out, 2), self._local(lse, 2)
        k, v = self._local(k, 2), self._local(v, 2)
        chunks = len(self.layout.chunks_of(self.layout.rank))
        dq: list = [None] * chunks
        dk = dv = None   # laid out [b, s_local, h, d], as they travel
        for step in range(self.cp):
            source = (self.layout.rank - step) % self.cp
            sent = (self._ring_send(k), self._ring_send(v)) if step < self.cp - 1 else None
            for i, j, diagonal in self._ring_blocks(source, causal):
                dq_block, dk_block, dv_block = target(
                    self._chunk(grad, i), self._chunk(q, i), self._chunk(k, j), self._chunk(v, j),
                    self._chunk(out, i), self._chunk(lse, i), 0.0, diagonal,
                    attn_mask=self._block_mask(mask, i, source, j), scale=scale)
                dq[i] = dq_block if dq[i] is None else aten.add.Tensor(dq[i], dq_block)
                dk_block, dv_block = (self._in_chunk(t, j, chunks) for t in (dk_block, dv_block))
                dk = dk_block if dk is None else aten.add.Tensor(dk, dk_block)
                dv = dv_block if dv is None else aten.add.Tensor(dv, dv_block)
            if sent is not None:
                k, v = (self._ring_receive(t) for t in sent)
            dk, dv = self._ring_pass(dk), self._ring_pass(dv)
        return _cat_sequence(dq), aten.transpose.int(dk, 1, 2), aten.transpose.int(dv, 1, 2)

    def _in_chunk(self, grad, j: int, chunks: int):
        """A key chunk's gradient ``[b, h, L, d]`` placed at chunk ``j`` of ``chunks``, as ``[b, chunks * L, h, d]``."""
        return _padded_keys(grad, j * self.layout.chunk, chunks * self.layout.chunk)

    def _prefix_only(self, causal: bool, kwargs, k) -> bool:
        """Whether each of the rank's chunks attends to the keys up to its own end only: under
        ``is_causal`` the later keys are masked for every one of its queries."""
        return bool(causal) and kwargs.get("attn_mask") is None and k.shape[2] == self.seq

    def _causal_parts(self) -> list["_CausalPart"]:
        return [_CausalPart(i * self.layout.chunk, start, end)
                for i, (start, end) in enumerate(self.layout.spans(self.layout.rank))]

    def _attention_backward(self, target, args, kwargs):
        from torch.distributed.tensor import Partial, Shard
        if target is not _ATTENTION_BACKWARD or not _sharded(args[1], 2):
            return None
        grad, q, k, v, out, lse, dropout, causal = args[:8]
        self._no_dropout(target, dropout)
        k, v = (self._repeated_again(self._repeats.get((self.current, i)), t) for i, t in ((2, k), (3, v)))
        if self._on_ring(causal, kwargs, k):
            mask = self._mask_rows(kwargs.get("attn_mask"), False, q, k)
            dq, dk, dv = self._ring_attention_backward(target, grad, q, k, v, out, lse, causal, kwargs.get("scale"),
                                                       mask)
            whole = _global_meta(target, args, kwargs)
            return tuple(self._placed(t, Shard(2), w) for t, w in zip((dq, dk, dv), whole))
        if self._prefix_only(causal, kwargs, k):
            grad, q, out, lse = self._local(grad, 2), q.to_local(), self._local(out, 2), self._local(lse, 2)
            k, v = self._gathered(k), self._gathered(v)
            # (a block's gradients from the whole row's output and log-sum-exp are its exact share)
            dqs, dk, dv = [], None, None
            for part in self._causal_parts():
                dq = None
                for block in part.blocks:
                    dq_block, dk_block, dv_block = target(
                        part.rows(grad), part.rows(q), block.of(k), block.of(v), part.rows(out), part.rows(lse),
                        0.0, block.causal, scale=kwargs.get("scale"))
                    dq = dq_block if dq is None else aten.add.Tensor(dq, dq_block)
                    dk_block, dv_block = block.spread(dk_block, self.seq), block.spread(dv_block, self.seq)
                    dk = dk_block if dk is None else aten.add.Tensor(dk, dk_block)
                    dv = dv_block if dv is None else aten.add.Tensor(dv, dv_block)
                dqs.append(dq)
            dq = _cat_sequence(dqs)
        else:
            mask = self._mask_rows(kwargs.get("attn_mask"), causal, q, k)
            dq, dk, dv = target(self._local(grad, 2), q.to_local(), self._gathered(k), self._gathered(v),
                                self._local(out, 2), self._local(lse, 2), 0.0, False, attn_mask=mask,
                                scale=kwargs.get("scale"))
        whole = _global_meta(target, args, kwargs)
        # Each rank's query rows give a partial sum of every key's gradient: reduce-scattered to the
        # chunks here (left partial, a reader of one chunk would take another rank's rows' share),
        # or, after GQA's repeat, once its backward has summed them to the kv head count.
        later = self._partial_grads.get(self.current, ())
        dk, dv = (self._placed(t, Partial(), w) if i in later else
                  self._laid_out_as(self._placed(t, Partial(), w).redistribute(self.mesh, [Shard(2)]), w)
                  for i, t, w in ((1, dk, whole[1]), (2, dv, whole[2])))
        return self._placed(dq, Shard(2), whole[0]), dk, dv

    def _repeated_again(self, chain, repeated):
        """GQA's repeated K (or V) for an attention backward: gathered again from the rank's chunk
        and repeated again, as the kernel's own operand is gathered again without the repeat, so
        the whole K and V are not kept from forward to backward."""
        from torch.distributed.tensor import Replicate
        shard = self._kv_shards.get(chain[-1]) if chain else None
        if shard is None:
            return repeated
        x, backward = shard.redistribute(self.mesh, [Replicate()]), self.current
        try:
            for node in reversed(chain):
                self.current = node   # (the rules read the op's whole value; the traced nodes keep backward's tags)
                rest = torch.fx.node.map_arg(node.args[1:], lambda a: self.env[a])
                x = self._call_function(node.target, (x, *rest), torch.fx.node.map_arg(node.kwargs, lambda a: self.env[a]))
        finally:
            self.current = backward
        return x

    def _scattered(self, out, node):
        """A key's (or value's) gradient summed back to its own heads, reduce-scattered to the chunks."""
        from torch.distributed.tensor import DTensor, Partial, Shard
        if not isinstance(out, DTensor) or not isinstance(out.placements[0], Partial):
            return out
        return self._laid_out_as(out.redistribute(self.mesh, [Shard(2)]), node.meta["val"])

    def _laid_out_as(self, t, like):
        """``t`` with its local tensor in ``like``'s dim order (a reduce-scatter returns it
        contiguous; the kernel's gradients are [b, s, h, d] in memory, and the graph views them so)."""
        order = sorted(range(like.ndim), key=lambda d: (-like.stride()[d], d))
        local = t.to_local()
        if list(order) == list(range(like.ndim)):
            return t
        inverse = [order.index(d) for d in range(like.ndim)]
        local = aten.permute.default(aten.clone.default(aten.permute.default(local, order),
                                                        memory_format=torch.contiguous_format), inverse)
        return self._placed(local, t.placements[0], like)

    def _no_dropout(self, target, p):
        if p:
            raise self._refuse(target, f"attention dropout (p={p}) under context parallelism: each rank would "
                                       "draw its own mask for its query rows; train with attention dropout 0")

    def _gathered(self, t):
        from torch.distributed.tensor import DTensor, Replicate
        return t.redistribute(self.mesh, [Replicate()]).to_local() if isinstance(t, DTensor) else t

    def _local(self, t, dim: int):
        from torch.distributed.tensor import DTensor, Shard
        return t.redistribute(self.mesh, [Shard(dim)]).to_local() if isinstance(t, DTensor) else t

    def _mask_rows(self, mask, causal: bool, q, k):
        """This rank's query rows of the mask (``is_causal``: of the causal mask it stands for), cut
        once per mask: every layer's attention, forward and backward, reads the same rows (cut per
        call, each layer would hold its own copy, and recompute would save each one)."""
        key = (id(mask), causal, q.shape[2], k.shape[2])
        if key not in self._masks:
            self._masks[key] = (mask, self._cut_mask_rows(mask, causal, q, k))   # (the mask kept: its id stays)
        return self._masks[key][1]

    def _cut_mask_rows(self, mask, causal: bool, q, k):
        from torch.distributed.tensor import DTensor, Replicate, Shard
        if causal:
            if mask is not None:
                raise self._refuse(_ATTENTION, "attention with both a mask and is_causal")
            # (torch's is_causal is the top-left aligned mask: query i sees keys 0..i)
            return _causal_mask(self.layout.positions(q.device), k.shape[2], q.dtype)
        if mask is None:
            return None
        if mask.ndim < 2 or mask.shape[-2] == 1:   # broadcast over the query rows
            return self._gathered(mask)
        if isinstance(mask, DTensor):
            if mask.placements[0] != Replicate() and mask.placements[0] != Shard(mask.ndim - 2):
                mask = mask.redistribute(self.mesh, [Replicate()])
            return mask.redistribute(self.mesh, [Shard(mask.ndim - 2)]).to_local()
        return self.layout.local(mask, mask.ndim - 2)

    # -- the loss -----------------------------------------------------------------------------------
    def _loss(self, target, args, kwargs):
        """nll_loss over token rows split across ranks: the sum and the count of counted tokens are
        all-reduced, the mean is their ratio (the single-process mean, padding and all)."""
        from torch.distributed.tensor import Partial, Replicate, Shard
        if target is not aten.nll_loss_forward.default or not _sharded(args[0], 0):
            return None
        x, labels, weight, reduction, ignore_index = args[:5]
        labels = self._local(labels, 0)
        if reduction == 0:   # none: one loss per token, on its rank
            out, count = target(x.to_local(), labels, self._gathered(weight), 0, ignore_index)
            whole = _global_meta(target, args, kwargs)
            return self._placed(out, Shard(0), whole[0]), self._placed(count, Replicate(), whole[1])
        total, count = target(x.to_local(), labels, self._gathered(weight), 2, ignore_index)
        whole = _global_meta(target, args, kwargs)
        total = self._placed(total, Partial(), whole[0]).redistribute(self.mesh, [Replicate()])
        count = self._placed(count, Partial(), whole[1]).redistribute(self.mesh, [Replicate()])
        return (total / count if reduction == 1 else total), count

    def _loss_backward(self, target, args, kwargs):
        from torch.distributed.tensor import Shard
        if target is not aten.nll_loss_backward.default or not _sharded(args[1], 0):
            return None
        grad, x, labels, weight, reduction, ignore_index, count = args[:7]
        local = target(self._gathered(grad) if reduction else self._local(grad, 0), x.to_local(),
                       self._local(labels, 0), self._gathered(weight), reduction, ignore_index, self._gathered(count))
        return self._placed(local, Shard(0), _global_meta(target, args, kwargs))

    # -- collectives already in the graph -----------------------------------------------------------
    def _local_collective(self, target, args, kwargs):
        """tensor_parallel's collectives (on the tp group) act on each rank's own tokens. A tp
        all-gather of token rows stacks the tp ranks' rows of this chunk: the result is each tp
        part's cp shard (``_StridedShard``), which the split after it takes apart and a
        reduce-scatter folds back."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        if target not in _LOCAL_COLLECTIVES or not isinstance(args[0], DTensor):
            return None
        x = args[0]
        place, out_place = x.placements[0], x.placements[0]
        local = target(x.to_local(), *args[1:], **kwargs)
        shape = list(x.shape)
        if target is c10d.all_gather_into_tensor.default:
            shape[0] = x.shape[0] * args[1]
            if type(place) is Shard and place.dim == 0:
                out_place = _StridedShard(0, split_factor=args[1])
            elif place != Replicate() and not (type(place) is Shard):
                raise self._refuse(target, f"a tensor-parallel all-gather of a value placed {place} over cp")
        elif target is c10d.reduce_scatter_tensor.default:
            shape[0] = x.shape[0] // args[2]
            if isinstance(place, _StridedShard) and place.dim == 0 and place.split_factor == args[2]:
                out_place = Shard(0)
            elif place != Replicate() and not (type(place) is Shard and place.dim != 0):
                raise self._refuse(target, f"a tensor-parallel reduce-scatter of a value placed {place} over cp")
        return DTensor.from_local(local, self.mesh, [out_place], run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_strides(shape))

    def _strided_split(self, target, args, kwargs):
        """The parts of a stacked tp gather (above), each this rank's token rows of its part."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        if target not in (aten.split.Tensor, aten.split_with_sizes.default) or not isinstance(args[0], DTensor) \
                or not isinstance(args[0].placements[0], _StridedShard):
            return None
        x, sizes = args[0], args[1]
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
        place = x.placements[0]
        parts = [sizes] * (x.shape[dim] // sizes) if isinstance(sizes, int) else list(sizes)
        if dim != place.dim or len(parts) != place.split_factor or len(set(parts)) != 1:
            raise self._refuse(target, f"a split into {parts} of a stacked tensor-parallel gather "
                                       f"({place.split_factor} parts along dim {place.dim})")
        pieces = aten.split.Tensor(x.to_local(), x.to_local().shape[dim] // len(parts), dim)
        whole = list(x.shape)
        whole[dim] = parts[0]
        return [DTensor.from_local(p, self.mesh, [Shard(dim)], run_check=False, shape=torch.Size(whole),
                                   stride=_contiguous_strides(whole)) for p in pieces]


def _causal_mask(rows, keys: int, dtype) -> torch.Tensor:
    """The additive mask (0 or -inf, in the query's dtype, as SDPA hands a boolean mask to its
    kernel) under which the query at position ``rows[i]`` sees keys ``0 .. rows[i]`` of ``keys``."""
    visible = aten.le.Tensor(aten.arange.default(keys, dtype=torch.int64, device=rows.device).view(1, keys),
                             rows.view(-1, 1))
    mask = aten.where.Scalar(visible, 0.0, float("-inf"))
    return mask if mask.dtype == dtype else aten._to_copy.default(mask, dtype=dtype)


class _KeyBlock:
    """Keys ``start .. end`` of one chunk's attention: all visible to its queries, or (``causal``)
    the diagonal block, where ``is_causal``'s top-left alignment is the chunk's own mask."""

    def __init__(self, start: int, end: int, causal: bool):
        self.start, self.end, self.causal = start, end, causal

    def of(self, t):
        return t if (self.start, self.end) == (0, t.shape[2]) else aten.slice.Tensor(t, 2, self.start, self.end)

    def spread(self, grad, seq: int):
        """A gradient of these keys ``[b, h, n, d]`` (laid out ``[b, n, h, d]``) as one of all
        ``seq`` keys, zeros elsewhere, in the same layout."""
        if (self.start, self.end) == (0, seq):
            return grad
        return aten.transpose.int(_padded_keys(grad, self.start, seq), 1, 2)


def _padded_keys(grad, start: int, keys: int) -> torch.Tensor:
    """A gradient of ``n`` keys from ``start``, ``[b, h, n, d]`` (laid out ``[b, n, h, d]``), as one of
    ``keys`` keys in that memory order, ``[b, keys, h, d]``, zeros elsewhere."""
    return aten.constant_pad_nd.default(aten.transpose.int(grad, 1, 2),
                                        [0, 0, 0, 0, start, keys - start - grad.shape[2]])


class _CausalPart:
    """One of the rank's chunks under ``is_causal``: its rows of the local queries (from ``offset``)
    at positions ``start .. end``, and the keys they see: ``0 .. start`` all, ``start .. end``
    causally. No mask is built, and the keys after ``end`` are not computed at all."""

    def __init__(self, offset: int, start: int, end: int):
        self.offset, self.count = offset, end - start
        self.blocks = ([_KeyBlock(0, start, False)] if start else []) + [_KeyBlock(start, end, True)]

    def rows(self, t):
        return aten.slice.Tensor(t, 2, self.offset, self.offset + self.count)


def _without_masked_rows(lse, mask):
    """A block's log-sum-exp, ``-inf`` on the query rows its mask hides every key from: the CPU
    kernel gives such a row an output of 0 and a log-sum-exp of 0, which merged would weigh as
    ``exp(0)`` of real attention."""
    if mask is None:
        return lse
    hidden = aten.eq.Scalar(aten.amax.default(mask, [-1], True), float("-inf"))      # [b, h|1, s, 1]
    hidden = aten.expand.default(aten.squeeze.dim(hidden, -1), list(lse.shape))
    return aten.where.self(hidden, aten.full_like.default(lse, float("-inf")), lse)


def _finite(lse):
    """A merged log-sum-exp with the rows every block hid (``-inf``) at 0, the whole kernel's value."""
    return aten.where.self(aten.isinf.default(lse), aten.zeros_like.default(lse), lse)


def _merged(blocks: list, hidden_rows: bool = False) -> tuple:
    """One attention from its key blocks' (output, log-sum-exp) pairs: the outputs weighed by
    ``exp(lse_block - lse)``, ``lse`` the log-sum-exp of the blocks' (in fp32, the kernel's lse dtype;
    the output back in the kernel's dtype and ``[b, s, h, d]`` layout). ``hidden_rows``: a block's
    log-sum-exp may be ``-inf`` (a masked row), every block's on a row no key is visible to, whose
    merged log-sum-exp is then 0 and its output 0, as the whole kernel gives them."""
    if len(blocks) == 1 and not hidden_rows:
        return blocks[0]
    lse = blocks[0][1]
    for _, other in blocks[1:]:
        lse = aten.logaddexp.default(lse, other)
    if hidden_rows:
        lse = _finite(lse)
    out = None
    for o, block_lse in blocks:
        weight = aten.unsqueeze.default(aten.transpose.int(aten.exp.default(aten.sub.Tensor(block_lse, lse)), 1, 2), -1)
        term = aten.mul.Tensor(aten.transpose.int(o, 1, 2), weight)   # [b, s, h, d]
        out = term if out is None else aten.add.Tensor(out, term)
    if out.dtype != blocks[0][0].dtype:
        out = aten._to_copy.default(out, dtype=blocks[0][0].dtype)
    return aten.transpose.int(out, 1, 2), lse


def _cat_sequence(parts: list) -> torch.Tensor:
    """Attention outputs (or query gradients) ``[b, h, s, d]`` laid out ``[b, s, h, d]`` in memory,
    as the kernel gives them, joined along the sequence in that layout."""
    if len(parts) == 1:
        return parts[0]
    joined = aten.cat.default([aten.transpose.int(p, 1, 2) for p in parts], 1)
    return aten.transpose.int(joined, 1, 2)


def _one_row_expanded(node) -> bool:
    """Whether ``node`` is an expand of a single row (through casts and copies of it)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _SAME_VALUE:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target is aten.expand.default):
        return False
    source, size = node.args[0].meta.get("val"), list(node.args[1])
    return isinstance(source, torch.Tensor) and (source.ndim < len(size) or source.shape[0] == 1)


def _row_valued(t, node) -> bool:
    """Whether a value read by an expert dispatch's node has one element per row of it."""
    val = node.meta.get("val")
    rows = val.shape[0] if isinstance(val, torch.Tensor) and val.ndim else None
    return rows is not None and t.ndim >= 1 and t.shape[0] == rows and rows > 1


def _sharded(t, dim: int | None = None) -> bool:
    from torch.distributed.tensor import DTensor, Shard
    return isinstance(t, DTensor) and type(t.placements[0]) is Shard and (dim is None or t.placements[0].dim == dim)


def _groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """The view's dims in groups of equal element count (size-1 dims join their neighbour's)."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        a, b, pa, pb = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                a.append(i)
                pa *= src[i]
                i += 1
            else:
                b.append(j)
                pb *= dst[j]
                j += 1
        groups.append((a, b))
    if groups:
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


def _group_of(src, dst, dim: int):
    if math.prod(src) != math.prod(dst) or 0 in src:
        return None
    return next((g for g in _groups(src, dst) if dim in g[0]), None)


def _behind_rows(shape, dims, dim: int) -> bool:
    """``dim`` follows a dim > 1 in its group: flattened, its shard's rows are rank-major."""
    return math.prod(shape[d] for d in dims if d < dim) > 1


def _flattened_sequence(src, dst, seq: int) -> int | None:
    """The dim of length ``seq`` (not the first) that this view flattens behind a dim > 1."""
    for d in range(1, len(src)):
        if src[d] == seq:
            group = _group_of(src, dst, d)
            if group and len(group[0]) > 1 and len(group[1]) == 1 and _behind_rows(src, group[0], d):
                return d
    return None


@contextlib.contextmanager
def _sequence_redistribution(layout: _Layout):
    """DTensor's redistributions as the sequence is laid out (``_Layout``), and refused from or to
    a shard of token rows (a dim of ``batch * seq`` tokens, ``batch * seq / cp`` per rank):
    DTensor orders shards by position, the rows here are rank-major, and the two differ when the
    batch has more than one row."""
    from torch.distributed.tensor import Shard
    seq = layout.seq
    import torch.distributed.tensor._dispatch as dispatch
    import torch.distributed.tensor._redistribute as redistribute

    original = redistribute.redistribute_local_tensor

    def guarded(local, current_spec, target_spec, *args, **kwargs):
        for spec in (current_spec, target_spec):
            for p in spec.placements:
                # (a dim of batch x seq tokens; a shard DTensor puts on another dim, heads say, is
                # positional and moves as any)
                if current_spec.placements != target_spec.placements and p.is_shard() \
                        and spec.shape[p.dim] % seq == 0 and spec.shape[p.dim] > seq:
                    raise ContextParallelError(
                        f"context_parallel: an op needs a value of shape {tuple(spec.shape)} moved from "
                        f"{current_spec.placements[0]} to {target_spec.placements[0]}; its dim {p.dim} holds "
                        "token rows of the split sequence, which are rank-major, not in position order (no "
                        "rule places this op on a sequence split)")
        if not layout.balanced:
            return original(local, current_spec, target_spec, *args, **kwargs)
        source, target = current_spec.placements[0], target_spec.placements[0]
        along = [p.dim for p, spec in ((source, current_spec), (target, target_spec))
                 if type(p) is Shard and spec.shape[p.dim] == seq]
        if source == target or not along:
            return original(local, current_spec, target_spec, *args, **kwargs)
        if type(source) is Shard and type(target) is Shard:   # (through the whole value)
            whole = guarded(local, current_spec, _replicated(current_spec), *args, **kwargs)
            return guarded(whole, _replicated(current_spec), target_spec, *args, **kwargs)
        if type(target) is Shard and source.is_replicate():
            return layout.local(local, target.dim)
        if type(target) is Shard and source.is_partial():
            return original(layout.in_rank_order(local, target.dim), current_spec, target_spec, *args, **kwargs)
        if type(source) is Shard and target.is_replicate():
            return layout.in_position_order(original(local, current_spec, target_spec, *args, **kwargs),
                                            source.dim)
        raise ContextParallelError(f"context_parallel: a value of shape {tuple(current_spec.shape)} split "
                                   f"over the sequence moved from {source} to {target}")

    dispatch.redistribute_local_tensor = redistribute.redistribute_local_tensor = guarded
    try:
        yield
    finally:
        dispatch.redistribute_local_tensor = redistribute.redistribute_local_tensor = original


def _replicated(spec):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    return DTensorSpec(spec.mesh, (Replicate(),), spec.tensor_meta)
