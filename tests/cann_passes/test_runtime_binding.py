"""The runtime behaves like eager PyTorch where users change things between steps."""
from __future__ import annotations

import copy

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.runtime import checkpoint
from cann_passes.runtime.binding import BindingError, _hparam
from tests.conftest import eager_losses, make_optimizer, mlp_batches, tiny_mlp


def _pair(kind="adamw"):
    model, loss_fn = tiny_mlp()
    ref = copy.deepcopy(model)
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=make_optimizer(kind, model.parameters()),
                           loss_fn=loss_fn)
    return model, ref, make_optimizer(kind, ref.parameters()), step, loss_fn


def _assert_same(model, ref):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_freezing_a_parameter_after_a_step_recompiles_and_trains_like_eager():
    model, ref, ref_opt, step, loss_fn = _pair("sgd")
    batches = mlp_batches(3)
    step(batches[0])
    eager_losses(ref, loss_fn, ref_opt, batches[:1])
    for m in (model, ref):
        next(m.parameters()).requires_grad_(False)
    step(batches[1])
    eager_losses(ref, loss_fn, ref_opt, batches[1:2])
    _assert_same(model, ref)
    assert len(step._compiled) == 2


def test_switching_training_mode_recompiles():
    model, _, _, step, _ = _pair()
    batch = mlp_batches(1)[0]
    step(batch)
    model.eval()
    step(batch)
    model.train()
    step(batch)
    assert len(step._compiled) == 2          # train and eval, the third call reused the first


def test_a_batch_that_requires_grad_leaves_no_autograd_history_in_the_optimizer():
    model, ref, ref_opt, step, loss_fn = _pair()
    x, y = mlp_batches(1)[0]
    step((x.clone().requires_grad_(True), y))
    assert all(t.grad_fn is None and not t.requires_grad for s in step.optimizer.state.values()
               for t in s.values() if isinstance(t, torch.Tensor))
    copy.deepcopy(step.optimizer.state_dict())


def test_loading_an_empty_optimizer_state_after_compiling_restarts_the_state_like_eager():
    model, ref, ref_opt, step, loss_fn = _pair("adamw")
    batches = mlp_batches(3)
    step(batches[0])
    eager_losses(ref, loss_fn, ref_opt, batches[:1])
    for opt in (step.optimizer, ref_opt):
        opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"]})
    step(batches[1])
    eager_losses(ref, loss_fn, ref_opt, batches[1:2])
    _assert_same(model, ref)
    assert float(step.optimizer.state[next(model.parameters())]["step"]) == 1.0


def test_loading_a_missing_checkpoint_is_a_clear_project_error(tmp_path):
    _, _, _, step, _ = _pair()
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load(step, tmp_path / "nothing-here", mlp_batches(1)[0])


def test_hyperparameter_inputs_bind_by_key_and_tuple_index():
    model, loss_fn = tiny_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.95))
    opt.add_param_group({"params": [], "lr": 0.2, "betas": (0.7, 0.9)})
    assert _hparam(opt, "lr:group1") == 0.2
    assert _hparam(opt, "betas.0:group0") == pytest.approx(0.8)
    assert _hparam(opt, "betas.1:group1") == pytest.approx(0.9)
    with pytest.raises(BindingError, match="betas.2:group0"):
        _hparam(opt, "betas.2:group0")


def test_after_a_step_no_parameter_holds_a_gradient_from_an_earlier_eager_backward():
    from cann_passes import Plan, compile_for_npu
    from tests.conftest import mlp_batches, tiny_mlp
    model, loss_fn = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = mlp_batches(2)
    loss_fn(model, batches[0]).backward()          # an eager backward the user ran before compiling
    assert all(p.grad is not None for p in model.parameters())
    step = compile_for_npu(model, Plan(backend="eager", compile_cache="off"), optimizer=opt, loss_fn=loss_fn)
    step(batches[1])
    assert all(p.grad is None for p in model.parameters())
