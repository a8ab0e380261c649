"""Expert parallelism on gloo with local processes against single-process eager training.

Each launch runs its scenarios (``ep_worker.py``) in one set of ranks; every scenario trains 10
steps of a transformers mixture of experts with ``compile_for_npu`` from the same initial weights
and batches as the eager reference here. The reference is data-parallel training done in one
process: each step's loss is the mean of the dp shards' losses (what every data-parallel rank
computes on its rows and the gradient average makes global; the router's load-balancing loss is
per shard, as under torch DDP), so the comparison isolates what expert parallelism changes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cann_passes.runtime.distributed import shard_batch

from tests import gloo_scenarios

sys.path.insert(0, str(Path(__file__).parent))
import ep_worker  # noqa: E402

WORKER = str(Path(__file__).parent / "ep_worker.py")

pytestmark = pytest.mark.slow


def eager_reference(name: str, opt: str, options: list[str], dp: int):
    entry, optimizer = ep_worker.make(name, opt)
    chunks = 2 if "mb2" in options else 1      # accumulation: each shard's rows in equal chunks

    def loss_of(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in options):
            return sum(entry.loss_fn(entry.model, shard_batch(shard_batch(batch, r, dp), c, chunks))
                       for r in range(dp) for c in range(chunks)) / (dp * chunks)
    return gloo_scenarios.eager_training(entry, optimizer, ep_worker.batches(entry), loss_of, clip="clip" in options)


def launch(tmp_path, world: int, mesh: str, scenarios: list[str]) -> dict[str, dict]:
    return gloo_scenarios.launch(WORKER, tmp_path, world, mesh, scenarios)


def assert_matches(scenario: str, got: dict, dp: int):
    name, opt, *options = scenario.split(":")
    ref_losses, ref_params = eager_reference(name, opt, options, dp)
    tol = 2e-2 if "bf16" in options else 1e-5   # bf16: the project's tolerance against eager autocast
    for i, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"{scenario}: step {i} loss {a} vs eager {b}"
    if opt == "sgd" and "bf16" not in options:   # AdamW normalises rounding noise into lr-sized steps: losses only
        for pname, want in ref_params.items():
            err = (got["params"][pname] - want).abs().max().item()
            assert err <= 1e-5, f"{scenario}: parameter {pname} differs from eager by {err:.2e}"


def test_ep2_matches_and_its_checkpoint_resumes_at_ep1(tmp_path):
    """dp=2 = ep=2: each rank keeps 2 of the 4 experts of every layer, the rows cross by all-to-all;
    fp32, bf16, full recompute, clipping and two microbatches; a checkpoint saved at ep=2 resumes at dp=2, ep=1."""
    scenarios = ["mixtral:sgd", "mixtral:adamw:ckpt", "mixtral:sgd:clip", "mixtral:sgd:bf16", "mixtral:sgd:full",
                 "mixtral:sgd:mb2"]
    got = launch(tmp_path, 2, "dp=2,ep=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario], dp=2)
    run = got["mixtral:sgd"]
    assert run["attrs"]["ep"] == 2 and run["attrs"]["blocks"] == 2
    assert set(run["attrs"]["local_experts"].values()) == {2}
    entry, _ = ep_worker.make("mixtral", "sgd")
    whole = sum(p.numel() * p.element_size() for n, p in entry.model.named_parameters() if n in run["attrs"]["experts"])
    assert run["held_expert_bytes"] * 2 == whole
    layers = 2
    # per layer: the counts, the rows out and back in forward, the gradients' out and back in backward
    assert run["collectives"]["forward.all_to_all_single"] == layers
    assert run["collectives"]["forward.all_to_all_rows"] == 2 * layers
    assert run["collectives"]["backward.all_to_all_rows"] == 2 * layers
    resumed = launch(tmp_path, 2, "dp=2", ["resume:mixtral:adamw"])["resume:mixtral:adamw"]
    uninterrupted = got["mixtral:adamw:ckpt"]["losses"][5:]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], uninterrupted, strict=True)) <= 1e-5
    for pname, value in got["mixtral:adamw:ckpt"]["params"].items():
        assert (resumed["params"][pname] - value).abs().max().item() <= 1e-5, pname


def test_dp4_ep2_with_zero_matches_and_resumes_without_ep(tmp_path):
    """dp=4 with ep=2 (two expert-data-parallel copies of the experts): expert gradients summed over
    the 2 ranks holding the same experts; Mixtral, Qwen2-MoE (with its shared expert), OLMoE; ZeRO-1,
    ZeRO-2 (dense state sharded over dp, the experts' over edp), whose checkpoint resumes at dp=4
    without ep or ZeRO, and ZeRO-3 (the expert parameters gathered over edp where they are read)."""
    scenarios = ["mixtral:sgd:zero1", "qwen2_moe:sgd", "olmoe:adamw:clip", "mixtral:adamw:zero2:ckpt",
                 "mixtral:sgd:zero3"]
    got = launch(tmp_path, 4, "dp=4,ep=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario], dp=4)
    # ZeRO-3: each rank holds a quarter of the expert bytes (its 2 experts, flat-sharded over edp=2)
    zero3 = got["mixtral:sgd:zero3"]
    entry, _ = ep_worker.make("mixtral", "sgd")
    whole = sum(p.numel() * p.element_size() for n, p in entry.model.named_parameters() if n in zero3["attrs"]["experts"])
    assert zero3["held_expert_bytes"] * 4 == whole
    resumed = launch(tmp_path, 4, "dp=4", ["resume:mixtral:adamw"])["resume:mixtral:adamw"]
    uninterrupted = got["mixtral:adamw:zero2:ckpt"]["losses"][5:]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], uninterrupted, strict=True)) <= 1e-5


def test_dp2_ep2_pp2_matches_single_process(tmp_path):
    """dp=2 = ep=2 under pp=2 (1F1B, two microbatches: each rank's rows in two chunks, whose mean
    loss the single-process reference takes too). The load-balancing loss reads every layer's router
    logits, so they travel to the last stage; the experts sit in one stage, and clipping's sum of
    their squares (over ep) joins the total over both stages."""
    scenarios = ["mixtral:sgd", "mixtral:adamw", "mixtral:sgd:clip", "mixtral:sgd:zero1", "qwen2_moe:sgd"]
    got = launch(tmp_path, 4, "dp=2,ep=2,pp=2", scenarios)
    for scenario in scenarios:
        assert got[scenario]["stages"] == 2 and got[scenario]["attrs"]["ep"] == 2
        assert_matches(scenario + ":mb2", got[scenario], dp=2)


def test_dp2_ep2_dynamic_accumulation_with_uneven_ranks_matches_single_process(tmp_path):
    """accumulate_target = 8 over 4-row calls split 1 + 3, then 3 + 1: each update sums two calls
    whose ranks' sizes differ. An expert's gradient sums both ranks' losses, each weighted by its
    own rank's samples (the seed is weighted, not this rank's gradient)."""
    scenarios = ["mixtral:sgd:target", "qwen2_moe:adamw:target:clip"]
    got = launch(tmp_path, 2, "dp=2,ep=2", scenarios)
    for scenario in scenarios:
        name, opt, *options = scenario.split(":")
        entry, optimizer = ep_worker.make(name, opt)
        losses = []
        data = ep_worker.batches(entry)
        for first in range(0, len(data), 2):
            optimizer.zero_grad()
            total = 0
            for call in (first, first + 1):
                parts = [ep_worker.uneven_shard(data[call], r, call) for r in range(2)]
                rows = [ep_worker.uneven_rows(call), 4 - ep_worker.uneven_rows(call)]
                part_losses = [entry.loss_fn(entry.model, part) for part in parts]
                weighted = sum(r * l for r, l in zip(rows, part_losses))
                losses.append(weighted.item() / 4)   # every rank reports the samples' mean
                total = total + weighted
            (total / 8).backward()
            if "clip" in options:
                torch.nn.utils.clip_grad_norm_(entry.model.parameters(), 1.0)
            optimizer.step()
        assert got[scenario]["history"] == [8] * 5, got[scenario]["history"]
        for i, (a, b) in enumerate(zip(got[scenario]["losses"], losses, strict=True)):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{scenario}: call {i} loss {a} vs eager {b}"
        if opt == "sgd":
            for pname, want in {n: p.detach() for n, p in entry.model.named_parameters()}.items():
                err = (got[scenario]["params"][pname] - want).abs().max().item()
                assert err <= 1e-5, f"{scenario}: parameter {pname} differs from eager by {err:.2e}"


def test_dp2_ep2_cp2_matches_single_process(tmp_path):
    """dp=2 = ep=2 with cp=2 (4 ranks): each rank keeps half of its dp rank's sequence, dispatches
    those token rows to the experts' ranks of its ep group (the dp ranks at its cp coordinate), and
    the experts' gradients are summed over cp, then over edp; with ZeRO-1, with clipping, and in
    bf16 with full recompute (autocast's casts between the load-balancing loss's per-expert sums
    and the token rows they scale)."""
    scenarios = ["mixtral:sgd:zero1", "qwen2_moe:adamw:clip", "mixtral:sgd:bf16:full"]
    got = launch(tmp_path, 4, "dp=2,ep=2,cp=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario], dp=2)
    entry, _ = ep_worker.make("mixtral", "sgd")
    run = got["mixtral:sgd:zero1"]
    assert run["collectives"]["forward.all_to_all_rows"] == 2 * 2     # rows out and back, 2 layers
    assert run["collectives"]["forward.all_gather_into_tensor"] >= 2 * 2   # K and V over cp, 2 layers
    whole = sum(p.numel() * p.element_size() for n, p in entry.model.named_parameters() if n in run["attrs"]["experts"])
    assert run["held_expert_bytes"] * 2 == whole


def test_dp2_ep2_tp2_matches_single_process(tmp_path):
    """dp=2 = ep=2 with tp=2 (4 ranks): attention and the dense projections split over tp, the
    experts split over ep and whole on both tp ranks (transformers' grouped expert matmul has no
    sharding rule: it runs on whole values, as Megatron's expert tensor parallel size 1). OLMoE's
    q_norm and k_norm normalise over a column-parallel projection's split features (a partial
    mean reduced before its rsqrt; the norm weight's split gradient gathered in backward)."""
    scenarios = ["mixtral:sgd", "olmoe:adamw:clip", "qwen2_moe:sgd:zero1"]
    got = launch(tmp_path, 4, "dp=2,ep=2,tp=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario], dp=2)
        assert got[scenario]["attrs"]["ep"] == 2
    run = got["mixtral:sgd"]
    assert set(run["attrs"]["local_experts"].values()) == {2}
    assert run["collectives"]["forward.all_to_all_rows"] == 2 * 2     # rows out and back, 2 layers
    assert run["collectives"]["forward.all_reduce"] >= 2             # the row-parallel projections' sums
