"""Instruction data made from the shipped corpus: prompt/response pairs, padded batches.

``corpus.txt`` is a sequence of entries ``<qualified name>\\n<docstring>\\n\\n``
(see ``make_corpus.py``). Each entry becomes two instructions:

- ``What does `json.dumps` do?`` -> the docstring's first sentence(s);
- ``Which module defines `json.dumps`?`` -> ``It is defined in the `json` module.``

Pairs are derived deterministically from the committed corpus, so nothing is
downloaded and the data does not depend on the Python version. A JSONL file of
``{"prompt": ..., "response": ...}`` lines (``python -m recipes.data.instructions
--output pairs.jsonl`` writes the shipped pairs as one) can replace them.

Tokens are bytes by default (:class:`ByteTokenizer`, as for the GPT recipe),
plus three control bytes the ASCII corpus never contains: PAD (0), BOS (2) and
EOS (3); any object with ``encode(text) -> ids`` and ``bos_id``/``eos_id``/
``pad_id`` can replace it (the fine-tuning recipe wraps a checkpoint's own
transformers tokenizer that way). Batches are right-padded
to a fixed length — one batch shape, so a compiled step is compiled once — and
carry ``attention_mask`` (1 = real token) and ``labels`` (-100 on the prompt and
the padding: the loss is taken on response tokens only).
"""
from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.data.make_corpus import MODULES
from recipes.data.text import CORPUS_PATH

PAD_ID, BOS_ID, EOS_ID = 0, 2, 3
IGNORE_INDEX = -100            # torch's cross_entropy / transformers' default ignore_index
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
MAX_RESPONSE_CHARS = 160
MIN_SEQ_LEN = 64


class ByteTokenizer:
    """UTF-8 bytes as token ids; BOS/EOS/PAD are control bytes the corpus never contains."""

    vocab_size = 256
    bos_id, eos_id, pad_id = BOS_ID, EOS_ID, PAD_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


BYTES = ByteTokenizer()


@dataclass(frozen=True)
class Pair:
    prompt: str
    response: str


def _entries(text: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of each corpus entry."""
    modules = sorted(MODULES, key=len, reverse=True)
    header = re.compile(r"(?m)(?:\A|(?<=\n\n))([A-Za-z_][\w.]*)\n(?=\S)")
    heads = [m for m in header.finditer(text)
             if any(m.group(1) == mod or m.group(1).startswith(mod + ".") for mod in modules)]
    for this, nxt in zip(heads, heads[1:] + [None]):
        body = text[this.end():nxt.start() if nxt else len(text)].strip()
        if body:
            yield this.group(1), body


def _summary(doc: str, limit: int = MAX_RESPONSE_CHARS) -> str:
    """The first paragraph's leading sentences, at most ``limit`` characters (cut at a word)."""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    sentences = re.split(r"(?<=[.!?])\s+", paragraph)
    out = sentences[0]
    for s in sentences[1:]:
        if len(out) + 1 + len(s) > limit:
            break
        out += " " + s
    if len(out) > limit:
        out = out[:limit].rsplit(" ", 1)[0] + " ..."
    return out


def _module_of(qualname: str) -> str:
    return max((m for m in MODULES if qualname == m or qualname.startswith(m + ".")), key=len)


def corpus_pairs(path: Path | str = CORPUS_PATH) -> list[Pair]:
    """The instruction pairs made from the shipped corpus (or another file in its format)."""
    pairs = []
    for name, doc in _entries(Path(path).read_text(encoding="ascii")):
        pairs.append(Pair(f"What does `{name}` do?", _summary(doc)))
        module = _module_of(name)
        if module != name:
            pairs.append(Pair(f"Which module defines `{name}`?", f"It is defined in the `{module}` module."))
    return pairs


def load_pairs(path: Path | str | None = None) -> list[Pair]:
    """Pairs from a JSONL file of {"prompt", "response"} objects, or the shipped ones."""
    if path is None:
        return corpus_pairs()
    pairs = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs.append(Pair(str(row["prompt"]), str(row["response"])))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object with 'prompt' and "
                             f"'response' strings ({type(exc).__name__}: {exc})") from None
    if not pairs:
        raise ValueError(f"{path}: no prompt/response pairs")
    return pairs


def split_pairs(pairs: list[Pair], val_fraction: float = 0.05, seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """A seeded shuffle, then a trailing validation share."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [pairs[i] for i in order]
    n_val = max(1, int(len(pairs) * val_fraction))
    return shuffled[:-n_val], shuffled[-n_val:]


def encode_pair(pair: Pair, seq_len: int, tokenizer=BYTES) -> tuple[list[int], int]:
    """Token ids of BOS + prompt + response + EOS, cut to ``seq_len``; and the prompt's length.

    A long prompt is cut first, so that at least half the window is response.
    A tokenizer without a BOS token (``bos_id`` None) starts with the prompt.
    """
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt = [*bos, *tokenizer.encode(PROMPT_TEMPLATE.format(prompt=pair.prompt))]
    response = [*tokenizer.encode(pair.response), tokenizer.eos_id]
    prompt = prompt[:max(seq_len - len(response), seq_len // 2)]
    return (prompt + response)[:seq_len], len(prompt)


def collate(pairs: list[Pair], seq_len: int, tokenizer=BYTES) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and response-only ``labels`` of shape (n, seq_len)."""
    ids = torch.full((len(pairs), seq_len), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), seq_len), dtype=torch.long)
    labels = torch.full((len(pairs), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, pair in enumerate(pairs):
        tokens, n_prompt = encode_pair(pair, seq_len, tokenizer)
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
        labels[row, n_prompt:len(tokens)] = torch.tensor(tokens[n_prompt:])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class InstructionBatches:
    """Batches of ``batch_size`` pairs, reshuffled every epoch from ``seed``; endless unless bounded.

    Each ``iter()`` restarts from ``seed``, so two passes yield identical batches.
    """

    def __init__(self, pairs: list[Pair], batch_size: int, seq_len: int, seed: int = 0,
                 num_batches: int | None = None, tokenizer=BYTES):
        if batch_size < 1 or batch_size > len(pairs):
            raise ValueError(f"batch_size must be in [1, {len(pairs)}] (the number of pairs), got {batch_size}")
        if seq_len < MIN_SEQ_LEN:
            raise ValueError(f"seq_len must be at least {MIN_SEQ_LEN} to hold a prompt and a response, "
                             f"got {seq_len}")
        self.pairs, self.batch_size, self.seq_len = pairs, batch_size, seq_len
        self.seed, self.num_batches, self.tokenizer = seed, num_batches, tokenizer

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        made = 0
        while True:
            order = torch.randperm(len(self.pairs), generator=generator).tolist()
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                if self.num_batches is not None and made >= self.num_batches:
                    return
                yield collate([self.pairs[i] for i in order[start:start + self.batch_size]], self.seq_len,
                              self.tokenizer)
                made += 1


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write the shipped instruction pairs as JSONL")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    pairs = corpus_pairs()
    with args.output.open("w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps({"prompt": pair.prompt, "response": pair.response}) + "\n")
    print(f"wrote {len(pairs):,} pairs to {args.output}")


if __name__ == "__main__":
    main()
