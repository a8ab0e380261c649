"""Context parallelism on gloo with local processes against single-process eager training.

Each launch runs its scenarios (``cp_worker.py``) in one set of ranks; every scenario trains 10
steps of a transformers LLaMA with ``compile_for_npu`` from the same initial weights and batches
as the eager reference here.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests import gloo_scenarios

sys.path.insert(0, str(Path(__file__).parent))
import cp_worker  # noqa: E402

WORKER = str(Path(__file__).parent / "cp_worker.py")

pytestmark = pytest.mark.slow


def eager_reference(name: str, opt: str, options: list[str]):
    entry, optimizer = cp_worker.make(name, opt)
    return gloo_scenarios.eager_training(entry, optimizer, cp_worker.batches(entry, options),
                                         lambda batch: entry.loss_fn(entry.model, batch), clip="clip" in options,
                                         before=cp_worker.rescale if "rescale" in options else None)


def launch(tmp_path, world: int, mesh: str, scenarios: list[str]) -> dict[str, dict]:
    return gloo_scenarios.launch(WORKER, tmp_path, world, mesh, scenarios)


def assert_matches(scenario: str, got: dict):
    name, opt, *options = scenario.split(":")
    ref_losses, ref_params = eager_reference(name, opt, options)
    for i, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{scenario}: step {i} loss {a} vs eager {b}"
    if opt == "sgd":   # AdamW normalises rounding noise into lr-sized steps: losses only
        for pname, want in ref_params.items():
            err = (got["params"][pname] - want).abs().max().item()
            assert err <= 1e-5, f"{scenario}: parameter {pname} differs from eager by {err:.2e}"


def test_cp2_matches_single_process(tmp_path):
    """cp=2 on padded rows (the chunks count different numbers of tokens), with clipping, and
    with two microbatches (unpadded: equal token counts, so their mean is the batch's), with full
    recompute:
    K and V are all-gathered per layer, their gradients reduce-scattered, each parameter's
    gradient all-reduced over cp in backward. Without an attention_mask transformers' causal mask
    is made from the sequence alone (attention_masks_as_flags): the chunks attend under is_causal."""
    scenarios = ["llama:sgd:pad", "llama:adamw:pad", "llama:sgd:pad:clip", "llama:sgd:mb2", "llama:sgd:pad:full",
                 "gpt+attention=sdpa:adamw:clip", "gpt+attention=sdpa:adamw:clip:ring",
                 "gpt+attention=sdpa:sgd:full:ring", "llama:adamw:pad:clip:ring", "llama:sgd:pad:rescale",
                 "llama:adamw:nomask", "llama:sgd:nomask:ring"]
    got = launch(tmp_path, 2, "cp=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario])
    assert got["llama:sgd:pad"]["masked_attention"] > 0
    assert got["llama:adamw:nomask"]["masked_attention"] == got["llama:sgd:nomask:ring"]["masked_attention"] == 0
    # the guards see the attention scale change on every rank: each compiles the cp step again
    assert [r.split(" changed")[0] for r in got["llama:sgd:pad:rescale"]["recompiles"]] == \
        ["attribute model.layers.0.self_attn.scaling of the model"]
    # full recompute gathers K and V again in backward instead of keeping them whole
    again = got["llama:sgd:pad:full"]["collectives"]["backward.all_gather_into_tensor"]
    assert again > got["llama:sgd:pad"]["collectives"].get("backward.all_gather_into_tensor", 0)
    collectives, attrs = got["llama:sgd:pad"]["collectives"], got["llama:sgd:pad"]["attrs"]
    assert attrs == {"cp": 2, "rank": 0, "seq": 12, "local_seq": 6, "chunks": [[0, 3], [9, 12]],
                     "partial_gradients": False}
    layers = 2
    assert collectives["forward.all_gather_into_tensor"] >= 2 * layers          # K and V of every layer
    assert collectives["backward.reduce_scatter_tensor"] == 2 * layers          # their gradients
    params = len(dict(cp_worker.make("llama", "sgd")[0].model.named_parameters()))
    assert collectives["backward.all_reduce"] == params


def test_cp2_on_inductor_matches_single_process(tmp_path):
    """Inductor compiles each rank's cp step: the attention mask all-gathered over the sequence
    crosses as bytes (bool_collectives_as_bytes), padded rows, gathered and ring attention."""
    scenarios = ["llama:sgd:pad:inductor", "llama:adamw:pad:clip:ring:inductor"]
    got = launch(tmp_path, 2, "cp=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario])


def test_cp2_on_more_transformers_models_matches_single_process(tmp_path):
    """The balanced chunks on models with other positional and attention code: GPT-NeoX (partial
    rotary, parallel residual), Phi-3 (fused qkv), Qwen2 (qkv bias), Gemma (one kv head), BERT
    (bidirectional, absolute positions), OPT (learned positions from the mask's cumulative sum),
    Falcon (multi-query, parallel attention) and RoBERTa (positions counted past the padding), padded;
    and mixtures of experts, Mixtral and Qwen2-MoE (its shared expert): each rank sorts, counts
    and multiplies its own token rows by the experts, and the load-balancing loss's counts per
    expert are summed over cp."""
    scenarios = ["gpt_neox:sgd:pad", "phi3:sgd:pad", "qwen2:adamw:pad", "gemma:sgd:pad", "bert:sgd:pad",
                 "opt:sgd:pad", "falcon:sgd:pad", "roberta:adamw:pad", "mixtral:sgd:pad", "qwen2_moe:adamw:pad"]
    got = launch(tmp_path, 2, "cp=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario])


def test_cp3_balanced_chunks_match_single_process(tmp_path):
    """cp=3 on a 12-token sequence: six chunks of two, rank r holding chunks r and 5 - r; the
    recipe GPT's is_causal attention computes each chunk against the keys up to its own end,
    with K and V gathered or passed round the ring. The ring under an explicit mask (padded
    LLaMA, causal, and BERT, bidirectional): every block computed with the mask's columns of the
    keys held, a query row that block hides every key from weighed out of the merge."""
    scenarios = ["gpt+attention=sdpa:sgd", "gpt+attention=sdpa:sgd:ring", "llama:sgd:pad:ring", "bert:sgd:pad:ring"]
    got = launch(tmp_path, 3, "cp=3", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario])
        assert got[scenario]["attrs"]["chunks"] == [[0, 2], [10, 12]]
    # ring: K and V of both layers passed round the three ranks (two steps), never gathered
    for scenario in scenarios[1:]:
        ring = got[scenario]["collectives"]
        assert ring["forward.all_to_all_single"] == 2 * 2 * 2, scenario
    assert "forward.all_gather_into_tensor" not in got["gpt+attention=sdpa:sgd:ring"]["collectives"]


def test_dp2_cp2_matches_single_process(tmp_path):
    """dp=2 x cp=2: each dp rank's rows (unpadded: equal token counts, so the mean over dp is the
    global mean), the sequence split over the cp pair; each gradient all-reduced once, over the
    four ranks of dp x cp (with clipping, and two microbatches accumulated first); under ZeRO-1 and
    ZeRO-3 reduce-scattered over dp and the shard summed over cp."""
    scenarios = ["llama:sgd", "llama:adamw:clip", "llama:sgd:mb2", "gpt+attention=sdpa:adamw:ring",
                 "llama:adamw:zero1:clip", "gpt_neox:sgd:zero3"]
    got = launch(tmp_path, 4, "dp=2,cp=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario])
        assert got[scenario]["attrs"]["partial_gradients"]
    # the gradients' parts summed over dp x cp in data_parallel's one bucket, not per gradient over cp
    assert got["llama:sgd"]["collectives"]["backward.all_reduce"] == 1
    # ZeRO: one reduction over dp per bucket (on gloo the reduce-scatter runs as an all-reduce of
    # which each rank keeps its shard), then the shard's all-reduce over cp (and the clipping
    # norm's), none per gradient in backward
    zero1 = got["llama:adamw:zero1:clip"]["collectives"]
    assert zero1["backward.all_reduce"] == 1 and zero1["optimizer.all_reduce"] == 2
    assert zero1["backward.reduce_scatter_tensor"] == 2 * 2      # K's and V's gradients over cp, 2 layers


def test_tp2_cp2_matches_single_process(tmp_path):
    """tp=2 x cp=2: tensor_parallel's per-rank graph re-traced over cp (its all-gather of the
    vocabulary-split logits gathers each cp rank's own token rows)."""
    scenarios = ["llama:sgd:pad", "llama:adamw:pad", "gpt+attention=sdpa:sgd:ring"]
    got = launch(tmp_path, 4, "tp=2,cp=2", scenarios)
    for scenario in scenarios:
        assert_matches(scenario, got[scenario])


def test_cp2_pp2_matches_single_process(tmp_path):
    """cp=2 x pp=2 (1F1B, two microbatches, unpadded: their mean is the batch's): each stage's
    attention gathers K and V over its cp pair, the stages pass their sequence chunks' activations,
    and ``model.state_dict()`` on rank 0 gives the trained parameters of both stages."""
    scenarios = ["llama:sgd", "llama:adamw", "llama:sgd:clip", "llama:sgd:full", "gpt+attention=sdpa:sgd:ring"]
    got = launch(tmp_path, 4, "cp=2,pp=2", scenarios)
    for scenario in scenarios:
        assert got[scenario]["stages"] == 2 and got[scenario]["attrs"]["local_seq"] == 6
        assert_matches(scenario, got[scenario])
