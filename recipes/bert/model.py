"""BERT for masked-language modelling in plain PyTorch.

Shaped like transformers' ``BertForMaskedLM``: the same module tree and parameter names
(``bert.encoder.layer.0.attention.self.query.weight``, ``cls.predictions.transform.dense`` ...),
so a state dict moves between the two unchanged. Post-LayerNorm encoder layers, GELU, learned
absolute positions, token types, and the MLM head's decoder tied to the word embeddings.
Written to be traced: position and token-type ids are made in ``forward`` on the input's
device (no buffers), no control flow on tensor values.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from recipes.data.mlm import IGNORE_INDEX, MLM_VOCAB_SIZE

Attention = Literal["explicit", "sdpa"]


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = MLM_VOCAB_SIZE
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 128
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    initializer_range: float = 0.02
    attention: Attention = "explicit"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.attention not in ("explicit", "sdpa"):
            raise ValueError(f"attention={self.attention!r}: must be 'explicit' or 'sdpa'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_transformers(self):
        """The equivalent ``transformers.BertConfig`` (eager attention for 'explicit')."""
        from transformers import BertConfig as HFBertConfig
        return HFBertConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings, type_vocab_size=self.type_vocab_size,
            layer_norm_eps=self.layer_norm_eps, hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob, hidden_act="gelu",
            initializer_range=self.initializer_range,
            # No padding row: transformers' default pad_token_id=0 would freeze byte 0's embedding
            # (nn.Embedding's padding_idx gets no gradient), which our model trains like any other.
            pad_token_id=None,
            attn_implementation="eager" if self.attention == "explicit" else "sdpa")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
             + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.attention_probs_dropout_prob)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        if cfg.attention == "sdpa":
            p = cfg.attention_probs_dropout_prob if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask, dropout_p=p)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(cfg.head_dim)
            if additive_mask is not None:
                att = att + additive_mask
            y = self.dropout(F.softmax(att, dim=-1)) @ v
        return y.transpose(1, 2).reshape(B, T, C)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, additive_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, additive_mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, additive_mask)
        return x


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        additive = None
        if attention_mask is not None:
            # (B, T) 1 = attend, 0 = padding  ->  (B, 1, 1, T) 0 / most negative, in the activation dtype.
            additive = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        return self.encoder(x, additive)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
        self.bias = self.decoder.bias      # transformers names the decoder's bias this way too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictions(x)


class BertForMaskedLM(nn.Module):
    """``model(input_ids, attention_mask=None) -> logits`` of shape (B, T, vocab_size)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.bert = BertModel(cfg)
        self.cls = BertOnlyMLMHead(cfg)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        self._init_weights()

    def _init_weights(self) -> None:
        if any(p.is_meta for p in self.parameters()):
            return
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.initializer_range)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.cls(self.bert(input_ids, attention_mask, token_type_ids))


def logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def mlm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy on the masked positions; ``batch`` is ``(input_ids, labels)``; any BertForMaskedLM."""
    input_ids, labels = batch
    logits = logits_of(model(input_ids=input_ids))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def masked_accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    """(correct, predicted) over the masked positions of one batch."""
    input_ids, labels = batch
    predictions = logits_of(model(input_ids=input_ids)).argmax(-1)
    chosen = labels != IGNORE_INDEX
    return int((predictions[chosen] == labels[chosen]).sum()), int(chosen.sum())


def count_parameters(cfg: BertConfig) -> int:
    """Exact parameter count of ``BertForMaskedLM(cfg)`` (decoder weight tied, counted once)."""
    d, ff, ln = cfg.hidden_size, cfg.intermediate_size, 2 * cfg.hidden_size
    embeddings = (cfg.vocab_size + cfg.max_position_embeddings + cfg.type_vocab_size) * d + ln
    layer = 4 * (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * ln
    head = d * d + d + ln + cfg.vocab_size
    return embeddings + cfg.num_hidden_layers * layer + head


def bert_tiny(**overrides) -> BertConfig:
    """Test-sized: 2 layers, hidden 32."""
    base = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=64)
    return dataclasses.replace(base, **overrides)


def bert_small_cpu(**overrides) -> BertConfig:
    """The byte-level model ``python -m recipes.bert`` trains on CPU: 2 layers, hidden 128, FFN 256
    (0.32M parameters). Two post-LayerNorm layers leave the unigram plateau (answering the space
    everywhere) in the command's 400 steps at lr 2e-3; the 4-layer, FFN 512 shape (``BertConfig()``)
    stayed on it for 600 steps on this CPU."""
    base = BertConfig(num_hidden_layers=2, intermediate_size=256, max_position_embeddings=32)
    return dataclasses.replace(base, **overrides)


def bert_large(**overrides) -> BertConfig:
    """BERT-large's shape (24 layers, hidden 1024, 16 heads, FFN 4096, WordPiece vocab 30522, 512 positions)."""
    base = BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096, max_position_embeddings=512, hidden_dropout_prob=0.1,
                      attention_probs_dropout_prob=0.1)
    return dataclasses.replace(base, **overrides)
