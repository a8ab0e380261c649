"""The LLaMA recipe: the model matches transformers', the compiled step matches eager PyTorch, the loss
falls on the shipped text, and every plan in recipes/llama/plans compiles (bf16 lowers to GE)."""
from __future__ import annotations

import json

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from recipes.data import TextBatches, load_corpus
from recipes.llama import LlamaConfig, LlamaForCausalLM, count_parameters, llama_7b, llama_loss, llama_tiny
from tests.recipes._helpers import (assert_plan_does_what_it_says, bf16_lowers_to_ge, capture,
                                    compiled_losses_match_eager, plan_files)

PLANS = plan_files("llama")


def _batches(n, rows=4, seq=16, seed=0):
    return list(TextBatches(load_corpus(), rows, seq, seed=seed, num_batches=n))


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_state_dict_and_logits_match_transformers(attention):
    from transformers import LlamaForCausalLM as HF
    cfg = llama_tiny(attention=attention)
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg)
    theirs = HF(cfg.to_transformers())
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_parameter_counts_and_meta_construction():
    assert count_parameters(llama_tiny()) == sum(p.numel() for p in LlamaForCausalLM(llama_tiny()).parameters())
    with torch.device("meta"):
        big = LlamaForCausalLM(llama_7b())
    assert all(p.is_meta for p in big.parameters())
    assert sum(p.numel() for p in big.parameters()) == count_parameters(llama_7b()) == 6_738_415_616


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LlamaConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="attention"):
        llama_tiny(attention="flash")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LlamaForCausalLM(llama_tiny(max_position_embeddings=8))(torch.zeros(1, 9, dtype=torch.long))


def test_compiled_fp32_step_matches_eager_pytorch_on_ours_and_transformers():
    from transformers import LlamaForCausalLM as HF
    cfg = llama_tiny()
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg)
    theirs = HF(cfg.to_transformers())
    theirs.load_state_dict(ours.state_dict())
    reference = compiled_losses_match_eager([ours, theirs], llama_loss, _batches(3))
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(ours.named_parameters())[name], p, rtol=1e-5, atol=1e-5)


def test_loss_falls_on_the_shipped_text():
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=opt, loss_fn=llama_loss)
    losses = [step(b).item() for b in _batches(30, rows=8, seq=32)]
    assert losses[0] > 5.0                               # about log(256): untrained
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def test_command_trains_and_writes_its_convergence_figure(tmp_path):
    from recipes.llama.train import main
    metrics = main(["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--out", str(tmp_path)])
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert json.loads((tmp_path / "metrics.json").read_text())["losses"] == metrics["losses"]
    assert metrics["val_loss_after"] < metrics["val_loss_before"]


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_tiny())
    return capture(model, llama_loss, _batches(1)[0])


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_every_plan_compiles_and_does_what_it_says(captured, path):
    assert_plan_does_what_it_says(captured, path)


def test_bf16_plan_lowers_to_ge_with_no_unsupported_op(tmp_path, torchair):
    torch.manual_seed(0)
    histogram = bf16_lowers_to_ge(LlamaForCausalLM(llama_tiny()), llama_loss, _batches(1)[0], PLANS[0].parent, tmp_path)
    assert histogram.get("Cast", 0) > 0
    matmuls = sum(histogram.get(op, 0) for op in ("MatMul", "MatMulV2", "BatchMatMul", "BatchMatMulV2"))
    assert matmuls >= 7 * 2 * 2      # q, k, v, o, gate, up, down per layer, forward and backward


@pytest.mark.parametrize("path", [p for p in PLANS if Plan.load(p).dp == 1 and Plan.load(p).precision != "fp32"],
                         ids=lambda p: p.stem)
def test_plans_run_on_transformers_llama_with_sdpa(path):
    """The user's own model: transformers' LlamaForCausalLM with its default SDPA attention."""
    from transformers import LlamaForCausalLM as HF
    cfg = llama_tiny(attention="sdpa")
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg)
    theirs = HF(cfg.to_transformers())
    theirs.load_state_dict(ours.state_dict())
    batch = _batches(1)[0]
    losses = []
    for model in (ours, theirs):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses.append(compile_for_npu(model, Plan.load(path), optimizer=opt, loss_fn=llama_loss)(batch).item())
    assert losses[1] == pytest.approx(losses[0], abs=2e-2)       # the same model in bf16/fp16
