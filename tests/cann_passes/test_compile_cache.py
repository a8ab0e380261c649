"""The compile cache: a fresh process with the same model and plan skips capture and the passes and
steps bitwise like an uncached compile; anything the step is specialised on changes the key; a
corrupt entry is ignored with a log line."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cann_passes import Plan, compile_cache, compile_for_npu
from cann_passes.compile_cache import CompileCache, cache_dir
from tests.conftest import gpt_batches, make_optimizer, tiny_gpt

REPO = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: a tiny GPT with dropout (the RNG stream must be the same with and
# without the cache), AdamW, two steps; prints whether the compile came from the cache and
# saves the parameters and the optimizer state.
_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {repo!r})
import cann_passes.compile_cache as cc
cc._STARTED = float("inf")     # other edits to the working tree while the test runs do not turn it off
from cann_passes import Plan, compile_for_npu
from tests.conftest import gpt_batches, make_optimizer, tiny_gpt
model, loss_fn = tiny_gpt(dropout=0.1)
opt = make_optimizer("adamw", model.parameters())
plan = Plan(backend="eager", compile_cache=sys.argv[1], extra_passes={extra!r})
step = compile_for_npu(model, plan, optimizer=opt, loss_fn=loss_fn)
losses = [step(b).item() for b in gpt_batches(2)]
torch.save({{"params": model.state_dict(), "opt": opt.state_dict()["state"]}}, sys.argv[2])
key = cc.CompileCache(sys.argv[1]).key(step, gpt_batches(1)[0])[0] if sys.argv[1] != "off" else None
ops = sorted({{str(n.target) for g in step.last.program.graphs.values() for n in g.graph.nodes
              if n.op == "call_function"}})
print(json.dumps({{"hit": step.last.program.attrs.get("compile_cache") == "hit", "losses": losses,
                  "passes": [r.name for r in step.records], "key": key, "ops": ops}}))
"""


def _run(script: Path, cache: str, out: Path) -> dict:
    env = dict(os.environ, CANN_PASSES_DUMP="")
    done = subprocess.run([sys.executable, str(script), cache, str(out)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_a_second_process_hits_the_cache_and_steps_bitwise_like_an_uncached_compile(tmp_path):
    script = tmp_path / "step_once.py"
    script.write_text(_SCRIPT.format(repo=str(REPO), extra=[]))
    cache = str(tmp_path / "cache")
    off = _run(script, "off", tmp_path / "off.pt")
    for _ in range(3):    # a source file edited between the two processes changes the key: try again
        cold = _run(script, cache, tmp_path / "cold.pt")
        warm = _run(script, cache, tmp_path / "warm.pt")
        if cold["key"] == warm["key"]:
            break
    assert cold["key"] == warm["key"]
    assert not off["hit"] and not cold["hit"] and warm["hit"]
    assert warm["losses"] == cold["losses"] == off["losses"]
    assert warm["passes"] == cold["passes"]                      # the pass records come with the entry
    ref = torch.load(tmp_path / "off.pt")
    for name in ("cold", "warm"):
        assert _equal(torch.load(tmp_path / f"{name}.pt"), ref), name


# Reads one entry by key in a fresh interpreter, as a warm process does before any pass or plan
# validation has imported the pass modules.
_LOAD = """
import json, sys
sys.path.insert(0, {repo!r})
import glob, os
import cann_passes.compile_cache as cc
(path,) = glob.glob(os.path.join(sys.argv[1], "*", "*"))     # the one entry the cold process stored
entry = cc.CompileCache(sys.argv[1]).load(os.path.basename(path))
ops = sorted({{str(n.target) for g in entry.program.graphs.values() for n in g.graph.nodes
              if n.op == "call_function"}}) if entry else []
print(json.dumps({{"loaded": entry is not None, "ops": ops}}))
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_cached_graph_holding_an_op_a_pass_defines_loads_in_a_fresh_process(tmp_path):
    # linear_on_onednn's ``cann.onednn_linear`` is a custom op that exists once its pass module is
    # imported; a process that loads the step from the cache has run no pass before reading the graph.
    script, loader = tmp_path / "step_once.py", tmp_path / "load.py"
    script.write_text(_SCRIPT.format(repo=str(REPO), extra=["linear_on_onednn"]))
    loader.write_text(_LOAD.format(repo=str(REPO)))
    cache = str(tmp_path / "cache")
    cold = _run(script, cache, tmp_path / "cold.pt")
    assert "cann.onednn_linear.default" in cold["ops"]
    done = subprocess.run([sys.executable, str(loader), cache], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, CANN_PASSES_DUMP=""), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    warm = json.loads(done.stdout.strip().splitlines()[-1])
    assert warm["loaded"], done.stderr[-2000:]
    assert warm["ops"] == cold["ops"]


@pytest.fixture(autouse=True)
def _steady_sources(monkeypatch):
    """Sources edited by others while these tests run would turn the cache off (see the guard test)."""
    monkeypatch.setattr(compile_cache, "_STARTED", float("inf"))


def test_a_source_edited_after_the_process_started_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_STARTED", 0.0)
    step = _compile(str(tmp_path))
    assert step.last.program.attrs.get("compile_cache") != "hit" and not os.listdir(tmp_path)
    batch = gpt_batches(1)[0]
    assert torch.isfinite(step(batch))


def _compile(cache: str, seed: int = 0, plan: dict | None = None, batch=None, **model):
    net, loss_fn = tiny_gpt(seed, **model)
    opt = make_optimizer("adamw", net.parameters())
    step = compile_for_npu(net, Plan(backend="eager", compile_cache=cache, **(plan or {})), optimizer=opt,
                           loss_fn=loss_fn)
    step.compile(batch or gpt_batches(1)[0])
    return step


def test_what_the_step_is_specialised_on_changes_the_key(tmp_path):
    cache = str(tmp_path)
    first = _compile(cache)
    assert first.last.program.attrs.get("compile_cache") != "hit"
    assert _compile(cache).last.program.attrs.get("compile_cache") == "hit"      # same process, fresh model
    # Same parameter shapes, other graph (heads); another plan; another batch shape: all miss.
    for step in (_compile(cache, n_head=4), _compile(cache, plan={"precision": "bf16"}),
                 _compile(cache, batch=gpt_batches(1, batch=2)[0])):
        assert step.last.program.attrs.get("compile_cache") != "hit"
    keys = [p for shard in os.listdir(cache) for p in os.listdir(os.path.join(cache, shard))]
    assert len(keys) == 4


def test_a_corrupt_entry_is_ignored_with_a_log_line_and_compiled_anew(tmp_path, caplog):
    cache = str(tmp_path)
    ref = _compile(cache)
    (entry,) = [os.path.join(cache, s, k) for s in os.listdir(cache) for k in os.listdir(os.path.join(cache, s))]
    with open(os.path.join(entry, "entry.json"), "r+", encoding="utf-8") as f:
        f.truncate(1000)
    with caplog.at_level(logging.WARNING, logger="cann_passes"):
        again = _compile(cache)
    assert again.last.program.attrs.get("compile_cache") != "hit"
    assert any("ignoring entry" in r.getMessage() for r in caplog.records)
    batch = gpt_batches(1)[0]
    assert torch.equal(again(batch), ref(batch))
    assert CompileCache(cache).load(os.path.basename(entry)) is not None     # rewritten whole


def test_the_cache_is_off_by_plan_or_environment_and_while_dumping(tmp_path, monkeypatch):
    monkeypatch.delenv("CANN_PASSES_COMPILE_CACHE", raising=False)
    monkeypatch.delenv("CANN_PASSES_DUMP", raising=False)
    assert cache_dir(Plan()) == os.path.expanduser("~/.cache/cann_recipes_train/compile")
    assert cache_dir(Plan(compile_cache="off")) is None
    assert cache_dir(Plan(compile_cache=str(tmp_path))) == str(tmp_path)
    assert cache_dir(Plan(compile_cache=str(tmp_path), dump_dir=str(tmp_path / "d"))) is None
    monkeypatch.setenv("CANN_PASSES_COMPILE_CACHE", "off")
    assert cache_dir(Plan()) is None
    monkeypatch.setenv("CANN_PASSES_COMPILE_CACHE", str(tmp_path / "env"))
    assert cache_dir(Plan()) == str(tmp_path / "env")
    with pytest.raises(ValueError, match="compile_cache"):
        Plan(compile_cache="  ")
