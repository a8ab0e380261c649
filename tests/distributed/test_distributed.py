"""Data parallelism, ZeRO 1-3, checkpoints and faults on gloo, with local processes.

Every multi-process test launches ``tests/distributed/worker.py`` as torchrun
would (RANK/WORLD_SIZE/MASTER_*), and compares with plain eager PyTorch
(``torch.optim.AdamW``) trained on the same global batches in this process.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from cann_passes.runtime.distributed import FAULT_EXIT_CODE, launch_local, rank_failures
from tests.gloo_scenarios import PRELOAD

sys.path.insert(0, str(Path(__file__).parent))
import worker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).parent / "worker.py")
# One intra-op thread per rank: the ranks outnumber the cores, and a rank whose idle OpenMP
# threads spin keeps the others from reaching the next collective (several times slower).
RANK_ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_ranks(n: int, *args: str, timeout_s: float = 600):
    results = launch_local([WORKER, *args], n, env=RANK_ENV, timeout_s=timeout_s, cwd=str(REPO), preload=PRELOAD)
    return results


def assert_all_ok(results):
    report = rank_failures(results)
    assert not report, report


def eager_reference(steps=worker.STEPS):
    model, opt = worker.make_model()
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = worker.gpt_loss(model, worker.global_batch(i))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches(losses, params, ref_losses, ref_params, what: str, param_tol: float = 1e-5):
    for i, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {i} loss {got} vs {want}"
    for name, want in ref_params.items():
        err = (params[name] - want).abs().max().item()
        assert err <= param_tol, f"{what}: parameter {name} differs by {err:.2e}"


@pytest.fixture(scope="module")
def reference():
    return eager_reference()


def _unsharded_state_bytes(ref_params) -> int:
    # AdamW: exp_avg and exp_avg_sq like each parameter, plus a scalar fp32 step.
    return sum(2 * p.numel() * 4 + 4 for p in ref_params.values())


def _skip_without_cxx():
    from cann_passes.lowering.base import cxx_compiler_available
    if not cxx_compiler_available()[0]:
        pytest.skip("inductor needs a C++ compiler")


def assert_every_rank_matches(out: Path, scenario: str, world_size: int, strategies: str, reference, what: str,
                              param_tol: float = 1e-5):
    """Every rank's losses and parameters of every strategy in ``out/<scenario>.rank<R>.pt`` match
    ``reference`` (losses, parameters)."""
    ref_losses, ref_params = reference
    for rank in range(world_size):
        result = torch.load(out / f"{scenario}.rank{rank}.pt", weights_only=False)
        for strategy in strategies.split(","):
            got = result[strategy]
            assert_matches(got["losses"], got["params"], ref_losses, ref_params,
                           f"{what} {strategy} on {world_size} ranks (rank {rank})", param_tol)


def test_inductor_dp_and_zero1_on_gloo_match_single_process_adamw(tmp_path, reference):
    # The inductor lowering of data-parallel and ZeRO steps (functional collectives compiled by
    # inductor, the gloo all-gathers run alone), 2 ranks, against eager PyTorch in one process;
    # ZeRO-2 and ZeRO-3 on inductor: the transformers LLaMA test below.
    _skip_without_cxx()
    assert_all_ok(run_ranks(2, "parity", str(tmp_path), "dp,zero1", "shallow", "inductor"))
    # Inductor's vectorized kernels round fp32 sums in the CPU's own order, and AdamW divides each
    # gradient by its own running size, so a rounding-level gradient difference on a near-zero
    # gradient becomes a parameter difference of lr's order: losses at 1e-5, parameters at 2e-5.
    assert_every_rank_matches(tmp_path, "parity", 2, "dp,zero1", reference, "inductor", param_tol=2e-5)


def test_bf16_gradient_reduction_is_torch_ddps_bf16_compress_hook(tmp_path):
    # grad_reduce_dtype: bf16 under DP and ZeRO-2 (a bf16 reduce-scatter) on 2 ranks, 10 SGD steps,
    # against torch DDP with bf16_compress_hook: the same parameters bit for bit; fp32 DP differs
    assert_all_ok(run_ranks(2, "bf16_reduce", str(tmp_path)))
    got = torch.load(tmp_path / "bf16_reduce.pt", weights_only=False)
    ref = got["ddp_bf16_hook"]
    for name in ("dp_bf16", "zero2_bf16"):
        assert got[name]["wire"] == ["torch.bfloat16"], got[name]["wire"]
        assert max(abs(a - b) for a, b in zip(got[name]["losses"], ref["losses"], strict=True)) <= 1e-6
        for pname, want in ref["params"].items():
            assert torch.equal(got[name]["params"][pname], want), f"{name}: {pname}"
    assert got["dp_fp32"]["wire"] == ["torch.float32"]
    assert max((got["dp_fp32"]["params"][n] - w).abs().max().item() for n, w in ref["params"].items()) > 1e-6


def zoo_reference(name: str, world_size: int):
    """Eager PyTorch in this process: each step's loss the mean of the ranks' shard losses (as the
    data-parallel step averages them; with padding the shards hold different token counts)."""
    from cann_passes.runtime.distributed import shard_batch
    from tests import zoo
    entry = zoo.build(name, layers=1)
    model, opt = entry.model, zoo.default_optimizer(entry.model.parameters())
    losses = []
    for i in range(worker.ZOO_STEPS):
        opt.zero_grad()
        batch = worker.zoo_batch(i)
        loss = sum(entry.loss_fn(model, shard_batch(batch, r, world_size)) for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_inductor_zero2_and_zero3_of_transformers_llama_on_gloo_match_eager_on_padded_batches(tmp_path):
    # A model we did not write, padded batches, the ZeRO stage with reduce-scatters (2) and the one
    # with all-gathers in the forward (3), inductor-compiled with gloo's all-gathers run alone.
    _skip_without_cxx()
    assert_all_ok(run_ranks(2, "zoo_parity", str(tmp_path), "llama", "zero2,zero3", "inductor"))
    assert_every_rank_matches(tmp_path, "zoo_parity", 2, "zero2,zero3", zoo_reference("llama", 2), "inductor llama")


@pytest.mark.parametrize("world_size,verify", [(2, "deep"), (4, "shallow")])
def test_dp_and_every_zero_stage_match_single_process_adamw(tmp_path, reference, world_size, verify):
    assert_all_ok(run_ranks(world_size, "parity", str(tmp_path), "dp,zero1,zero2,zero3", verify))
    ref_losses, ref_params = reference
    for rank in range(world_size):
        result = torch.load(tmp_path / f"parity.rank{rank}.pt", weights_only=False)
        for strategy in ("dp", "zero1", "zero2", "zero3"):
            got = result[strategy]
            assert_matches(got["losses"], got["params"], ref_losses, ref_params,
                           f"{strategy} on {world_size} ranks (rank {rank})")
        # ZeRO-1 state: each rank holds 1/N of every moment, padded to N equal shards.
        zero = result["zero1"]["zero"]
        padded_shards = sum(2 * info["shard"] * 4 + 4 for info in zero["params"].values())
        assert result["zero1"]["state_bytes"] == padded_shards
        assert result["dp"]["state_bytes"] == _unsharded_state_bytes(ref_params)
        padding = sum(2 * info["padding"] * 4 for info in zero["params"].values())
        scalars = 4 * len(ref_params)
        assert (result["zero1"]["state_bytes"] - scalars) * world_size == \
            result["dp"]["state_bytes"] - scalars + padding


def test_resume_from_step_5_equals_uninterrupted_run_on_same_and_other_dp_degree(tmp_path, reference):
    ckpt = str(tmp_path / "ckpt")
    assert_all_ok(run_ranks(2, "resume", str(tmp_path), "1", ckpt, "save"))
    assert_all_ok(run_ranks(2, "resume", str(tmp_path), "1", ckpt, "load"))
    assert_all_ok(run_ranks(4, "resume", str(tmp_path), "2", ckpt, "load"))
    full = torch.load(tmp_path / "resume_save_2.rank0.pt", weights_only=False)
    ref_losses, ref_params = reference
    assert_matches(full["losses"], full["params"], ref_losses, ref_params, "uninterrupted ZeRO-1 run")
    for world_size in (2, 4):
        for rank in range(world_size):
            resumed = torch.load(tmp_path / f"resume_load_{world_size}.rank{rank}.pt", weights_only=False)
            assert len(resumed["losses"]) == 5
            assert_matches(resumed["losses"], resumed["params"], full["losses"][5:], full["params"],
                           f"resumed on {world_size} ranks (rank {rank})")


def test_a_rank_raising_at_step_3_stops_every_rank_with_its_name(tmp_path):
    start = time.monotonic()
    results = run_ranks(2, "fault", str(tmp_path), timeout_s=120)
    elapsed = time.monotonic() - start
    assert all(r.returncode is not None for r in results), "a rank was still running after 120s"
    assert elapsed < 60, f"ranks took {elapsed:.0f}s to stop"
    failed, survivor = results[1], results[0]
    assert failed.returncode not in (0, None) and "injected failure at step 3" in failed.stderr
    assert survivor.returncode == FAULT_EXIT_CODE, survivor.stderr[-2000:]
    assert "rank 1 failed: RuntimeError: injected failure at step 3" in survivor.stderr
    assert "finished" not in survivor.stdout
