"""LLaMA in plain PyTorch: RMSNorm, rotary position embeddings, SwiGLU and grouped-query attention.

Shaped like transformers' ``LlamaForCausalLM``: the same module tree and parameter names
(``model.layers.0.self_attn.q_proj.weight`` ...), so a state dict moves between the two
unchanged and the compiler sees the same module paths on either. It is written to be
traced: every tensor made in ``forward`` (positions, rotary angles, the causal mask)
is built on the input's device, there is no control flow on tensor values and no
buffer or constant, so meta-device construction and fake-tensor capture work.
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


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2          # < num_attention_heads: grouped-query attention
    max_position_embeddings: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # "explicit" spells attention as matmul / causal mask / softmax / matmul, so the
    # compiler sees every op; "sdpa" calls the fused scaled_dot_product_attention.
    attention: Attention = "explicit"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.attention not in ("explicit", "sdpa"):
            raise ValueError(f"attention={self.attention!r}: must be 'explicit' or 'sdpa'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_transformers(self):
        """The equivalent ``transformers.LlamaConfig`` (eager attention for 'explicit')."""
        from transformers import LlamaConfig as HFLlamaConfig
        return HFLlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range, attention_bias=False, mlp_bias=False,
            attn_implementation="eager" if self.attention == "explicit" else "sdpa")


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 whatever the activation dtype, as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype=torch.float32):
    """cos and sin of the rotary angles, (seq_len, head_dim), halves repeated as transformers lays them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, kv_heads, T, D) -> (B, kv_heads * n_rep, T, D): each key/value head serves n_rep query heads."""
    if n_rep == 1:
        return x
    B, H, T, D = x.shape
    return x[:, :, None, :, :].expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if cfg.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(cfg.head_dim))
            pos = torch.arange(T, device=x.device)
            att = att.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
            # Softmax in fp32, as transformers' eager attention does.
            y = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        if T > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}")
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(T, self.cfg.head_dim, self.cfg.rope_theta, input_ids.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``model(input_ids) -> logits`` of shape (B, T, vocab_size)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._init_weights()

    def _init_weights(self) -> None:
        if any(p.is_meta for p in self.parameters()):
            return      # shapes only: nothing to initialise
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.initializer_range)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def logits_of(output) -> torch.Tensor:
    """Logits from our model (a tensor) or from a transformers model (an output with ``.logits``)."""
    return output.logits if hasattr(output, "logits") else output


def llama_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy; ``batch`` is ``(input_ids, targets)``; works for transformers' model too."""
    input_ids, targets = batch
    logits = logits_of(model(input_ids=input_ids))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def count_parameters(cfg: LlamaConfig) -> int:
    """Exact parameter count of ``LlamaForCausalLM(cfg)``."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * cfg.num_attention_heads * hd * 2 + d * cfg.num_key_value_heads * hd * 2
    mlp = 3 * d * cfg.intermediate_size
    per_layer = attn + mlp + 2 * d
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.num_hidden_layers * per_layer + d + head


# Presets; keyword overrides go into the config: ``llama_tiny(attention="sdpa")``.

def llama_tiny(**overrides) -> LlamaConfig:
    """Test-sized: 2 layers, hidden 32, 4 query heads sharing 2 key/value heads."""
    base = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return dataclasses.replace(base, **overrides)


def llama_small_cpu(**overrides) -> LlamaConfig:
    """Byte-level model (~0.8M parameters) the recipe trains on CPU in well under 3 minutes."""
    return dataclasses.replace(LlamaConfig(), **overrides)


def llama_7b(**overrides) -> LlamaConfig:
    """LLaMA-2-7B's shape (32 layers, hidden 4096, SwiGLU 11008, vocab 32000); build it on meta.

    LLaMA-2-7B uses full multi-head attention (32 key/value heads); LLaMA-2-70B and
    LLaMA-3 use grouped-query attention: pass ``num_key_value_heads=8`` for that shape.
    """
    base = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                       rms_norm_eps=1e-5)
    return dataclasses.replace(base, **overrides)
