"""cann_passes.backend(plan) as a torch.compile backend for forward/backward-only use."""
from __future__ import annotations

import torch

import cann_passes
from tests.conftest import gpt_batches, tiny_gpt


def test_torch_compile_backend_matches_eager_gradients_and_runs_the_passes():
    model, loss_fn = tiny_gpt()
    ref, _ = tiny_gpt()
    ref.load_state_dict(model.state_dict())
    backend = cann_passes.backend(cann_passes.Plan(backend="eager", verify="deep"))
    compiled = torch.compile(model, backend=backend)
    batch = gpt_batches(1)[0]
    torch.nn.functional.cross_entropy(compiled(batch[0]).flatten(0, 1), batch[1].flatten()).backward()
    loss_fn(ref, batch).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    names = [name for name, _ in backend.records]
    assert names[0].startswith("forward") and names[1].startswith("backward")
    assert all(records[0].name == "cleanup" for _, records in backend.records)


def test_whole_step_fields_are_refused_not_ignored():
    import pytest
    with pytest.raises(cann_passes.PlanError, match="recompute"):
        cann_passes.backend(cann_passes.Plan(recompute="full"))
