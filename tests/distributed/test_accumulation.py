"""Gradient accumulation: static microbatches, dynamic sample targets, one sync per optimizer step."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from cann_passes import PassContext, PassManager, Plan, compile_for_npu
from graph_ir import capture_train_step
from graph_ir.mesh import MeshDesc
from recipes.models.gpt import gpt_loss

sys.path.insert(0, str(Path(__file__).parent))
import worker  # noqa: E402

C10D = "_c10d_functional"


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_close(got, want, what):
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= 1e-5, f"{what}: {name} differs by {err:.2e}"


def test_four_static_microbatches_equal_one_step_on_the_four_times_larger_batch():
    ref_model, ref_opt = worker.make_model()
    ref = compile_for_npu(ref_model, Plan(backend="eager"), optimizer=ref_opt, loss_fn=gpt_loss)
    model, opt = worker.make_model()
    step = compile_for_npu(model, Plan(backend="eager", verify="deep", microbatches=4), optimizer=opt,
                           loss_fn=gpt_loss)
    for i in range(3):
        batch = worker.global_batch(i, rows=8)
        want, got = ref(batch), step(batch)
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
        _assert_close(_params(model), _params(ref_model), f"after step {i}")
    assert [g.attrs["name"] for g in step.graphs] == ["step.grad", "step.apply"]
    assert step.last.graph.attrs["grad_accumulation"]["microbatches"] == 4
    assert step.accumulation.history == [8, 8, 8]


def test_dynamic_accumulation_reaches_its_target_every_optimizer_step():
    sizes = [3, 2, 4, 1, 5, 2, 2, 3]     # samples per microbatch, varying
    target = 6
    model, opt = worker.make_model()
    step = compile_for_npu(model, Plan(backend="eager", accumulate_target=target), optimizer=opt,
                           loss_fn=gpt_loss)
    ref_model, ref_opt = worker.make_model()
    ref = compile_for_npu(ref_model, Plan(backend="eager"), optimizer=ref_opt, loss_fn=gpt_loss)
    pending = []
    for i, rows in enumerate(sizes):
        batch = worker.global_batch(i, rows=rows)
        step(batch)
        pending.append(batch)
        if bool(step.metrics["applied"]):
            # The same samples in one plain step: same parameters.
            ref(tuple(torch.cat(parts) for parts in zip(*pending)))
            pending = []
            _assert_close(_params(model), _params(ref_model), f"after microbatch {i}")
    assert step.accumulation.history == [9, 6, 7]          # each the first count >= 6
    assert all(s >= target for s in step.accumulation.history)
    assert step.accumulation.pending_samples == 0


def test_data_parallel_and_zero_sync_once_per_optimizer_step_not_per_microbatch():
    model, opt = worker.make_model()
    tg, _ = capture_train_step(model, opt, gpt_loss, worker.global_batch(0, rows=2))
    mesh = MeshDesc.fake(dp=2)
    for sync in ("data_parallel{bucket_mb=0.02}", "optimizer_shard{stage=2,bucket_mb=0.02}"):
        program = PassManager(f"cleanup,grad_accumulation{{microbatches=4}},{sync},cleanup,split_grad_apply",
                              verify_level="deep").run(tg.copy(), PassContext(mesh=mesh))
        grad, apply = program["grad"], program["apply"]
        grad_collectives = [n for n in grad.graph.nodes if C10D in str(n.target) and "wait" not in str(n.target)]
        apply_collectives = [n for n in apply.graph.nodes if C10D in str(n.target) and "wait" not in str(n.target)]
        # Per microbatch: only the scalar loss is averaged; every gradient crosses ranks in "apply".
        assert [n.meta["val"].numel() for n in grad_collectives] == [1]
        assert sum(n.args[0].meta["val"].numel() for n in apply_collectives
                   if "all_gather" not in str(n.target)) >= sum(p.numel() for p in model.parameters())
