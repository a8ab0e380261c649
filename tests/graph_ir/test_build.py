"""graph_ir.build: the remembered fake values and dead-code elimination agree with torch's own."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graph_ir import capture_train_step
from graph_ir.analysis.structure import Structure
from graph_ir.build import _MEMOS, eliminate_dead_code, fake_value
from recipes.models.gpt import GPT, gpt_loss, gpt_tiny

aten = torch.ops.aten


def _layout(v):
    if isinstance(v, torch.Tensor):
        return (v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.device)
    if isinstance(v, (list, tuple)):
        return tuple(_layout(x) for x in v)
    return v


def _direct(mode, target, *args, **kwargs):
    with mode:
        return target(*args, **kwargs)


@pytest.mark.parametrize("op, make_args", [
    (aten.mm.default, lambda x, w: (x, w)),
    (aten._to_copy.default, lambda x, w: (x,)),
    (aten.native_layer_norm.default, lambda x, w: (x, [8], None, None, 1e-5)),
    (aten.t.default, lambda x, w: (w,)),
    (aten.view.default, lambda x, w: (x, [2, 2, 8])),
    (aten.transpose.int, lambda x, w: (x, 0, 1)),
    (aten._unsafe_view.default, lambda x, w: (x, [16, 2])),
    (aten.expand.default, lambda x, w: (x[0:1], [3, 8])),
])
def test_remembered_answers_match_the_fake_mode_and_keep_aliasing(op, make_args):
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 8)
        w = torch.empty(8, 6)
    kwargs = {"dtype": torch.bfloat16} if op is aten._to_copy.default else {}
    args = make_args(x, w)
    memo_answers = []
    for _ in range(3):   # the first is computed, the others rebuilt
        memo_answers.append(_call_memo(mode, op, args, kwargs))
    expected = _direct(mode, op, *args, **kwargs)
    memo = _MEMOS[mode]
    assert memo.hits >= 2, "an identical question is answered from the memo"
    for got in memo_answers:
        assert _layout(got) == _layout(expected)
        for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
            if not isinstance(e, torch.Tensor):
                continue
            # A view reads through its input's storage exactly when torch's own answer does.
            shares = [a for a in args if isinstance(a, torch.Tensor)
                      and a.untyped_storage()._cdata == e.untyped_storage()._cdata]
            got_shares = [a for a in args if isinstance(a, torch.Tensor)
                          and a.untyped_storage()._cdata == g.untyped_storage()._cdata]
            assert [id(a) for a in shares] == [id(a) for a in got_shares]
            assert g.fake_mode is mode


def _call_memo(mode, op, args, kwargs):
    from graph_ir.build import _Memo
    memo = _MEMOS.get(mode)
    if memo is None:
        memo = _MEMOS[mode] = _Memo(mode)
    return memo(op, list(args), kwargs)


def test_mutating_ops_are_always_run():
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 8)
    before = _call_memo(mode, aten.add_.Tensor, (x, x), {})
    _call_memo(mode, aten.add_.Tensor, (x, x), {})
    assert before is x and not _MEMOS[mode].entries


def test_fake_value_answers_a_captured_graphs_nodes_as_recorded():
    model = GPT(gpt_tiny(n_layer=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    tg, _ = capture_train_step(model, opt, gpt_loss, batch)
    mode = tg.fake_mode()
    nodes = [n for n in tg.graph.nodes if n.op == "call_function"
             and isinstance(n.target, torch._ops.OpOverload)][:60]
    for _ in range(2):   # the second time from the memo
        for n in nodes:
            got = fake_value(n.target, n.args, n.kwargs, mode=mode)
            assert _layout(got) == _layout(n.meta["val"]), n.name
    assert _MEMOS[mode].hits >= len(nodes) // 2


def test_dead_code_elimination_removes_what_torch_removes():
    model = GPT(gpt_tiny(n_layer=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    tg, _ = capture_train_step(model, opt, gpt_loss, batch)
    graph = tg.graph
    # Dead ends: a pure op nobody reads, and a chain of two.
    anchor = next(n for n in graph.nodes if n.target is aten.mm.default)
    with graph.inserting_after(anchor):
        dead = graph.call_function(aten.relu.default, (anchor,))
    with graph.inserting_after(dead):
        graph.call_function(aten.neg.default, (dead,))
    ours, theirs = copy.deepcopy(graph), copy.deepcopy(graph)
    removed = eliminate_dead_code(ours)
    theirs.eliminate_dead_code()
    assert removed >= 2
    assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]


def test_block_of_answers_as_a_scan_of_the_blocks():
    structure = Structure({"model.layers": ["model.layers.0", "model.layers.1", "model.layers.10"],
                           "encoder.block": ["encoder.block.2"]})

    def scan(path):
        return next((b for b in structure.blocks if path == b or path.startswith(b + ".")), "")
    for path in ["", "model", "model.layers", "model.layers.1", "model.layers.1.attn.q",
                 "model.layers.10.mlp", "model.layers.100", "encoder.block.2.x", "encoder.block.20"]:
        assert structure.block_of(path) == scan(path), path
