"""BatchNorm under data parallelism trains as torch DDP does: the buffers the step updates (the
running statistics) are rank 0's before every forward (DDP's default ``broadcast_buffers``), so
every rank's parameters and buffers equal DDP's, with ZeRO and with accumulation too."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import RANK_ENV, REPO, assert_all_ok  # noqa: E402

WORKER = str(Path(__file__).parent / "batch_norm_worker.py")
PLANS = ["dp", "zero1", "zero3", "mb2"]


@pytest.mark.slow
def test_resnet_batch_norm_under_dp_zero_and_accumulation_equals_ddp_on_every_rank(tmp_path):
    from cann_passes.runtime.distributed import launch_local
    assert_all_ok(launch_local([WORKER, str(tmp_path), *PLANS], 2, env=RANK_ENV, timeout_s=600, cwd=str(REPO)))
    for name in PLANS:
        for rank in (0, 1):
            diff = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert any("running_mean" in k for k in diff)
            bad = {k: v for k, v in diff.items() if v > 1e-5}
            assert not bad, f"{name} rank {rank}: differs from DDP in {sorted(bad.items(), key=lambda kv: -kv[1])[:3]}"


def test_the_plan_broadcasts_updated_buffers_except_under_pp():
    from cann_passes import Plan
    from cann_passes.pass_pipeline import build_pipeline
    assert "buffers=local" not in str(build_pipeline(Plan(dp=2), "eager"))
    assert "buffers=local" not in str(build_pipeline(Plan(dp=2, zero_stage=3), "eager"))
    assert "buffers=local}" in str(build_pipeline(Plan(dp=2, pp=2, microbatches=2), "eager"))
