"""grad_clip against torch.nn.utils.clip_grad_norm_: alone, accumulated, loss-scaled, DP and ZeRO on gloo."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from cann_passes.plan import PlanError
from cann_passes.runtime.distributed import launch_local, rank_failures
from tests.gloo_scenarios import PRELOAD
from tests.zoo import build, compare, eager_steps

HERE = Path(__file__).parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import clip_worker  # noqa: E402

CLIP = 0.5


def _eager_norms(entry, batches, opt_factory, microbatches=1):
    """clip_grad_norm_'s returned norms, training eagerly with clipping."""
    model = copy.deepcopy(entry.model)
    opt = opt_factory(model.parameters())
    norms = []
    for b in batches:
        opt.zero_grad()
        eager_steps(model, entry.loss_fn, _NoStep(), [b], microbatches=microbatches)
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)))
        opt.step()
    return norms


class _NoStep:
    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass


def test_clipping_is_bitwise_equal_to_clip_grad_norm_and_reports_the_norm():
    entry = build("gpt")
    batches = [entry.make_batch(1000 + i) for i in range(3)]
    opt = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    norms = _eager_norms(entry, batches, opt)
    assert max(norms) > CLIP  # the clip is active
    run = compare(entry, Plan(backend="eager", grad_clip_norm=CLIP, verify="deep"), optimizer=opt,
                  clip_norm=CLIP, batches=batches)
    assert run.eager_losses == run.compiled_losses and run.max_param_diff() == 0.0
    assert float(run.step.metrics["grad_clip:grad_norm"]) == norms[-1]
    assert "grad_clip{max_norm=0.5}" in str(run.step.last.pipeline)


def test_clipping_under_accumulation_clips_the_accumulated_mean_once():
    run = compare("llama", Plan(backend="eager", grad_clip_norm=CLIP, microbatches=2, verify="deep"),
                  clip_norm=CLIP)
    assert run.max_loss_diff() <= 1e-5 * max(run.eager_losses) and run.max_param_diff() <= 1e-5
    assert "grad_clip:grad_norm" in run.step.metrics


def test_fp16_clips_unscaled_gradients_and_an_overflowing_step_stays_skipped():
    entry = build("gpt")
    before = {n: p.detach().clone() for n, p in entry.model.named_parameters()}
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    # A scale of 2**40 overflows fp16 in the first backward: that step must change nothing.
    step = compile_for_npu(entry.model, Plan(backend="eager", precision="fp16", grad_clip_norm=CLIP,
                                             loss_scale_init=2.0 ** 40),
                           optimizer=opt, loss_fn=entry.loss_fn)
    step(entry.make_batch(1))
    assert bool(step.metrics["loss_scale:found_inf"])
    for n, p in entry.model.named_parameters():
        assert torch.equal(p, before[n]), n
    # Once the scale has backed off, the reported norm is that of the unscaled gradients.
    for i in range(40):
        step(entry.make_batch(2))
        if not bool(step.metrics["loss_scale:found_inf"]):
            break
    assert not bool(step.metrics["loss_scale:found_inf"])
    ref = build("gpt").model
    ref.load_state_dict({n: before[n] for n in before}, strict=False)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = entry.loss_fn(ref, entry.make_batch(2))
    loss.backward()
    want = float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), CLIP))
    assert abs(float(step.metrics["grad_clip:grad_norm"]) - want) <= 2e-2 * want


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "1.0"])
def test_grad_clip_norm_must_be_a_positive_finite_number(value):
    with pytest.raises(PlanError, match="grad_clip_norm"):
        Plan(grad_clip_norm=value)


def _single_process_reference():
    model, opt = clip_worker.make_model()
    losses, norms = [], []
    for i in range(clip_worker.STEPS):
        opt.zero_grad()
        loss = clip_worker.gpt_loss(model, clip_worker.global_batch(i))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip_worker.MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_clipping_under_dp2_and_zero3_on_gloo_equals_single_process_clipping(tmp_path):
    results = launch_local([str(HERE / "clip_worker.py"), str(tmp_path), "dp,zero3"], 2,
                           env={"PYTHONPATH": str(REPO)}, timeout_s=300, cwd=str(REPO), preload=PRELOAD)
    report = rank_failures(results)
    assert not report, report
    ref_losses, ref_norms, ref_params = _single_process_reference()
    assert max(ref_norms) > clip_worker.MAX_NORM
    for rank in range(2):
        result = torch.load(tmp_path / f"clip.rank{rank}.pt", weights_only=False)
        for strategy in ("dp", "zero3"):
            got = result[strategy]
            for i, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{strategy} rank {rank} step {i}: loss {a} vs {b}"
            for i, (a, b) in enumerate(zip(got["norms"], ref_norms, strict=True)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{strategy} rank {rank} step {i}: norm {a} vs {b}"
            for name, want in ref_params.items():
                err = (got["params"][name] - want).abs().max().item()
                assert err <= 1e-5, f"{strategy} rank {rank}: {name} differs by {err:.2e}"
