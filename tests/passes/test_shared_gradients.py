"""Two parameters whose gradients are equal computations, or one tensor, keep a gradient each.

GPT-NeoX's parallel residual adds the attention and MLP outputs, so ``dense.bias`` and
``dense_4h_to_h.bias`` receive the same sum of the output gradient; ``x + b1 + b2`` hands two
biases the very same tensor. Eager gives each parameter its own ``.grad``; the captured step marks
each parameter's gradient at capture and ``cleanup`` never merges a marked gradient, so every
per-gradient rewrite (accumulators, buckets, clipping, stages) sees one value per parameter.
"""
from __future__ import annotations

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from graph_ir.meta import GRADIENT_OF
from tests import zoo
from tests.eager_reference import eager_steps


class TwoBiases(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, bias=False)
        self.b1 = torch.nn.Parameter(torch.randn(6))
        self.b2 = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.lin(x) + self.b1 + self.b2


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("fields", [{}, {"microbatches": 2}, {"accumulate_target": 8}, {"grad_clip_norm": 0.1}],
                         ids=["plain", "microbatches", "accumulate_target", "clip"])
def test_one_tensor_as_two_parameters_gradient_trains_like_eager(fields):
    torch.manual_seed(0)
    model = TwoBiases()
    ref = TwoBiases()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)) for _ in range(3)]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = eager_steps(ref, ref_opt, _mse, batches, grad_clip=fields.get("grad_clip_norm"),
                       microbatches=fields.get("microbatches", 1)).losses
    step = compile_for_npu(model, Plan(backend="eager", verify="deep", **fields),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn=_mse)
    got = [float(step(b)) for b in batches]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    marked = [n.meta[GRADIENT_OF] for n in step.last.captured.graph.nodes if GRADIENT_OF in n.meta]
    assert sorted(marked) == ["b1", "b2", "lin.weight"]     # three parameters, three gradient values


@pytest.mark.parametrize("fields", [{"microbatches": 2}, {"accumulate_target": 4}, {"grad_clip_norm": 0.05}],
                         ids=["microbatches", "accumulate_target", "clip"])
def test_gpt_neox_parallel_residual_biases_keep_their_own_gradient(fields):
    clip = fields.get("grad_clip_norm")
    c = zoo.compare("gpt_neox", Plan(backend="eager", verify="deep", **fields), steps=3, clip_norm=clip)
    assert c.max_loss_diff() <= 1e-5 and c.max_param_diff() <= 1e-5
    marked = [n.meta[GRADIENT_OF] for n in c.step.last.captured.graph.nodes if GRADIENT_OF in n.meta]
    assert sorted(marked) == sorted(name for name, p in c.step.model.named_parameters() if p.requires_grad)
