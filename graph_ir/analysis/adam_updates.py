"""Where a graph's optimizer region computes one tensor's Adam or AdamW update.

The chain is recognised by its computation, not by names: the reference is
:func:`graph_ir.optimizers.adam_update` itself, traced once per structural variant (decoupled
decay or not, weight decay or none, amsgrad) into a small aten graph; a match is a
node whose inputs, followed back, compute exactly that graph: the same ops with the same
non-tensor arguments, reading the reference's inputs consistently (one graph node per
reference input). The parameter, gradient and state may be any values (a ZeRO shard, a
tensor-parallel piece, an unscaled or clipped gradient). A value the chain computes from the
hyperparameters alone (``1 - beta1``) may be shared with other chains (``cleanup`` merges
them); one computed from this tensor's values must be read only inside the chain, except the
new parameter and state the chain returns.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx

from ..meta import Region, region_of

_TENSORS = ("param", "grad", "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_HPARAMS = ("lr", "beta1", "beta2", "eps", "weight_decay")
_RESULTS = ("param", "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@dataclass(frozen=True)
class Variant:
    decoupled: bool
    weight_decay: bool
    amsgrad: bool
    maximize: bool


@dataclass
class AdamUpdate:
    """One matched chain: the graph nodes bound to the reference's inputs and results."""

    variant: Variant
    inputs: dict[str, torch.fx.Node]        # _TENSORS (max_exp_avg_sq only with amsgrad) and _HPARAMS
    results: dict[str, torch.fx.Node]       # the new values, _RESULTS (max_exp_avg_sq only with amsgrad)
    nodes: set[torch.fx.Node]               # the chain's nodes computed from this tensor's values


@functools.lru_cache(maxsize=None)
def reference(variant: Variant) -> torch.fx.GraphModule:
    """``adam_update`` for one tensor of this variant, as the captured step spells it."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from ..optimizers import adam_update
    group = {"amsgrad": variant.amsgrad, "maximize": variant.maximize,
             "weight_decay": 0.1 if variant.weight_decay else 0.0}
    names = [n for n in _TENSORS if n != "max_exp_avg_sq" or variant.amsgrad] + list(_HPARAMS)

    def update(*values):
        bound = dict(zip(names, values))
        state = {k: bound[k] for k in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in bound}
        h = {"lr": bound["lr"], "betas": (bound["beta1"], bound["beta2"]), "eps": bound["eps"],
             "weight_decay": bound["weight_decay"]}
        param, new = adam_update(bound["param"], bound["grad"], state, h, group, variant.decoupled)
        return [param] + [new[k] for k in _RESULTS[1:] if k in new]

    examples = [torch.zeros(()) if n == "step" else torch.zeros(2) for n in names if n not in _HPARAMS]
    examples += [torch.zeros((), dtype=torch.float64) for _ in _HPARAMS]
    gm = make_fx(update)(*examples)
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        node.meta["reference_input"] = name
    return gm


def variants(amsgrad: bool) -> tuple[Variant, ...]:
    """The variants to try, longest chain first: one without weight decay would also match a chain
    that has it, with the decay left outside as part of the "gradient". ``maximize`` is not
    tried: a maximising chain matches with its negated gradient as the gradient, the same update.
    Without weight decay, Adam's and AdamW's chains are one and the same."""
    return (Variant(True, True, amsgrad, False), Variant(False, True, amsgrad, False),
            Variant(True, False, amsgrad, False))


def _match_args(p, g, bind, seen) -> bool:
    if isinstance(p, torch.fx.Node):
        return isinstance(g, torch.fx.Node) and _match(p, g, bind, seen)
    if isinstance(p, (list, tuple)):
        return isinstance(g, (list, tuple)) and len(p) == len(g) and all(
            _match_args(a, b, bind, seen) for a, b in zip(p, g))
    return type(p) is type(g) and p == g


def _match(p: torch.fx.Node, g: torch.fx.Node, bind: dict, seen: dict) -> bool:
    if p.op == "placeholder":
        return bind.setdefault(p.meta["reference_input"], g) is g
    if p in seen:
        return seen[p] is g
    if g.op != "call_function" or g.target != p.target or region_of(g) != Region.OPTIMIZER \
            or set(p.kwargs) != set(g.kwargs) or len(p.args) != len(g.args):
        return False
    seen[p] = g
    return all(_match_args(a, g.args[i], bind, seen) for i, a in enumerate(p.args)) and all(
        _match_args(v, g.kwargs[k], bind, seen) for k, v in p.kwargs.items())


def _own(seen: dict, bind: dict, results: dict) -> set | None:
    """The chain's nodes computed from this tensor's own inputs (not from the hyperparameters alone),
    or None when one of them is read outside the chain and is not a value the chain returns."""
    own = {bind[n] for n in _TENSORS if n in bind}
    computed = set()
    chain = set(seen.values())
    returned = set(results.values())
    for node in seen.values():              # reference order is topological
        if not any(a in own for a in node.all_input_nodes):
            continue
        own.add(node)
        computed.add(node)
        if node not in returned and any(u not in chain for u in node.users):
            return None
    return computed


def match_at(node: torch.fx.Node, variant: Variant) -> AdamUpdate | None:
    """The chain of ``variant`` whose new parameter is ``node``, or None."""
    gm = reference(variant)
    out = gm.graph.output_node().args[0]
    bind: dict = {}
    seen: dict = {}
    if not _match(out[0], node, bind, seen):
        return None
    results = dict(zip([r for r in _RESULTS if r != "max_exp_avg_sq" or variant.amsgrad], (seen[r] for r in out)))
    tensors = [bind[n] for n in _TENSORS if n in bind]
    own = _own(seen, bind, results) if len(set(tensors)) == len(tensors) else None
    if own is None:
        return None
    return AdamUpdate(variant, bind, results, own)


def adam_updates(graph: torch.fx.Graph, amsgrad: bool = False) -> list[AdamUpdate]:
    """Every Adam/AdamW chain of the optimizer region, in graph order of their new parameters;
    ``amsgrad``: look for amsgrad's chains instead (the graph has ``max_exp_avg_sq`` state)."""
    found, taken = [], set()
    tried = variants(amsgrad)
    first = {reference(v).graph.output_node().args[0][0].target for v in tried[:1]}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in first or region_of(node) != Region.OPTIMIZER \
                or node in taken:
            continue
        for variant in tried:
            update = match_at(node, variant)
            if update is not None and not (update.nodes & taken):
                found.append(update)
                taken |= update.nodes
                break
    return found
