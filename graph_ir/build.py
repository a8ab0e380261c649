"""Making and re-deriving fake values: new nodes of a pass, and whole graphs re-run on fake inputs.

A node a pass adds must look like a captured one (see :mod:`graph_ir.meta`):
a fake value in the graph's own fake mode, a region, a module path, and here
also the pass that made it, so dumps and lowering reports can say where it
came from.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .meta import MODULE_PATH, ORIGIN_PASS, REGION, Region, is_fake


def fake_value(target, args: tuple, kwargs: dict | None = None, *, mode) -> Any:
    """What ``target`` returns when its node arguments are replaced by their ``meta["val"]``.

    ``mode`` is the graph's FakeTensorMode (``TrainGraph.fake_mode()``): values made
    outside it would not mix with the graph's others. Results are remembered per mode
    (see :class:`_Memo`): a stack of identical layers asks the same question once per layer.
    """
    vals, kw = torch.fx.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    if mode is None:
        return target(*vals, **kw)
    memo = _MEMOS.get(mode)
    if memo is None:
        memo = _MEMOS[mode] = _Memo(mode)
    return memo(target, vals, kw)


class _Memo:
    """``target(*vals, **kw)`` under a fake mode, answered from the first identical call.

    A fake op's result is a function of the op, its non-tensor arguments and its
    tensor inputs' metadata (dtype, shape, strides, storage offset, device, and which
    inputs are the same tensor), as FakeTensorMode's own dispatch cache assumes. That
    cache answers in about a millisecond per op (hashing every argument, rebuilding
    through the dispatcher); a 7B-shaped step's passes ask a few thousand such
    questions, so this one keys on the metadata directly and rebuilds the answer as a
    meta tensor wrapped in the mode, a fraction of that. The first answer says how to
    rebuild: outputs that share no input's storage become fresh buffers of the same
    layout; a single output that shares the storage of one argument (a view, or
    ``_unsafe_view``, whose schema does not say so) is set to that argument's storage
    at the same offset, as FakeTensorMode's cache rebuilds a view. Always run:
    mutating ops, non-aten targets, constant tensors, tensors that require grad or are
    not plain dense strided ones, and results that are not plain tensors (or a
    tuple/list of plain tensors, ``None`` and Python numbers).
    """

    def __init__(self, mode):
        self.mode = mode
        self.entries: dict = {}
        self.hits = self.misses = 0

    def __call__(self, target, vals, kw):
        key = _memo_key(target, vals, kw)
        if key is not None:
            entry = self.entries.get(key)
            if entry is not None:
                self.hits += 1
                return _rebuild(entry, self.mode, vals)
        with self.mode:
            out = target(*vals, **kw)
        self.misses += 1
        if key is not None:
            entry = _template(out, vals)
            if entry is not None:
                self.entries[key] = entry
        return out


_MEMOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_ANSWERABLE: dict = {}


def _answerable(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return not schema.is_mutable and not any(a.alias_info is not None and a.alias_info.is_write
                                             for a in schema.arguments)


class _Uncacheable(Exception):
    pass


def _plain_fake(v) -> bool:
    return is_fake(v) and v.constant is None and not v.requires_grad and v.layout == torch.strided \
        and not v.is_conj() and not v.is_neg()


def _memo_key(target, vals, kw):
    if target not in _ANSWERABLE:
        _ANSWERABLE[target] = _answerable(target)
    if not _ANSWERABLE[target]:
        return None
    seen: dict[int, int] = {}

    def describe(v):
        if isinstance(v, torch.Tensor):
            if not _plain_fake(v):
                raise _Uncacheable
            first = seen.setdefault(id(v), len(seen))
            return ("T", v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.device, first)
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(describe(x) for x in v))
        if isinstance(v, _PLAIN):
            return (type(v).__name__, v)
        raise _Uncacheable
    try:
        return (target, tuple(describe(v) for v in vals), tuple(sorted((k, describe(v)) for k, v in kw.items())))
    except _Uncacheable:
        return None


def _storages(vals) -> list:
    out = []
    for v in vals:
        if isinstance(v, torch.Tensor):
            out.append(v.untyped_storage()._cdata)
        elif isinstance(v, (list, tuple)):
            out.extend(_storages(v))
    return out


def _template(out, vals):
    """How to rebuild ``out`` for the same question, or None when it is not rebuilt."""
    inputs = _storages(vals)
    if isinstance(out, torch.Tensor) and _plain_fake(out):
        storage = out.untyped_storage()._cdata
        if storage in inputs:
            viewed = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)
                      and v.untyped_storage()._cdata == storage]
            if len(viewed) != 1 or inputs.count(storage) != 1 or out.dtype != vals[viewed[0]].dtype \
                    or out.device != vals[viewed[0]].device:
                return None
            return ("view", viewed[0], tuple(out.shape), out.stride(), out.storage_offset())
    fresh = _fresh_template(out, set(inputs))
    return None if fresh is None else ("fresh", fresh)


def _fresh_template(out, inputs: set):
    if isinstance(out, torch.Tensor):
        if not _plain_fake(out) or out.storage_offset() != 0 or out.untyped_storage()._cdata in inputs:
            return None
        meta = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        if meta.untyped_storage().nbytes() != out.untyped_storage().nbytes():
            return None
        return ("T", tuple(out.shape), out.stride(), out.dtype, out.device)
    if type(out) in (list, tuple):
        items = [_fresh_template(x, inputs) for x in out]
        if any(i is None for i in items):
            return None
        storages = [x.untyped_storage()._cdata for x in out if isinstance(x, torch.Tensor)]
        if len(set(storages)) != len(storages):   # two outputs of one buffer
            return None
        return (type(out), items)
    if isinstance(out, (int, float, bool, type(None))):
        return ("V", out)
    return None


def _rebuild(entry, mode, vals):
    if entry[0] == "view":
        # As FakeTensorMode's own cache rebuilds a view: a meta tensor set to the base's storage.
        _, index, shape, stride, offset = entry
        base = vals[index]
        with in_kernel_invocation_manager(mode):
            empty = torch.empty_strided(shape, stride, dtype=base.dtype, device="meta")
            empty.set_(base.untyped_storage(), offset, shape, stride)
        return FakeTensor(mode, empty, base.device)
    return _rebuild_fresh(entry[1], mode)


def _rebuild_fresh(entry, mode):
    kind = entry[0]
    if kind == "T":
        _, shape, stride, dtype, device = entry
        return FakeTensor(mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)
    if kind == "V":
        return entry[1]
    return kind([_rebuild_fresh(e, mode) for e in entry[1]])


def tag(node: torch.fx.Node, *, region: Region | str, module_path: str, origin: str) -> None:
    node.meta[REGION] = Region(region).value
    node.meta[MODULE_PATH] = module_path
    node.meta[ORIGIN_PASS] = origin


def add_node(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None, *,
             region: Region | str, module_path: str, origin: str, mode, val: Any = None) -> torch.fx.Node:
    """A ``call_function`` node at ``graph``'s insertion point, tagged, with its fake value (``val``
    when the caller has already computed it in ``mode``)."""
    node = graph.call_function(target, args, kwargs)
    tag(node, region=region, module_path=module_path, origin=origin)
    node.meta["val"] = val if val is not None else fake_value(target, node.args, node.kwargs, mode=mode)
    return node


def propagate_fake_values(gm: torch.fx.GraphModule, inputs: Sequence[Any],
                          mode: FakeTensorMode | None = None) -> torch.fx.GraphModule:
    """Set every node's ``meta["val"]`` by running ``gm`` on fake copies of ``inputs``.

    Tensors already fake in ``mode`` are used as they are; other tensors (real, or
    fake in another mode) are converted. Non-tensor inputs pass through.
    """
    mode = mode if mode is not None else FakeTensorMode(allow_non_fake_inputs=True)
    fake = [t if is_fake(t) and t.fake_mode is mode
            else mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake)
    return gm


def eliminate_dead_code(graph: torch.fx.Graph) -> int:
    """``Graph.eliminate_dead_code`` for the graphs of this IR; returns the number of nodes removed.

    torch's asks every node whether it is impure before looking at its users (and lints
    the whole graph first), half a second per call on a 7B-shaped step; here only nodes
    without users are asked, and an op's answer is remembered for the call (for an aten
    op it depends on its schema and tags alone). The same nodes go: those without
    users that ``Node.is_impure`` calls pure, in reverse order. A graph that calls
    submodules is left to torch's (it also cleans their graphs).
    """
    if graph.find_nodes(op="get_attr") and graph.owning_module is not None and any(
            isinstance(getattr(graph.owning_module, n.target, None), torch.fx.GraphModule)
            for n in graph.find_nodes(op="get_attr")):
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        return before - len(graph.nodes)
    impure = ImpurityCache()
    removed = 0
    for node in reversed(graph.nodes):
        if not node.users and not impure(node):
            graph.erase_node(node)
            removed += 1
    return removed


class ImpurityCache:
    """``node.is_impure()``, remembered per aten op (whose answer depends on the op alone)."""

    def __init__(self):
        self._by_op: dict = {}

    def __call__(self, node: torch.fx.Node) -> bool:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            known = self._by_op.get(node.target)
            if known is None:
                known = self._by_op[node.target] = node.is_impure()
            return known
        return node.is_impure()
