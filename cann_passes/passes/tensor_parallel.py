"""tensor_parallel: Megatron tensor parallelism, by rewriting the whole captured step per rank.

Which parameters are split comes from rules on parameter paths (built in for
the recipe GPT, transformers' GPT-2, LLaMA / Mistral / Qwen2 and BERT, or the
user's own): *column* splits a projection's output features (q/k/v, fc1,
gate/up), *row* its input features (out-proj, fc2, down), *vocab* an
embedding's rows; a fused projection (GPT-2's ``c_attn``, the recipe's
``qkv``) is split per part (``column:3``: each rank holds its heads of q, k
and v). Which dimension of a weight holds the output features is read from
the graph, not from the module's type: a weight the forward transposes
before a matmul (``nn.Linear``) has them in dim 0, one used as it is (GPT-2's
``Conv1D``) in dim 1.

The rewrite re-traces the captured step with every input as a ``DTensor`` on
the tensor-parallel mesh axis: torch's own sharding propagation (the op
strategy registry of ``torch.distributed.tensor``) gives every value's
placement op by op, through forward, backward and the optimizer; a
collective is traced only where an op needs a layout its input does not
have (a partial sum read as a whole: all-reduce; a shard read whole:
all-gather); view and reshape sizes become the local ones (heads, and GQA's
kv heads, split across ranks); the optimizer updates each rank's shard. The
result is an ordinary per-rank aten graph with functional collectives. A few
rules are added where DTensor's are missing or too eager (see
:class:`_Rewriter`): fused projections' per-part shards, elementwise ops on
identically placed operands, attention on head-sharded inputs, one
collective per value and layout (a value read in forward and again in
backward is reduced once), and Megatron's layout for a projection's products
where DTensor's cheapest strategy differs: a weight shard never moves (the
activation is gathered, so GQA's small K and V projections keep their kv
heads) and a weight's gradient is computed as its shard, never as a partial
sum of the whole weight. A vocab-parallel embedding's gradient is computed for
the rank's rows only.

With ``sequence_parallel`` the residual stream between the tensor-parallel
regions is sharded on the sequence dimension (norms and dropout run on
``1/tp`` of the tokens): a partial sum becomes a reduce-scatter and a
column-parallel input an all-gather. With ``vocab_parallel_loss`` the
cross-entropy runs on vocabulary-sharded logits (DTensor's loss-parallel
rules): the logits are never gathered.

Tracing needs a ``DeviceMesh``: in a process with live process groups it is
the tensor-parallel group named by ``ctx.mesh``; otherwise a private "fake"
process group of the same size and rank (nothing is communicated while
tracing). The collectives in the result name the mesh description's group.
"""
from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._prims_common import make_contiguous_strides_for

from graph_ir import TrainGraph
from graph_ir.analysis.gradients import GradientNotFound, find_gradients
from graph_ir.meta import GRADIENT_OF, MODULE_PATH, RECOMPUTE, REGION, Region, region_of
from graph_ir.placement import RANDOM_PIECE, Placement, set_placement
from graph_ir.signature import InputKind, OutputKind, Spec, split_state_name

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

STYLES = ("column", "row", "vocab", "replicate")
ATTR = "tensor_parallel"


class TensorParallelError(ValueError):
    pass


# -- rules --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """Parameters under modules matching ``pattern`` (fnmatch on the module path) are split by ``style``."""

    pattern: str
    style: str
    parts: int = 1

    def __str__(self) -> str:
        return f"{self.pattern}={self.style}" + (f":{self.parts}" if self.parts > 1 else "")


def parse_rules(text: str) -> list[Rule]:
    """``pattern=style[:parts];...`` (the pass option's text form)."""
    rules = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        pattern, sep, style = item.rpartition("=")
        style, _, parts = style.partition(":")
        if not sep or not pattern or style not in STYLES:
            raise TensorParallelError(f"tensor_parallel rule {item!r}: expected pattern=style[:parts] "
                                      f"with style one of {', '.join(STYLES)}")
        if parts and (not parts.isdigit() or int(parts) < 1):
            raise TensorParallelError(f"tensor_parallel rule {item!r}: parts must be an integer >= 1")
        rules.append(Rule(pattern.strip(), style, int(parts or 1)))
    return rules


def format_rules(rules: Iterable[Rule]) -> str:
    return ";".join(map(str, rules))


# Built-in rule sets: (family, a parameter name that identifies it, rules). Module paths, as
# named_parameters spells them minus the trailing ".weight"/".bias".
BUILTIN_RULES: tuple[tuple[str, str, str], ...] = (
    ("recipe-gpt", "*layers.*.attn.qkv.weight",
     "*layers.*.attn.qkv=column:3;*layers.*.attn.proj=row;*layers.*.mlp.fc1=column;"
     "*layers.*.mlp.fc2=row;wte=vocab;lm_head=column"),
    ("gpt2", "*.attn.c_attn.weight",
     "*.h.*.attn.c_attn=column:3;*.h.*.attn.c_proj=row;*.h.*.mlp.c_fc=column;*.h.*.mlp.c_proj=row;"
     "*wte=vocab;lm_head=column"),
    ("llama", "*.self_attn.q_proj.weight",
     "*.self_attn.q_proj=column;*.self_attn.k_proj=column;*.self_attn.v_proj=column;"
     "*.self_attn.o_proj=row;*.mlp.gate_proj=column;*.mlp.up_proj=column;*.mlp.down_proj=row;"
     "*embed_tokens=vocab;lm_head=column"),
    ("bert", "*.attention.self.query.weight",
     "*.attention.self.query=column;*.attention.self.key=column;*.attention.self.value=column;"
     "*.attention.output.dense=row;*.intermediate.dense=column;*.layer.*.output.dense=row;"
     "*word_embeddings=vocab"),
)


def builtin_rules(param_names: Iterable[str]) -> tuple[str, list[Rule]]:
    names = list(param_names)
    for family, marker, text in BUILTIN_RULES:
        if any(fnmatch.fnmatchcase(n, marker) for n in names):
            return family, parse_rules(text)
    return "none", []


# -- which parameter is split how -----------------------------------------------------------------

@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is split over the tp ranks: ``dim`` (None: replicated), in ``parts`` blocks."""

    name: str
    dim: int | None
    parts: int
    rule: str

    def to_json(self) -> dict:
        return {"dim": self.dim, "parts": self.parts, "rule": self.rule}


def _module_and_leaf(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _feature_dims(graph: TrainGraph, name: str) -> tuple[int, int] | None:
    """(output-feature dim, input-feature dim) of a 2-D weight, from how the forward reads it."""
    node = graph.input_node(InputKind.PARAM, name)
    users = list(node.users)
    while users:
        user = users.pop(0)
        if region_of(user) != Region.FORWARD:
            continue
        if user.target in _CASTS:   # autocast's copy of the weight in the compute dtype
            users.extend(user.users)
            continue
        if user.target in (aten.t.default, aten.permute.default, aten.transpose.int):
            return 0, 1          # y = x @ W.T  (nn.Linear: [out, in])
        if user.target in (aten.mm.default, aten.addmm.default, aten.matmul.default):
            return 1, 0          # y = x @ W    (Conv1D: [in, out])
        if user.target is aten.embedding.default:
            return 1, 0          # rows are the vocabulary
    return None


_CASTS = (aten._to_copy.default, aten.clone.default, aten.alias.default)


def assign_layouts(graph: TrainGraph, rules: list[Rule], tp: int, *, user_rules: Iterable[Rule] = ()
                   ) -> dict[str, ParamLayout]:
    """Every parameter's layout; refuses a user rule that matches nothing and sizes tp does not divide."""
    params = [s.name for _, s in graph.signature.inputs_of(InputKind.PARAM)]
    matched: set[Rule] = set()
    layouts = {}
    for name in params:
        module, leaf = _module_and_leaf(name)
        rule = next((r for r in rules if fnmatch.fnmatchcase(module, r.pattern)), None)
        layouts[name] = _layout_of(graph, name, leaf, rule, tp)
        if rule is not None:
            matched.add(rule)
    for rule in user_rules:
        if rule not in matched:
            raise TensorParallelError(f"tensor_parallel rule '{rule}' matches no parameter "
                                      f"(parameters look like {', '.join(params[:3])}, ...)")
    return layouts


def _reads_as_embedding(node: torch.fx.Node) -> bool:
    return any(u.target is aten.embedding.default or (u.target in _CASTS and _reads_as_embedding(u))
               for u in node.users)


def _layout_of(graph: TrainGraph, name: str, leaf: str, rule: Rule | None, tp: int) -> ParamLayout:
    val = graph.input_node(InputKind.PARAM, name).meta["val"]
    if rule is None or rule.style == "replicate":
        return ParamLayout(name, None, 1, str(rule) if rule else "")
    if val.ndim == 2:
        dims = _feature_dims(graph, name)
        if dims is None:
            raise TensorParallelError(f"parameter '{name}' (rule '{rule}'): the forward reads it neither "
                                      "as a matmul weight nor as an embedding table, so its feature "
                                      "dimensions are unknown (rule: split only projections and embeddings)")
        out_dim, in_dim = dims
        dim = {"column": out_dim, "vocab": 0, "row": in_dim}[rule.style]
        if rule.style == "vocab" and not _reads_as_embedding(graph.input_node(InputKind.PARAM, name)):
            dim = out_dim  # an output head under a vocab rule: its vocabulary is the output features
    elif val.ndim == 1:
        if rule.style == "row":  # a row-parallel bias is added once, after the reduction
            return ParamLayout(name, None, 1, str(rule))
        dim = 0
    else:
        raise TensorParallelError(f"parameter '{name}' (rule '{rule}') has {val.ndim} dimensions; "
                                  "tensor parallelism splits 1-D and 2-D parameters only")
    size, parts = val.shape[dim], rule.parts
    if size % (parts * tp):
        what = "vocabulary" if rule.style == "vocab" else "output features" if rule.style == "column" \
            else "input features"
        raise TensorParallelError(
            f"parameter '{name}' (rule '{rule}'): its {what} {size} along dim {dim}"
            + (f" in {parts} parts" if parts > 1 else "") + f" is not divisible by tp={tp}")
    return ParamLayout(name, dim, parts, str(rule))


# -- the mesh for tracing ---------------------------------------------------------------------------

@contextlib.contextmanager
def _tracing_mesh(group_name: str, size: int, coord: int, device_type: str):
    """A 1-D DeviceMesh for DTensor's propagation: the live group if there is one, else a fake one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _resolve_process_group
        try:
            group = _resolve_process_group(group_name)
        except Exception:
            group = None
        if group is None:
            raise TensorParallelError(
                f"tensor_parallel: process groups are live but none is named '{group_name}' (the mesh "
                "description's tp group); compile with the run's own mesh description")
        yield DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=coord, world_size=size)
    try:
        yield init_device_mesh(device_type, (size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


# -- the rewrite --------------------------------------------------------------------------------------

def _dtensor_placement(layout: ParamLayout | None):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if layout is None or layout.dim is None:
        return Replicate()
    if layout.parts > 1:
        return _StridedShard(layout.dim, split_factor=layout.parts)
    return Shard(layout.dim)


def _local_shape(shape, placement, size: int) -> list[int]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    shape = list(shape)
    if isinstance(placement, (Shard, _StridedShard)):
        shape[placement.dim] //= size
    return shape


def _is_pointwise(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


_HEAD_LOCAL_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


class _Rewriter(torch.fx.Interpreter):
    """Runs the captured graph on DTensors; the extra rules torch's registry lacks live here."""

    def __init__(self, gm, mesh, *, sequence_parallel: bool, origins: dict, grad_places: dict | None = None,
                 weights: set | None = None):
        super().__init__(gm, garbage_collect_values=False)   # (_whole reads a view's input later)
        self.mesh, self.sp, self.origins = mesh, sequence_parallel, origins
        self.grad_places = grad_places or {}
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
        traced there, after some whole-gradient arithmetic."""
        from torch.distributed.tensor import DTensor
        want = self.grad_places.get(n)
        if want is None or not isinstance(out, DTensor) or out.placements[0] == want or _strided(out):
            return out
        return out.redistribute(self.mesh, [want])

    def _shard_random(self, n, out):
        """A random draw (a dropout mask) is made whole on every rank, so its numbers are the
        single-process ones; it is cut to the shard of the value it multiplies right away, so
        only the shard lives on (and is saved for backward)."""
        from torch.distributed.tensor import DTensor, Replicate
        if not (isinstance(out, torch.Tensor) and out.ndim > 0
                and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())):
            return out
        if not isinstance(out, DTensor):   # drawn from a factory: the same on every rank
            out = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
        elif out.placements[0] != Replicate():
            return out
        frontier = [n]
        for _ in range(4):   # through the mask's scaling and casts to the op that applies it
            frontier = [u for f in frontier for u in f.users
                        if _is_pointwise(u.target) or u.target is aten._to_copy.default]
            for user in frontier:
                for other in (self.env.get(a) for a in user.all_input_nodes):
                    if isinstance(other, DTensor) and other.shape == out.shape \
                            and other.placements[0].is_shard() and not _strided(other):
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
        if self.sp and not (target in (aten.add.Tensor, aten.sub.Tensor) and _all_partial(args)):
            # (a sum of partial sums stays partial: q/k/v's input gradients are reduced once)
            args = tuple(self._sequence_shard(a) for a in args)
        args = self._megatron_operands(target, args)
        for rule in (self._vocab_embedding_backward, self._fused_split, self._fused_cat, self._fused_contraction, self._same_placement,
                     self._batch_local, self._head_local, self._legacy_empty_cat):
            out = rule(target, args, kwargs)
            if out is not None:
                return out
        try:
            try:
                out = super().call_function(target, args, kwargs)
            except Exception:
                if not any(_strided(a) for a in args):
                    raise
                # DTensor cannot move a per-part shard; move the other operands instead (a
                # sequence shard read by a fused projection's weight gradient: gather it).
                args = tuple(a.redistribute(self.mesh, [Replicate()])
                             if isinstance(a, DTensor) and not _strided(a) and a.placements[0].is_shard()
                             else a for a in args)
                out = super().call_function(target, args, kwargs)
            if _strided(out) and out.ndim == 2 and not any(_strided(a) for a in args):
                # A flatten into a matmul operand of a shard on a non-leading dim (the sequence-
                # sharded residual viewed [batch*seq, hidden]): gather it first, as Megatron's SP does.
                args = tuple(a.redistribute(self.mesh, [Replicate()]) if isinstance(a, DTensor) else a
                             for a in args)
                out = super().call_function(target, args, kwargs)
            return out
        except TensorParallelError:
            raise
        except Exception as exc:
            placed = [f"{tuple(a.shape)} {a.placements[0]}" for a in args if isinstance(a, DTensor)]
            origin = self.origins.get(self.current)
            raise TensorParallelError(
                f"tensor_parallel: node {self.current.name} ({target}, module "
                f"'{self.current.meta.get(MODULE_PATH, '')}') cannot run on inputs placed "
                f"{', '.join(placed) or 'replicated'}" + (f" (split by the rule of parameter '{origin}')"
                                                          if origin else "")
                + f": {type(exc).__name__}: {str(exc).splitlines()[0]}") from None

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
        if want is not None and not _strided(a) and not _strided(b):
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
            if isinstance(source, DTensor) and source.placements[0].is_shard() and not _strided(source):
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
        """An elementwise op whose tensor operands share one shape and placement runs on the shards."""
        from torch.distributed.tensor import DTensor, Replicate
        if not _is_pointwise(target):
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
        if first.placements[0] == Replicate() or not all(
                a.shape == first.shape and a.placements == first.placements for a in big) \
                or not all(a.ndim > 0 or a.placements[0] == Replicate() for a in dts):
            return None
        local = lambda v: v.to_local() if isinstance(v, DTensor) else v
        out = target(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()})
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
        if a.placements != b.placements or not _strided(a) or a.placements[0].dim != 0:
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
        """Attention kernels without a DTensor rule: independent per head, so head shards run locally."""
        from torch.distributed.tensor import DTensor, Shard
        if target not in _HEAD_LOCAL_OPS:
            return None
        tensors = [a for a in args if isinstance(a, DTensor)]
        if not tensors or not all(a.placements[0] == Shard(1) for a in tensors):
            return None
        local = lambda v: v.to_local() if isinstance(v, DTensor) else v
        outs = target(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()})
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


def _all_partial(args) -> bool:
    from torch.distributed.tensor import DTensor, Partial
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(isinstance(a, DTensor) and isinstance(a.placements[0], Partial)
                                 for a in tensors)


_WEIGHT_VIEWS = (aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
                 aten.clone.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
                 aten.reshape.default)


_LAYOUT_OPS = (aten.t.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
               aten.reshape.default, aten.alias.default)


def _weight_nodes(graph: TrainGraph) -> set:
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


def _strided(value) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard
    return isinstance(value, DTensor) and isinstance(value.placements[0], _StridedShard)


def _global_meta(target, args, kwargs):
    """``target`` on meta tensors of its operands' global shapes and strides (outside the trace)."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    def meta(v):   # (a plain tensor too: an attention mask made from factories, not a DTensor)
        return (torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) else v)
    with disable_proxy_modes_tracing():
        return target(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})


def _heads_check(graph: TrainGraph, layouts: dict[str, ParamLayout], tp: int) -> None:
    """A column-parallel output viewed as [..., heads, head_dim] must split whole heads over tp."""
    for name, layout in layouts.items():
        if layout.dim is None or not name.endswith("weight"):
            continue
        node = graph.input_node(InputKind.PARAM, name)
        if not layout.rule.split("=")[1].startswith("column"):
            continue
        for view in _forward_head_views(node):
            heads = int(view.meta["val"].shape[-2])
            if heads % tp:
                last = _module_and_leaf(_module_and_leaf(name)[0])[1]
                kind = "kv heads" if last in ("k_proj", "v_proj", "key", "value", "wk", "wv") else "heads"
                raise TensorParallelError(
                    f"parameter '{name}' (rule '{layout.rule}'): {heads} {kind} (viewed at node "
                    f"{view.name}, module '{view.meta.get(MODULE_PATH, '')}') are not divisible by tp={tp}")


def _forward_head_views(param: torch.fx.Node):
    """Forward views splitting the last dim of (a part of) this weight's matmul output into
    [..., heads, head_dim]: the heads a column-parallel split divides among the ranks."""
    passing = {aten.t.default, aten.mm.default, aten.addmm.default, aten.add.Tensor, aten.view.default,
               aten._unsafe_view.default, aten.reshape.default, aten.split.Tensor,
               aten.split_with_sizes.default, aten.matmul.default, aten.mul.Tensor}
    seen, stack = set(), list(param.users)
    while stack:
        n = stack.pop()
        if n in seen or region_of(n) != Region.FORWARD or len(seen) > 64:
            continue
        seen.add(n)
        if n.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            out, src = n.meta["val"].shape, n.args[0].meta["val"].shape
            if len(out) == len(src) + 1 and out[-2] * out[-1] == src[-1] and list(out[:-2]) == list(src[:-1]):
                yield n
                continue
        if n.target in passing or getattr(n.target, "__name__", "") == "getitem":
            stack.extend(n.users)


def _retrace(graph: TrainGraph, layouts: dict[str, ParamLayout], mesh, *, sequence_parallel: bool,
             vocab_parallel_loss: bool) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.fx.experimental.proxy_tensor import make_fx

    size = mesh.size(0)
    inputs = graph.placeholders()
    in_place = [_dtensor_placement(_layout_for(spec, layouts)) for spec in graph.signature.inputs]
    out_place = [_dtensor_placement(_layout_for(spec, layouts)) for spec in graph.signature.outputs]
    origins = _origins(graph, layouts)
    values = [n.meta["val"] for n in inputs]
    try:
        grads = find_gradients(graph, mark=False)
    except GradientNotFound:
        grads = {}
    grad_places = {node: _dtensor_placement(layouts[name]) for name, node in grads.items()
                   if layouts.get(name) is not None and layouts[name].dim is not None and layouts[name].parts == 1}
    weights = _weight_nodes(graph)

    def step(*local):
        wrapped = [DTensor.from_local(t, mesh, [p], run_check=False, shape=v.shape, stride=v.stride())
                   if isinstance(v, torch.Tensor) else t for t, p, v in zip(local, in_place, values)]
        with implicit_replication():
            outs = _Rewriter(graph.gm, mesh, sequence_parallel=sequence_parallel, origins=origins,
                             grad_places=grad_places, weights=weights).run(*wrapped)
        return [o.redistribute(mesh, [p]).to_local() if isinstance(o, DTensor) else o
                for o, p in zip(outs, out_place)]

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        local_inputs = [torch.empty(_local_shape(v.shape, p, size), dtype=v.dtype, device=v.device)
                        if isinstance(v, torch.Tensor) else v for v, p in zip(values, in_place)]
    with torch.no_grad(), fx_traceback.preserve_node_meta(), _one_collective_per_layout(), \
            (loss_parallel() if vocab_parallel_loss else contextlib.nullcontext()):
        return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*local_inputs)


def _layout_for(spec, layouts: dict[str, ParamLayout]) -> ParamLayout | None:
    if spec.kind == InputKind.PARAM:
        return layouts.get(spec.name)
    if spec.kind == InputKind.OPT_STATE:
        param, key = split_state_name(spec.name)
        layout = layouts.get(param)
        return layout if key != "step" else None
    return None


def _origins(graph: TrainGraph, layouts: dict[str, ParamLayout]) -> dict:
    """Node -> the first split parameter it derives from (for error messages)."""
    origin = {}
    for spec, node in zip(graph.signature.inputs, graph.placeholders()):
        if spec.kind == InputKind.PARAM and layouts[spec.name].dim is not None:
            origin[node] = spec.name
    for node in graph.graph.nodes:
        if node not in origin:
            found = next((origin[a] for a in node.all_input_nodes if a in origin), None)
            if found:
                origin[node] = found
    return origin


@contextlib.contextmanager
def _one_collective_per_layout():
    """One redistribution per (value, layout): a forward value read again in backward is not reduced twice."""
    import torch.distributed.tensor._dispatch as dispatch
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import Replicate, Shard

    original = redistribute.redistribute_local_tensor
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def cached(local, current_spec, target_spec, *args, **kwargs):
        # A shard gathered in forward is gathered again where backward reads it (Megatron's
        # sequence parallelism): keeping the forward's whole copy would undo the shard's saving.
        gathered = any(isinstance(a, Shard) for a in current_spec.placements) and \
            all(isinstance(b, Replicate) for b in target_spec.placements)
        region = ((fx_traceback.get_current_meta() or {}).get("custom") or {}).get(REGION) if gathered else None
        key = (id(local), tuple(current_spec.placements), tuple(target_spec.placements),
               tuple(target_spec.shape), region)
        if key not in cache:
            cache[key] = (local, original(local, current_spec, target_spec, *args, **kwargs))
        return cache[key][1]

    dispatch.redistribute_local_tensor = redistribute.redistribute_local_tensor = cached
    try:
        yield
    finally:
        dispatch.redistribute_local_tensor = redistribute.redistribute_local_tensor = original


def _finish(gm: torch.fx.GraphModule, graph: TrainGraph, traced_group: str, group_name: str) -> None:
    """IR metadata on the traced nodes; collectives named by the mesh description's group."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, old in zip(placeholders, graph.placeholders()):
        node.name = node.target = old.name
        node.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "tensor_meta")})
    for node in gm.graph.nodes:
        custom = node.meta.pop("custom", None) or {}
        if node.op in ("placeholder", "output"):
            node.meta[REGION] = Region.IO.value
            continue
        node.meta[REGION] = custom.get(REGION) or Region.FORWARD.value
        node.meta[MODULE_PATH] = custom.get(MODULE_PATH) or ""
        if custom.get(RECOMPUTE) is not None:
            node.meta[RECOMPUTE] = custom[RECOMPUTE]
        node.meta.pop("stack_trace", None)
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "_c10d_functional":
            node.args = tuple(group_name if a == traced_group else a for a in node.args)
            node.meta["origin_pass"] = ATTR
    _functionalize_in_place(gm.graph)
    _lowerable_forms(gm.graph)
    _drop_identity_views(gm.graph)
    # DTensor's shard-offset arithmetic for per-part shards is traced but never read.
    gm.graph.eliminate_dead_code()
    _mark_random_pieces(gm.graph)
    gm.graph.lint()
    gm.recompile()


def _functionalize_in_place(graph: torch.fx.Graph) -> None:
    """In-place ops DTensor's rules trace (the vocab-parallel embedding masks its ids in place) become
    their functional form, later readers of the mutated tensor reading the result."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target._schema.name.endswith("_")
                and target._schema.is_mutable and target.namespace == "aten"):
            continue
        packet = getattr(aten, target._schema.name.split("::")[1][:-1], None)
        functional = getattr(packet, target._overloadname, None) if packet is not None else None
        mutated = node.args[0]
        if functional is None or mutated.op == "placeholder":
            raise TensorParallelError(f"tensor_parallel: traced an in-place {target} on "
                                      f"{'an input' if functional else 'a value'} it cannot make functional")
        later = [u for u in mutated.users if u is not node and order[u] > order[node]]
        node.target = functional
        for user in later:
            user.replace_input_with(mutated, node)
        # the in-place op returned its input; readers of its result already read ``node``


_CUT_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.narrow.default,
            aten.clone.default, aten.alias.default, aten.view.default, aten.chunk.default)


def _mark_random_pieces(graph: torch.fx.Graph) -> None:
    """Tag the end of each cut of a whole random draw to this rank's shard (``_Rewriter._shard_random``)
    with ``RANDOM_PIECE``: the piece is what backward needs and what is kept for it."""
    import operator
    for draw in graph.nodes:
        val = draw.meta.get("val")
        if not (torch.Tag.nondeterministic_seeded in getattr(draw.target, "tags", ())
                and isinstance(val, torch.Tensor) and val.ndim > 0 and region_of(draw) == Region.FORWARD):
            continue
        stack = [draw]
        while stack:
            node = stack.pop()
            cuts = [u for u in node.users if (u.target in _CUT_OPS or u.target is operator.getitem)
                    and u.all_input_nodes == [node]]
            stack.extend(cuts)
            piece = node.meta.get("val")
            if node is not draw and len(cuts) < len(node.users) and isinstance(piece, torch.Tensor) \
                    and piece.numel() < val.numel():
                node.meta[RANDOM_PIECE] = draw.name


def _lowerable_forms(graph: torch.fx.Graph) -> None:
    """Spell two ops DTensor's local kernels use the way the captured graphs already do, so every
    backend that takes the captured step takes this one (torchair has no converter for either):
    ``index_put(x, [bool mask], v)`` (the vocab-parallel embedding zeroing other ranks' rows) as
    ``where``, and ``squeeze.dims`` of size-1 dims as a ``view``."""
    for node in list(graph.nodes):
        if node.target is aten.index_put.default and len(node.args[1]) == 1:
            x, (mask,), value = node.args[:3]
            xv, mv = x.meta["val"], mask.meta["val"]
            if mv.dtype != torch.bool or tuple(mv.shape) != tuple(xv.shape[:mv.ndim]) or node.args[3:4] == (True,):
                continue
            with graph.inserting_before(node):
                shaped = graph.call_function(aten.view.default, (mask, list(mv.shape) + [1] * (xv.ndim - mv.ndim)))
                fill = graph.call_function(aten._to_copy.default, (value,), {"dtype": xv.dtype})
                where = graph.call_function(aten.where.self, (shaped, fill, x))
            for new in (shaped, fill, where):
                new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            shaped.meta["val"] = mv.view(list(mv.shape) + [1] * (xv.ndim - mv.ndim))
            fill.meta["val"] = value.meta["val"].to(xv.dtype)
            where.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(where)
            graph.erase_node(node)
        elif node.target is aten.index_put.default and len(node.args[1]) == 2 and _is_row_arange(node):
            # grad[arange(N), target] = v (the vocab-parallel loss' backward): one column per row
            x, (_, cols), value = node.args[:3]
            n = x.meta["val"].shape[0]
            with graph.inserting_before(node):
                index = graph.call_function(aten.view.default, (cols, [n, 1]))
                src = graph.call_function(aten.view.default, (value, [n, 1]))
                scatter = graph.call_function(aten.scatter.src, (x, 1, index, src))
            for new in (index, src, scatter):
                new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            index.meta["val"] = cols.meta["val"].view(n, 1)
            src.meta["val"] = value.meta["val"].view(n, 1)
            scatter.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(scatter)
            graph.erase_node(node)
        elif node.target is aten.squeeze.dims:
            node.target, node.args = aten.view.default, (node.args[0], list(node.meta["val"].shape))


def _is_row_arange(node: torch.fx.Node) -> bool:
    x, (rows, cols), value = node.args[:3]
    n = x.meta["val"].shape[0] if x.meta["val"].ndim == 2 else None
    counts_rows = (rows.target is aten.arange.default and tuple(rows.args[:1]) == (n,)) or \
        (rows.target is aten.arange.start and tuple(rows.args[:2]) == (0, n))
    return (n is not None and counts_rows and node.args[3:4] != (True,)
            and all(tuple(v.meta["val"].shape) == (n,) for v in (cols, value)))


def _drop_identity_views(graph: torch.fx.Graph) -> None:
    """DTensor's from_local/to_local trace ``view(x, x.shape)`` aliases; the graph is functional, drop them."""
    for node in list(graph.nodes):
        if node.target is aten.view.default or node.target is aten.alias.default:
            src = node.args[0]
            val, src_val = node.meta.get("val"), getattr(src, "meta", {}).get("val")
            if isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor) \
                    and val.shape == src_val.shape and val.stride() == src_val.stride():
                node.replace_all_uses_with(src)
                graph.erase_node(node)


def _record_placements(out: TrainGraph, captured: TrainGraph, layouts: dict[str, ParamLayout]) -> None:
    """Where each split input and output lives, in graph_ir's placement vocabulary (the runtime's
    binding and checkpoints cut and gather by it); a fused projection's per-part split is a
    ``Shard(dim, parts)``."""
    full = {spec: n.meta["val"] for spec, n in zip(captured.signature.inputs, captured.placeholders())}
    nodes = dict(zip(out.signature.inputs, out.placeholders()))
    for spec in list(out.signature.inputs) + list(out.signature.outputs):
        layout = _layout_for(spec, layouts)
        if layout is None or layout.dim is None:
            continue
        source = Spec(InputKind.PARAM if spec.kind == OutputKind.PARAM else spec.kind, spec.name)
        placement = Placement.sharded(tuple(full[source].shape), layout.dim, "tp", layout.parts)
        set_placement(out, spec.kind, spec.name, placement, nodes.get(spec))


def _mark_local_gradients(graph: TrainGraph, layouts: dict[str, ParamLayout]) -> None:
    """Mark, for each split parameter, the value holding this rank's shard of its gradient.

    Where backward yields a gradient whole on every rank (a vocab-parallel embedding's dense
    backward) DTensor cuts it to the parameter's shard at the first optimizer op that reads it,
    so the cut is traced in the optimizer region. The data-parallel passes that follow reduce
    what the update reads: the shard, moved into backward, is the gradient."""
    try:
        found = find_gradients(graph, mark=False)
    except GradientNotFound:
        return  # nothing trains (or a shape the data-parallel passes refuse on their own)
    for name, grad in found.items():
        layout = layouts.get(name)
        local = tuple(graph.input_node(InputKind.PARAM, name).meta["val"].shape)
        if layout is None or layout.dim is None or tuple(grad.meta["val"].shape) == local:
            continue
        _merge_repeated_cuts(graph, grad)
        chain, frontier, shard = [], [grad], None
        while frontier and shard is None:
            node = frontier.pop(0)
            for user in node.users:
                if region_of(user) != Region.OPTIMIZER or user.all_input_nodes != [node]:
                    continue   # (a split's pieces are read through getitem)
                chain.append(user)
                val = user.meta.get("val")
                if isinstance(val, torch.Tensor) and tuple(val.shape) == local:
                    shard = user
                    break
                frontier.append(user)
        if shard is None:
            raise TensorParallelError(f"tensor_parallel: the gradient of '{name}' ({grad.name}, shape "
                                      f"{list(grad.meta['val'].shape)}) is never cut to the parameter's shard "
                                      f"{list(local)} before its update")
        # the cut and its inputs up to the whole gradient belong to backward
        keep, stack = set(), [shard]
        while stack:
            n = stack.pop()
            if n in chain and n not in keep:
                keep.add(n)
                stack.extend(n.all_input_nodes)
        for n in keep:
            n.meta[REGION] = Region.BACKWARD.value
        shard.meta[GRADIENT_OF] = name


def _merge_repeated_cuts(graph: TrainGraph, grad: torch.fx.Node) -> None:
    """Each optimizer op that reads a whole gradient as a shard traced its own cut of it: one cut
    (the first) serves them all, so there is one value to reduce."""
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    seen: dict[tuple, torch.fx.Node] = {}
    frontier = [grad]
    while frontier:
        node = frontier.pop(0)
        for user in sorted(node.users, key=order.__getitem__):
            if region_of(user) != Region.OPTIMIZER or user.all_input_nodes != [node] \
                    or user.op != "call_function":
                continue
            key = (user.target, repr(user.args), repr(sorted(user.kwargs.items())))
            if key in seen and seen[key] is not user:
                user.replace_all_uses_with(seen[key])
                graph.graph.erase_node(user)
                continue
            seen[key] = user
            frontier.append(user)


def count_collectives(graph: TrainGraph) -> dict[tuple[str, str], int]:
    """(region, collective) -> count, from the graph (wait_tensor not counted)."""
    counts: dict[tuple[str, str], int] = {}
    for node in graph.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "_c10d_functional" \
                and node.target is not c10d.wait_tensor.default:
            key = (str(region_of(node)), node.target._overloadpacket.__name__)
            counts[key] = counts.get(key, 0) + 1
    return counts


@register_pass("tensor_parallel", preserves=())
def tensor_parallel_pass(graph: TrainGraph, ctx: PassContext, *, rules: str = "auto", extra_rules: str = "",
                         sequence_parallel: bool = False, vocab_parallel_loss: bool = False) -> TrainGraph:
    """Split parameters over the mesh's ``tp`` axis by path rules; one per-rank graph with collectives.

    ``rules``: ``auto`` (the built-in rules of the model family the parameter names show) or
    ``pattern=style[:parts];...``; ``extra_rules`` are the user's, tried first.
    """
    mesh = getattr(ctx, "mesh", None)
    if mesh is None:
        raise TensorParallelError("pass 'tensor_parallel' needs ctx.mesh (a mesh description with a 'tp' axis)")
    tp = int(mesh.size("tp"))
    plan = getattr(ctx, "plan", None)
    if plan is not None and getattr(plan, "tp", tp) != tp:
        raise TensorParallelError(f"pass 'tensor_parallel': plan asks for tp={plan.tp} but the mesh's tp "
                                  f"axis has {tp} ranks")
    if "zero" in graph.attrs or "data_parallel" in graph.attrs:
        raise TensorParallelError("tensor_parallel must run before data_parallel / optimizer_shard "
                                  "(rule: the data-parallel rewrites see the tensor-parallel shards)")
    user = parse_rules(extra_rules)
    family, builtin = builtin_rules(s.name for _, s in graph.signature.inputs_of(InputKind.PARAM)) \
        if rules == "auto" else ("user", parse_rules(rules))
    all_rules = user + builtin
    if not all_rules:
        raise TensorParallelError("tensor_parallel: no rule applies (the parameter names match no built-in "
                                  "model family); give rules as pattern=column|row|vocab[:parts]")
    layouts = assign_layouts(graph, all_rules, tp, user_rules=user + (builtin if rules != "auto" else []))
    if tp == 1:
        return graph
    _heads_check(graph, layouts, tp)
    group_name = mesh.group_name("tp")
    coord = int(mesh.local_rank("tp"))
    with _tracing_mesh(group_name, tp, coord, getattr(mesh, "device_type", "cpu")) as device_mesh:
        traced_group = device_mesh.get_group(0).group_name
        gm = _retrace(graph, layouts, device_mesh, sequence_parallel=sequence_parallel,
                      vocab_parallel_loss=vocab_parallel_loss)
    _finish(gm, graph, traced_group, group_name)
    out = TrainGraph(gm, graph.signature, graph.attrs)
    _record_placements(out, graph, layouts)
    _mark_local_gradients(out, layouts)
    out.attrs[ATTR] = {
        "tp": tp, "rank": coord, "family": family, "rules": format_rules(all_rules),
        "sequence_parallel": sequence_parallel, "vocab_parallel_loss": vocab_parallel_loss,
        "params": {n: l.to_json() for n, l in layouts.items() if l.dim is not None}}
    counts = count_collectives(out)
    for (region, name), n in counts.items():
        ctx.stat(f"{region}.{name}", n)
    return out
