"""Training data for the recipes: a shipped English corpus and byte-level batching."""

from recipes.data.text import (
    CORPUS_PATH,
    VOCAB_SIZE,
    TextBatches,
    decode,
    encode,
    load_corpus,
    train_val_split,
)

__all__ = [
    "CORPUS_PATH",
    "VOCAB_SIZE",
    "TextBatches",
    "decode",
    "encode",
    "load_corpus",
    "train_val_split",
]
