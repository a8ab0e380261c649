"""Parameters and optimizer state updated in place under data parallelism and ZeRO-1/2/3 (eager backend).

Two gloo ranks train a transformers GPT-2 built from a config with SGD (momentum) and AdamW (under
ZeRO-2 with gradient clipping, a collective of the optimizer's own; under DP, ZeRO-1 and ZeRO-3 also
as torch's fused kernel, ``optimizer_kernel: fused``, against ``fused=True``). Every
step equals the functional variant of the same graph bitwise, on every rank and for every value the
step stores (``inplace_worker.parity``), and the run equals plain ``torch.optim`` on the global batches
in this process (1e-5: ranks sum in another order). Every buffer ``plan_buffers`` may hold is held
(``min_bytes=0``), the all-gathered parameters of ZeRO-1/2 included. The storage of what is written in place stays
the same from step to step. A step whose labels are out of the vocabulary on one rank leaves both
ranks' parameters, parameter shards and optimizer state exactly as they were
(``inplace_worker.failure``): every write comes after every op that can fail on data or on a peer.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tests.gloo_scenarios import PRELOAD

sys.path.insert(0, str(Path(__file__).parent))
import inplace_worker  # noqa: E402
from test_distributed import RANK_ENV, REPO, assert_all_ok  # noqa: E402

WORKER = str(Path(__file__).parent / "inplace_worker.py")
pytestmark = pytest.mark.slow


def _launch(*args: str):
    from cann_passes.runtime.distributed import launch_local
    assert_all_ok(launch_local([WORKER, *args], 2, env=RANK_ENV, timeout_s=600, cwd=str(REPO), preload=PRELOAD))


def _eager_torch(kind: str, clip):
    entry, opt = inplace_worker.make(kind, reference=True)
    losses = []
    for i in range(inplace_worker.STEPS):
        opt.zero_grad()
        loss = entry.loss_fn(entry.model, inplace_worker.global_batch(i))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(entry.model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in entry.model.state_dict().items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("inplace")
    _launch("parity", str(out))
    return out


def test_dp_and_every_zero_stage_update_in_place_bitwise_like_the_functional_step(ranks):
    reference = {(kind, clip): _eager_torch(kind, clip) for _, kind, clip in inplace_worker.RUNS}
    every = list(inplace_worker.make("sgd")[0].model.parameters())
    params = len(every)
    filled = sum(p.numel() % 2 == 0 for p in every)     # no padding in their 2 flat shards
    state_per_param = {"sgd": 1, "adamw": 3, "adamw_fused": 3}   # momentum_buffer; step, exp_avg, exp_avg_sq
    for rank in range(2):
        result = torch.load(ranks / f"parity.rank{rank}.pt", weights_only=False)
        for strategy, kind, clip in inplace_worker.RUNS:
            stage, per_param = inplace_worker.STAGES[strategy], state_per_param[kind]
            name = inplace_worker.run_name(strategy, kind, clip)
            got, what = result[name], f"{name} rank {rank}"
            assert got["mismatches"] == [], f"{what}: differs from the functional step: {got['mismatches'][:5]}"
            # ZeRO-1/2 copy the gathered columns over the parameters whose shards fill them (a padded
            # one comes fresh from its column).
            expected = params * per_param + (filled if stage in (1, 2) else params)
            assert len(got["written"]) == expected, f"{what}: {len(got['written'])} inputs written in place"
            assert got["storage_kept"] >= expected, f"{what}: a written value moved to new storage"
            assert got["fused_calls"] == (1 if kind == "adamw_fused" else 0), what
            assert got["held"] > 0, f"{what}: no buffer held across steps"
            # ZeRO-1/2 gather the new parameters after the update, ZeRO-3 before their uses: into held buffers
            assert (got["held_all_gathers"] > 0) == (stage > 0), f"{what}: {got['held_all_gathers']}"
            want_losses, want_params = reference[(kind, clip)]
            for i, (a, b) in enumerate(zip(got["losses"], want_losses, strict=True)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {i} loss {a} vs eager torch {b}"
            for param, want in want_params.items():
                err = (got["params"][param] - want).abs().max().item()
                assert err <= 1e-5, f"{what}: {param} differs from eager torch by {err:.2e}"


def test_a_zero1_step_failing_on_one_ranks_labels_leaves_every_rank_as_it_was(ranks):
    for rank in range(2):
        got = torch.load(ranks / f"failure.rank{rank}.pt", weights_only=False)
        assert got["error"] is not None, f"rank {rank}: the step did not fail"
        assert got["written"], f"rank {rank}: nothing is updated in place, so nothing is tested"
        if rank == 1:
            assert "out of bounds" in got["error"], got["error"]
        before, after = got["before"], got["after"]
        for part in ("params", "shards"):
            for name, value in before[part].items():
                assert torch.equal(after[part][name], value), f"rank {rank}: {part} {name} changed"
        for i, state in before["state"].items():
            for key, value in state.items():
                assert torch.equal(after["state"][i][key], value), f"rank {rank}: state {i}.{key} changed"
