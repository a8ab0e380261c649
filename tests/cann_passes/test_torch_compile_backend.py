"""cann_passes.backend(plan) as a torch.compile backend for forward/backward-only use."""
from __future__ import annotations

import contextlib
import copy

import pytest
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
    with pytest.raises(cann_passes.PlanError, match="every_n_layers"):
        cann_passes.backend(cann_passes.Plan(recompute="every_n_layers"))
    with pytest.raises(cann_passes.PlanError, match="microbatches.*whole compiled steps"):
        cann_passes.backend(cann_passes.Plan(microbatches=2))
    with pytest.raises(cann_passes.PlanError, match="grad_clip_norm.*whole compiled steps"):
        cann_passes.backend(cann_passes.Plan(grad_clip_norm=1.0))


def _grads_after_one_backward(name, plan, autocast=None, **build_kw):
    from tests.zoo import build
    entry = build(name, **build_kw)
    model, reference = entry.model, copy.deepcopy(entry.model)
    backend = cann_passes.backend(plan)
    compiled = torch.compile(model, backend=backend)
    batch = entry.make_batch(0)
    loss = entry.loss_fn(compiled, batch)
    loss.backward()
    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        want = entry.loss_fn(reference, batch)
    want.backward()
    names = [n for n, _ in model.named_parameters()]
    return (loss.item(), want.item(), names, [p.grad for p in model.parameters()],
            [p.grad for p in reference.parameters()], backend)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_the_readme_example_on_inductor_with_bf16_and_selective_recompute_matches_eager_autocast(name):
    torch._dynamo.reset()
    got, want, names, grads, ref_grads, backend = _grads_after_one_backward(
        name, cann_passes.Plan(backend="inductor", precision="bf16", recompute="selective"),
        autocast=torch.bfloat16, layers=1)
    assert got == pytest.approx(want, rel=2e-2)
    flat = torch.cat([g.flatten() for g in grads])
    ref = torch.cat([g.flatten() for g in ref_grads])
    assert ((flat - ref).norm() / ref.norm()).item() <= 2e-2
    assert all(g.dtype == torch.float32 for g in grads)      # the weights stay the user's fp32
    assert backend.partitions[0]["tagged_for_recompute"] > 0


def test_selective_recompute_on_the_eager_lowering_is_bitwise_and_autocast_is_eager_autocast():
    torch._dynamo.reset()
    got, want, names, grads, ref_grads, backend = _grads_after_one_backward(
        "gpt2", cann_passes.Plan(backend="eager", recompute="selective"), layers=1)
    assert got == want and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert backend.partitions[0]["tagged_for_recompute"] > 0
    torch._dynamo.reset()
    got, want, names, grads, ref_grads, _ = _grads_after_one_backward(
        "gpt2", cann_passes.Plan(backend="eager", precision="bf16"), autocast=torch.bfloat16, layers=1)
    # The casts are eager autocast's own, made while AOTAutograd traces: the same numbers.
    assert got == want and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_full_recompute_keeps_fewer_values_for_backward_and_stays_bitwise():
    saved = {}
    for policy in ("none", "full"):
        torch._dynamo.reset()
        plan = cann_passes.Plan(backend="eager", recompute=policy)
        if policy == "none":
            # The min-cut partitioner at budget 1.0, to compare like with like.
            plan = cann_passes.Plan(backend="eager", recompute="budget", recompute_budget=1.0)
        got, want, names, grads, ref_grads, backend = _grads_after_one_backward("llama", plan, layers=1)
        assert got == want and all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), policy
        saved[policy] = backend.partitions[0]["saved_values"]
    assert saved["full"] < saved["none"], saved
