"""GPT-2-style decoder-only transformer in plain PyTorch.

The model is written to be traced, not just run: module paths are stable
(``layers.{i}.attn.qkv`` ...), every tensor created in ``forward`` lives on the
input's device, and there is no control flow on tensor values, no in-place
update of activations and no ``.item()``. That keeps
``make_fx(..., tracing_mode="fake")`` and meta-device construction working.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Attention = Literal["explicit", "sdpa"]

_ACTIVATIONS = {
    # GPT-2 used the tanh approximation of GELU.
    "gelu": lambda: nn.GELU(approximate="tanh"),
    "gelu_exact": lambda: nn.GELU(),
    "relu": lambda: nn.ReLU(),
}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int  # maximum number of positions (size of ``wpe``)
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    # "explicit" spells attention out as matmul/mask/softmax/matmul so a
    # compiler sees every op; "sdpa" uses the fused PyTorch kernel.
    attention: Attention = "explicit"
    mlp_ratio: int = 4
    activation: str = "gelu"

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} not divisible by n_head={self.n_head}")
        if self.attention not in ("explicit", "sdpa"):
            raise ValueError(f"unknown attention {self.attention!r}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def d_ff(self) -> int:
        return self.mlp_ratio * self.d_model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attention = cfg.attention
        self.dropout_p = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            p = self.dropout_p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = self._explicit_attention(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))

    def _explicit_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        # Built per call rather than stored as a buffer so it follows the
        # input's device (fake/meta included) and never enters the state dict.
        pos = torch.arange(T, device=q.device)
        future = pos[None, :] > pos[:, None]
        att = att.masked_fill(future, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        return att @ v


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.act = _ACTIVATIONS[cfg.activation]()
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block, as in GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # Meta parameters have no storage; they get real values only once
        # materialised (e.g. via to_empty + a later init or a checkpoint).
        if any(p.is_meta for p in self.parameters()):
            return
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: scale the projections that write into the residual stream so
        # its variance does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for block in self.layers:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.fc2.weight, mean=0.0, std=resid_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy; ``batch`` is ``(idx, targets)``, both (B, T)."""
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def count_parameters_analytic(cfg: GPTConfig) -> int:
    """Exact parameter count of ``GPT(cfg)``, with tied weights counted once."""
    d, bias = cfg.d_model, int(cfg.bias)
    layer_norm = d + bias * d
    attn = (d * 3 * d + bias * 3 * d) + (d * d + bias * d)
    mlp = (d * cfg.d_ff + bias * cfg.d_ff) + (cfg.d_ff * d + bias * d)
    per_layer = 2 * layer_norm + attn + mlp
    embeddings = cfg.vocab_size * d + cfg.seq_len * d
    lm_head = 0 if cfg.tie_weights else cfg.vocab_size * d
    return embeddings + cfg.n_layer * per_layer + layer_norm + lm_head


# Presets. Keyword overrides go straight into the config, e.g.
# ``gpt_tiny(attention="sdpa")``.


def gpt_tiny(**overrides) -> GPTConfig:
    """Unit-test sized model: traces and runs in milliseconds."""
    base = GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, seq_len=32, dropout=0.0)
    return dataclasses.replace(base, **overrides)


def gpt_small_cpu(**overrides) -> GPTConfig:
    """Byte-level model (~0.84M parameters) that the recipes train on CPU."""
    base = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128, dropout=0.0)
    return dataclasses.replace(base, **overrides)


def gpt_7b(**overrides) -> GPTConfig:
    """7B-class GPT (vocab padded to a multiple of 64); build it on meta."""
    base = GPTConfig(vocab_size=50304, n_layer=32, n_head=32, d_model=4096, seq_len=2048)
    return dataclasses.replace(base, **overrides)


def gpt3_175b_layer(**overrides) -> GPTConfig:
    """One transformer layer at GPT-3 175B width, for per-layer analysis."""
    base = GPTConfig(
        vocab_size=50304,
        n_layer=1,
        n_head=96,
        d_model=12288,
        seq_len=2048,
        dropout=0.1,
        attention="explicit",
    )
    return dataclasses.replace(base, **overrides)
