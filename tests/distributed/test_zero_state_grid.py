"""ZeRO-1/2/3 on 2 and 4 gloo ranks: the user's own model is the trained one, read with plain torch.

After 5 SGD steps of every ZeRO stage, ``model.state_dict()`` on every rank
(rank 0 is what a user saves) equals the single-process model trained on the
same global batches (1e-5), and ``model.eval(); model(x)`` gives its output,
without calling any project function (no ``sync_model``): the state-dict and
forward hooks of ``cann_passes/runtime/user_state.py`` gather what is sharded.
One spawn per world size runs all three stages, so the grid costs two launches.

This file is also the per-rank program: ``python tests/distributed/test_zero_state_grid.py OUTDIR``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tests.gloo_scenarios import PRELOAD

sys.path.insert(0, str(Path(__file__).parent))
import worker  # noqa: E402
from test_distributed import RANK_ENV, REPO, assert_all_ok  # noqa: E402

STAGES, STEPS = (1, 2, 3), 5
pytestmark = pytest.mark.slow


def rank_main(out: str) -> None:
    import os
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime.distributed import init_distributed, shard_batch
    world_size = int(os.environ["WORLD_SIZE"])
    base = Plan(backend="eager", dp=world_size)
    with init_distributed(base) as world:
        result = {}
        for stage in STAGES:
            model, opt = worker.make_model("sgd")
            step = compile_for_npu(model, base.replace(zero_stage=stage), optimizer=opt, loss_fn=worker.gpt_loss)
            for i in range(STEPS):
                step(shard_batch(worker.global_batch(i), world.dp_rank, world.dp_size))
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # a collective under ZeRO-3
            model.eval()
            with torch.no_grad():
                evaluated = model(worker.probe_batch())
            model.train()
            result[stage] = {"model": state, "eval": evaluated}
        torch.save(result, f"{out}/grid_{world_size}.rank{world.rank}.pt")


@pytest.fixture(scope="module")
def reference():
    model, opt = worker.make_model("sgd")
    for i in range(STEPS):
        opt.zero_grad()
        worker.gpt_loss(model, worker.global_batch(i)).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        evaluated = model(worker.probe_batch())
    return model.state_dict(), evaluated


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_zero_stage_leaves_the_trained_model_in_the_users_state_dict_and_forward(
        world_size, reference, tmp_path):
    from cann_passes.runtime.distributed import launch_local
    assert_all_ok(launch_local([__file__, str(tmp_path)], world_size, env=RANK_ENV,
                               timeout_s=600, cwd=str(REPO), preload=PRELOAD))
    want_state, want_eval = reference
    for rank in range(world_size):
        got = torch.load(tmp_path / f"grid_{world_size}.rank{rank}.pt", weights_only=False)
        for stage in STAGES:
            what = f"ZeRO-{stage}, {world_size} ranks, rank {rank}"
            state = got[stage]["model"]
            assert set(state) == set(want_state), what
            for name, value in want_state.items():
                assert state[name].shape == value.shape, f"{what}: {name} shape"
                err = (state[name] - value).abs().max().item()
                assert err <= 1e-5, f"{what}: model.state_dict()[{name!r}] differs by {err:.2e}"
            torch.testing.assert_close(got[stage]["eval"], want_eval, rtol=1e-5, atol=1e-5, msg=what)


if __name__ == "__main__":
    rank_main(sys.argv[1])
