"""CLIP (Radford et al., 2021) in plain PyTorch: a ViT image tower, a causal text transformer,
both projected into one embedding space, trained with the symmetric contrastive loss and a
learnable logit scale.

Written to be traced: stable module paths (``vision.layers.{i}.attn.qkv``,
``text.layers.{i}.mlp.fc1``), tensors made in ``forward`` on the input's device, no
data-dependent Python. The logit scale is a 1-element parameter rather than CLIP's 0-dim one;
the maths is the same (it broadcasts), and a 1-element tensor goes through every optimizer
path (transformers' ``CLIPModel`` with its 0-dim ``logit_scale`` is supported by
:func:`recipes.clip.hf.hf_clip`).

The building blocks here (pre-LN transformer block, ViT, text transformer) are shared with the
ALIGN and Flamingo recipes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from recipes.data.images import CAPTION_LEN, EOS, VOCAB_SIZE


@dataclass(frozen=True)
class TowerConfig:
    """One transformer tower: width, depth, heads; MLP width is ``mlp_ratio * width``."""

    width: int
    layers: int
    heads: int
    mlp_ratio: int = 4
    attention: str = "sdpa"          # "sdpa" (fused kernel) or "explicit" (matmul, softmax, matmul)

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width={self.width} is not divisible by heads={self.heads}")
        if self.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention must be 'sdpa' or 'explicit', got {self.attention!r}")


@dataclass(frozen=True)
class CLIPConfig:
    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    vision: TowerConfig = TowerConfig(64, 2, 4)
    vocab_size: int = VOCAB_SIZE
    context_length: int = CAPTION_LEN
    text: TowerConfig = TowerConfig(64, 2, 4)
    embed_dim: int = 64
    init_logit_scale: float = math.log(1 / 0.07)   # CLIP's initial temperature 0.07
    max_logit_scale: float = math.log(100.0)       # CLIP clamps the scale at 100
    eos_token_id: int = EOS                        # the text tower pools this token's features

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class SelfAttention(nn.Module):
    def __init__(self, cfg: TowerConfig, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal, self.explicit = cfg.heads, causal, cfg.attention == "explicit"
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: optional boolean (B, 1, 1, T) of keys that may be attended to."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.explicit:
            y = explicit_attention(q, k, v, causal=self.causal, mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def explicit_attention(q, k, v, *, causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[-2]
        allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


class MLP(nn.Module):
    def __init__(self, width: int, ratio: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, ratio * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block, as in CLIP's towers."""

    def __init__(self, cfg: TowerConfig, causal: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = SelfAttention(cfg, causal)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg.width, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """ViT: conv patch embedding, class token, learned positions, pre-LN blocks."""

    def __init__(self, cfg: CLIPConfig) -> None:
        super().__init__()
        w = cfg.vision.width
        self.patch_embed = nn.Conv2d(cfg.channels, w, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.cls_token = nn.Parameter(torch.randn(1, 1, w) * w ** -0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.num_patches + 1, w) * 0.02)
        self.ln_pre = nn.LayerNorm(w)
        self.layers = nn.ModuleList(Block(cfg.vision) for _ in range(cfg.vision.layers))
        self.ln_post = nn.LayerNorm(w)

    def tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Every position's final features (B, 1 + patches, width): the class token first."""
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.ln_pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.ln_post(x)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.tokens(pixel_values)[:, 0]


class TextTransformer(nn.Module):
    """Causal text transformer pooled at the end-of-text token (CLIP's text tower)."""

    def __init__(self, cfg: CLIPConfig) -> None:
        super().__init__()
        w = cfg.text.width
        self.eos_token_id = cfg.eos_token_id
        self.token_embed = nn.Embedding(cfg.vocab_size, w)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.context_length, w) * 0.01)
        self.layers = nn.ModuleList(Block(cfg.text, causal=True) for _ in range(cfg.text.layers))
        self.ln_final = nn.LayerNorm(w)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embed(input_ids) + self.pos_embed[:, : input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = self.ln_final(x)
        # Pool the first end-of-text token: a one-hot weighted sum (no data-dependent indexing).
        is_eos = (input_ids == self.eos_token_id).to(x.dtype)
        first = is_eos * (is_eos.cumsum(dim=1) == 1).to(x.dtype)
        return (first.unsqueeze(-1) * x).sum(dim=1)


class CLIP(nn.Module):
    def __init__(self, cfg: CLIPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg)
        self.text = TextTransformer(cfg)
        self.visual_projection = nn.Linear(cfg.vision.width, cfg.embed_dim, bias=False)
        self.text_projection = nn.Linear(cfg.text.width, cfg.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.full((1,), cfg.init_logit_scale))

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.visual_projection(self.vision(pixel_values)), dim=-1)

    def encode_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text_projection(self.text(input_ids)), dim=-1)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Image-to-text logits (B_images, B_texts), scaled by the clamped learnable scale."""
        scale = self.logit_scale.clamp(max=self.cfg.max_logit_scale).exp()
        return scale * self.encode_image(pixel_values) @ self.encode_text(input_ids).t()


def contrastive_loss(logits_per_image: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Symmetric InfoNCE: each image's own caption among the batch's, and each caption's image."""
    labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    return 0.5 * (F.cross_entropy(logits_per_image, labels, label_smoothing=label_smoothing)
                  + F.cross_entropy(logits_per_image.t(), labels, label_smoothing=label_smoothing))


def clip_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return contrastive_loss(model(batch["pixel_values"], batch["input_ids"]))


# -- configurations --------------------------------------------------------------------------

def clip_tiny(**overrides) -> CLIPConfig:
    """For tests: 2 + 2 layers of width 32."""
    base = CLIPConfig(vision=TowerConfig(32, 2, 4), text=TowerConfig(32, 2, 4), embed_dim=32)
    return dataclasses.replace(base, **overrides)


def clip_small_cpu(**overrides) -> CLIPConfig:
    """The recipe's model: trains on the procedural images in well under 3 minutes on 2 cores."""
    return dataclasses.replace(CLIPConfig(), **overrides)


def clip_vit_l14(**overrides) -> CLIPConfig:
    """CLIP ViT-L/14 at 224 px (428M parameters): for estimates; build it on meta."""
    base = CLIPConfig(image_size=224, patch_size=14, vision=TowerConfig(1024, 24, 16),
                      vocab_size=49408, context_length=77, text=TowerConfig(768, 12, 12), embed_dim=768,
                      eos_token_id=49407)
    return dataclasses.replace(base, **overrides)
