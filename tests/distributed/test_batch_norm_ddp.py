"""BatchNorm under data parallelism trains as torch DDP does: the buffers the step updates (the
running statistics) are rank 0's before every forward (DDP's default ``broadcast_buffers``), so
every rank's parameters and buffers equal DDP's, with ZeRO, with accumulation and under pp too."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tests.gloo_scenarios import PRELOAD

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import RANK_ENV, REPO, assert_all_ok  # noqa: E402

WORKER = str(Path(__file__).parent / "batch_norm_worker.py")
PLANS = ["dp", "zero1", "zero3", "mb2", "sync", "sync_zero3"]


def _launch_and_compare(tmp_path, plans: list[str], world: int) -> None:
    """Run the worker's plans on ``world`` ranks; every rank's state_dict within 1e-5 of its
    reference (DDP, or for a ``sync`` plan one process on the global batch)."""
    from cann_passes.runtime.distributed import launch_local
    assert_all_ok(launch_local([WORKER, str(tmp_path), *plans], world, env=RANK_ENV, timeout_s=600, cwd=str(REPO), preload=PRELOAD))
    for name in plans:
        for rank in range(world):
            diff = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert any("running_mean" in k for k in diff)
            bad = {k: v for k, v in diff.items() if v > 1e-5}
            reference = "one process on the global batch" if "sync" in name else "DDP"
            assert not bad, (f"{name} rank {rank}: differs from {reference} in "
                             f"{sorted(bad.items(), key=lambda kv: -kv[1])[:3]}")


@pytest.mark.slow
def test_resnet_batch_norm_under_dp_zero_and_accumulation_equals_ddp_on_every_rank(tmp_path):
    """And with ``sync_batch_norm`` (plain, under ZeRO-3, and inductor-compiled) the single-process
    step on the global batch (SyncBatchNorm's statistics over both ranks' rows)."""
    from cann_passes.lowering.base import cxx_compiler_available
    _launch_and_compare(tmp_path, PLANS + ["sync_inductor"] * cxx_compiler_available()[0], 2)


@pytest.mark.slow
def test_resnet_batch_norm_under_dp_x_pp_equals_ddp_on_every_rank(tmp_path):
    """dp=2 x pp=2: each stage's data-parallel ranks take their dp rank 0's buffers of that stage,
    at the first microbatch of the step; every rank's state_dict (both stages') equals DDP's; with
    sync_batch_norm, one process's on each microbatch of the global batch."""
    _launch_and_compare(tmp_path, ["pp", "pp_zero1", "pp_sync"], 4)


def test_the_plan_broadcasts_updated_buffers_under_dp_zero_and_pp():
    from cann_passes import Plan
    from cann_passes.pass_pipeline import build_pipeline
    for plan in (Plan(dp=2), Plan(dp=2, zero_stage=3), Plan(dp=2, pp=2, microbatches=2)):
        assert "buffers=local" not in str(build_pipeline(plan, "eager"))


def test_sync_batch_norm_all_reduces_each_norms_sums_and_leaves_its_statistics_unbroadcast():
    from cann_passes import Plan
    from cann_passes.compile import compile_program
    from cann_passes.passes.tensor_parallel import count_collectives
    from cann_passes.plan import PlanError
    from graph_ir import capture_train_step
    from graph_ir.mesh import MeshDesc
    from tests import zoo
    entry = zoo.build("resnet", layers=1, seed=0)
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1)
    captured, _ = capture_train_step(entry.model, opt, entry.loss_fn, zoo.image_batch(0))
    norms = sum(n.target is torch.ops.aten._native_batch_norm_legit_functional.default for n in captured.graph.nodes)
    program = compile_program(captured, Plan(dp=2, sync_batch_norm=True, verify="deep"), MeshDesc.fake(dp=2))
    graph = program.main
    attrs = graph.attrs["sync_batch_norm"]
    assert attrs["batch_norms"] == norms and len(attrs["buffers"]) == 2 * norms   # running mean and var
    # one all-reduce of (sum, sum of squares, count) per norm forward, one of the two gradient sums
    # per norm backward; of the buffers only num_batches_tracked is broadcast
    ours = [str(n.meta["region"]) for n in graph.graph.nodes
            if n.target is torch.ops._c10d_functional.all_reduce.default and n.meta.get("origin_pass") == "sync_batch_norm"]
    assert sorted(ours) == ["backward"] * norms + ["forward"] * norms
    assert count_collectives(graph)[("forward", "broadcast")] == norms
    assert not any(n.target is torch.ops.aten._native_batch_norm_legit_functional.default for n in graph.graph.nodes)
    with pytest.raises(PlanError, match="sync_batch_norm.*needs dp > 1"):
        Plan(sync_batch_norm=True)
    with pytest.raises(PlanError, match="sync_batch_norm.*true or false"):
        Plan(dp=2, sync_batch_norm="yes")
