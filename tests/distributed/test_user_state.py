"""Under ZeRO the user's model and optimizer follow torch's distributed conventions.

- ``model.state_dict()`` and ``model(x)`` are the trained model (ZeRO-3 gathers
  on read); ``torch.save`` of it resumes in one process.
- ``optimizer.state_dict()`` holds every sharded entry as a parameter-shaped
  ``DTensor`` (``Shard(0)`` on the dp mesh): ``torch.distributed.checkpoint``
  saves it (``get_optimizer_state_dict``, FQN keys) and a plain single-process
  run loads it (``dcp_to_torch_save``, then ``set_optimizer_state_dict``);
  ``get_optimizer_state_dict(...)`` gives the full state,
  which ``set_optimizer_state_dict`` loads into a plain run or into a ZeRO run
  of another stage and dp degree.

Every run continues equal (1e-5) to the uninterrupted single-process run on the
same global batches. This file is also the per-rank program:
``python tests/distributed/test_user_state.py SCENARIO OUTDIR [CKPT]``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tests.gloo_scenarios import PRELOAD
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

sys.path.insert(0, str(Path(__file__).parent))
import worker  # noqa: E402
from test_distributed import RANK_ENV, REPO, assert_all_ok  # noqa: E402

pytestmark = pytest.mark.slow
FULL = StateDictOptions(full_state_dict=True)


# -- the per-rank program --------------------------------------------------------------------------

def _train(step, world, steps):
    from cann_passes.runtime.distributed import shard_batch
    for i in steps:
        step(shard_batch(worker.global_batch(i), world.dp_rank, world.dp_size))


def _evaluate(model):
    model.eval()
    with torch.no_grad():
        out = model(worker.probe_batch())
    model.train()
    return out


def rank_main(scenario: str, out: str, ckpt: str = "") -> None:
    import os
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard
    from cann_passes import Plan, compile_for_npu
    from cann_passes.runtime.distributed import init_distributed
    world_size = int(os.environ["WORLD_SIZE"])
    kind, stage = {"zero3_sgd": ("sgd", 3), "zero2_adamw": ("adamw", 2), "zero1_load": ("adamw", 1)}[scenario]
    plan = Plan(backend="eager", dp=world_size, zero_stage=stage)
    with init_distributed(plan) as world:
        model, opt = worker.make_model(kind)
        first = 0
        if scenario == "zero1_load":
            saved = torch.load(ckpt, weights_only=False)
            model.load_state_dict(saved["model"])
            set_optimizer_state_dict(model, opt, saved["optim_full"], options=FULL)
            first = 5
        step = compile_for_npu(model, plan, optimizer=opt, loss_fn=worker.gpt_loss)
        _train(step, world, range(first, first + 5))
        result = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "eval": _evaluate(model)}
        sharded = opt.state_dict()                                   # DTensor entries (a collective)
        params = dict(model.named_parameters())
        names = [n for g in opt.param_groups for n, p in params.items() for q in g["params"] if p is q]
        result["layout"] = {
            (names[pos], key): (type(v).__name__, tuple(v.shape), [str(p) for p in v.placements]
                                if isinstance(v, DTensor) else None)
            for pos, entries in sharded["state"].items() for key, v in entries.items()}
        result["shard_rows"] = {names[pos]: entries["exp_avg" if kind == "adamw" else "momentum_buffer"]
                                .to_local().shape[0] for pos, entries in sharded["state"].items()
                                if isinstance(entries.get("exp_avg", entries.get("momentum_buffer")), DTensor)
                                and entries.get("exp_avg", entries.get("momentum_buffer")).dim()}
        assert all(isinstance(v, DTensor) and v.placements == (Shard(0),)
                   for entries in sharded["state"].values() for k, v in entries.items()
                   if k != "step" and v.dim()), "sharded entries are Shard(0) DTensors"
        result["optim_full"] = get_optimizer_state_dict(model, opt, options=FULL)   # a collective
        if scenario == "zero1_load":
            # Loading the DTensor form (and, through torch's function, a full state into a run whose
            # state is sharded) leaves the training unchanged: one more step continues the run.
            opt.load_state_dict(sharded)
            set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt, options=FULL), options=FULL)
            _train(step, world, range(10, 11))
            result["model_step_11"] = {k: v.clone() for k, v in model.state_dict().items()}
        if scenario == "zero2_adamw":
            # torch's convention for a sharded checkpoint: FQN keys (DCP would turn the positions
            # of optimizer.state_dict() into strings), DTensor values, each rank writing its rows
            dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=f"{out}/sharded")
        torch.save(result, f"{out}/{scenario}_{world_size}.rank{world.rank}.pt")


# -- the tests ---------------------------------------------------------------------------------------

def _spawn(n: int, *args: str):
    from cann_passes.runtime.distributed import launch_local
    assert_all_ok(launch_local([__file__, *args], n, env=RANK_ENV, timeout_s=600,
                               cwd=str(REPO), preload=PRELOAD))


def eager_run(kind: str, steps: range, model=None, opt=None):
    if model is None:
        model, opt = worker.make_model(kind)
    for i in steps:
        opt.zero_grad()
        worker.gpt_loss(model, worker.global_batch(i)).backward()
        opt.step()
    return model, opt


def assert_state_equal(got: dict, model: torch.nn.Module, what: str):
    want = model.state_dict()
    assert set(got) == set(want), what
    for name, value in want.items():
        assert got[name].shape == value.shape, f"{what}: {name} shape"
        err = (got[name] - value).abs().max().item()
        assert err <= 1e-5, f"{what}: {name} differs by {err:.2e}"


def _plain(kind: str, model_state: dict, optim_state: dict):
    """A plain single-process run (no project code) from the given state, steps 5..9."""
    model, opt = worker.make_model(kind)
    model.load_state_dict(model_state)
    set_optimizer_state_dict(model, opt, optim_state, options=FULL)
    return eager_run(kind, range(5, 10), model, opt)[0]


def test_zero3_state_dict_and_evaluation_are_the_trained_model_and_resume_in_one_process(tmp_path):
    _spawn(2, "zero3_sgd", str(tmp_path))
    saved = torch.load(tmp_path / "zero3_sgd_2.rank0.pt", weights_only=False)
    at5, at5_opt = eager_run("sgd", range(5))
    assert_state_equal(saved["model"], at5, "ZeRO-3 model.state_dict() after 5 steps")
    torch.testing.assert_close(saved["eval"], _evaluate(at5), rtol=1e-5, atol=1e-5)
    for name, p in at5.named_parameters():
        kind, shape, placements = saved["layout"][(name, "momentum_buffer")]
        assert (kind, shape, placements) == ("DTensor", tuple(p.shape), ["S(0)"]), name
    want_full = get_optimizer_state_dict(at5, at5_opt, options=FULL)
    for name, entries in want_full["state"].items():
        err = (saved["optim_full"]["state"][name]["momentum_buffer"] - entries["momentum_buffer"]).abs().max()
        assert err <= 1e-5, f"full optimizer state {name}: {err:.2e}"
    resumed = _plain("sgd", saved["model"], saved["optim_full"])
    assert_state_equal(resumed.state_dict(), eager_run("sgd", range(10))[0], "resumed single-process run")


def test_zero2_sharded_and_full_optimizer_state_load_into_a_plain_run_and_into_zero1_on_2_ranks(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    _spawn(4, "zero2_adamw", str(tmp_path))
    ranks = [torch.load(tmp_path / f"zero2_adamw_4.rank{r}.pt", weights_only=False) for r in range(4)]
    saved = ranks[0]
    at5, at5_opt = eager_run("adamw", range(5))
    assert_state_equal(saved["model"], at5, "ZeRO-2 model.state_dict() after 5 steps")
    params = dict(at5.named_parameters())
    for name, p in params.items():
        assert saved["layout"][(name, "exp_avg")] == ("DTensor", tuple(p.shape), ["S(0)"]), name
        # Shard(0): each rank a torch.chunk of the rows
        assert sum(r["shard_rows"][name] for r in ranks) == p.shape[0], name
    uninterrupted = eager_run("adamw", range(10))[0]
    plain_full = _plain("adamw", saved["model"], saved["optim_full"])
    assert_state_equal(plain_full.state_dict(), uninterrupted, "plain run from the full optimizer state")
    dcp_to_torch_save(tmp_path / "sharded", tmp_path / "sharded.pt")
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=False)
    assert all(tuple(sharded["optim"]["state"][n]["exp_avg"].shape) == tuple(p.shape) for n, p in params.items())
    plain_sharded = _plain("adamw", sharded["model"], sharded["optim"])
    assert_state_equal(plain_sharded.state_dict(), uninterrupted, "plain run from the sharded (DCP) state")
    ckpt = tmp_path / "zero2_adamw_4.rank0.pt"
    _spawn(2, "zero1_load", str(tmp_path), str(ckpt))
    zero1 = torch.load(tmp_path / "zero1_load_2.rank0.pt", weights_only=False)
    assert_state_equal(zero1["model"], uninterrupted, "ZeRO-1 on 2 ranks from ZeRO-2's full optimizer state")
    assert_state_equal(zero1["model_step_11"], eager_run("adamw", range(11))[0],
                       "ZeRO-1 after reloading its own sharded and full optimizer state")


if __name__ == "__main__":
    rank_main(*sys.argv[1:])
