import itertools

import pytest
import torch

from recipes.data import VOCAB_SIZE, TextBatches, decode, encode, load_corpus, train_val_split


def test_tokenizer_round_trip():
    text = "Hello, world!\n\tbytes: caf\u00e9 \u2014 \u65e5\u672c"
    tokens = encode(text)
    assert tokens.dtype == torch.long
    assert tokens.max() < VOCAB_SIZE
    assert decode(tokens) == text
    assert decode(encode("")) == ""


def test_corpus_size_and_content():
    corpus = load_corpus()
    assert corpus.dim() == 1 and corpus.dtype == torch.long
    assert 300_000 <= len(corpus) <= 600_000
    printable = ((corpus >= 32) & (corpus < 127)) | (corpus == ord("\n"))
    assert printable.float().mean() > 0.99
    assert "the" in decode(corpus[:10_000])


def test_train_val_split():
    tokens = torch.arange(100)
    train, val = train_val_split(tokens, val_fraction=0.1)
    assert len(train) == 90 and len(val) == 10
    assert torch.equal(torch.cat([train, val]), tokens)


def take(batches, n):
    return list(itertools.islice(batches, n))


def test_batches_shape_and_shift():
    tokens = load_corpus()
    for idx, targets in take(TextBatches(tokens, batch_size=4, seq_len=16, seed=0), 3):
        assert idx.shape == targets.shape == (4, 16)
        assert torch.equal(idx[:, 1:], targets[:, :-1])
        targets.view(-1)  # contiguous, as gpt_loss needs


def test_batches_deterministic_given_seed():
    tokens = load_corpus()
    a = take(TextBatches(tokens, 4, 16, seed=1), 3)
    b = take(TextBatches(tokens, 4, 16, seed=1), 3)
    c = take(TextBatches(tokens, 4, 16, seed=2), 3)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not torch.equal(a[0][0], c[0][0])


def test_batches_cover_the_end_of_the_tokens():
    # With exactly seq_len + 1 tokens there is one window; it must be the whole tensor.
    tokens = torch.arange(9)
    idx, targets = next(iter(TextBatches(tokens, batch_size=2, seq_len=8)))
    assert torch.equal(idx[0], tokens[:8]) and torch.equal(targets[0], tokens[1:])


def test_num_batches_bounds_iteration():
    assert len(list(TextBatches(torch.arange(50), 2, 4, num_batches=5))) == 5


def test_too_few_tokens_rejected():
    with pytest.raises(ValueError):
        TextBatches(torch.arange(8), batch_size=1, seq_len=8)
