"""Op-level calibration and the per-node terms: the op table, per-op and per-view costs, collectives."""
from __future__ import annotations

import operator
from dataclasses import replace

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes.cost_model import collective_time, cpu_profile, get_profile, node_time
from cann_passes.cost_model.calibrate import is_launched, measure_ops, op_key, with_op_table
from cann_passes.cost_model.profiles import launch_costs
from cann_passes.simulate import graph_step_time


def _graph(fn, *shapes, dtype=torch.float32):
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s, dtype=dtype) for s in shapes])


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _mlp(x, w1, w2, g, b):
    h = torch.nn.functional.layer_norm(x, (32,), g, b)      # a tuple output, read by getitem
    h = torch.nn.functional.gelu(h @ w1, approximate="tanh")
    return (torch.nn.functional.gelu(h @ w2) @ w2.t()).view(-1).sum()


MLP_SHAPES = ((64, 32), (32, 32), (32, 32), (32,), (32,))


class TestOpKey:
    def test_the_signature_is_the_op_its_layouts_and_its_arguments(self):
        gm = _graph(lambda a, b, c: (a @ b, a @ b, a @ c, a.t() @ b, torch.nn.functional.gelu(a),
                                     torch.nn.functional.gelu(a, approximate="tanh")),
                    (32, 32), (32, 32), (32, 64))
        mm1, mm2, mm_wide, _t, mm_t, gelu, gelu_tanh = _calls(gm)
        assert op_key(mm1) == op_key(mm2)                      # same op, same layouts
        assert op_key(mm1) != op_key(mm_wide)                  # another shape
        assert op_key(mm1) != op_key(mm_t)                     # a transposed operand: other strides
        assert op_key(gelu) != op_key(gelu_tanh)               # another argument value
        assert "aten.mm.default" in op_key(mm1) and "(32, 32)" in op_key(mm1)


class TestMeasureOps:
    def test_every_distinct_launched_signature_is_timed_once(self):
        gm = _graph(_mlp, *MLP_SHAPES)
        table = measure_ops([gm], target_s=1e-4, max_repeats=3)
        launched = [n for n in _calls(gm) if is_launched(n)]
        assert set(table) == {op_key(n) for n in launched}
        assert len(table) < len(launched)                       # w2 @ ... shapes repeat
        assert all(0 < s < 1.0 for s in table.values())
        assert not any("getitem" in k for k in table)

    def test_index_inputs_are_made_in_range(self):
        gm = make_fx(lambda w, i: torch.nn.functional.embedding(i, w).sum(), tracing_mode="fake")(
            torch.empty(16, 8), torch.empty(4, 5, dtype=torch.long))
        table = measure_ops([gm], target_s=1e-4, max_repeats=3)
        assert any("embedding" in k for k in table)

    def test_the_table_replaces_the_roofline_and_includes_the_dispatch(self):
        gm = _graph(_mlp, *MLP_SHAPES)
        base = replace(get_profile("a100"), op_overhead=1e-3, view_overhead=0.0)
        mm = next(n for n in _calls(gm) if n.target is torch.ops.aten.mm.default)
        prof = with_op_table(base, {op_key(mm): 0.5})
        assert node_time(mm, prof) == 0.5                        # no op_overhead on top of a measured op
        gelu = next(n for n in _calls(gm) if n.target is torch.ops.aten.gelu.default)
        assert node_time(gelu, prof) == node_time(gelu, base) > 1e-3   # not in the table: roofline


class TestPerNodeTerms:
    def test_the_per_op_cost_is_counted_once_per_launched_op(self):
        gm = _graph(_mlp, *MLP_SHAPES)
        overhead = 1.0                                           # dwarfs the roofline of these tiny ops
        prof = replace(get_profile("a100"), op_overhead=overhead, view_overhead=0.0)
        launched = [n for n in _calls(gm) if node_time(n, prof) > 0]
        views = [n for n in _calls(gm) if node_time(n, prof) == 0]
        seconds, busy, comm = graph_step_time(gm.graph, prof, world_size=1)
        assert busy == pytest.approx(len(launched) * overhead, rel=1e-3) and seconds == busy and comm == 0
        assert views and all(n.target in (torch.ops.aten.t.default, torch.ops.aten.view.default)
                             for n in views)

    def test_getitem_is_not_timed_but_priced_as_an_op(self):
        gm = _graph(_mlp, *MLP_SHAPES)
        getitems = [n for n in _calls(gm) if n.target is operator.getitem]
        assert getitems and not any(is_launched(n) for n in getitems)
        prof = replace(get_profile("a100"), op_overhead=1.0, view_overhead=0.0)
        assert all(node_time(n, prof) == pytest.approx(1.0) for n in getitems)

    def test_views_cost_the_profiles_view_overhead(self):
        gm = _graph(lambda a: a.t().unsqueeze(0), (64, 64))
        assert all(node_time(n, get_profile("h100")) == 0 for n in _calls(gm))
        eager = replace(get_profile("h100"), view_overhead=2e-6)
        assert [node_time(n, eager) for n in _calls(gm)] == [2e-6, 2e-6]
        assert graph_step_time(gm.graph, eager, world_size=1)[1] == pytest.approx(4e-6)

    def test_the_cpu_profile_measures_per_op_and_per_view_costs(self):
        p = cpu_profile()
        assert 0 < p.view_overhead < 1e-3 and 0 < p.op_overhead < 1e-3
        per_op, per_view = launch_costs(chain=20, repeats=3)
        assert per_op > 0 and per_view > 0


def _all_reduce_graph(numel: int) -> torch.fx.Graph:
    """x -> all_reduce -> wait -> mul, with fake values (no process group needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        val = mode.from_tensor(torch.empty(numel))
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = val
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    ar.meta["val"] = val
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    wait.meta["val"] = val
    y = g.call_function(torch.ops.aten.mul.Tensor, (wait, wait))
    y.meta["val"] = val
    g.output(y)
    return g


class TestCollectiveTerms:
    def test_alpha_is_paid_per_ring_step_and_the_launch_once(self):
        p = replace(get_profile("ascend_910b"), op_overhead=1e-3)
        tiny = collective_time("all_reduce", 0, 4, p)
        assert tiny == pytest.approx(2 * 3 * p.intra_node_latency)     # no bytes: the alpha term alone
        g = _all_reduce_graph(1 << 20)
        ar = next(n for n in g.nodes if n.target is torch.ops._c10d_functional.all_reduce.default)
        want = p.op_overhead + collective_time("all_reduce", 4 << 20, 4, p)
        assert node_time(ar, p, world_size=4) == pytest.approx(want)
        seconds, busy, comm = graph_step_time(g, p, world_size=4)
        assert comm == pytest.approx(want)                               # wait_tensor adds nothing
        # the multiply reads the reduced value: it waits for the collective
        mul = next(n for n in g.nodes if n.target is torch.ops.aten.mul.Tensor)
        assert seconds == pytest.approx(want + node_time(mul, p))
