"""autocast: mixed precision on the whole-step graph, forward and backward together.

What ``torch.autocast`` does op by op while tracing, done here on a captured
step, where the backward is already in the graph:

- Ops of the policy's low-precision list (``mm``, ``addmm``, ``bmm``,
  convolution, attention), in forward *and* backward, compute in ``dtype``:
  their float inputs are cast down. A backward matmul is the gradient of a
  forward one and runs in the same precision, as under autocast.
- Ops of the fp32 list (softmax, norms, losses, exp/log, sum/mean and their
  backward ops) compute in fp32; reductions that take a ``dtype`` argument get
  ``dtype=float32`` instead of a cast, like autocast's ``fp32_set_opt_dtype``.
- Every other op keeps torch's own type promotion (``add`` of bf16 and fp32 is
  fp32 without a cast); where an op refuses mixed dtypes it gets its inputs
  cast to the widest one (autocast's ``promote``).
- The optimizer region is untouched: parameters and optimizer state stay fp32
  (master weights). A value that crosses into it or into the outputs (the
  gradients, the loss) is cast back to the dtype it had before, once per
  parameter, where the backward produces it.
- With ``narrow_saved`` an fp32 activation that the backward reads is kept
  between forward and backward in ``dtype`` and widened again in the backward
  (section "saved activations" below).

Cast hygiene: one cast per (value, dtype), shared by every user in forward
and backward, so a weight is cast once per step; a cast requested through a
view (``t(weight)``) is made on the viewed value and the view replayed, so
``t(w)`` in forward and ``w`` in backward share it; asking for a cast of a
cast returns a cast of its source (no ``cast(cast(x))``); asking for the
dtype a value already has returns the value.

Metadata: each rewritten node's ``meta["val"]`` is recomputed by running the
op on its inputs' fake values, in graph order, so the deep verifier's
re-propagation agrees with every recorded dtype.

The ``overrides`` option lists ``key=dtype`` entries (pipeline text
``autocast{overrides="lm_head=fp32;aten.mm=fp32"}``, the plan's
``autocast_overrides``): a module path (every op of that module and its
submodules, forward and backward) or an op, with or without its overload.
A module path beats an op name; the longest matching path wins.
"""
from __future__ import annotations

import operator
from typing import Any, Literal

import torch
import torch.fx
from torch.fx.node import map_arg

from graph_ir import TrainGraph
from graph_ir.build import add_node, eliminate_dead_code, fake_value
from graph_ir.meta import MODULE_PATH, ORIGIN_PASS, REGION, Region, region_of

from ..pass_manager import PassContext, PassOptionError, register_pass
from ..precision_policy import (DTYPES, FP32, LOW_DTYPES, LOWER, PROMOTE, PrecisionPolicy,
                                get_policy, op_packet_name)

CAST = torch.ops.aten._to_copy.default
_REWRITTEN = (Region.FORWARD, Region.BACKWARD)
# Views whose cast equals the view of the cast and whose input is no bigger
# than their output: casting their input instead lets every view share one cast.
_HOISTABLE_VIEWS = {"t", "transpose", "view", "_unsafe_view", "reshape", "permute", "unsqueeze",
                    "squeeze", "expand", "alias"}


# Arguments of backward ops that are normalization statistics: they stay fp32.
# A low-precision backward op reads them as its forward op produced them (the
# attention backward's logsumexp is fp32 whatever the dtype of q, k and v).
_STATISTICS = {"mean", "rstd", "save_mean", "save_invstd", "logsumexp", "log_sumexp", "total_weight"}
# Marks the backward cast that widens a low-precision saved activation.
WIDENS_SAVED = "autocast_widens_saved"


def _statistic_args(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The inputs of ``node`` that its schema names as normalization or softmax statistics."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return set()
    names = [a.name for a in schema.arguments]
    out = {a for i, a in enumerate(node.args) if i < len(names) and names[i] in _STATISTICS}
    out |= {v for k, v in node.kwargs.items() if k in _STATISTICS}
    return {a for a in out if isinstance(a, torch.fx.Node)}


# Ops whose output dtype is one of their inputs' by definition (a conversion), not a promotion.
_CONVERTING = {"copy", "_to_copy", "copy_", "lift_fresh_copy"}


def _needs_one_dtype(node: torch.fx.Node) -> bool:
    """An aten op without type promotion, given float inputs of several dtypes, must get one.

    Pointwise ops promote (``add`` of bf16 and fp32 is fp32). Most others
    (``index_put``, ``index_add``, ``mm``, ``embedding_dense_backward``) refuse
    mixed dtypes in their CPU kernels while their meta kernels accept them, so a
    fake-value check alone would pass a graph that fails when run. autocast's
    ``promote`` rule (cast to the widest) is what eager autocast would give them.
    """
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    return torch.Tag.pointwise not in target.tags and op_packet_name(target) not in _CONVERTING


class AutocastError(ValueError):
    pass


def is_cast(node: torch.fx.Node) -> bool:
    """A pure dtype conversion: ``_to_copy`` with only a dtype, or ``convert_element_type``."""
    if node.op != "call_function":
        return False
    if node.target is CAST:
        return set(node.kwargs) <= {"dtype"} and "dtype" in node.kwargs
    return node.target is torch.ops.prims.convert_element_type.default


def _dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _is_float(node: Any) -> bool:
    dt = _dtype(node)
    return dt is not None and dt.is_floating_point and dt != torch.float64


def _same_layout(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return a is None and b is None


def _widest(dtypes: list[torch.dtype]) -> torch.dtype:
    out = dtypes[0]
    for dt in dtypes[1:]:
        out = torch.promote_types(out, dt)
    return out


def _parse_overrides(entries: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for entry in entries:
        key, sep, value = entry.rpartition("=")
        if not sep or not key.strip() or value.strip() not in DTYPES:
            raise PassOptionError("autocast", "overrides", f"entry {entry!r} must be 'key=dtype' with dtype "
                                  f"one of {', '.join(DTYPES)}", entries)
        out[key.strip()] = value.strip()
    return out


class _Overrides:
    """Module path or op name -> dtype."""

    def __init__(self, entries: tuple[str, ...], graph: TrainGraph):
        self.paths: dict[str, torch.dtype] = {}
        self.ops: dict[str, torch.dtype] = {}
        known_paths = {n.meta.get(MODULE_PATH, "") for n in graph.compute_nodes()}
        for key, value in _parse_overrides(entries).items():
            dtype = DTYPES[value]
            if key.startswith("aten."):
                self.ops[key.removeprefix("aten.")] = dtype
            elif any(p == key or p.startswith(key + ".") for p in known_paths):
                self.paths[key] = dtype
            else:
                sample = ", ".join(sorted(p for p in known_paths if p and p.count(".") <= 1)[:8])
                raise PassOptionError(
                    "autocast", "overrides",
                    f"key {key!r} names neither an aten op (spelled 'aten.<op>' or 'aten.<op>.<overload>') "
                    f"nor a module path of the graph (e.g. {sample})", entries)

    def lookup(self, node: torch.fx.Node) -> torch.dtype | None:
        path = node.meta.get(MODULE_PATH, "")
        best = None
        for key, dtype in self.paths.items():
            if (path == key or path.startswith(key + ".")) and (best is None or len(key) > len(best[0])):
                best = (key, dtype)
        if best is not None:
            return best[1]
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            packet = op_packet_name(target)
            for name in (f"{packet}.{target._overloadname}", packet):
                if name in self.ops:
                    return self.ops[name]
        return None


class _Rewriter:
    def __init__(self, graph: TrainGraph, low: torch.dtype, policy: PrecisionPolicy, overrides: _Overrides,
                 bias_in_fp32: bool = False):
        self.tg, self.graph = graph, graph.graph
        self.bias_in_fp32 = bias_in_fp32
        self.low, self.policy, self.overrides = low, policy, overrides
        self.mode = graph.fake_mode()
        self.original = {n: _dtype(n) for n in self.graph.nodes}
        self.casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        self.cast_source: dict[torch.fx.Node, torch.fx.Node] = {}
        self.touched: set[torch.fx.Node] = set()
        # autograd sequence number -> the dtypes the forward ops of that number compute in
        self.forward_dtypes: dict[int, set[torch.dtype]] = {}
        self.counts = {"casts_inserted": 0, "set_dtype": 0, "promoted": 0, "boundary_casts": 0,
                       "bias_in_fp32": 0}

    # -- what each node computes in --------------------------------------------------------------
    def compute_dtype(self, node: torch.fx.Node) -> torch.dtype | None:
        """The dtype a node must compute in, or None to follow type promotion.

        A backward node computes in the dtype of the forward op it differentiates
        (the same autograd sequence number), as under eager autocast, where the
        backward formula of a bf16 ``addmm`` runs on bf16 tensors: its weight
        gradient ``mm`` and its bias gradient ``sum`` alike. Where no forward op
        is known, the op's own list decides.
        """
        want = self.overrides.lookup(node)
        packet = op_packet_name(node.target)
        seq = node.meta.get("seq_nr")
        if want is None and region_of(node) == Region.BACKWARD and seq is not None \
                and packet not in _HOISTABLE_VIEWS:
            inherited = self.forward_dtypes.get(seq, set())
            if len(inherited) == 1:
                return next(iter(inherited))
        if want is None:
            category = self.policy.category(packet) if packet else PROMOTE
            want = {LOWER: self.low, FP32: torch.float32}.get(category)
        if region_of(node) == Region.FORWARD and seq is not None and want is not None:
            self.forward_dtypes.setdefault(seq, set()).add(want)
        return want

    # -- casts ---------------------------------------------------------------------------------
    def cast(self, value: torch.fx.Node, dtype: torch.dtype, requester: torch.fx.Node) -> torch.fx.Node:
        if _dtype(value) == dtype:
            return value
        source = self.cast_source.get(value)
        if source is not None:
            return self.cast(source, dtype, requester)
        if (value, dtype) in self.casts:
            return self.casts[(value, dtype)]
        if op_packet_name(value.target) in _HOISTABLE_VIEWS and value.op == "call_function":
            base = value.args[0]
            if isinstance(base, torch.fx.Node) and _is_float(base) and base.op != "get_attr":
                cast = self._replay(value, self.cast(base, dtype, requester))
                self.casts[(value, dtype)] = cast
                return cast
        cast = self._insert_cast(value, dtype, requester)
        self.casts[(value, dtype)] = cast
        return cast

    def _insert_cast(self, value: torch.fx.Node, dtype: torch.dtype, requester: torch.fx.Node) -> torch.fx.Node:
        if value.op == "placeholder":
            where, region, path = self.graph.inserting_before(requester), region_of(requester), \
                requester.meta.get(MODULE_PATH, "")
        else:
            where, region, path = self.graph.inserting_after(value), region_of(value), \
                value.meta.get(MODULE_PATH, "")
        with where:
            cast = self._add(CAST, (value,), {"dtype": dtype}, region, path)
        self.cast_source[cast] = value
        self.counts["casts_inserted"] += 1
        return cast

    def _replay(self, view: torch.fx.Node, new_base: torch.fx.Node) -> torch.fx.Node:
        with self.graph.inserting_after(new_base):
            return self._add(view.target, (new_base, *view.args[1:]), dict(view.kwargs),
                             region_of(new_base) if new_base.op != "placeholder" else region_of(view),
                             view.meta.get(MODULE_PATH, ""))

    # -- new nodes and fake values --------------------------------------------------------------
    def _add(self, target, args: tuple, kwargs: dict, region: Region, path: str) -> torch.fx.Node:
        """A node of this pass at the insertion point; one asked for in region io computes in forward."""
        region = Region.FORWARD if region == Region.IO else region
        node = add_node(self.graph, target, args, kwargs, region=region, module_path=path, origin="autocast",
                        mode=self.mode)
        self.touched.add(node)
        return node

    def _refresh(self, node: torch.fx.Node) -> None:
        old = node.meta.get("val")
        node.meta["val"] = new = fake_value(node.target, node.args, node.kwargs, mode=self.mode)
        # A value whose dtype, shape and strides came out as before leaves its users' values as
        # they were: they are not re-run (a quarter of the refreshes of a bf16 GPT step).
        if not _same_layout(old, new):
            self.touched.add(node)

    # -- rewriting ------------------------------------------------------------------------------
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "output" or (node.op == "call_function" and region_of(node) == Region.OPTIMIZER):
                self._restore_boundary(node)
            elif node.op == "call_function" and region_of(node) in _REWRITTEN and node not in self.touched:
                self._rewrite(node)

    def _rewrite(self, node: torch.fx.Node) -> None:
        want = self.compute_dtype(node) if node.target is not operator.getitem else None
        if self.bias_in_fp32 and want is not None and want != torch.float32 and self._bias_joins_fp32_sum(node):
            # Matmul in low precision, bias added in fp32: the backward ops of this
            # addmm no longer share one dtype, so each follows its own list.
            self.forward_dtypes.setdefault(node.meta.get("seq_nr"), set()).add(torch.float32)
            node, want = self._split_bias(node), None
        changed = False
        if want is not None and not is_cast(node):
            changed = self._cast_inputs(node, want)
        elif want is None:
            changed = self._follow_input_dtype(node)
        if changed or any(a in self.touched for a in node.all_input_nodes):
            if want is None and _needs_one_dtype(node) and len(self._float_input_dtypes(node)) > 1:
                self._promote(node, None)
                return
            try:
                self._refresh(node)
            except Exception as exc:  # an op that refuses mixed dtypes: promote its inputs
                self._promote(node, exc)

    @staticmethod
    def _float_input_dtypes(node: torch.fx.Node) -> set[torch.dtype]:
        keep = _statistic_args(node)
        return {_dtype(a) for a in node.all_input_nodes if _is_float(a) and a not in keep}

    def _cast_inputs(self, node: torch.fx.Node, want: torch.dtype) -> bool:
        """Cast float inputs to ``want``; use the op's own dtype argument where it has one."""
        schema = node.target._schema if isinstance(node.target, torch._ops.OpOverload) else None
        names = {a.name for a in schema.arguments} if schema else set()
        if "dtype" in names and want == torch.float32 and node.kwargs.get("dtype") is None \
                and op_packet_name(node.target) in self.policy.set_opt_dtype:
            if any(_is_float(a) and _dtype(a) != want for a in node.all_input_nodes):
                node.kwargs = {**node.kwargs, "dtype": want}
                self.counts["set_dtype"] += 1
                return True
            return False
        before = (node.args, node.kwargs)
        keep = _statistic_args(node)

        def cast(a):
            return self.cast(a, want, node) if _is_float(a) and a not in keep else a
        node.args = map_arg(node.args, cast)
        node.kwargs = map_arg(node.kwargs, cast)
        if "input_dtype" in names and schema is not None:
            self._set_input_dtype(node, schema, want)
        return (node.args, node.kwargs) != before

    def _follow_input_dtype(self, node: torch.fx.Node) -> bool:
        """A backward op that names its forward input's dtype follows the dtypes it now reads."""
        schema = getattr(node.target, "_schema", None)
        if schema is None or "input_dtype" not in {a.name for a in schema.arguments}:
            return False
        floats = [_dtype(a) for a in node.all_input_nodes if _is_float(a)]
        if not floats:
            return False
        before = (node.args, node.kwargs)
        self._set_input_dtype(node, schema, _widest(floats))
        return (node.args, node.kwargs) != before

    @staticmethod
    def _set_input_dtype(node: torch.fx.Node, schema, want: torch.dtype) -> None:
        # _softmax_backward_data and friends name the dtype the forward op read;
        # that is now ``want``, and it decides the gradient's dtype.
        index = [a.name for a in schema.arguments].index("input_dtype")
        if index < len(node.args):
            node.args = (*node.args[:index], want, *node.args[index + 1:])
        else:
            node.kwargs = {**node.kwargs, "input_dtype": want}

    def _promote(self, node: torch.fx.Node, cause: Exception | None) -> None:
        floats = sorted(self._float_input_dtypes(node), key=str)
        if len(floats) < 2:
            raise AutocastError(f"node {node.name} ({node.target}) fails on its fake inputs after "
                                f"autocast: {type(cause).__name__}: {cause}") from cause
        widest = _widest(floats)
        keep = _statistic_args(node)

        def cast(a):
            return self.cast(a, widest, node) if _is_float(a) and a not in keep else a
        node.args = map_arg(node.args, cast)
        node.kwargs = map_arg(node.kwargs, cast)
        self.counts["promoted"] += 1
        self._refresh(node)

    # -- a bias that an fp32 sum would promote anyway -------------------------------------------
    def _bias_joins_fp32_sum(self, node: torch.fx.Node) -> bool:
        """``addmm(b, x, w)`` whose result only feeds ``add``/``sub`` with an fp32 tensor.

        The output of such a linear (an attention or MLP output projection
        joining the residual stream) is promoted to fp32 by its consumer anyway;
        adding the bias there, in fp32, needs no low-precision copy of the bias.
        """
        if node.target is not torch.ops.aten.addmm.default or node.kwargs or region_of(node) != Region.FORWARD:
            return False
        if _dtype(node.args[0]) != torch.float32:
            return False
        frontier, seen_sum = list(node.users), False
        while frontier:
            user = frontier.pop()
            if op_packet_name(user.target) in _HOISTABLE_VIEWS:
                frontier.extend(user.users)
                continue
            if user.target not in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor) or user.kwargs:
                return False
            others = [a for a in user.args[:2] if isinstance(a, torch.fx.Node) and a not in (node,)
                      and not (op_packet_name(a.target) in _HOISTABLE_VIEWS and a.args[0] is node)]
            if len(others) != 1 or _dtype(others[0]) != torch.float32:
                return False
            seen_sum = True
        return seen_sum

    def _split_bias(self, node: torch.fx.Node) -> torch.fx.Node:
        bias, x, w = node.args[:3]
        with self.graph.inserting_before(node):
            mm = self.graph.call_function(torch.ops.aten.mm.default, (x, w))
        mm.meta.update({k: node.meta[k] for k in (REGION, MODULE_PATH) if k in node.meta})
        mm.meta[ORIGIN_PASS] = "autocast"
        node.target, node.args = torch.ops.aten.add.Tensor, (mm, bias)
        self.counts["bias_in_fp32"] += 1
        self._rewrite(mm)
        return node

    # -- saved activations ----------------------------------------------------------------------
    def narrow_saved(self) -> int:
        """Keep fp32 activations that the backward reads in low precision between the two.

        The backward reads them through a widening cast placed in the backward,
        so the fp32 ops there (norm, softmax and loss backward) still compute in
        fp32; what lives from forward to backward is the low-precision copy, often
        one the forward made anyway (the softmax output cast for the next matmul).
        Normalization statistics (``mean``, ``rstd``) stay fp32: they are small
        and every gradient of the norm is scaled by them.
        """
        widened: dict[torch.fx.Node, torch.fx.Node] = {}
        replayed: dict[torch.fx.Node, torch.fx.Node] = {}
        narrowed = 0
        for node in list(self.graph.nodes):
            if node.op != "call_function" or region_of(node) != Region.BACKWARD:
                continue
            for arg in list(node.all_input_nodes):
                chain = self._saved_chain(node, arg)
                if chain is None:
                    continue
                root = chain[0]
                if root not in widened:
                    widened[root] = self._widen(self.cast(root, self.low, node), node)
                    narrowed += 1
                new = widened[root]
                for view in chain[1:]:
                    if view not in replayed:
                        replayed[view] = self._replay_before(view, new, node)
                    new = replayed[view]
                node.replace_input_with(arg, new)
        return narrowed

    def _saved_chain(self, reader: torch.fx.Node, arg: torch.fx.Node) -> list[torch.fx.Node] | None:
        """[root, view, ..., arg] when ``arg`` is (a view of) a narrowable forward activation."""
        chain = [arg]
        while op_packet_name(chain[0].target) in _HOISTABLE_VIEWS and region_of(chain[0]) == Region.FORWARD:
            chain.insert(0, chain[0].args[0])
        root = chain[0]
        if root.op != "call_function" or region_of(root) != Region.FORWARD or _dtype(root) != torch.float32:
            return None
        if is_cast(root) or root.meta["val"].numel() <= 1 or self._is_statistic(reader, arg):
            return None
        return chain

    @staticmethod
    def _is_statistic(reader: torch.fx.Node, arg: torch.fx.Node) -> bool:
        schema = getattr(reader.target, "_schema", None)
        if schema is None:
            return False
        names = [a.name for a in schema.arguments]
        for i, a in enumerate(reader.args):
            if a is arg and i < len(names) and names[i] in _STATISTICS:
                return True
        return any(v is arg and k in _STATISTICS for k, v in reader.kwargs.items())

    def _widen(self, low: torch.fx.Node, reader: torch.fx.Node) -> torch.fx.Node:
        # Deliberately cast(cast(x)): the narrow copy is the saved activation.
        with self.graph.inserting_before(reader):
            wide = self._add(CAST, (low,), {"dtype": torch.float32}, Region.BACKWARD,
                             reader.meta.get(MODULE_PATH, ""))
        wide.meta[WIDENS_SAVED] = True
        self.counts["casts_inserted"] += 1
        return wide

    def _replay_before(self, view: torch.fx.Node, base: torch.fx.Node, reader: torch.fx.Node) -> torch.fx.Node:
        with self.graph.inserting_before(reader):
            return self._add(view.target, (base, *view.args[1:]), dict(view.kwargs), Region.BACKWARD,
                             view.meta.get(MODULE_PATH, ""))

    def _restore_boundary(self, node: torch.fx.Node) -> None:
        """Values read by the optimizer or the outputs keep the dtype they had before."""
        def restore(arg: torch.fx.Node) -> torch.fx.Node:
            was = self.original.get(arg)
            if was is None or _dtype(arg) == was:
                return arg
            self.counts["boundary_casts"] += 1
            return self.cast(arg, was, node)
        node.args = map_arg(node.args, restore)
        node.kwargs = map_arg(node.kwargs, restore)


def count_casts(graph: torch.fx.Graph) -> int:
    """``_to_copy`` and ``convert_element_type`` nodes: what a cast count means in this project."""
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in (
        CAST, torch.ops.prims.convert_element_type.default))


@register_pass("autocast", preserves=())
def autocast_pass(graph: TrainGraph, ctx: PassContext, *, dtype: Literal[tuple(LOW_DTYPES)] = "bf16", policy: str = "cuda",
                  narrow_saved: bool = True, bias_in_fp32: bool = False,
                  overrides: tuple[str, ...] = ()) -> TrainGraph:
    """Matmul-class ops in ``dtype``, numerically sensitive ops in fp32, master weights fp32.

    ``bias_in_fp32`` adds the bias of a linear whose output joins an fp32 sum (the
    residual stream) in fp32 instead of in ``dtype``: no low-precision copy of the bias,
    one rounding less, but no longer what eager autocast computes (its fp16 bias
    gradient can overflow where this one does not), so it is off by default.
    """
    if dtype not in LOW_DTYPES:
        raise AutocastError(f"autocast option dtype={dtype!r}: must be one of {', '.join(LOW_DTYPES)}")
    rewriter = _Rewriter(graph, LOW_DTYPES[dtype], get_policy(policy), _Overrides(overrides, graph), bias_in_fp32)
    before = count_casts(graph.graph)
    rewriter.run()
    if narrow_saved:
        rewriter.counts["narrowed_saved"] = rewriter.narrow_saved()
    eliminate_dead_code(graph.graph)
    for key, value in rewriter.counts.items():
        ctx.stat(key, value)
    ctx.stat("casts", count_casts(graph.graph) - before)
    return graph
