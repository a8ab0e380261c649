"""Global grad-norm clipping under tensor parallelism equals torch.nn.utils.clip_grad_norm_ on one
process: a split weight's gradient is this rank's shard, so its squared norm is summed over the tp
ranks, while a replicated weight's gradient (norms, biases of row-parallel layers) counts once."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cann_passes.runtime.distributed import launch_local, rank_failures
from tests.gloo_scenarios import PRELOAD

sys.path.insert(0, str(Path(__file__).parent))
import clip_tp_worker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).parent / "clip_tp_worker.py")
RANK_ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
# Small enough that every step clips (the first norms of these models are 1-10).
MAX_NORM = 0.05

pytestmark = pytest.mark.slow


def eager_clipped(name: str):
    entry, optimizer = clip_tp_worker.make(name)
    losses, norms = [], []
    for batch in clip_tp_worker.batches(entry):
        optimizer.zero_grad()
        loss = entry.loss_fn(entry.model, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(entry.model.parameters(), MAX_NORM)))
        optimizer.step()
        losses.append(float(loss))
    return losses, norms, {n: p.detach().clone() for n, p in entry.model.named_parameters()}


@pytest.mark.parametrize("name,flags", [("llama", []), ("gpt2", [])])
def test_tp2_grad_clipping_matches_clip_grad_norm(tmp_path, name, flags):
    results = launch_local([WORKER, str(tmp_path), name, str(MAX_NORM), *flags], 2, env=RANK_ENV,
                           timeout_s=900, cwd=str(REPO), preload=PRELOAD)
    report = rank_failures(results)
    assert not report, report
    got = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    losses, norms, params = eager_clipped(name)
    assert all(n > MAX_NORM for n in norms), norms        # the clip bites on every step
    for i, (a, b) in enumerate(zip(got["norms"], norms, strict=True)):
        assert abs(a - b) <= 1e-5 * max(1.0, b), f"{name}: step {i} grad norm {a} vs clip_grad_norm_ {b}"
    for i, (a, b) in enumerate(zip(got["losses"], losses, strict=True)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{name}: step {i} loss {a} vs eager {b}"
    for pname, want in params.items():
        err = (got["params"][pname] - want).abs().max().item()
        assert err <= 1e-5, f"{name}: parameter {pname} differs from eager by {err:.2e}"
