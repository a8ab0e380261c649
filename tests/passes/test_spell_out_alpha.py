"""spell_out_alpha: ``add/sub(x, y, alpha=k)`` becomes ``add/sub(x, mul(y, k))``, nothing else changes,
and the step computes what it computed (to the rounding of the one multiply)."""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.pass_manager import PassContext, PassManager
from graph_ir import capture_train_step
from graph_ir.meta import REGION
from graph_ir.mesh import MeshDesc
from tests.eager_reference import eager_steps
from tests.passes._tiny import Step, aten, mlp_batch, mlp_step, ops, run, sgd


class _Alpha(torch.nn.Module):
    """A block whose forward writes ``alpha`` twice (an add and a sub) and a plain add once."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 16), torch.nn.Linear(16, 5)

    def forward(self, x):
        h = self.fc1(x)
        h = torch.add(h, torch.tanh(h), alpha=0.5)
        h = torch.sub(h, h.square(), alpha=0.25) + h
        return self.fc2(h)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _alpha_nodes(graph):
    return [n for n in graph.graph.nodes if n.op == "call_function" and n.target in (aten.add.Tensor, aten.sub.Tensor)
            and n.kwargs.get("alpha", 1) != 1]


def _spell(graph):
    manager = PassManager("cleanup,spell_out_alpha", verify_level="deep")
    out = manager.run(graph.copy(), PassContext(mesh=MeshDesc.fake()))
    return out, manager.records[-1]


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    model = _Alpha()
    optimizer = sgd(model.parameters())
    batch = mlp_batch()
    captured, layout = capture_train_step(model, optimizer, _loss, batch)
    return Step(model, optimizer, _loss, batch, captured, layout, sgd)


class TestSpellOutAlpha:
    def test_every_alpha_becomes_a_multiply_of_the_second_operand(self, step):
        before = {n.name: (n.target, n.args, n.kwargs["alpha"]) for n in _alpha_nodes(step.captured)}
        assert sorted(alpha for _, _, alpha in before.values()) == [0.25, 0.5]
        out, record = _spell(step.captured)
        assert _alpha_nodes(out) == []
        assert record.stats["rewritten"] == 2 and record.ops_added == {"aten.mul.Tensor": 2}
        nodes = {n.name: n for n in out.graph.nodes}
        for name, (target, (x, y), alpha) in before.items():
            node = nodes[name]
            assert node.target is target and node.kwargs == {} and node.args[0].name == x.name
            scaled = node.args[1]
            assert scaled.target is aten.mul.Tensor and scaled.args == (nodes[y.name], alpha)
            assert scaled.meta[REGION] == node.meta[REGION] == "forward"
            assert scaled.meta["val"].shape == y.meta["val"].shape

    def test_adds_and_subs_without_alpha_are_left_alone(self, step):
        cleaned = PassManager("cleanup").run(step.captured.copy(), PassContext(mesh=MeshDesc.fake()))
        plain = {n.name: ([str(a) for a in n.args], n.kwargs) for n in cleaned.graph.nodes
                 if n.target in (aten.add.Tensor, aten.sub.Tensor) and n.kwargs.get("alpha", 1) == 1}
        out, _ = _spell(step.captured)
        nodes = {n.name: n for n in out.graph.nodes}
        assert len(plain) == 8   # one in forward, three in backward, four SGD updates
        for name, (args, kwargs) in plain.items():
            assert ([str(a) for a in nodes[name].args], nodes[name].kwargs) == (args, kwargs), name

    def test_a_step_without_alpha_is_unchanged(self):
        mlp = mlp_step()
        assert _alpha_nodes(mlp.captured) == []
        cleaned = PassManager("cleanup").run(mlp.captured.copy(), PassContext(mesh=MeshDesc.fake()))
        out, record = _spell(mlp.captured)
        assert not record.changed and record.stats == {"rewritten": 0}
        assert ops(out) == ops(cleaned)

    def test_the_spelled_out_step_computes_what_the_captured_step_computes(self, step):
        out, _ = _spell(step.captured)
        want, got = run(step.captured, step), run(out, step)
        assert list(got) == list(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)

    def test_a_step_with_it_in_its_pipeline_trains_like_eager(self, step):
        model, optimizer = step.fresh()
        reference, reference_optimizer = step.fresh()
        batches = [mlp_batch(20 + i) for i in range(3)]
        compiled = compile_for_npu(model, Plan(backend="eager", verify="deep", pipeline="cleanup,spell_out_alpha"),
                                   optimizer=optimizer, loss_fn=_loss)
        losses = [compiled(b).item() for b in batches]
        assert _alpha_nodes(compiled.last.graph) == []
        want = eager_steps(reference, reference_optimizer, _loss, batches).losses
        assert losses == pytest.approx(want, rel=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
