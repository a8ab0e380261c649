"""Masked-language-model batches over the byte corpus, and the unigram baseline they are judged against.

BERT's masking rule: of the tokens chosen for prediction, 80% become ``[MASK]``, 10% a random
byte and 10% stay as they are; labels are the original byte at chosen positions and
``IGNORE_INDEX`` elsewhere (what ``F.cross_entropy(ignore_index=...)`` skips).

Every row gets the same number of predictions, ``max(1, round(mask_prob * seq_len))`` (as BERT's
own ``create_pretraining_data.py`` does). Why it matters here: ``mlm_loss`` is a mean over the
predicted positions, so with a count that varied per row, the mean over a data-parallel shard or a
microbatch would weigh tokens differently from the mean over the global batch; with equal counts,
the mean of the shards' (or microbatches') means *is* the global mean, and a ZeRO or accumulation
run optimizes and logs the same loss as one process on the whole batch.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from recipes.data.text import VOCAB_SIZE

MASK_ID = VOCAB_SIZE          # 256: the one token beyond the bytes
MLM_VOCAB_SIZE = VOCAB_SIZE + 1
IGNORE_INDEX = -100


def predictions_per_row(seq_len: int, mask_prob: float = 0.15) -> int:
    """How many positions of a ``seq_len`` row are chosen for prediction."""
    return min(seq_len, max(1, round(mask_prob * seq_len)))


def mask_tokens(tokens: torch.Tensor, generator: torch.Generator, mask_prob: float = 0.15
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` for a (B, T) batch of byte tokens; every row gets the same number chosen."""
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
    k = predictions_per_row(tokens.size(1), mask_prob)
    # k positions per row, uniformly without replacement: the k smallest of T uniform draws.
    picked = torch.rand(tokens.shape, generator=generator).argsort(dim=1)[:, :k]
    chosen = torch.zeros(tokens.shape, dtype=torch.bool).scatter_(1, picked, True)
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
    roll = torch.rand(tokens.shape, generator=generator)
    random_bytes = torch.randint(VOCAB_SIZE, tokens.shape, generator=generator)
    input_ids = torch.where(chosen & (roll < 0.8), torch.full_like(tokens, MASK_ID), tokens)
    input_ids = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_bytes, input_ids)
    return input_ids, labels


class MaskedLMBatches:
    """Random ``(input_ids, labels)`` windows of shape (batch_size, seq_len); each ``iter()`` restarts."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
                 mask_prob: float = 0.15, num_batches: int | None = None) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if len(tokens) < seq_len:
            raise ValueError(f"need at least seq_len = {seq_len} tokens, got {len(tokens)}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.mask_prob, self.num_batches = seed, mask_prob, num_batches
        self._window = torch.arange(seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        n = 0
        while self.num_batches is None or n < self.num_batches:
            starts = torch.randint(len(self.tokens) - self.seq_len + 1, (self.batch_size,), generator=generator)
            yield mask_tokens(self.tokens[starts[:, None] + self._window], generator, self.mask_prob)
            n += 1


def most_frequent_token(tokens: torch.Tensor) -> int:
    """The byte a unigram model predicts everywhere: the corpus's most frequent one."""
    return int(torch.bincount(tokens, minlength=VOCAB_SIZE).argmax())


def unigram_accuracy(labels: torch.Tensor, token: int) -> float:
    """Accuracy on the predicted positions of always answering ``token``."""
    chosen = labels != IGNORE_INDEX
    return float((labels[chosen] == token).float().mean())
