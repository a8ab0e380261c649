"""The recompute_pointwise pass: fusible pointwise values recomputed in backward, the step unchanged."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan
from cann_passes.pass_manager import PassContext, PassManager
from cann_passes.pass_pipeline import build_pipeline
from graph_ir import capture_train_step, gather_inputs
from graph_ir.analysis.memory import memory_profile
from graph_ir.meta import RECOMPUTE, Region, nbytes, region_of
from tests.zoo import build

aten = torch.ops.aten


def _captured(model, loss_fn, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tg, layout = capture_train_step(model, opt, loss_fn, batch)
    return tg, gather_inputs(model, opt, layout, batch)


def _run(tg):
    manager = PassManager("recompute_pointwise", verify_level="deep")
    out = manager.run(tg.copy(), PassContext())
    return out, manager.records[-1].stats["recomputed"]


def _kept(graph, target):
    return [n for n in graph.graph.nodes if n.target == target and region_of(n) == Region.FORWARD
            and any(region_of(u) == Region.BACKWARD for u in n.users)]


def test_swiglus_silu_is_recomputed_in_backward_and_the_step_is_bitwise_unchanged():
    zoo = build("llama", layers=2)
    batch = zoo.make_batch(0)
    tg, inputs = _captured(zoo.model, zoo.loss_fn, batch)
    silus = _kept(tg, aten.silu.default)
    assert len(silus) == 2                       # one SwiGLU per layer, kept for the product's gradient
    out, recomputed = _run(tg)
    assert recomputed >= len(silus)
    assert _kept(out, aten.silu.default) == []
    copies = [n for n in out.graph.nodes if n.target == aten.silu.default and region_of(n) == Region.BACKWARD]
    assert len(copies) == 2 and all(n.meta[RECOMPUTE] for n in copies)
    # backward keeps nothing new: every copy reads values it kept anyway, so the saved bytes fall
    saved = memory_profile(tg.graph).saved_bytes - memory_profile(out.graph).saved_bytes
    assert saved >= sum(nbytes(n.meta["val"]) for n in silus)
    for before, after in zip(tg.gm(*inputs), out.gm(*inputs), strict=True):
        assert torch.equal(before, after)


def test_a_value_a_matmul_reads_is_kept_and_so_is_one_a_reduction_reads():
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.up(x))     # read by the down projection's weight gradient
            scale = torch.exp(x)                         # read by a reduction of its gradient
            return self.down(h) * scale.sum(-1, keepdim=True)

    torch.manual_seed(0)
    model = Mlp()
    tg, _ = _captured(model, lambda m, b: m(b).square().mean(), torch.randn(4, 8))
    gelus = _kept(tg, aten.gelu.default)
    assert len(gelus) == 1
    out, _ = _run(tg)
    assert len(_kept(out, aten.gelu.default)) == 1
    assert not any(n.meta.get(RECOMPUTE) and n.target in (aten.gelu.default, aten.exp.default)
                   for n in out.graph.nodes)


def test_only_the_inductor_pipeline_runs_it():
    plan = Plan()
    assert "recompute_pointwise" in {p.name for p in build_pipeline(plan, "inductor").passes}
    for backend in ("eager", "torchair"):
        assert "recompute_pointwise" not in {p.name for p in build_pipeline(plan, backend).passes}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_an_inductor_step_of_a_gated_mlp_recomputes_its_activation_and_matches_eager(name):
    from tests.zoo import compare
    run = compare(name, Plan(backend="inductor"), steps=2, layers=1)
    stats = {r.name: r.stats for r in run.step.records}
    assert stats["recompute_pointwise"]["recomputed"] >= 1
    assert run.compiled_losses == pytest.approx(run.eager_losses, rel=1e-5)
    assert run.max_param_diff() < 1e-5
