"""A Flamingo-shaped captioner (Alayrac et al., 2022) in plain PyTorch.

- a **frozen vision encoder** (the CLIP recipe's ViT; ``requires_grad=False``, so the
  optimizer never sees it and backward stops at its output);
- a **perceiver resampler**: a fixed number of learned latents cross-attend to the image's
  patch features (keys and values are the features and the latents together), giving the
  language model the same number of visual tokens for any image size;
- a causal **language model** with a **gated cross-attention block** before every
  ``cross_every``-th layer: text attends to the visual tokens, and the result enters the
  residual stream through ``tanh(gate)`` with the gate starting at 0, so at initialisation the
  language model is exactly itself;
- the loss is next-token cross-entropy on the caption, conditioned on the image.

Flamingo freezes a pretrained language model as well. No pretrained weights are available
here, so the recipe's small LM trains from scratch (``train_lm=True``); the full-size shape
(:func:`flamingo_3b`) freezes it, as Flamingo does, so its trainable set is Flamingo's: the
resampler and the gated cross-attention blocks. One image per caption: no media-position
masking or time embeddings are needed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from recipes.clip.model import MLP, Block, CLIPConfig, TowerConfig, VisionTransformer, explicit_attention
from recipes.data.images import CAPTION_LEN, PAD, VOCAB_SIZE


@dataclass(frozen=True)
class FlamingoConfig:
    vision: CLIPConfig = CLIPConfig()          # the vision tower (its text part is unused)
    num_latents: int = 8
    resampler_layers: int = 2
    resampler_heads: int = 4
    vocab_size: int = VOCAB_SIZE
    context_length: int = CAPTION_LEN
    lm: TowerConfig = TowerConfig(64, 2, 4)
    cross_every: int = 1                       # a gated cross-attention block before every n-th LM layer
    cross_heads: int = 4
    train_lm: bool = True                      # Flamingo freezes a pretrained LM; see the module doc
    gate_init: float = 0.0                     # Flamingo's: the LM starts exactly as itself

    def __post_init__(self) -> None:
        if self.cross_every < 1:
            raise ValueError(f"cross_every must be >= 1, got {self.cross_every}")
        for name, width, heads in (("resampler", self.vision.vision.width, self.resampler_heads),
                                   ("cross-attention", self.lm.width, self.cross_heads)):
            if width % heads:
                raise ValueError(f"{name} width {width} is not divisible by its {heads} heads")


class CrossAttention(nn.Module):
    """Queries from ``x``, keys and values from ``context`` (another width allowed)."""

    def __init__(self, width: int, context_width: int, heads: int, explicit: bool = False) -> None:
        super().__init__()
        self.heads, self.explicit = heads, explicit
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(context_width, 2 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        q = self.q(x).view(b, t, h, c // h).transpose(1, 2)
        k, v = self.kv(context).view(b, context.shape[1], 2, h, c // h).permute(2, 0, 3, 1, 4)
        y = explicit_attention(q, k, v) if self.explicit else F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class PerceiverLayer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_media = nn.LayerNorm(width)
        self.ln_latents = nn.LayerNorm(width)
        self.attn = CrossAttention(width, width, heads)
        self.ln_ff = nn.LayerNorm(width)
        self.ff = MLP(width, 4)

    def forward(self, latents: torch.Tensor, media: torch.Tensor) -> torch.Tensor:
        q = self.ln_latents(latents)
        latents = latents + self.attn(q, torch.cat([self.ln_media(media), q], dim=1))
        return latents + self.ff(self.ln_ff(latents))


class PerceiverResampler(nn.Module):
    def __init__(self, width: int, num_latents: int, layers: int, heads: int) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, width) * 0.02)
        self.layers = nn.ModuleList(PerceiverLayer(width, heads) for _ in range(layers))
        self.ln_out = nn.LayerNorm(width)

    def forward(self, media: torch.Tensor) -> torch.Tensor:
        latents = self.latents.expand(media.shape[0], -1, -1)
        for layer in self.layers:
            latents = layer(latents, media)
        return self.ln_out(latents)


class GatedCrossAttentionBlock(nn.Module):
    """Flamingo's GATED XATTN-DENSE: tanh-gated cross-attention and feed-forward, gates at 0."""

    def __init__(self, width: int, media_width: int, heads: int, gate_init: float = 0.0) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(width)
        self.attn = CrossAttention(width, media_width, heads)
        self.attn_gate = nn.Parameter(torch.full((1,), gate_init))
        self.ln_ff = nn.LayerNorm(width)
        self.ff = MLP(width, 4)
        self.ff_gate = nn.Parameter(torch.full((1,), gate_init))

    def forward(self, x: torch.Tensor, media: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn_gate) * self.attn(self.ln_attn(x), media)
        return x + torch.tanh(self.ff_gate) * self.ff(self.ln_ff(x))


class LMLayer(nn.Module):
    """One language-model layer, with its gated cross-attention block in front when it has one."""

    def __init__(self, cfg: FlamingoConfig, cross: bool) -> None:
        super().__init__()
        self.xattn = GatedCrossAttentionBlock(cfg.lm.width, cfg.vision.vision.width, cfg.cross_heads,
                                              cfg.gate_init) if cross else None
        self.block = Block(cfg.lm, causal=True)

    def forward(self, x: torch.Tensor, media: torch.Tensor) -> torch.Tensor:
        if self.xattn is not None:
            x = self.xattn(x, media)
        return self.block(x)


class Flamingo(nn.Module):
    def __init__(self, cfg: FlamingoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg.vision)
        self.vision.requires_grad_(False)          # frozen, as in Flamingo
        self.resampler = PerceiverResampler(cfg.vision.vision.width, cfg.num_latents, cfg.resampler_layers,
                                            cfg.resampler_heads)
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.lm.width)
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.context_length, cfg.lm.width) * 0.01)
        self.layers = nn.ModuleList(LMLayer(cfg, cross=i % cfg.cross_every == 0) for i in range(cfg.lm.layers))
        self.ln_final = nn.LayerNorm(cfg.lm.width)
        self.lm_head = nn.Linear(cfg.lm.width, cfg.vocab_size, bias=False)
        if not cfg.train_lm:
            for module in (self.token_embed, self.ln_final, self.lm_head, *(l.block for l in self.layers)):
                module.requires_grad_(False)
            self.pos_embed.requires_grad_(False)

    def visual_tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.resampler(self.vision.tokens(pixel_values))

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, T, vocab) for each caption position, given its image."""
        media = self.visual_tokens(pixel_values)
        x = self.token_embed(input_ids) + self.pos_embed[:, : input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x, media)
        return self.lm_head(self.ln_final(x))


def flamingo_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the caption tokens (bos excluded, eos included)."""
    ids = batch["input_ids"]
    logits = model(batch["pixel_values"], ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), ignore_index=PAD)


# -- configurations --------------------------------------------------------------------------

def flamingo_tiny(**overrides) -> FlamingoConfig:
    vision = CLIPConfig(vision=TowerConfig(32, 1, 4))
    base = FlamingoConfig(vision=vision, num_latents=4, resampler_layers=1, lm=TowerConfig(32, 2, 4))
    return dataclasses.replace(base, **overrides)


def flamingo_small_cpu(**overrides) -> FlamingoConfig:
    return dataclasses.replace(FlamingoConfig(), **overrides)


def flamingo_3b(**overrides) -> FlamingoConfig:
    """Flamingo-3B's shape (for estimates; build it on meta): a frozen ViT-L/14 vision tower
    (as OpenFlamingo; Flamingo used NFNet-F6), a 6-layer resampler with 64 latents, a frozen
    24-layer d2048 language model with a gated cross-attention block before every layer."""
    from recipes.clip.model import clip_vit_l14

    base = FlamingoConfig(vision=clip_vit_l14(), num_latents=64, resampler_layers=6, resampler_heads=16,
                          vocab_size=32000, context_length=256, lm=TowerConfig(2048, 24, 16),
                          cross_every=1, cross_heads=16, train_lm=False)
    return dataclasses.replace(base, **overrides)

