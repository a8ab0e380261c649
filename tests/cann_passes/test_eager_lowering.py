"""The eager backend's buffer reuse: in-place only where the functional graph's buffer is dead."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cann_passes.lowering.eager import reuse_dead_operands

aten = torch.ops.aten


def _traced(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm


def _run_both(fn, *args):
    gm = _traced(fn, *args)
    reference = [t.clone() for t in gm(*args)]
    assert len(reference) > 1
    rewritten = reuse_dead_operands(gm)
    kept = [a.clone() for a in args]
    out = gm(*args)
    assert all(torch.equal(a, k) for a, k in zip(args, kept)), "a graph input was written"
    assert all(torch.equal(o, r) for o, r in zip(out, reference))
    return gm, rewritten


def test_chain_of_temporaries_is_updated_in_place_inputs_are_not():
    def step(p, g, m):
        m2 = m * 0.9 + g * 0.1          # m2's temporaries die at the add
        return p - (m2.sqrt() + 1e-8).reciprocal() * 1e-3, m2

    args = (torch.randn(64), torch.rand(64), torch.rand(64))   # m2 > 0: no NaN from sqrt
    gm, rewritten = _run_both(step, *args)
    assert rewritten >= 3
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.add_.Tensor in targets
    # p and m are inputs: the ops reading them first stay functional.
    first = [n for n in gm.graph.nodes if n.op == "call_function"][0]
    assert first.target is aten.mul.Tensor


def test_buffer_read_later_or_returned_or_viewed_is_not_reused():
    def f(x):
        a = x * 2
        b = a + 1          # a is read again below: must stay
        c = a.view(-1)     # an alias of a, read after the next op
        d = b.exp()        # b is returned: must stay
        return b, d + c.sum()

    gm, _ = _run_both(f, torch.randn(4, 4))
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name["add"].target is aten.add.Tensor
    assert by_name["exp"].target is aten.exp.default


def test_broadcast_and_dtype_change_stay_functional():
    def f(x, y):
        a = x * 2                      # (1, 4)
        b = a + y                      # broadcasts to (4, 4): a cannot hold it
        c = b.to(torch.float64) * 2    # dtype change
        return b.sum() + c.sum(), b

    gm, _ = _run_both(f, torch.randn(1, 4), torch.randn(4, 4))
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name["add"].target is aten.add.Tensor
