"""ALIGN (Jia et al., 2021) in plain PyTorch: an EfficientNet-style ConvNet image encoder and a
BERT-style text encoder, contrastive, with a learnable temperature and label smoothing.

The image encoder is EfficientNet's shape: a strided stem, MBConv blocks (1x1 expansion,
depthwise conv, squeeze-and-excitation, 1x1 projection, BatchNorm and SiLU throughout,
residual where the shape allows), a 1x1 head. One change: the final feature map is
flattened into the embedding instead of average-pooled, because these captions name where
things are (``top left``) and global average pooling throws position away.

The text encoder is BERT: word + position embeddings, LayerNorm, post-LN bidirectional
blocks with padding masked out of attention, the first token (``<bos>``, BERT's [CLS]) pooled
and projected.

transformers' own ``AlignModel`` is trained by the same recipe too (``recipes.align.hf``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from recipes.clip.model import MLP, SelfAttention, TowerConfig, contrastive_loss
from recipes.data.images import CAPTION_LEN, PAD, VOCAB_SIZE


@dataclass(frozen=True)
class MBConvStage:
    expand: int        # expansion ratio of the 1x1 conv (1: none)
    kernel: int
    stride: int
    channels: int
    repeats: int


@dataclass(frozen=True)
class ALIGNConfig:
    image_size: int = 32
    channels: int = 3
    stem_channels: int = 16
    stages: tuple[MBConvStage, ...] = (MBConvStage(1, 3, 1, 16, 1), MBConvStage(4, 3, 2, 24, 1),
                                       MBConvStage(4, 3, 2, 32, 1))
    head_channels: int = 32
    pool: str = "flatten"                # "flatten" (keeps where things are) or "mean" (EfficientNet's)
    se_ratio: float = 0.25
    vocab_size: int = VOCAB_SIZE
    context_length: int = CAPTION_LEN
    text: TowerConfig = TowerConfig(64, 2, 4)
    embed_dim: int = 64
    init_temperature: float = 0.1
    label_smoothing: float = 0.1         # ALIGN's

    def __post_init__(self) -> None:
        if self.pool not in ("flatten", "mean"):
            raise ValueError(f"pool must be 'flatten' or 'mean', got {self.pool!r}")

    @property
    def feature_size(self) -> int:
        """Side of the final feature map: the stem and every stage's first block may stride."""
        side = math.ceil(self.image_size / 2)
        for stage in self.stages:
            side = math.ceil(side / stage.stride)
        return side


class ConvBNAct(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True):
        super().__init__(nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out), nn.SiLU() if act else nn.Identity())


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean(dim=(2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(s))))


class MBConv(nn.Module):
    def __init__(self, c_in: int, c_out: int, expand: int, kernel: int, stride: int, se_ratio: float) -> None:
        super().__init__()
        hidden = c_in * expand
        self.expand = ConvBNAct(c_in, hidden, 1) if expand != 1 else nn.Identity()
        self.depthwise = ConvBNAct(hidden, hidden, kernel, stride, groups=hidden)
        self.se = SqueezeExcite(hidden, max(1, int(c_in * se_ratio)))
        self.project = ConvBNAct(hidden, c_out, 1, act=False)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class ConvNetEncoder(nn.Module):
    def __init__(self, cfg: ALIGNConfig) -> None:
        super().__init__()
        self.stem = ConvBNAct(cfg.channels, cfg.stem_channels, 3, stride=2)
        blocks, c = [], cfg.stem_channels
        for stage in cfg.stages:
            for r in range(stage.repeats):
                blocks.append(MBConv(c, stage.channels, stage.expand, stage.kernel,
                                     stage.stride if r == 0 else 1, cfg.se_ratio))
                c = stage.channels
        self.blocks = nn.Sequential(*blocks)
        self.head = ConvBNAct(c, cfg.head_channels, 1)
        self.pool = cfg.pool
        pooled = cfg.head_channels * (cfg.feature_size ** 2 if cfg.pool == "flatten" else 1)
        self.proj = nn.Linear(pooled, cfg.embed_dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.head(self.blocks(self.stem(pixel_values)))
        pooled = features.flatten(1) if self.pool == "flatten" else features.mean(dim=(2, 3))
        return self.proj(pooled)


class PostLNBlock(nn.Module):
    """BERT's block: attention and MLP each followed by a residual LayerNorm."""

    def __init__(self, cfg: TowerConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg, causal=False)
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg.width, cfg.mlp_ratio)
        self.ln_2 = nn.LayerNorm(cfg.width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x, mask))
        return self.ln_2(x + self.mlp(x))


class BertEncoder(nn.Module):
    def __init__(self, cfg: ALIGNConfig) -> None:
        super().__init__()
        w = cfg.text.width
        self.word_embed = nn.Embedding(cfg.vocab_size, w)
        self.pos_embed = nn.Embedding(cfg.context_length, w)
        self.ln_embed = nn.LayerNorm(w)
        self.layers = nn.ModuleList(PostLNBlock(cfg.text) for _ in range(cfg.text.layers))
        self.proj = nn.Linear(w, cfg.embed_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.ln_embed(self.word_embed(input_ids) + self.pos_embed(positions))
        keys = (input_ids != PAD)[:, None, None, :]         # padding is never attended to
        for layer in self.layers:
            x = layer(x, keys)
        return self.proj(x[:, 0])


class ALIGN(nn.Module):
    def __init__(self, cfg: ALIGNConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = ConvNetEncoder(cfg)
        self.text = BertEncoder(cfg)
        # 1-element rather than 0-dim: the same maths, and every optimizer path takes it.
        self.temperature = nn.Parameter(torch.full((1,), cfg.init_temperature))

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        image = F.normalize(self.vision(pixel_values), dim=-1)
        text = F.normalize(self.text(input_ids), dim=-1)
        return image @ text.t() / self.temperature


def align_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["pixel_values"], batch["input_ids"])
    return contrastive_loss(logits, label_smoothing=model.cfg.label_smoothing)


# -- configurations --------------------------------------------------------------------------

def align_tiny(**overrides) -> ALIGNConfig:
    base = ALIGNConfig(stem_channels=8, stages=(MBConvStage(1, 3, 1, 8, 1), MBConvStage(4, 3, 2, 16, 1),
                                                MBConvStage(4, 3, 2, 16, 1)),
                       head_channels=16, text=TowerConfig(32, 2, 4), embed_dim=32)
    return dataclasses.replace(base, **overrides)


def align_small_cpu(**overrides) -> ALIGNConfig:
    """The recipe's model: narrow stages (depthwise convolutions are slow on CPU)."""
    base = ALIGNConfig(stem_channels=8, stages=(MBConvStage(1, 3, 1, 8, 1), MBConvStage(3, 3, 2, 16, 1),
                                                MBConvStage(3, 3, 2, 24, 1)), head_channels=32)
    return dataclasses.replace(base, **overrides)


def _round_channels(c: int, width: float, divisor: int = 8) -> int:
    scaled = c * width
    new = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    return int(new + divisor) if new < 0.9 * scaled else int(new)


def align_base(**overrides) -> ALIGNConfig:
    """ALIGN-base's shape: EfficientNet-B7 (width 2.0, depth 3.1, 600 px) + BERT-base, 640-d.

    For estimates; build it on meta. Average-pooled, as ALIGN is.
    """
    b0 = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
    stages = tuple(MBConvStage(e, k, s, _round_channels(c, 2.0), math.ceil(r * 3.1)) for e, k, s, c, r in b0)
    base = ALIGNConfig(image_size=600, stem_channels=_round_channels(32, 2.0), stages=stages,
                       head_channels=_round_channels(1280, 2.0), pool="mean", vocab_size=30522, context_length=64,
                       text=TowerConfig(768, 12, 12), embed_dim=640)
    return dataclasses.replace(base, **overrides)
