"""scalars_on_host: the optimizer's step-count arithmetic as Python floats, as torch.optim computes it.

A captured update keeps the numbers torch.optim's single-tensor loop computes as Python floats
(Adam's bias corrections ``1 - beta1 ** step`` and ``(1 - beta2 ** step) ** 0.5``, the step size
``lr / bias_correction1``, RAdam's rectification, NAdam's momentum factors) as 0-dim float64
tensors: a chain of about eight 0-dim ops per parameter, from that parameter's step count. Run
op by op on the eager backend, each is a dispatch of a few microseconds, about a third of every
op a small model's step dispatches (``bench.step_op_counts``). This pass marks, for the eager
lowering to compute as torch.optim does:

- a 0-dim float64 node of the optimizer region whose op is plain arithmetic (``HOST_OPS``) and
  whose tensor operands are 0-dim CPU tensors (``ON_HOST``; not on a device, where reading one
  with ``.item()`` would wait for the device): the lowering gives it a twin that
  does the same arithmetic on Python floats, each tensor operand (the step count, a
  hyperparameter) read once with ``.item()``;
- each operand of a consumer that may take a Python number there instead (``HOST_OPERANDS``):
  ``add`` / ``sub`` / ``mul`` / ``div`` of a dimensioned tensor of the result's dtype, where a
  0-dim tensor and a wrapped number promote alike and the kernel receives the same double.

- an ``add`` of ``x`` and ``(h * t1) / t2``, or an ``addcmul`` of ``x``, ``h * t1`` and ``t2``, with
  ``h`` such a float and all of one shape and dtype, float32 or float64 (``HOST_FOLD``): the lowering folds it into one
  ``addcdiv`` / ``addcmul`` with ``value=h``, as torch.optim calls them (the kernels compute
  ``x + (h * t1) / t2`` and ``x + (h * t1) * t2``, the same operations in the same order), one pass
  over memory where there were three, in place where the add was.

The lowered copy (``apply_scalars_on_host``) then drops the tensor nodes nothing reads any more;
one still read elsewhere (``lerp``'s weight) stays as it was. The graph itself stays as captured
(its fake values, the deep verifier and every other backend see tensors).

The host arithmetic is Python's, which is torch.optim's: ``x ** 0.5`` and ``math.sqrt`` are
correctly rounded, where a 0-dim float64 ``pow(x, 0.5)`` dispatches to torch's vectorized sqrt,
one unit in the last place off in 31 of Adam's first 20000 bias corrections (beta2 0.999), so
the update takes torch.optim's numbers at every step, not at nearly every one. An operation
Python refuses (a division by zero, a domain or range error) is computed by the aten op instead.
"""
from __future__ import annotations

import functools
import math
import operator

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.build import tag
from graph_ir.meta import HOST_FOLD, HOST_OPERANDS, MODULE_PATH, ON_HOST, Region, region_of

from ..pass_manager import PassContext, register_pass

aten = torch.ops.aten


def _pow(a, b):
    return a ** b


def _rsub(a, b, alpha=1):
    return b - a


# op -> (the arithmetic on Python floats, the kwargs it accepts and their accepted values)
HOST_OPS = {
    aten.add.Tensor: (operator.add, {"alpha": (1,)}),
    aten.add.Scalar: (operator.add, {"alpha": (1,)}),
    aten.sub.Tensor: (operator.sub, {"alpha": (1,)}),
    aten.sub.Scalar: (operator.sub, {"alpha": (1,)}),
    aten.rsub.Tensor: (_rsub, {"alpha": (1,)}),
    aten.rsub.Scalar: (_rsub, {"alpha": (1,)}),
    aten.mul.Tensor: (operator.mul, {}),
    aten.mul.Scalar: (operator.mul, {}),
    aten.div.Tensor: (operator.truediv, {}),
    aten.div.Scalar: (operator.truediv, {}),
    aten.neg.default: (operator.neg, {}),
    aten.reciprocal.default: (lambda a: 1.0 / a, {}),
    aten.sqrt.default: (math.sqrt, {}),
    aten.pow.Tensor_Tensor: (_pow, {}),
    aten.pow.Tensor_Scalar: (_pow, {}),
    aten.pow.Scalar: (_pow, {}),
    aten._to_copy.default: (lambda a: a, {"dtype": (torch.float64,)}),
}
# A conversion that stays a CPU tensor of the default layout.
_SAME_PLACE = {"layout": (None, torch.strided), "device": (None, torch.device("cpu")),
               "pin_memory": (None, False), "memory_format": (None, torch.preserve_format)}
# Consumers whose Tensor operand may be a Python number (torch wraps it as a float64 scalar).
NUMBER_OPERANDS = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}
_LEAF_DTYPES = (torch.float64, torch.float32, torch.int64)


def _scalar_tensor(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.device.type == "cpu" \
        and val.dtype in _LEAF_DTYPES


def _hostable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in HOST_OPS or region_of(node) != Region.OPTIMIZER:
        return False
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float64
            and val.device.type == "cpu"):
        return False
    allowed = HOST_OPS[node.target][1]
    if node.target is aten._to_copy.default:
        allowed = {**allowed, **_SAME_PLACE}
    if any(k not in allowed or v not in allowed[k] for k, v in node.kwargs.items()):
        return False
    return all(_scalar_tensor(a) if isinstance(a, torch.fx.Node) else isinstance(a, (int, float, bool))
               for a in node.args)


def is_host(node) -> bool:
    """Whether ``node`` computes on Python numbers (made by :func:`apply_scalars_on_host`)."""
    return isinstance(node, torch.fx.Node) and hasattr(node.target, "host_op")


@functools.cache
def _host_function(target):
    """``target`` on Python numbers (tensor operands already read), as torch.optim computes it: the
    function the lowered graph calls, one per op (the chains run on every step)."""
    fn = HOST_OPS[target][0]

    def compute(*args):
        try:
            out = fn(*map(float, args))
            if type(out) is float:
                return out
        except (ArithmeticError, ValueError):
            pass
        return _by_aten(target, args)
    compute.__name__ = compute.__qualname__ = f"host_{target.__name__.replace('.', '_')}"
    compute.host_op = target
    return compute


def _by_aten(target, args):
    """Where Python refuses (0 division, a domain or range error) or leaves the reals: the aten op."""
    schema = target._schema.arguments
    operands = [torch.tensor(float(a), dtype=torch.float64) if isinstance(schema[i].type, torch.TensorType)
                else a for i, a in enumerate(args)]
    if target is aten._to_copy.default:
        return operands[0].item()
    return target(*operands).item()


def _item(t: torch.Tensor):
    return t.item()


def _accepts_number(consumer: torch.fx.Node, position: int) -> bool:
    """Whether ``consumer`` computes the same with a Python number at arg ``position``."""
    if consumer.target not in NUMBER_OPERANDS or position > 1 or consumer.op != "call_function":
        return False
    out = consumer.meta.get("val")
    if not (isinstance(out, torch.Tensor) and out.dim() >= 1 and out.dtype.is_floating_point):
        return False
    # A dimensioned operand of the result's dtype decides the promotion either way.
    return any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
               and a.meta["val"].dim() >= 1 and a.meta["val"].dtype == out.dtype for a in consumer.args)


def _tagged(new: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    tag(new, region=region_of(like), module_path=like.meta.get(MODULE_PATH, ""), origin="scalars_on_host")
    return new


def _same_layout(*nodes) -> bool:
    """One shape and a dtype the fused kernels compute in (their ``opmath``): a float16 or bfloat16
    ``addcdiv`` computes in float32 and rounds once, where the three ops round three times."""
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in nodes]
    first = vals[0]
    return all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.dtype in (torch.float32, torch.float64)
               and v.dtype == first.dtype and v.shape == first.shape for v in vals)


def _scaled_operand(node, host_of) -> tuple | None:
    """``(t, h)`` where ``node`` is ``mul(t, h)`` or ``mul(h, t)``, ``h`` a host value, read only there."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.mul.Tensor and len(node.users) == 1
            and not node.kwargs and len(node.args) == 2):
        return None
    a, b = node.args
    if host_of(node, 1) and isinstance(a, torch.fx.Node):
        return a, b
    if host_of(node, 0) and isinstance(b, torch.fx.Node):
        return b, a
    return None


def folded_reads(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What a node marked ``HOST_FOLD`` reads once folded: the operands of the multiply (and, for
    addcdiv, the divide) it absorbs, read where it stands (``reuse_dead_operands`` keeps their
    buffers alive until there)."""
    inner = node.args[1] if len(node.args) > 1 else None
    if not isinstance(inner, torch.fx.Node):
        return []
    absorbed = [inner]
    if node.meta.get(HOST_FOLD) == aten.addcdiv.default.__name__ and inner.args \
            and isinstance(inner.args[0], torch.fx.Node):
        absorbed.append(inner.args[0])
    return [a for m in absorbed for a in m.all_input_nodes]


def _fold(node, host_of) -> tuple | None:
    """``(target, (x, t1, t2), h)`` where ``node`` computes ``x + (h * t1) / t2`` (addcdiv) or
    ``addcmul(x, h * t1, t2)`` (addcmul with value h), its intermediates read only there."""
    if node.op != "call_function" or region_of(node) != Region.OPTIMIZER or node.kwargs.get("value", 1) != 1:
        return None
    if node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2:
        x, d = node.args
        if not (isinstance(d, torch.fx.Node) and d.target is aten.div.Tensor and len(d.users) == 1
                and not d.kwargs and isinstance(d.args[1], torch.fx.Node)):
            return None
        scaled, t2 = _scaled_operand(d.args[0], host_of), d.args[1]
        target = aten.addcdiv.default
    elif node.target is aten.addcmul.default and len(node.args) == 3:
        x, m, t2 = node.args
        scaled, target = _scaled_operand(m, host_of), aten.addcmul.default
    else:
        return None
    if scaled is None or not isinstance(x, torch.fx.Node) or not _same_layout(node, x, scaled[0], t2):
        return None
    return target, (x, scaled[0], t2), scaled[1]


def mark_scalars_on_host(graph: torch.fx.Graph) -> tuple[int, int, int]:
    """Set the marks (the module docstring); returns (nodes marked, consumer operands marked, folds)."""
    for node in graph.nodes:
        node.meta.pop(ON_HOST, None)
        node.meta.pop(HOST_OPERANDS, None)
    marked = [n for n in graph.nodes if _hostable(n)]
    for node in marked:
        node.meta[ON_HOST] = True
    operands = 0
    for node in marked:
        for user in node.users:
            if user.meta.get(ON_HOST) or any(v is node for v in user.kwargs.values()):
                continue
            positions = [i for i, a in enumerate(user.args) if a is node]
            if positions and all(_accepts_number(user, i) for i in positions):
                # A list: the compile cache keeps a node's JSON-stable metadata only.
                user.meta[HOST_OPERANDS] = sorted({*user.meta.get(HOST_OPERANDS, ()), *positions})
                operands += len(positions)
    folds = 0
    for node in graph.nodes:
        node.meta.pop(HOST_FOLD, None)
        fold = _fold(node, lambda n, i: i in n.meta.get(HOST_OPERANDS, ()))
        if fold is not None:
            node.meta[HOST_FOLD] = fold[0].__name__
            folds += 1
    return len(marked), operands, folds


def apply_scalars_on_host(gm: torch.fx.GraphModule) -> int:
    """Give every marked node of ``gm`` its host twin and hand the marked operands the twins; returns
    how many 0-dim tensor ops left the graph."""
    graph = gm.graph
    twins: dict[torch.fx.Node, torch.fx.Node] = {}
    items: dict[torch.fx.Node, torch.fx.Node] = {}

    def host_value(arg, before: torch.fx.Node):
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg in twins:
            return twins[arg]
        if arg not in items:
            # Read where the first marked node reads it: nothing writes it before its last reader.
            with graph.inserting_before(before):
                items[arg] = _tagged(graph.call_function(_item, (arg,)), before)
        return items[arg]

    for node in list(graph.nodes):
        # A mark is applied only where it still holds (a pass after this one may have edited the node).
        if node.meta.get(ON_HOST) and _hostable(node):
            args = tuple(host_value(a, node) for a in node.args)
            with graph.inserting_before(node):
                twins[node] = _tagged(graph.call_function(_host_function(node.target), args), node)
    if not twins:
        return 0
    for node in graph.nodes:
        positions = [i for i in node.meta.get(HOST_OPERANDS, ()) if i < len(node.args)
                     and isinstance(node.args[i], torch.fx.Node) and node.args[i] in twins
                     and _accepts_number(node, i)]
        if positions:
            node.args = tuple(twins[a] if i in positions else a for i, a in enumerate(node.args))
    for node in list(graph.nodes):
        fold = _fold(node, lambda n, i: is_host(n.args[i])) if node.meta.get(HOST_FOLD) else None
        if fold is not None:
            # The node keeps its place, value and reuse mark: a marked add becomes addcdiv_ in place.
            target, args, value = fold
            dropped = [node.args[1]] + ([node.args[1].args[0]] if target is aten.addcdiv.default else [])
            node.target, node.args, node.kwargs = target, args, {"value": value}
            for gone in dropped:
                graph.erase_node(gone)
    # The chains that nothing reads any more, then their twins and reads; in reverse order.
    removed = 0
    for node in reversed(list(graph.nodes)):
        if not node.users and (node in twins or node.target is _item or is_host(node)):
            removed += node in twins
            graph.erase_node(node)
    gm.recompile()
    return removed


@register_pass("scalars_on_host", preserves=("cost", "memory", "networkx", "collectives", "state_bytes"))
def scalars_on_host_pass(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Mark the optimizer's 0-dim float64 arithmetic the eager lowering computes as Python floats."""
    nodes, operands, folds = mark_scalars_on_host(graph.graph)
    ctx.stat("marked", nodes)
    ctx.stat("operands_as_numbers", operands)
    ctx.stat("folded", folds)
    return graph
