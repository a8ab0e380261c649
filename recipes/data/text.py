"""Byte-level tokenizer and deterministic language-model batches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB_SIZE = 256  # one token per byte: no tokenizer files, no unknown tokens
CORPUS_PATH = Path(__file__).with_name("corpus.txt")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor."""
    return _bytes_to_tensor(text.encode("utf-8"))


def decode(tokens: torch.Tensor) -> str:
    """Inverse of :func:`encode`; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(tokens.flatten().tolist()).decode("utf-8", errors="replace")


def load_corpus(path: Path | str = CORPUS_PATH) -> torch.Tensor:
    """The shipped corpus (or ``path``) as a 1-D int64 tensor of bytes."""
    return _bytes_to_tensor(Path(path).read_bytes())


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split into a leading train part and a trailing validation part.

    A contiguous split (rather than sampled windows) keeps validation text
    unseen during training apart from the single boundary.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_train = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:n_train], tokens[n_train:]


class TextBatches:
    """Random ``(idx, targets)`` windows of shape (batch_size, seq_len).

    ``targets`` is ``idx`` shifted left by one token. Each ``iter()`` restarts
    from ``seed``, so two passes (or two instances) yield identical batches.
    With ``num_batches=None`` iteration never ends; bound it with ``zip`` or
    ``itertools.islice``.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        num_batches: int | None = None,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {len(tokens)}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_batches = num_batches
        # Offsets of one window of seq_len + 1 tokens (inputs plus the last target).
        self._window = torch.arange(seq_len + 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        step = 0
        while self.num_batches is None or step < self.num_batches:
            yield self._sample(generator)
            step += 1

    def _sample(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # Start positions are chosen so the last target is still in range.
        high = len(self.tokens) - self.seq_len
        starts = torch.randint(high, (self.batch_size,), generator=generator)
        windows = self.tokens[starts[:, None] + self._window]
        # contiguous() so callers can .view() them (as gpt_loss does).
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _bytes_to_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
