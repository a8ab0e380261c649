"""``launch_local``: ranks forked from a preloading server see what fresh interpreters see
(environment, working directory, ``sys.argv``, ``sys.path``, thread count, ``__main__``), talk over
gloo, and fail the same way (exit codes, a native crash's Python stack)."""
from __future__ import annotations

import json

import pytest

from cann_passes.runtime.distributed import launch_local, rank_failures

RANK = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "extra": os.environ.get("EXTRA"),
                  "argv": sys.argv[1:], "cwd": os.getcwd(), "threads": torch.get_num_threads(),
                  "path0": sys.path[0], "name": __name__, "sum": t.tolist()}))
dist.destroy_process_group()
if "fail" in sys.argv and os.environ["RANK"] == "0":
    import ctypes
    ctypes.string_at(0)
if "fail" in sys.argv:
    raise SystemExit(3)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def _seen(results) -> list[dict]:
    assert not rank_failures(results), rank_failures(results)
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


def test_forked_ranks_see_what_fresh_interpreters_see(script, tmp_path):
    env = {"EXTRA": "x", "OMP_NUM_THREADS": "1"}
    fresh = _seen(launch_local([str(script), "a", "b"], 2, env=env, cwd=str(tmp_path), timeout_s=120))
    forked = _seen(launch_local([str(script), "a", "b"], 2, env=env, cwd=str(tmp_path), timeout_s=120,
                                preload=["torch", "torch.distributed"]))
    assert forked == fresh
    assert [s["rank"] for s in forked] == ["0", "1"] and forked[0]["sum"] == [3.0, 3.0]
    assert forked[0]["name"] == "__main__" and forked[0]["threads"] == 1 and forked[0]["extra"] == "x"
    assert forked[0]["path0"] == str(script.parent) and forked[0]["argv"] == ["a", "b"]


def test_forked_ranks_run_a_module_and_fail_with_their_own_exit_codes(script, tmp_path):
    module = _seen(launch_local(["-m", "rank", "c"], 2, env={"PYTHONPATH": str(tmp_path)}, timeout_s=120,
                                preload=["torch"]))
    assert [s["argv"] for s in module] == [["c"], ["c"]]
    results = launch_local([str(script), "fail"], 2, timeout_s=120, preload=["torch"])
    assert [r.returncode for r in results] == [-11, 3]
    report = rank_failures(results)
    assert report.index("rank 0 exited -11") < report.index("rank 1 exited 3")
    assert "Fatal Python error: Segmentation fault" in results[0].stderr and "rank.py" in results[0].stderr


def test_a_forked_launch_runs_only_scripts_and_modules():
    with pytest.raises(ValueError, match="runs 'script.py args' or '-m module args', not \\['-c'"):
        launch_local(["-c", "pass"], 2, preload=["torch"])
