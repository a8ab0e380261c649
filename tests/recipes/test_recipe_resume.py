"""The recipe launcher's run directory: a run continued from a checkpoint gives bitwise the losses and
parameters of the run that never stopped (one process, and two data-parallel gloo ranks), the
directory holds the config, the metrics log, the checkpoints and the figure, and the run-management
flags refuse bad values on one line with exit status 2, writing nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cann_passes.runtime.distributed import launch_local, rank_failures
from tests.gloo_scenarios import PRELOAD

REPO = Path(__file__).resolve().parents[2]
TINY = ["--batch-size", "2", "--seq-len", "16", "--backend", "eager"]
# One intra-op thread per rank: the ranks outnumber the cores (see tests/distributed).
RANK_ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _llama(argv):
    from recipes.llama.train import main
    return main([*TINY, *argv])


def _checkpoint(path: Path, tmp_path: Path) -> dict:
    """Everything a checkpoint holds (model, optimizer, step state, step count) as one plain dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    file = tmp_path / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(file))
    return torch.load(file, weights_only=False)


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_repeats_the_uninterrupted_one_bitwise(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    want = _llama(["--steps", "6", "--save-every", "3", "--eval-every", "2", "--out", str(whole)])
    # the first run stops at step 3 of a schedule meant for 6 steps; the second continues it
    _llama(["--steps", "3", "--schedule-steps", "6", "--save-every", "3", "--eval-every", "2", "--out", str(parts)])
    got = _llama(["--steps", "6", "--resume", "latest", "--save-every", "3", "--eval-every", "2", "--out", str(parts)])
    assert got["losses"] == want["losses"] and len(got["losses"]) == 6
    assert got["evals"] == want["evals"] and [e["step"] for e in got["evals"]] == [2, 4, 6]
    assert _logged(parts) == [{**w, "seconds": g["seconds"], "tokens_per_s": g["tokens_per_s"], "mfu": g["mfu"]}
                              for w, g in zip(_logged(whole), _logged(parts), strict=True)]
    assert_bitwise_equal(_checkpoint(parts / "checkpoints" / "step-000006", tmp_path),
                         _checkpoint(whole / "checkpoints" / "step-000006", tmp_path))
    assert_the_run_directory_is_complete(parts)


def assert_the_run_directory_is_complete(out: Path) -> None:
    import yaml
    assert {"config.yaml", "metrics.jsonl", "checkpoints", "loss.png", "metrics.json"} <= {p.name for p in out.iterdir()}
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["plan"]["backend"] == "eager" and config["world_size"] == 1 and config["seed"] == 0
    assert config["args"]["steps"] == 6 and config["args"]["save_every"] == 3 and config["start_step"] == 3
    assert config["resumed_from"] == str(out / "checkpoints" / "step-000003")
    log = _logged(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert set(log[0]) == {"step", "loss", "lr", "tokens_per_s", "seconds", "mfu"} and "val_loss" in log[1]
    assert log[0]["mfu"] > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    assert json.loads((out / "metrics.json").read_text())["losses"] == [r["loss"] for r in log]


def test_two_data_parallel_ranks_resume_bitwise(tmp_path):
    """ZeRO-1 on two gloo ranks: the run continued from the step-2 checkpoint of a 4-step run ends
    where that run ended."""
    plan = str(REPO / "recipes" / "llama" / "plans" / "zero1_dp2.yaml")

    def run(*argv):
        results = launch_local(["-m", "recipes.llama", "--plan", plan, *TINY, "--steps", "4", *argv], 2,
                               env=RANK_ENV, timeout_s=300, cwd=str(REPO), preload=PRELOAD)
        assert not rank_failures(results), rank_failures(results)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run("--save-every", "2", "--out", str(whole))
    run("--resume", str(whole / "checkpoints" / "step-000002"), "--save-every", "2", "--out", str(resumed))
    # a run resumed into another directory logs its own steps; its figure shows the whole history
    assert [r["step"] for r in _logged(resumed)] == [3, 4]
    assert [r["loss"] for r in _logged(resumed)] == [r["loss"] for r in _logged(whole)][2:]
    assert json.loads((resumed / "metrics.json").read_text())["losses"] == [r["loss"] for r in _logged(whole)]
    assert_bitwise_equal(_checkpoint(resumed / "checkpoints" / "step-000004", tmp_path),
                         _checkpoint(whole / "checkpoints" / "step-000004", tmp_path))


def _refusal(argv, capsys, tmp_path, monkeypatch) -> list[str]:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        _llama(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_resume_latest_with_nothing_saved_is_one_line_and_writes_nothing(capsys, tmp_path, monkeypatch):
    err = _refusal(["--resume", "latest", "--out", "run"], capsys, tmp_path, monkeypatch)
    assert err == ["python -m recipes.llama: error: --resume latest: no checkpoint under 'run/checkpoints' "
                   "(a run saves them with --save-every N)"]
    assert list(tmp_path.iterdir()) == []


def test_resume_from_a_directory_that_is_no_checkpoint_is_refused(capsys, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    err = _refusal(["--resume", "empty", "--out", "run"], capsys, tmp_path, monkeypatch)
    assert len(err) == 1 and err[0].startswith("python -m recipes.llama: error: --resume 'empty': not a checkpoint")
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]


def test_resume_past_the_requested_steps_is_refused(capsys, tmp_path, monkeypatch):
    _llama(["--steps", "2", "--save-every", "2", "--out", str(tmp_path / "run")])
    capsys.readouterr()
    err = _refusal(["--steps", "1", "--resume", "latest", "--out", str(tmp_path / "run")], capsys, tmp_path,
                   monkeypatch)
    assert len(err) == 1 and "its checkpoint is at step 2, past --steps 1" in err[0], err


def test_a_fresh_run_never_removes_an_earlier_runs_checkpoints_unasked(capsys, tmp_path, monkeypatch):
    run = tmp_path / "run"
    _llama(["--steps", "2", "--save-every", "2", "--out", str(run)])
    saved = (run / "checkpoints" / "step-000002").stat().st_mtime_ns
    capsys.readouterr()
    err = _refusal(["--steps", "1", "--save-every", "1", "--out", str(run)], capsys, tmp_path, monkeypatch)
    assert len(err) == 1 and "holds checkpoints of an earlier run (newest: step 2); --resume latest" in err[0], err
    assert (run / "checkpoints" / "step-000002").stat().st_mtime_ns == saved
    _llama(["--steps", "1", "--save-every", "1", "--overwrite", "--out", str(run)])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]


def test_tensorboard_log_needs_its_package(capsys, tmp_path, monkeypatch):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        err = _refusal(["--log", "tensorboard", "--out", "run"], capsys, tmp_path, monkeypatch)
        assert len(err) == 1 and "--log tensorboard: needs the 'tensorboard' package" in err[0], err
        assert list(tmp_path.iterdir()) == []
        return
    _llama(["--steps", "2", "--log", "tensorboard", "--out", str(tmp_path)])
    assert any((tmp_path / "tensorboard").iterdir())
