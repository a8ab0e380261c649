"""split_grad_apply: the per-microbatch grad graph and the per-step apply graph carry what the step reads."""
from __future__ import annotations

import copy

import torch

from cann_passes import Plan, compile_for_npu


class _Weighted(torch.nn.Module):
    """Builds an unequal tensor constant in forward (a ``_tensor_constant`` read by ``lift_fresh_copy``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        weights = torch.tensor([1.0, -2.0, 0.5])
        return (self.fc(x) * weights).square().mean()


def test_unequal_tensor_constant_is_carried_into_the_grad_graph_and_accumulation_equals_eager():
    torch.manual_seed(0)
    model = _Weighted()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step = compile_for_npu(model, Plan(backend="eager", microbatches=2, verify="deep"), optimizer=opt,
                           loss_fn=lambda m, x: m(x))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, generator=g) for _ in range(3)]
    for x in batches:
        loss = float(step(x))
        ref_opt.zero_grad()
        want = 0.0
        for part in x.chunk(2):
            part_loss = ref(part) * 0.5
            part_loss.backward()
            want += float(part_loss)
        ref_opt.step()
        assert abs(loss - want) <= 1e-6 * max(1.0, abs(want))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, name
    grad_graph = step.last.program.graphs["grad"]
    constants = [n for n in grad_graph.graph.nodes if n.op == "get_attr"]
    assert constants, "the constant stays a module attribute read by the grad graph"
    values = [getattr(grad_graph.gm, n.target) for n in constants]
    assert any(torch.equal(v, torch.tensor([1.0, -2.0, 0.5])) for v in values)
