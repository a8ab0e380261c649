"""fuse_optimizer: the optimizer's per-parameter update chains as multi-tensor (``_foreach_*``) ops.

The captured step updates one parameter at a time (``graph_ir.optimizers`` follows torch.optim's
single-tensor code): AdamW is ~20 ops per parameter, ~10 of them on 0-dim tensors (the step
count, the bias corrections, the step size). A model of N parameter tensors runs 20N small
ops, each paying dispatch (eager) or a kernel launch (a device). This pass finds the ops of the
optimizer region that compute the same thing for different parameters and replaces each such
group by one ``aten._foreach_*`` op over the group's tensors, as torch.optim's ``foreach=True``
path does: a group of N parameters costs one op per position of the chain instead of N.

Which ops form a group, from the graph alone (op targets, data flow, the region tag; never
names): two optimizer-region nodes belong together when they are the same op with the same
non-tensor arguments, their tensor operands are, position by position, either nodes of one
group or values of the same dtype, device and rank class (0-dim or not), and they sit at the
same depth of the optimizer region (the longest path to them from outside it). The depth
keeps the rewrite acyclic: an optimizer node depends on another only through deeper optimizer
nodes (regions flow forward -> backward -> optimizer), so no member of a group can feed
another group that feeds it. A tensor operand all members share (``lr``, ``1 - beta1``, the
clip coefficient) becomes the foreach op's scalar-tensor argument (``_foreach_mul.Tensor``);
operands that differ become lists, with a shared one repeated where the op has no Tensor
overload.

Numerics: on CPU every ``_foreach_*`` op runs the per-tensor op on each element (ATen's slow
path), so each fused group computes bitwise what its members computed, and the step stays
bitwise the unfused graph, the eager single-tensor optimizer and torch.optim's ``foreach=True``.
Where the chain needs an op the foreach family lacks, the nearest exact spelling is used:
``rsub(x, c)`` (``c - x``) as ``_foreach_add.Scalar(_foreach_neg(x), c)`` (``c + (-x)`` is the
same IEEE operation) and the step count's float32 -> float64 ``_to_copy`` as a product with a
float64 one (exact). Commutative ops (``mul``, ``add`` without alpha, ``maximum``) put the
non-0-dim operand first, because a foreach op's result takes its first list's shape. Every new
op's fake value is compared with its members' (shape, dtype, device, strides); a group whose
foreach op would not give exactly what its members gave stays unfused, as does any op outside
the table (``where``, a ``_to_copy`` to float32, collectives): never wrong, only unfused.

What fuses (the rules of ``graph_ir.optimizers``): SGD (momentum, nesterov, weight decay),
Adam, AdamW (also amsgrad), Adagrad, Adamax, RMSprop (centered, momentum) fully; NAdam and
RAdam except the ops without a foreach form (NAdam's float32 ``mu``, RAdam's ``where``), which
stay one per parameter. Gradient clipping's per-gradient scaling and fp16 unscaling fuse too
(they are optimizer-region ``mul``s by one shared coefficient, as in ``clip_grad_norm_``'s
foreach path), and ZeRO's per-shard updates fuse as whole parameters do.

``kernel=fused`` replaces instead each Adam/AdamW chain (``graph_ir.analysis.adam_updates``:
the update of one tensor, recognised by its computation) by torch's fused kernel, one
``cann::fused_adam`` call (``graph_ir.multi_tensor_ops``) per set of chains that read the same
hyperparameter inputs and variant (decoupled, weight decay, amsgrad) and whose
tensors share a dtype and device: one pass over each tensor's four buffers where the chain
makes about a dozen full-size passes and ten 0-dim ops. The kernel takes ``beta1``, ``beta2``,
``eps`` and ``weight_decay`` as floats; the op reads them from their graph inputs with
``.item()`` each call, so a scheduler still never recompiles, and the step is bitwise
``torch.optim``'s ``fused=True`` (not the single-tensor chain, which rounds its own way, within
1e-6). Only the step count's increment stays per parameter (the kernel reads the new count).
Other chains (SGD, a dtype the kernel lacks) stay as they are; an optimizer with no Adam state
at all is refused, naming the option. ``kernel=fused_or_foreach`` (the plan's ``auto`` on
inductor) takes ``fused`` for a graph with Adam state and ``foreach`` for any other: inductor
then calls one kernel for the Adam update instead of generating and compiling its code (a
third less cold compile for a 6-layer GPT, and a faster step).

The eager lowering's in-place reuse (``reuse_dead_operands``) marks per-tensor pointwise ops and
``cann::fused_adam`` (whose parameter and state lists it writes where they die), not foreach
ops, so a foreach update allocates its results (as torch.optim's out-of-place foreach calls do)
and the step no longer writes parameters and state in place: the plan's ``optimizer_kernel:
auto`` leaves the eager backend unfused for that reason.
The pipeline runs this pass only at pp = 1: ``pipeline_split`` cuts the graph per stage after
it, and one foreach op spanning two stages' parameters would not split.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.analysis.adam_updates import AdamUpdate, adam_updates
from graph_ir.build import add_node, eliminate_dead_code, tag
from graph_ir.meta import MODULE_PATH, ORIGIN_PASS, Region, region_of
from graph_ir.multi_tensor_ops import FUSED_ADAM

from ..pass_manager import PassContext, PassOptionError, register_pass

aten = torch.ops.aten
_ORIGIN = "fuse_optimizer"

_UNARY = {aten.sqrt.default: aten._foreach_sqrt.default, aten.neg.default: aten._foreach_neg.default,
          aten.abs.default: aten._foreach_abs.default, aten.sign.default: aten._foreach_sign.default,
          aten.exp.default: aten._foreach_exp.default, aten.log.default: aten._foreach_log.default,
          aten.reciprocal.default: aten._foreach_reciprocal.default,
          aten.sigmoid.default: aten._foreach_sigmoid.default}


@dataclass(frozen=True)
class _Binary:
    packet: Any                 # aten._foreach_<op>
    commutative: bool           # op(a, b) == op(b, a) bitwise (IEEE add and multiply are)
    alpha: bool                 # the List overload takes alpha=
    tensor_overload: bool       # a ``.Tensor`` overload (one 0-dim tensor for every element)
    scalar_overload: bool = True


_BINARY = {aten.add.Tensor: _Binary(aten._foreach_add, True, True, True),
           aten.sub.Tensor: _Binary(aten._foreach_sub, False, True, False),
           aten.mul.Tensor: _Binary(aten._foreach_mul, True, False, True),
           aten.div.Tensor: _Binary(aten._foreach_div, False, False, True),
           aten.maximum.default: _Binary(aten._foreach_maximum, True, False, False, False),
           aten.minimum.default: _Binary(aten._foreach_minimum, True, False, False, False),
           aten.pow.Tensor_Tensor: _Binary(aten._foreach_pow, False, False, False, False)}
_TERNARY = {aten.addcmul.default: aten._foreach_addcmul.Scalar, aten.addcdiv.default: aten._foreach_addcdiv.Scalar}
_OTHERS = (aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.rsub.Scalar, aten.lerp.Tensor, aten.lerp.Scalar,
           aten._to_copy.default)
_FUSIBLE = set(_UNARY) | set(_BINARY) | set(_TERNARY) | set(_OTHERS)


def _val(node: torch.fx.Node):
    return node.meta.get("val")


def _is_tensor_node(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(_val(a), torch.Tensor)


def _candidate(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _FUSIBLE or region_of(node) != Region.OPTIMIZER:
        return False
    if not isinstance(_val(node), torch.Tensor):
        return False
    return all(_is_tensor_node(a) or not isinstance(a, (torch.fx.Node, list, tuple, dict))
               for a in (*node.args, *node.kwargs.values()))


def _depths(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Longest path to each optimizer-region node from outside the region (0 outside it)."""
    depth: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if region_of(node) != Region.OPTIMIZER or node.op != "call_function":
            depth[node] = 0
        else:
            depth[node] = 1 + max((depth[a] for a in node.all_input_nodes), default=0)
    return depth


def _groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Optimizer-region nodes computing the same op on isomorphic operands, at the same depth."""
    depth = _depths(graph)
    sig: dict[torch.fx.Node, int] = {}
    interned: dict[tuple, int] = {}
    members: dict[int, list[torch.fx.Node]] = {}

    def operand(a):
        if isinstance(a, torch.fx.Node):
            if a in sig:
                return ("op", sig[a])
            v = _val(a)
            return ("leaf", v.dtype, v.device, v.dim() == 0)
        return ("const", type(a).__name__, a)

    for node in graph.nodes:
        if not _candidate(node):
            continue
        v = _val(node)
        key = (node.target, depth[node], v.dtype, v.device, v.dim() == 0,
               tuple(operand(a) for a in node.args),
               tuple(sorted((k, operand(a)) for k, a in node.kwargs.items())))
        try:
            s = interned.setdefault(key, len(interned))
        except TypeError:   # an unhashable constant argument: leave the node alone
            continue
        sig[node] = s
        members.setdefault(s, []).append(node)
    return [group for group in members.values() if len(group) > 1]


class _Unfusable(Exception):
    pass


@dataclass
class _Call:
    target: Any
    args: tuple
    kwargs: dict


def _column(group: list[torch.fx.Node], position: int) -> list:
    return [m.args[position] if position < len(m.args) else None for m in group]


def _shared(column: list) -> bool:
    return isinstance(column[0], torch.fx.Node) and all(a is column[0] for a in column) \
        and _val(column[0]).dim() == 0


def _const(column: list):
    if isinstance(column[0], torch.fx.Node) or any(a != column[0] for a in column):
        raise _Unfusable
    return column[0]


def _nodes(column: list) -> list:
    if not all(isinstance(a, torch.fx.Node) for a in column):
        raise _Unfusable
    return list(column)


def _kwarg(group: list[torch.fx.Node], name: str, default):
    values = [m.kwargs.get(name, default) for m in group]
    if any(v != values[0] for v in values):
        raise _Unfusable
    return values[0]


def _only_kwargs(group: list[torch.fx.Node], allowed: tuple[str, ...]) -> None:
    if any(set(m.kwargs) - set(allowed) for m in group):
        raise _Unfusable


def _binary(group: list[torch.fx.Node], rule: _Binary) -> _Call:
    _only_kwargs(group, ("alpha",))
    alpha = _kwarg(group, "alpha", 1)
    a, b = _column(group, 0), _column(group, 1)
    if not isinstance(a[0], torch.fx.Node):
        raise _Unfusable
    if not isinstance(b[0], torch.fx.Node):   # a Python number: the Scalar overload
        if alpha != 1 or not rule.scalar_overload:
            raise _Unfusable
        return _Call(rule.packet.Scalar, (_nodes(a), _const(b)), {})
    # A foreach op's result takes the shape of its first list's elements.
    if rule.commutative and alpha == 1 and all(_val(x).dim() == 0 for x in a) \
            and not all(_val(y).dim() == 0 for y in b):
        a, b = b, a
    kwargs = {"alpha": alpha} if alpha != 1 else {}
    if kwargs and not rule.alpha:
        raise _Unfusable
    if _shared(b) and rule.tensor_overload:
        return _Call(rule.packet.Tensor, (_nodes(a), b[0]), kwargs)
    return _Call(rule.packet.List, (_nodes(a), _nodes(b)), kwargs)


def _call(group: list[torch.fx.Node]) -> _Call | list[_Call]:
    """The foreach op computing ``group`` (a list: a chain of them, the last one the result)."""
    target = group[0].target
    if target in _UNARY:
        _only_kwargs(group, ())
        return _Call(_UNARY[target], (_nodes(_column(group, 0)),), {})
    if target in _BINARY:
        return _binary(group, _BINARY[target])
    if target in _TERNARY:
        _only_kwargs(group, ("value",))
        value = _kwarg(group, "value", 1)
        return _Call(_TERNARY[target], tuple(_nodes(_column(group, i)) for i in range(3)), {"value": value})
    _only_kwargs(group, ("alpha",) if target is aten.rsub.Scalar else ())
    if target is aten.pow.Tensor_Scalar:
        return _Call(aten._foreach_pow.Scalar, (_nodes(_column(group, 0)), _const(_column(group, 1))), {})
    if target is aten.pow.Scalar:
        return _Call(aten._foreach_pow.ScalarAndTensor, (_const(_column(group, 0)), _nodes(_column(group, 1))), {})
    if target is aten.lerp.Scalar:
        return _Call(aten._foreach_lerp.Scalar, (_nodes(_column(group, 0)), _nodes(_column(group, 1)),
                                                 _const(_column(group, 2))), {})
    if target is aten.lerp.Tensor:
        return _Call(aten._foreach_lerp.List, tuple(_nodes(_column(group, i)) for i in range(3)), {})
    if target is aten.rsub.Scalar:
        if _kwarg(group, "alpha", 1) != 1:
            raise _Unfusable
        # c - x is c + (-x), the same IEEE operation.
        return [_Call(aten._foreach_neg.default, (_nodes(_column(group, 0)),), {}),
                _Call(aten._foreach_add.Scalar, (None, _const(_column(group, 1))), {})]
    raise _Unfusable


def _same_layout(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride())


def _to_float64(graph: TrainGraph, group: list[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """A 0-dim float -> float64 ``_to_copy`` group (the step counts) as ``1.0 * x`` in float64 (exact)."""
    xs = _column(group, 0)
    if any(set(m.kwargs) != {"dtype"} or m.kwargs["dtype"] != torch.float64 for m in group) or \
            not all(_is_tensor_node(x) and _val(x).dim() == 0 and _val(x).is_floating_point() for x in xs):
        return None
    device = _val(group[0]).device
    with graph.graph.inserting_before(group[-1]):
        one = add_node(graph.graph, aten.full.default, ([], 1.0), {"dtype": torch.float64, "device": device,
                                                                   "pin_memory": False},
                       region=Region.OPTIMIZER, module_path="", origin=_ORIGIN, mode=graph.fake_mode())
    result = _emit(graph, group, [_Call(aten._foreach_mul.List, ([one] * len(xs), xs), {})])
    if result is None:
        graph.graph.erase_node(one)
    return result


def _emit(graph: TrainGraph, group: list[torch.fx.Node], calls: list[_Call]) -> list[torch.fx.Node] | None:
    """Insert ``calls`` (each reading the previous one's list where its first argument is None) and
    one getitem per member; None, with nothing inserted, when the values would not be the members'."""
    mode = graph.fake_mode()
    vals, computed = None, []
    try:
        for call in calls:
            args, kwargs = torch.fx.map_arg((call.args, call.kwargs), lambda n: n.meta["val"])
            if call.args[0] is None:
                args = (list(vals), *args[1:])
            with mode:
                vals = call.target(*args, **kwargs)
            computed.append(vals)
    except Exception:   # an overload that refuses these operands: the group stays as it is
        return None
    if not isinstance(vals, (list, tuple)) or len(vals) != len(group) or \
            not all(_same_layout(v, _val(m)) for v, m in zip(vals, group)):
        return None
    previous = None
    with graph.graph.inserting_before(group[-1]):
        for call, val in zip(calls, computed):
            args = call.args if call.args[0] is not None else (
                [_getitem(previous, i, m) for i, m in enumerate(group)], *call.args[1:])
            # the fake values computed for the check above (a foreach op's fake run is per tensor)
            previous = add_node(graph.graph, call.target, args, call.kwargs, region=Region.OPTIMIZER,
                                module_path=group[0].meta.get(MODULE_PATH, ""), origin=_ORIGIN, mode=mode, val=val)
        return [_getitem(previous, i, m) for i, m in enumerate(group)]


def _getitem(foreach: torch.fx.Node, index: int, member: torch.fx.Node) -> torch.fx.Node:
    item = foreach.graph.call_function(operator.getitem, (foreach, index))
    tag(item, region=Region.OPTIMIZER, module_path=member.meta.get(MODULE_PATH, ""), origin=_ORIGIN)
    item.meta["val"] = foreach.meta["val"][index]
    return item


def _fuse(graph: TrainGraph, group: list[torch.fx.Node]) -> list[torch.fx.Node] | None:
    if group[0].target is aten._to_copy.default:
        return _to_float64(graph, group)
    try:
        calls = _call(group)
    except _Unfusable:
        return None
    return _emit(graph, group, calls if isinstance(calls, list) else [calls])


def _stable_topological_order(graph: torch.fx.Graph) -> None:
    """Reorder so every node follows its inputs, otherwise keeping the present order."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(i, n) for n, i in index.items() if waiting[n] == 0 and n.op != "output"]
    heapq.heapify(ready)
    ordered = []
    while ready:
        _, node = heapq.heappop(ready)
        ordered.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0 and user.op != "output":
                heapq.heappush(ready, (index[user], user))
    if len(ordered) != len(nodes) - 1:
        raise RuntimeError("fuse_optimizer: the fused graph has a cycle")
    cursor = graph.output_node()
    for node in reversed(ordered):
        cursor.prepend(node)
        cursor = node


def _has_state(graph: TrainGraph, key: str) -> bool:
    """Whether the graph takes optimizer state ``key`` (``exp_avg_sq``: an Adam update) of some parameter."""
    return any(s.kind == "opt_state" and s.name.endswith(f":{key}") for s in graph.signature.inputs)


def _fused_adam_key(update: AdamUpdate):
    """What one ``cann::fused_adam`` call shares, or None where the kernel does not take these tensors:
    the four per-parameter tensors of one dtype (float32, bfloat16, float16), shape and dense
    layout, on one device, and a 0-dim float32 step (torch.optim's)."""
    tensors = [update.inputs[k] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
               if k in update.inputs]
    vals = [_val(n) for n in tensors]
    step = _val(update.results["step"])
    first = vals[0]
    if len(set(tensors)) != len(tensors) or not all(isinstance(v, torch.Tensor) for v in vals) \
            or first.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
            or not all(v.dtype == first.dtype and v.shape == first.shape and v.device == first.device
                       and v.is_contiguous() for v in vals) \
            or not (isinstance(step, torch.Tensor) and step.ndim == 0 and step.dtype == torch.float32):
        return None
    hparams = tuple(update.inputs.get(k) for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    if not all(h is None or isinstance(_val(h), torch.Tensor) and _val(h).ndim == 0 for h in hparams):
        return None
    return update.variant, hparams, first.dtype, first.device


def _emit_fused_adam(graph: TrainGraph, members: list[AdamUpdate], position: dict) -> None:
    v = members[0].variant

    def column(key):
        return [m.inputs[key] for m in members] if key != "step" else [m.results["step"] for m in members]
    lr, beta1, beta2, eps, wd = (members[0].inputs.get(k) for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    args = (column("param"), column("grad"), column("exp_avg"), column("exp_avg_sq"),
            column("max_exp_avg_sq") if v.amsgrad else [], column("step"), lr, beta1, beta2, eps, wd,
            v.decoupled, v.amsgrad, v.maximize)
    mode = graph.fake_mode()
    last = max((m.results["param"] for m in members), key=position.__getitem__)
    with graph.graph.inserting_before(last):
        fused = add_node(graph.graph, FUSED_ADAM, args, {}, region=Region.OPTIMIZER, module_path="",
                         origin=_ORIGIN, mode=mode)
        lists = [_getitem(fused, k, last) for k in range(4)]
        for i, member in enumerate(members):
            for k, key in enumerate(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")):
                if key in member.results:
                    member.results[key].replace_all_uses_with(_getitem(lists[k], i, member.results[key]))


def fuse_adam(graph: TrainGraph) -> tuple[int, int]:
    """Each set of Adam/AdamW chains sharing hyperparameters as one ``cann::fused_adam``; returns
    (calls, tensors updated)."""
    position = {n: i for i, n in enumerate(graph.graph.nodes)}
    groups: dict = {}
    for update in adam_updates(graph.graph, amsgrad=_has_state(graph, "max_exp_avg_sq")):
        key = _fused_adam_key(update)
        if key is not None:
            groups.setdefault(key, []).append(update)
    for members in groups.values():
        _emit_fused_adam(graph, members, position)
    if groups:
        _stable_topological_order(graph.graph)
        eliminate_dead_code(graph.graph)
    return len(groups), sum(len(m) for m in groups.values())


@register_pass("fuse_optimizer")
def fuse_optimizer_pass(graph: TrainGraph, ctx: PassContext, *,
                        kernel: Literal["foreach", "fused", "fused_or_foreach"] = "foreach") -> TrainGraph:
    """Per-parameter update chains of the optimizer region as ``_foreach_*`` ops, bitwise; with
    ``kernel=fused``, Adam/AdamW chains as torch's fused kernel and nothing else;
    ``fused_or_foreach``: fused where the optimizer has Adam state, foreach otherwise."""
    if kernel == "fused_or_foreach":
        kernel = "fused" if _has_state(graph, "exp_avg_sq") else "foreach"
    if kernel == "fused":
        if not _has_state(graph, "exp_avg_sq"):
            raise PassOptionError(_ORIGIN, "kernel", "this graph's optimizer has no Adam update (no exp_avg_sq "
                                                     "state); torch's fused kernels with these semantics exist "
                                                     "only for Adam and AdamW; use kernel=foreach (bitwise "
                                                     "torch.optim's foreach=True on CPU)", "fused")
        calls, tensors = fuse_adam(graph)
        ctx.stat("fused_adam_calls", calls)
        ctx.stat("tensors_fused", tensors)
        return graph
    fused = groups = 0
    for group in _groups(graph.graph):
        items = _fuse(graph, group)
        if items is None:
            continue
        for member, item in zip(group, items):
            member.replace_all_uses_with(item)
        for member in group:
            graph.graph.erase_node(member)
        groups += 1
        fused += len(group)
    if groups:
        _stable_topological_order(graph.graph)
    ctx.stat("groups", groups)
    ctx.stat("ops_fused", fused)
    ctx.stat("foreach_ops", sum(1 for n in graph.graph.nodes if str(n.target).startswith("aten._foreach_")
                                and n.meta.get(ORIGIN_PASS) == _ORIGIN))
    return graph
