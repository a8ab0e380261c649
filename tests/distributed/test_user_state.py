"""Under ZeRO the user's model and optimizer stay valid: state dicts, evaluation, loading elsewhere."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import worker  # noqa: E402
from test_distributed import assert_all_ok, run_ranks  # noqa: E402


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
        err = (got[name] - value).abs().max().item()
        assert err <= 1e-5, f"{what}: {name} differs by {err:.2e}"


def _evaluate(model):
    model.eval()
    with torch.no_grad():
        return model(worker.probe_batch())


def test_zero3_state_dict_and_evaluation_are_the_trained_model_and_resume_in_one_process(tmp_path):
    assert_all_ok(run_ranks(2, "user_state", str(tmp_path), "save", "sgd", "3", "-"))
    saved = torch.load(tmp_path / "user_state_save_sgd_3_2.pt", weights_only=False)
    at5, _ = eager_run("sgd", range(5))
    assert_state_equal(saved["model"], at5, "ZeRO-3 model.state_dict() after 5 steps")
    torch.testing.assert_close(saved["eval"], _evaluate(at5), rtol=1e-5, atol=1e-5)
    # A fresh single-process model and optimizer from the saved dicts continue like the uninterrupted run.
    model, opt = worker.make_model("sgd")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    resumed, _ = eager_run("sgd", range(5, 10), model, opt)
    uninterrupted, _ = eager_run("sgd", range(10))
    assert_state_equal(resumed.state_dict(), uninterrupted, "resumed single-process run")


def test_full_optimizer_state_from_zero2_on_4_ranks_continues_plain_and_on_zero1_with_2_ranks(tmp_path):
    assert_all_ok(run_ranks(4, "user_state", str(tmp_path), "save", "adamw", "2", "-"))
    ckpt = tmp_path / "user_state_save_adamw_2_4.pt"
    saved = torch.load(ckpt, weights_only=False)
    at5, at5_opt = eager_run("adamw", range(5))
    assert_state_equal(saved["model"], at5, "ZeRO-2 model.state_dict() after 5 steps")
    for position, entries in at5_opt.state_dict()["state"].items():
        for key, value in entries.items():
            assert saved["optim"]["state"][position][key].shape == value.shape, "full state has parameter shapes"
    uninterrupted, _ = eager_run("adamw", range(10))
    model, opt = worker.make_model("adamw")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    plain, _ = eager_run("adamw", range(5, 10), model, opt)
    assert_state_equal(plain.state_dict(), uninterrupted, "plain run from ZeRO-2's full optimizer state")
    assert_all_ok(run_ranks(2, "user_state", str(tmp_path), "load", "adamw", "1", str(ckpt)))
    zero1 = torch.load(tmp_path / "user_state_load_adamw_1_2.pt", weights_only=False)
    assert_state_equal(zero1["model"], uninterrupted, "ZeRO-1 on 2 ranks from ZeRO-2's full optimizer state")
