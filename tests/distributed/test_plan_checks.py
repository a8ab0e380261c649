"""Plans that cannot run on the world are refused before any process-group work, naming the rule."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from cann_passes import Plan, PlanError
from cann_passes.runtime.distributed import check_world, collective_algo_env, init_distributed


def test_dp_must_equal_the_process_count():
    with pytest.raises(PlanError, match=r"dp x cp x tp x pp = 2 x 1 x 1 x 1 = 2 must equal the number of processes \(4\)"):
        check_world(Plan(dp=2), 4)


def test_zero_with_dp_1_is_refused_by_the_plan_itself():
    with pytest.raises(PlanError, match="zero_stage.*needs dp > 1"):
        Plan(zero_stage=1)


def test_refused_plan_creates_no_process_group(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(PlanError, match="must equal the number of processes"):
        init_distributed(Plan(dp=2))
    assert not dist.is_initialized()


def test_allreduce_algo_maps_to_the_collective_library_setting():
    assert collective_algo_env("ring", "nccl") == {"NCCL_ALGO": "Ring"}
    assert collective_algo_env("tree", "hccl") == {"HCCL_ALGO": "level0:NA;level1:H-D_R"}
    assert collective_algo_env("auto", "nccl") == {}
    assert collective_algo_env("ring", "gloo") == {}
