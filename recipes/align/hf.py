"""The ALIGN recipe on transformers' ``AlignModel`` built from a config (nothing is downloaded).

``AlignModel`` is EfficientNet + BERT with transformers' own contrastive loss
(``return_loss=True``) and its 0-dim learnable ``temperature``. It averages the image
features (no position in the embedding), so on these captions it reaches lower retrieval
accuracy than the recipe's own model; it is here to show a user's ALIGN compiles and trains.
Its EfficientNet has many small ops: a step is slow on this CPU, so the tiny config is used.
"""
from __future__ import annotations

import torch

from recipes.data.images import CAPTION_LEN, PAD, VOCAB_SIZE


def hf_align_config(width: int = 32, layers: int = 2, heads: int = 4, embed_dim: int = 32,
                    dropout: bool = True):
    """``dropout=False`` turns off every dropout and drop-connect (for comparisons with eager)."""
    from transformers import AlignConfig

    text = dict(vocab_size=VOCAB_SIZE, hidden_size=width, intermediate_size=4 * width,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=CAPTION_LEN,
                pad_token_id=PAD)
    vision = dict(image_size=32, num_channels=3, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=64)
    if not dropout:
        text.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        vision.update(dropout_rate=0.0, drop_connect_rate=0.0)
    return AlignConfig(text_config=text, vision_config=vision, projection_dim=embed_dim)


def hf_align(**config) -> torch.nn.Module:
    from transformers import AlignModel

    return AlignModel(hf_align_config(**config))


def _mask(batch):
    return (batch["input_ids"] != PAD).long()


def hf_align_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=_mask(batch), pixel_values=batch["pixel_values"],
                 return_loss=True).loss


def hf_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=_mask(batch),
                 pixel_values=batch["pixel_values"]).logits_per_image
