"""The BERT recipe: the model matches transformers' BertForMaskedLM, the compiled step matches eager
PyTorch, masked-token accuracy beats the unigram baseline, and every plan in recipes/bert/plans
compiles (bf16 lowers to GE)."""
from __future__ import annotations

import json

import pytest
import torch

from cann_passes import Plan, compile_for_npu
from recipes.bert import BertForMaskedLM, bert_large, bert_tiny, count_parameters, masked_accuracy, mlm_loss
from recipes.common import warmup_cosine
from recipes.data import load_corpus, train_val_split
from recipes.data.mlm import (IGNORE_INDEX, MASK_ID, MaskedLMBatches, mask_tokens, most_frequent_token,
                              predictions_per_row, unigram_accuracy)
from tests.recipes._helpers import (assert_plan_does_what_it_says, bf16_lowers_to_ge, capture,
                                    compiled_losses_match_eager, plan_files)

PLANS = plan_files("bert")
TRAIN_STEPS, TRAIN_SEQ = 300, 16     # see the accuracy test


def _batches(n, rows=4, seq=16, seed=0, tokens=None):
    return list(MaskedLMBatches(load_corpus() if tokens is None else tokens, rows, seq, seed=seed,
                                num_batches=n))


def test_masking_follows_bert_rule():
    tokens = load_corpus()[:64 * 256].view(256, 64)
    ids, labels = mask_tokens(tokens, torch.Generator().manual_seed(0))
    chosen = labels != IGNORE_INDEX
    # The same count in every row (BERT's round(15% of the length)): a shard's or microbatch's mean
    # loss over its predicted positions then averages to the global batch's mean.
    assert predictions_per_row(64) == 10 and (chosen.sum(dim=1) == 10).all()
    assert predictions_per_row(16) == 2 and predictions_per_row(4) == 1
    assert torch.equal(labels[chosen], tokens[chosen]) and torch.equal(ids[~chosen], tokens[~chosen])
    masked = (ids == MASK_ID)[chosen].float().mean()
    kept = (ids == tokens)[chosen].float().mean()
    assert 0.75 < masked < 0.85 and 0.07 < kept < 0.15   # 80% [MASK], 10% kept (+ random hits)


def test_shard_and_microbatch_means_are_the_global_mean():
    """What a ZeRO or accumulation run logs and optimizes (the mean of its shards' or microbatches'
    mean losses) is the loss over the whole batch: every row has the same number of predictions."""
    torch.manual_seed(0)
    model = BertForMaskedLM(bert_tiny()).eval()
    ids, labels = _batches(1, rows=8)[0]
    with torch.no_grad():
        whole = mlm_loss(model, (ids, labels))
        for parts in (2, 4, 8):
            means = [mlm_loss(model, part) for part in zip(ids.chunk(parts), labels.chunk(parts))]
            torch.testing.assert_close(torch.stack(means).mean(), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_state_dict_and_logits_match_transformers(attention):
    from transformers import BertForMaskedLM as HF
    cfg = bert_tiny(attention=attention)
    torch.manual_seed(0)
    ours = BertForMaskedLM(cfg).eval()
    theirs = HF(cfg.to_transformers()).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, 256, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    got, want = ours(ids, attention_mask=mask), theirs(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :10], want[1, :10], rtol=1e-5, atol=1e-5)


def test_parameter_counts_and_tied_decoder():
    model = BertForMaskedLM(bert_tiny())
    assert count_parameters(bert_tiny()) == sum(p.numel() for p in model.parameters())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    with torch.device("meta"):
        large = BertForMaskedLM(bert_large())
    assert sum(p.numel() for p in large.parameters()) == count_parameters(bert_large()) == 335_174_458


def test_compiled_fp32_step_matches_eager_pytorch_on_ours_and_transformers():
    from transformers import BertForMaskedLM as HF
    cfg = bert_tiny()
    torch.manual_seed(0)
    ours = BertForMaskedLM(cfg)
    theirs = HF(cfg.to_transformers())
    theirs.load_state_dict(ours.state_dict())
    compiled_losses_match_eager([ours, theirs], mlm_loss, _batches(3))


def _unigram_cross_entropy(train_tokens, labels) -> float:
    """The cross-entropy of the unigram model (byte frequencies of the training text) on ``labels``."""
    counts = torch.bincount(train_tokens, minlength=256).double() + 1.0
    log_p = (counts / counts.sum()).log()
    chosen = labels[labels != IGNORE_INDEX]
    return float(-log_p[chosen].mean())


def test_masked_token_accuracy_beats_the_unigram_baseline():
    """Trained by the compiled step, the model predicts masked bytes from their context: it beats the
    unigram model (the most frequent byte everywhere) in accuracy and in cross-entropy, on held-out
    text. A byte-level post-LayerNorm BERT first sits on the unigram plateau (it answers the space);
    2 layers of width 64 over 16-byte windows leave it within a few hundred small steps."""
    train_tokens, val_tokens = train_val_split(load_corpus())
    torch.manual_seed(0)
    model = BertForMaskedLM(bert_tiny(hidden_size=64, intermediate_size=128, max_position_embeddings=TRAIN_SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = warmup_cosine(opt, TRAIN_STEPS, warmup=TRAIN_STEPS // 10)
    step = compile_for_npu(model, Plan(backend="eager"), optimizer=opt, loss_fn=mlm_loss)
    for batch in _batches(TRAIN_STEPS, rows=32, seq=TRAIN_SEQ, tokens=train_tokens):
        step(batch)
        schedule.step()
    model.eval()
    token = most_frequent_token(train_tokens)
    correct = total = baseline = 0
    losses, unigram_losses = [], []
    for batch in _batches(4, rows=128, seq=TRAIN_SEQ, seed=1, tokens=val_tokens):
        c, t = masked_accuracy(model, batch)
        correct, total = correct + c, total + t
        baseline += unigram_accuracy(batch[1], token) * t
        with torch.no_grad():
            losses.append(mlm_loss(model, batch).item())
        unigram_losses.append(_unigram_cross_entropy(train_tokens, batch[1]))
    assert correct / total > baseline / total + 0.02, (correct / total, baseline / total)
    assert sum(losses) / 4 < sum(unigram_losses) / 4 - 0.1, (losses, unigram_losses)


def test_command_trains_and_reports_accuracy(tmp_path):
    from recipes.bert.train import main
    metrics = main(["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--out", str(tmp_path)])
    assert (tmp_path / "loss.png").stat().st_size > 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["losses"] == metrics["losses"] and 0.0 < saved["unigram_accuracy"] < 0.5
    assert 0.0 <= saved["masked_accuracy"] <= 1.0


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = BertForMaskedLM(bert_tiny())
    return capture(model, mlm_loss, _batches(1)[0])


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_every_plan_compiles_and_does_what_it_says(captured, path):
    assert_plan_does_what_it_says(captured, path)


def test_bf16_plan_lowers_to_ge_with_no_unsupported_op(tmp_path, torchair):
    torch.manual_seed(0)
    histogram = bf16_lowers_to_ge(BertForMaskedLM(bert_tiny()), mlm_loss, _batches(1)[0], PLANS[0].parent, tmp_path)
    assert histogram.get("Cast", 0) > 0 and histogram.get("LayerNormV4", 0) == 2 * 2 + 2   # layers, embeddings, head
