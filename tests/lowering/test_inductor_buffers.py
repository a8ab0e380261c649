"""Inductor's intermediates kept from one call of a lowered graph to its next (``inductor_buffers``):
a buffer comes back only when nothing but the pool references it, and a kept step trains exactly as
the same step allocating afresh."""
from __future__ import annotations

import pytest
import torch

from cann_passes.lowering.base import BUFFER_PLAN_ENV
from cann_passes.lowering.inductor_buffers import HoldingRunner, KeptBuffers, empty_strided

LAYOUT = ((4, 4), (4, 1), torch.float32)


def test_a_dropped_buffer_comes_back_and_a_referenced_one_does_not():
    kept = KeptBuffers()
    dropped = kept.take(*LAYOUT)
    ptr = dropped.data_ptr()
    del dropped
    named = kept.take(*LAYOUT)
    assert named.data_ptr() == ptr                        # the pool's only reference was dropped
    assert kept.take(*LAYOUT).data_ptr() != ptr           # while a name holds it: another buffer
    view = named[1:]
    del named
    assert kept.take(*LAYOUT).data_ptr() != ptr           # a view of it holds its storage
    del view
    shared = torch.empty(0).set_(kept.take(*LAYOUT).untyped_storage())
    assert kept.take(*LAYOUT).data_ptr() != shared.data_ptr()   # another tensor on its storage
    assert kept.take((4,), (1,), torch.float32).data_ptr() not in (ptr, shared.data_ptr())  # by layout


def test_after_a_call_the_pool_lets_go_of_what_is_still_referenced():
    kept = KeptBuffers()
    a, b = kept.take(*LAYOUT), kept.take(*LAYOUT)
    held_view = b.view(16)
    del a, b
    kept.let_go_of_referenced()
    assert kept.nbytes() == 64                            # a's; b's storage is the view's now
    del held_view
    assert kept.take(*LAYOUT).data_ptr() != 0


def _generated_like(x: torch.Tensor):
    """What inductor's wrapper code does: an intermediate freed inside, an output returned."""
    tmp = empty_strided((4,), (1,), torch.float32)
    torch.mul(x, 2, out=tmp)
    out = empty_strided((4,), (1,), torch.float32)
    torch.add(tmp, 1, out=out)
    del tmp
    return (out,)


def test_a_runner_reuses_its_intermediates_and_never_the_outputs_it_returned():
    runner = HoldingRunner(_generated_like)
    first = runner(torch.ones(4))[0]
    kept_after_first = runner.kept.nbytes()
    second = runner(torch.full((4,), 3.0))[0]
    assert kept_after_first == 16                         # the intermediate, not the output
    assert second.data_ptr() != first.data_ptr()
    torch.testing.assert_close(first, torch.full((4,), 3.0))     # untouched by the second call
    torch.testing.assert_close(second, torch.full((4,), 7.0))
    # Outside a runner (a module the same code serves for torch.compile) allocation is torch's own.
    assert _generated_like(torch.ones(4))[0].data_ptr() not in (first.data_ptr(), second.data_ptr())


@pytest.mark.slow
def test_an_inductor_step_keeping_its_buffers_trains_bitwise_as_one_allocating_afresh(monkeypatch):
    from cann_passes import Plan, compile_for_npu
    from tests.conftest import mlp_batches, tiny_mlp
    batches = mlp_batches(3)

    def train(keep: bool):
        monkeypatch.setenv(BUFFER_PLAN_ENV, "1" if keep else "0")
        model, loss_fn = tiny_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        step = compile_for_npu(model, Plan(backend="inductor", compile_cache="off"), optimizer=opt, loss_fn=loss_fn)
        losses = [step(b) for b in batches]       # every loss kept: a returned tensor stays the caller's
        runner = step.last.runners["step"]
        return [l.item() for l in losses], [p.detach().clone() for p in model.parameters()], runner

    kept_losses, kept_params, runner = train(keep=True)
    fresh_losses, fresh_params, plain = train(keep=False)
    assert kept_losses == fresh_losses
    for p, q in zip(kept_params, fresh_params):
        assert torch.equal(p, q)
    assert isinstance(runner.run, HoldingRunner) and runner.run.kept.nbytes() > 0
    assert not isinstance(plain.run, HoldingRunner)
