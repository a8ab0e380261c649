"""Drive torchair's own FX->GE path on an aten-level GraphModule, offline.

We reuse torchair's ``GeConcreteGraph`` (the object that owns the GE GraphDef
and whose ``parse_input``/``parse_node``/``parse_output`` call the registered
converters) and its FX interpreter ``_NpuGraphConverter``, with two changes:

* output metadata comes from ``node.meta["val"]`` instead of re-running every
  op under a fresh FakeTensorMode (no fake-mode mixing, no re-tracing);
* a node whose converter is missing, is a ``raise NotImplementedError``-style
  stub, or fails, is recorded as :class:`UnsupportedOp` and replaced by a
  placeholder GE op whose type is the aten overload name (torchair's own
  "mock node" helper), so lowering continues and reports every gap at once.

torchair's GE graph passes (``optimize_graph_without_runtime``: dead-data
removal, input/output attrs, ref-data and transpose-into-mm passes,
``_normalize_ge_graph``) run afterwards, i.e. the GraphDef is what torchair
would hand to ``GeGraph.load`` -- the first step that needs CANN.
"""

from __future__ import annotations

import ast
import collections
import functools
import inspect
import textwrap
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ._loader import load_torchair

_LOCK = threading.RLock()  # torchair's default-graph / converter state is process global


@dataclass
class UnsupportedOp:
    node: str
    target: str
    module_path: str | None
    reason: str

    def __str__(self) -> str:
        where = f" [{self.module_path}]" if self.module_path else ""
        return f"{self.node}: {self.target}{where}: {self.reason}"


@dataclass
class GeLoweringReport:
    name: str
    graph_text: str
    op_histogram: dict[str, int]
    unsupported: list[UnsupportedOp]
    ok: bool
    notes: list[str] = field(default_factory=list)
    graph_def: Any = None  # torchair ge_ir_pb2.GraphDef (protobuf), if built

    def summary(self) -> str:
        lines = [f"GE graph {self.name}: ok={self.ok}, {sum(self.op_histogram.values())} ops"]
        for op_type, n in sorted(self.op_histogram.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {n:5d}  {op_type}")
        if self.unsupported:
            lines.append(f"unsupported ({len(self.unsupported)}):")
            lines.extend(f"  {u}" for u in self.unsupported)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


# --------------------------------------------------------------------------- registry


def _is_stub(fn) -> bool:
    """True if the converter body (docstring aside) is one unconditional ``raise``."""
    fn = inspect.unwrap(fn)
    try:
        return _is_stub_source(fn)
    except TypeError:        # unhashable: read it each time
        return _is_stub_source.__wrapped__(fn)


@functools.lru_cache(maxsize=None)
def _is_stub_source(fn) -> bool:
    # cached per converter: reading and parsing its source was 40% of lowering a graph
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    body = [
        s for s in getattr(tree, "body", [])
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))
    ]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


@functools.lru_cache(maxsize=None)
def _registry() -> dict[str, tuple[Any, bool]]:
    """{op name: (OpOverload, is_real)} for every converter torchair registered."""
    load_torchair()
    import sys

    from torchair._ge_concrete_graph.fx2ge_converter import Converter

    ops: dict[str, Any] = {}
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("torchair._ge_concrete_graph.ge_converter") or mod is None:
            continue
        for v in list(vars(mod).values()):
            if isinstance(v, Converter) and isinstance(v._aten_op, torch._ops.OpOverload):
                ops[str(v._aten_op)] = v._aten_op
    out = {}
    for name, op in ops.items():
        conv = getattr(op, "_ge_converter", None)
        out[name] = (op, conv is not None and not _is_stub(conv))
    return out


def supported_ops() -> set[str]:
    """Overload names (``"aten.addmm.default"``, ``"_c10d_functional.all_reduce.default"``, ...)
    that have a real (non-stub) torchair FX->GE converter: torchair's own, and ours
    (``cann_passes.lowering.ge_converters``: transformers' grouped matmuls, the all-to-alls)."""
    return {name for name, (_, real) in _registry().items() if real} | _our_converters()


def _our_converters() -> set[str]:
    load_torchair()
    from ..ge_converters import register
    return register()


def _unsupported_reason(target) -> str | None:
    """Static verdict for OpOverload targets; None means "try the converter"."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    conv = getattr(target, "_ge_converter", None)
    if conv is None:
        return "no torchair FX->GE converter registered"
    if _is_stub(conv):
        return "torchair converter is a stub (raises NotImplementedError/not supported)"
    return None


def _module_path(node: torch.fx.Node | None) -> str | None:
    if node is None:
        return None
    custom = node.meta.get("custom") or {}
    mp = custom.get("module_path") if isinstance(custom, dict) else None
    mp = mp or node.meta.get("module_path")
    if not mp:
        stack = node.meta.get("nn_module_stack")
        if stack:
            last = list(stack.values())[-1]
            mp = last[0] if isinstance(last, tuple) else str(last)
    return mp


def _target_name(target) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


# --------------------------------------------------------------------------- driver


class _Abort(Exception):
    pass


@functools.lru_cache(maxsize=None)
def _classes():
    load_torchair()
    from torchair._ge_concrete_graph.fx2ge_converter import GeConcreteGraph, set_ge_outputs
    from torchair.ge._ge_graph import get_default_ge_graph
    from torchair.npu_fx_compiler import _NpuGraphConverter, _is_binary_operator
    from torch._dynamo.trace_rules import is_builtin_callable

    class OfflineGeConcreteGraph(GeConcreteGraph):
        def __init__(self, *a, inputs_on_device: bool = True, **kw):
            super().__init__(*a, **kw)
            self.unsupported: list[UnsupportedOp] = []
            self._inputs_on_device = inputs_on_device

        def parse_input(self, target, args, kwargs, meta_outputs):
            data = super().parse_input(target, args, kwargs, meta_outputs)
            # The FX graph was traced on CPU, but on the NPU tensor inputs live in device
            # memory: mark them as torchair would for npu tensors (not host tensors).
            if (
                self._inputs_on_device
                and isinstance(meta_outputs, torch.Tensor)
                and hasattr(data, "node")
                and data.node.type == "Data"
            ):
                op = data.node
                for desc in list(op.input_desc) + list(op.output_desc):
                    desc.device_type = "NPU"
                if "_host_tensor" in op.attr:
                    del op.attr["_host_tensor"]
                info = self.graph._named_inputs_info.get(op.name)
                if info is not None:
                    info.device_type = "NPU"
            return data

        def _record(self, target, reason):
            node = getattr(self._converter_ctx, "node", None)
            self.unsupported.append(
                UnsupportedOp(
                    node=node.name if node is not None else "?",
                    target=_target_name(target),
                    module_path=_module_path(node),
                    reason=reason,
                )
            )

        def parse_node(self, target, args, kwargs, meta_outputs):
            graph = get_default_ge_graph()
            n0 = len(graph.op)
            reason = _unsupported_reason(target)
            if reason is None:
                try:
                    return super().parse_node(target, args, kwargs, meta_outputs)
                except Exception as e:  # noqa: BLE001 - every converter failure becomes a report entry
                    reason = f"converter raised {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                    del graph.op[n0:]
            self._record(target, reason)
            if not isinstance(target, torch._ops.OpOverload):
                raise _Abort(f"cannot continue after unsupported non-OpOverload target {_target_name(target)}")
            try:
                ge_outputs = self._create_mock_node_for_op(target, args, kwargs)
                if meta_outputs is not None:
                    set_ge_outputs(ge_outputs, meta_outputs)
            except Exception as e:  # noqa: BLE001
                raise _Abort(f"could not build a placeholder GE op for {_target_name(target)}: {e}") from e
            return ge_outputs

    class OfflineFxToGe(_NpuGraphConverter):
        """torchair's interpreter, but meta comes from node.meta['val']."""

        _node = None

        def run_node(self, n):
            self._node = n
            return super().run_node(n)

        def _wrap(self, fn):
            def inner(target, args, kwargs):
                func = getattr(torch.fx.Interpreter, fn).__get__(self)
                if is_builtin_callable(target) and not _is_binary_operator(target):
                    return func(target, args, kwargs)
                node = self._node
                if "val" not in node.meta:
                    raise _Abort(f"node {node.name} ({_target_name(target)}) has no meta['val']")
                meta_outputs = node.meta["val"]
                if target is torch.ops.aten.view.default:  # torchair's _view_to_reshape FX pass
                    target = torch.ops.aten.reshape.default
                args_npu, kwargs_npu = self._unpack_npu(args, kwargs)
                npu_outputs = self._graph.parse_node(target, args_npu, kwargs_npu, meta_outputs)
                return self._get_value_pack(meta_outputs, npu_outputs)

            return inner

    return OfflineGeConcreteGraph, OfflineFxToGe


def _graph_text(proto) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(proto)


def lower_to_ge(
    gm: torch.fx.GraphModule, *, name: str, optimize: bool = True, inputs_on_device: bool = True
) -> GeLoweringReport:
    """Lower an aten-level, functional FX graph (meta['val'] on every node) to a GE GraphDef
    using torchair's converters.  Never raises for unsupported ops; see ``report.unsupported``.

    ``optimize`` runs torchair's pre-load GE graph passes (as ``torch.compile`` would).
    ``inputs_on_device`` marks tensor inputs as NPU-resident (the graph is usually traced on CPU);
    SymInt inputs stay host tensors, as in torchair.
    """
    _our_converters()
    OfflineGeConcreteGraph, OfflineFxToGe = _classes()
    from torchair.configs.compiler_config import CompilerConfig

    notes: list[str] = []
    example_inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    with _LOCK, warnings.catch_warnings():
        # torchair's hcom converters call a deprecated c10d helper; not actionable here
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
        warnings.filterwarnings("ignore", message="Multiple backends are registered.*")
        concrete = OfflineGeConcreteGraph(CompilerConfig(), name=name, inputs_on_device=inputs_on_device)
        concrete.save_fx_graph(gm)
        try:
            OfflineFxToGe(gm, graph=concrete, garbage_collect_values=False).run(*example_inputs)
        except _Abort as e:
            notes.append(f"lowering aborted: {e}")
        except Exception as e:  # noqa: BLE001
            notes.append(f"lowering aborted: {type(e).__name__}: {e}")
        aborted = bool(notes)
        if optimize and not aborted:
            try:
                from torchair._utils.graph_transform_observer import GraphTransformObserver

                observer = GraphTransformObserver(gm, example_inputs, concrete.config)
                concrete.optimize_graph_without_runtime(*example_inputs, observer=observer, aot_gm=gm)
            except Exception as e:  # noqa: BLE001
                notes.append(f"torchair GE graph passes failed, graph is unoptimized: {type(e).__name__}: {e}")
        proto = concrete.graph._proto
        hist = dict(collections.Counter(op.type for op in proto.op))
        return GeLoweringReport(
            name=name,
            graph_text=_graph_text(proto),
            op_histogram=hist,
            unsupported=list(concrete.unsupported),
            ok=not concrete.unsupported and not aborted,
            notes=notes,
            graph_def=proto,
        )
