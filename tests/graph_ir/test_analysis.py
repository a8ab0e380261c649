"""FLOPs, bytes, liveness/memory and the networkx view on hand-checkable graphs."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_ir import capture_train_step
from graph_ir.analysis import graph_cost, memory_profile, node_cost, saved_activations, to_networkx
from graph_ir.meta import REGION
from tests.conftest import make_optimizer, tiny_mlp


def _traced(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:
        n.meta[REGION] = "io" if n.op in ("placeholder", "output") else "forward"
    return gm


def test_matmul_flops_follow_2mnk_and_elementwise_one_per_element():
    gm = _traced(lambda a, b: torch.relu(a @ b), torch.randn(8, 16), torch.randn(16, 4))
    costs = {n.target: node_cost(n) for n in gm.graph.nodes if n.op == "call_function"}
    mm = costs[torch.ops.aten.mm.default]
    assert mm.flops == 2 * 8 * 16 * 4 and mm.matmul
    assert mm.bytes_read == (8 * 16 + 16 * 4) * 4 and mm.bytes_written == 8 * 4 * 4
    relu = costs[torch.ops.aten.relu.default]
    assert relu.flops == 32 and not relu.matmul


def test_views_cost_nothing_and_allocate_nothing():
    gm = _traced(lambda a: (a * 2).t().unsqueeze(0), torch.randn(4, 6))
    view_costs = [node_cost(n) for n in gm.graph.nodes
                  if n.target in (torch.ops.aten.t.default, torch.ops.aten.unsqueeze.default)]
    assert len(view_costs) == 2
    assert view_costs and all(c.flops == 0 and c.bytes == 0 for c in view_costs)
    profile = memory_profile(gm.graph)
    assert profile.resident_bytes == 4 * 6 * 4
    assert max(profile.live_bytes) == 4 * 6 * 4   # only the product is allocated


def test_liveness_frees_values_after_their_last_use():
    def f(x):
        a = x * 2        # dies after b
        b = a + 1        # dies after c
        c = b * 3
        return c
    gm = _traced(f, torch.randn(1024))
    p = memory_profile(gm.graph)
    # At most two 4 KiB intermediates are ever live together.
    assert p.peak_bytes - p.resident_bytes == 2 * 4096


def test_saved_activations_are_forward_values_read_by_backward():
    model, loss_fn = tiny_mlp()
    tg, _ = capture_train_step(model, make_optimizer("sgd", model.parameters()), loss_fn,
                               (torch.randn(8, 12), torch.randint(0, 5, (8,))))
    saved = saved_activations(tg.graph)
    assert saved and all(v > 0 for v in saved.values())
    by_name = {n.name: n for n in tg.graph.nodes}
    for name in saved:
        assert by_name[name].meta[REGION] == "forward"
    cost = graph_cost(tg.graph)
    assert cost.flops_by_region["backward"] > cost.flops_by_region["forward"] > 0


def test_networkx_view_has_every_node_and_edge():
    gm = _traced(lambda a, b: (a + b) * a, torch.randn(3), torch.randn(3))
    g = to_networkx(gm.graph)
    assert set(g.nodes) == {n.name for n in gm.graph.nodes}
    assert g.number_of_edges() == sum(len(n.all_input_nodes) for n in gm.graph.nodes)
    assert g.nodes["mul"]["flops"] == 3


def test_is_matmul_says_what_node_cost_says_on_attention_moe_and_convolution_steps():
    from graph_ir.analysis.cost import is_matmul
    from tests.zoo import build
    for name in ("llama", "mixtral", "swin"):
        entry = build(name, layers=1)
        tg, _ = capture_train_step(entry.model, torch.optim.SGD(entry.model.parameters(), lr=0.1), entry.loss_fn,
                                   entry.make_batch(0))
        said = {n: node_cost(n).matmul for n in tg.graph.nodes}
        assert any(said.values()) and not all(said.values()), name
        assert all(is_matmul(n) == said[n] for n in tg.graph.nodes), name
