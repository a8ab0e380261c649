"""Gradient accumulation in one process: parameter names, and failures that leave nothing behind."""
from __future__ import annotations

import copy

import pytest
import torch

from cann_passes import Plan, compile_for_npu


def _linear_pair():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)   # parameters named "weight" and "bias"
    return model, copy.deepcopy(model)


def _loss(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def test_parameters_named_like_the_accumulation_scalars_accumulate_correctly():
    model, ref = _linear_pair()
    step = compile_for_npu(model, Plan(backend="eager", microbatches=2),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = (torch.randn(8, 4), torch.randn(8, 3))
    step(batch)
    _loss(ref, batch).backward()
    ref_opt.step()
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-5, atol=1e-6)


def test_a_failed_microbatch_discards_the_partial_gradients():
    model, ref = _linear_pair()
    step = compile_for_npu(model, Plan(backend="eager", microbatches=2),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss)
    good = (torch.randn(8, 4), torch.randn(8, 3))
    with pytest.raises(RuntimeError):
        step.accumulate([good, (torch.randn(4, 4), torch.randn(4, 5))])   # targets of the wrong width
    assert not any(name.startswith("grad_accumulation:grad/") for name in step.step_state.values)
    step(good)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _loss(ref, good).backward()
    ref_opt.step()
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-5, atol=1e-6)
