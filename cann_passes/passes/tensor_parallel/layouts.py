"""Which parameter is split how: rules matched to parameter paths, dimensions read from the graph."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx

from graph_ir import TrainGraph
from graph_ir.meta import MODULE_PATH, Region, region_of
from graph_ir.signature import InputKind, split_state_name

from .common import TensorParallelError, TensorParallelRuleError, aten
from .rules import Rule


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


_CASTS = (aten._to_copy.default, aten.clone.default, aten.alias.default)


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


def assign_layouts(graph: TrainGraph, rules: list[Rule], tp: int, *, user_rules: Iterable[Rule] = ()
                   ) -> dict[str, ParamLayout]:
    """Every parameter's layout; refuses a user rule that matches nothing and sizes tp does not divide."""
    params = [s.name for _, s in graph.signature.inputs_of(InputKind.PARAM)]
    matched: set[Rule] = set()
    layouts = {}
    user_rules = list(user_rules)
    for name in params:
        module, leaf = _module_and_leaf(name)
        rule = next((r for r in rules if fnmatch.fnmatchcase(module, r.pattern)), None)
        try:
            layouts[name] = _layout_of(graph, name, leaf, rule, tp)
        except TensorParallelError as exc:
            raise TensorParallelRuleError("extra_rules" if rule in user_rules else "rules", str(exc),
                                          str(rule)) from None
        if rule is not None:
            matched.add(rule)
    for rule in user_rules:
        if rule not in matched:
            raise TensorParallelRuleError("extra_rules", f"tensor_parallel rule '{rule}' matches no parameter "
                                          f"(parameters look like {', '.join(params[:3])}, ...)", str(rule))
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


def layout_for(spec, layouts: dict[str, ParamLayout]) -> ParamLayout | None:
    """The layout of a graph input or output: its parameter's, or that of the parameter an
    optimizer state belongs to (the step counter stays whole)."""
    if spec.kind == InputKind.PARAM:
        return layouts.get(spec.name)
    if spec.kind == InputKind.OPT_STATE:
        param, key = split_state_name(spec.name)
        layout = layouts.get(param)
        return layout if key != "step" else None
    return None


def check_heads(graph: TrainGraph, layouts: dict[str, ParamLayout], tp: int) -> dict[str, ParamLayout]:
    """A column-parallel output viewed as [..., heads, head_dim] must split whole heads over tp.

    Key/value projections with fewer heads than tp ranks, tp a multiple of them (GQA: LLaMA-70B's 8
    kv heads at tp=16), are replicated instead, as Megatron replicates kv heads: every rank computes
    all of K and V (small next to Q under GQA) and keeps the query heads' share after the head
    repeat; their gradient is the sum over the ranks' query heads, reduced by the rewrite.
    Returns the layouts with those projections (weight and bias) replicated."""
    replicated: dict[str, str] = {}
    for name, layout in layouts.items():
        if layout.dim is None or not name.endswith("weight"):
            continue
        node = graph.input_node(InputKind.PARAM, name)
        if not layout.rule.split("=")[1].startswith("column"):
            continue
        for view in _forward_head_views(node):
            heads = int(view.meta["val"].shape[-2])
            if heads % tp:
                module, _ = _module_and_leaf(name)
                kv = _module_and_leaf(module)[1] in KV_PROJECTIONS
                if kv and tp % heads == 0 and layout.parts == 1:
                    replicated[module] = f"{layout.rule} ({heads} kv heads replicated over tp={tp})"
                    break
                kind = "kv heads" if kv else "heads"
                raise TensorParallelError(
                    f"parameter '{name}' (rule '{layout.rule}'): {heads} {kind} (viewed at node "
                    f"{view.name}, module '{view.meta.get(MODULE_PATH, '')}') are not divisible by tp={tp}"
                    + (" (rule: kv heads fewer than tp are replicated when tp is a multiple of them)" if kv else ""))
    return {name: (ParamLayout(name, None, 1, replicated[_module_and_leaf(name)[0]])
                   if _module_and_leaf(name)[0] in replicated else layout) for name, layout in layouts.items()}


KV_PROJECTIONS = ("k_proj", "v_proj", "key", "value", "wk", "wv")


def _forward_head_views(param: torch.fx.Node):
    """Forward views splitting the last dim of (a part of) this weight's matmul output into
    [..., heads, head_dim]: the heads a column-parallel split divides among the ranks. The walk
    passes one matmul, the weight's own: past it (a residual add into the next layer) the views
    belong to other weights."""
    matmuls = {aten.mm.default, aten.addmm.default, aten.matmul.default}
    passing = {aten.t.default, aten.add.Tensor, aten.view.default, aten._unsafe_view.default,
               aten.reshape.default, aten.split.Tensor, aten.split_with_sizes.default, aten.mul.Tensor,
               *matmuls, *_CASTS}
    seen, stack = set(), [(u, 0) for u in param.users]
    while stack:
        n, passed = stack.pop()
        if n in seen or region_of(n) != Region.FORWARD or len(seen) > 64:
            continue
        seen.add(n)
        if n.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            out, src = n.meta["val"].shape, n.args[0].meta["val"].shape
            if len(out) == len(src) + 1 and out[-2] * out[-1] == src[-1] and list(out[:-2]) == list(src[:-1]):
                yield n
                continue
        passed += n.target in matmuls
        if passed <= 1 and (n.target in passing or getattr(n.target, "__name__", "") == "getitem"):
            stack.extend((u, passed) for u in n.users)
