"""bool_collectives_as_bytes on context parallelism's step: the attention mask (a boolean
tensor) is all-gathered over the sequence; for inductor it crosses as uint8 and is read as bool.
Inductor's numerics on gloo: tests/context_parallel/test_cp_gloo.py (``inductor`` scenarios)."""
from __future__ import annotations

import torch

from cann_passes import Plan
from cann_passes.planning import compile_planned
from graph_ir import capture_train_step
from graph_ir.analysis.collectives import collective_kind, waits_of
from graph_ir.mesh import MeshDesc
from tests.gloo_scenarios import make

aten = torch.ops.aten


def _cp_step(backend: str):
    entry, optimizer = make("llama", "sgd")
    captured, _ = capture_train_step(entry.model, optimizer, entry.loss_fn, entry.make_batch(1000, pad=True))
    program = compile_planned(captured, Plan(backend=backend, cp=2, verify="deep"), MeshDesc.fake(cp=2),
                              backend=backend)
    return program


def _gathers(graph, dtype):
    return [n for n in graph.graph.nodes if collective_kind(n) == "all_gather"
            and n.args[0].meta["val"].dtype == dtype]


def test_the_gathered_mask_crosses_as_bytes_for_inductor_and_is_read_as_bool():
    eager = _cp_step("eager")
    assert _gathers(eager.graphs["step"], torch.bool)          # what the rewrite is for
    program = _cp_step("inductor")
    record = next(r for r in program.records if r.name == "bool_collectives_as_bytes")
    graph = program.graphs["step"]
    assert not _gathers(graph, torch.bool)
    moved = _gathers(graph, torch.uint8)
    assert record.stats["rewritten"] == len(moved) == len(_gathers(eager.graphs["step"], torch.bool))
    for gather in moved:
        source = gather.args[0]
        assert source.target is aten._to_copy.default and source.kwargs == {"dtype": torch.uint8}
        assert source.args[0].meta["val"].dtype == torch.bool
        for wait in waits_of(gather):
            assert wait.meta["val"].dtype == torch.uint8
            (back,) = wait.users
            assert back.target is aten._to_copy.default and back.kwargs == {"dtype": torch.bool}
            assert back.meta["val"].shape == wait.meta["val"].shape


def test_a_step_without_boolean_collectives_is_left_as_it_is():
    from cann_passes.pass_manager import PassContext, get_pass
    from tests.passes._tiny import mlp_batch, mlp_step
    tiny = mlp_step()
    model, opt = tiny.fresh()
    graph, _ = capture_train_step(model, opt, tiny.loss_fn, mlp_batch(1))
    before = graph.state()
    ctx = PassContext()
    get_pass("bool_collectives_as_bytes").fn(graph, ctx)
    assert ctx.stats["rewritten"] == 0 and graph.state() == before
