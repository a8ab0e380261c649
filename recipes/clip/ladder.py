"""The CLIP family on the optimization ladder (``python -m recipes.ladder clip``).

Full size: CLIP ViT-L/14 (428M) at 224 px, 77-token captions, 32 pairs per rank. Depth is the
vision tower's (24); the text tower keeps its 1 : 2 ratio to it (12 at full size), so the
ladder's linear extrapolation in depth is exact for both towers.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from recipes.clip.model import CLIP, clip_loss, clip_small_cpu, clip_vit_l14
from recipes.data.images import ImageTextBatches
from recipes.ladder import Family, adamw

FULL_ROWS = 32


def _with_depth(cfg, layers):
    if not layers:
        return cfg
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=layers),
                               text=dataclasses.replace(cfg.text, layers=max(1, layers // 2)))


def family() -> Family:
    full = clip_vit_l14()

    def full_batch():
        return {"pixel_values": torch.zeros(FULL_ROWS, 3, full.image_size, full.image_size),
                "input_ids": torch.zeros(FULL_ROWS, full.context_length, dtype=torch.long)}

    return Family(
        name="clip", title="CLIP",
        small_model=lambda: CLIP(clip_small_cpu()),
        small_batches=ImageTextBatches(32).first,
        loss_fn=clip_loss,
        full_model=lambda layers: CLIP(_with_depth(full, layers)),
        full_batch=full_batch,
        full_name=f"CLIP ViT-L/14 (224 px, 77 tokens, {FULL_ROWS} pairs per rank)",
        full_layers=full.vision.layers,
        make_optimizer=adamw(weight_decay=0.05),
        recompute="selective",
        plans_dir=Path(__file__).with_name("plans"))


