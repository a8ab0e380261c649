"""graph_ir.analysis.expert_dispatch on transformers' mixture-of-experts steps: which nodes run on
the rows in the router's sorted order, where the rows leave that order, and what is refused."""
from __future__ import annotations

import pytest
import torch

from graph_ir import capture_train_step
from graph_ir.analysis.expert_dispatch import (COUNTS, INVERSE, ORDER, SORTED, TOKEN_OF, TOKENS, WEIGHT_GRAD,
                                               DispatchError, dispatch_regions, grouped_mm_ops)
from tests import zoo

aten = torch.ops.aten


def _capture(name: str, layers: int = 1):
    entry = zoo.build(name, layers=layers, seed=0)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    graph, _ = capture_train_step(entry.model, opt, entry.loss_fn, entry.make_batch(0, pad=False))
    return graph


@pytest.fixture(scope="module")
def mixtral():
    return _capture("mixtral", layers=2)


def test_states_of_each_layers_dispatch(mixtral):
    states = dispatch_regions(mixtral.graph)
    gmm, gmm_backward = grouped_mm_ops()
    nodes = list(mixtral.graph.nodes)
    grouped = [n for n in nodes if n.target in (gmm, gmm_backward)]
    assert grouped and all(n in states for n in grouped)
    assert all(states[n] == SORTED for n in grouped if n.target is gmm)
    assert all(states[n.args[2]] == COUNTS for n in grouped)              # the offsets
    sorts = [n for n in nodes if n.target is aten.sort.default]
    assert len(sorts) == 2 and all(n in states for n in sorts)             # one per layer
    assert {ORDER, TOKEN_OF, INVERSE} <= set(states.values())
    # every way out: token order (forward's output, backward's input gradients) or a weight gradient
    exits = [n for n, s in states.items() if s in (TOKENS, WEIGHT_GRAD)]
    assert all(u not in states for n in exits for u in n.users)
    assert sum(states[n] == WEIGHT_GRAD for n in exits) == len([n for n in grouped if n.target is gmm_backward])
    # nothing else is inside: the router, the residual stream and the optimizer are not
    assert not any(n.op == "placeholder" or n.target is aten.mm.default for n in states)


def test_a_graph_without_experts_has_none():
    assert dispatch_regions(_capture("llama").graph) == {}


def test_a_reader_that_mixes_the_sorted_rows_is_refused(mixtral):
    graph = _capture("mixtral")
    gmm, _ = grouped_mm_ops()
    first = next(n for n in graph.graph.nodes if n.target is gmm)
    rows = first.args[0]
    with graph.graph.inserting_before(first):
        mixed = graph.graph.call_function(aten.cumsum.default, (rows, 0))
    mixed.meta["val"] = rows.meta["val"]
    first.update_arg(0, mixed)
    with pytest.raises(DispatchError, match=f"node {mixed.name} .*may mix rows"):
        dispatch_regions(graph.graph)
