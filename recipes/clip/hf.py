"""The same recipe on transformers' ``CLIPModel``, built from a config (nothing is downloaded).

A user's own CLIP goes through the compiler unchanged: its loss is transformers' own
(``return_loss=True``), its ``logit_scale`` is the 0-dim parameter CLIP ships with, and its
attention is SDPA. The captions carry no ``attention_mask``: the text tower is causal and
pools the first end-of-text token, so the padding after it is never read.
"""
from __future__ import annotations

import torch

from recipes.data.images import BOS, CAPTION_LEN, EOS, PAD, VOCAB_SIZE


def hf_clip_config(width: int = 64, layers: int = 2, heads: int = 4, embed_dim: int = 64,
                   image_size: int = 32, patch_size: int = 8):
    from transformers import CLIPConfig

    tower = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                 num_attention_heads=heads)
    text = dict(tower, vocab_size=VOCAB_SIZE, max_position_embeddings=CAPTION_LEN,
                eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD)
    vision = dict(tower, image_size=image_size, patch_size=patch_size)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=embed_dim)


def hf_clip(**config) -> torch.nn.Module:
    from transformers import CLIPModel

    return CLIPModel(hf_clip_config(**config))


def hf_clip_tiny() -> torch.nn.Module:
    return hf_clip(width=32, embed_dim=32)


def hf_clip_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], return_loss=True).loss


def hf_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits_per_image
