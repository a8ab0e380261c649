"""plan.background_lowering under data parallelism: each rank's child process compiles the dp
step with inductor, whose compile resolves the graph's process groups by name, so the child stands
in groups of the parent's ranks under the parent's names. Both ranks take inductor's runners over
after two steps on the eager lowering, from the caches the child filled, and train like
single-process eager PyTorch on the same batch.

This file is also the per-rank program: ``python tests/distributed/test_background_lowering_dp.py OUTDIR``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from test_distributed import RANK_ENV, REPO, assert_all_ok  # noqa: E402

from tests.gloo_scenarios import PRELOAD  # noqa: E402
from tests.passes._tiny import mlp_batch, mlp_step  # noqa: E402

BATCHES = [mlp_batch(seed) for seed in range(1, 7)]


def rank_main(out: str) -> None:
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime.distributed import init_distributed
    plan = Plan(backend="inductor", dp=2, background_lowering=True)
    init_distributed(plan)
    tiny = mlp_step()
    model, opt = tiny.fresh()
    step = compile_for_npu(model, plan, optimizer=opt, loss_fn=tiny.loss_fn)
    from torch._dynamo.utils import counters
    losses = []
    for i, batch in enumerate(BATCHES):        # every rank the same batch: the mean gradient is its own
        losses.append(float(step(batch)))
        if i == 1:
            step.wait_for_lowering()
            hits = counters["aot_autograd"]["autograd_cache_hit"]
    background = step.last.background
    torch.save({"losses": losses, "switched_at": background.switched_at, "error": background.error,
                "take_over_hits": counters["aot_autograd"]["autograd_cache_hit"] - hits,
                "params": [p.detach().clone() for p in model.parameters()]},
               Path(out) / f"rank{torch.distributed.get_rank()}.pt")


@pytest.mark.slow
def test_each_rank_takes_inductor_over_from_its_child_and_trains_like_eager(tmp_path):
    from cann_passes.runtime.distributed import launch_local
    from tests.eager_reference import eager_steps
    assert_all_ok(launch_local([__file__, str(tmp_path)], 2, env=RANK_ENV, timeout_s=600, cwd=str(REPO),
                               preload=PRELOAD))
    tiny = mlp_step()
    model, opt = tiny.fresh()
    want = eager_steps(model, opt, tiny.loss_fn, BATCHES)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["error"] is None and got["switched_at"] == 2, (rank, got["error"])
        # the rank (started by multiprocessing) found what its child compiled: the keys match
        assert got["take_over_hits"] == 1, rank
        assert got["losses"] == pytest.approx(want.losses, rel=1e-5)
        for p, q in zip(got["params"], model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    rank_main(sys.argv[1])
