"""On gloo, every all-gather runs with no other collective in flight (``base.gloo_all_gathers_alone``);
on other backends the order is left as it is. The distributed tests run the result on gloo ranks,
bitwise against the functional step (tests/distributed/test_inplace_updates.py)."""
from __future__ import annotations

import torch
import torch.fx

from cann_passes.lowering.base import gloo_all_gathers_alone

F = torch.ops._c10d_functional
aten = torch.ops.aten


def _zero_like_step():
    """Two reduce-scatters in flight, an update, its all-gather, a second all-gather, the waits late."""
    g = torch.fx.Graph()
    a, b = g.placeholder("grad_a"), g.placeholder("grad_b")
    rs_a = g.call_function(F.reduce_scatter_tensor.default, (a, "avg", 2, "0"))
    rs_b = g.call_function(F.reduce_scatter_tensor.default, (b, "avg", 2, "0"))
    wa = g.call_function(F.wait_tensor.default, (rs_a,))
    upd = g.call_function(aten.mul.Tensor, (wa, 0.5))
    ag1 = g.call_function(F.all_gather_into_tensor.default, (upd, 2, "0"))
    ag2 = g.call_function(F.all_gather_into_tensor.default, (upd, 2, "0"))
    other = g.call_function(aten.add.Tensor, (upd, 1.0))
    wb = g.call_function(F.wait_tensor.default, (rs_b,))
    w1 = g.call_function(F.wait_tensor.default, (ag1,))
    w2 = g.call_function(F.wait_tensor.default, (ag2,))
    g.output((wb, w1, w2, other))
    return g


def _order(g):
    return [n.name for n in g.nodes if n.op == "call_function"]


def test_each_gloo_all_gather_waits_for_what_is_in_flight_and_is_waited_at_once():
    g = _zero_like_step()
    moved = gloo_all_gathers_alone(g, backend_of=lambda name: "gloo")
    g.lint()
    order = _order(g)
    # rs_b's wait moves before the first all-gather, each all-gather's wait right behind it.
    assert order == ["reduce_scatter_tensor_default", "reduce_scatter_tensor_default_1", "wait_tensor_default",
                     "mul_tensor", "wait_tensor_default_1", "all_gather_into_tensor_default", "wait_tensor_default_2",
                     "all_gather_into_tensor_default_1", "wait_tensor_default_3", "add_tensor"], order
    assert moved == 3
    assert gloo_all_gathers_alone(g, backend_of=lambda name: "gloo") == 0   # already in that order


def test_groups_of_other_backends_keep_their_overlap():
    g = _zero_like_step()
    before = _order(g)
    assert gloo_all_gathers_alone(g, backend_of=lambda name: "hccl") == 0
    assert gloo_all_gathers_alone(g) == 0     # no process group in this process: nothing is known to be gloo
    assert _order(g) == before
