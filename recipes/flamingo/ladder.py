"""The Flamingo family on the optimization ladder (``python -m recipes.ladder flamingo``).

Full size: Flamingo-3B's shape (:func:`recipes.flamingo.model.flamingo_3b`): a frozen ViT-L/14,
a 6-layer resampler with 64 latents, a frozen 24-layer d2048 LM with a gated cross-attention
block before every layer; 8 captions of 256 tokens per rank. Depth is the LM's; the vision
tower keeps the same depth (24 at full size), the resampler stays at 6 layers.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from recipes.data.images import ImageTextBatches
from recipes.flamingo.model import Flamingo, flamingo_3b, flamingo_loss, flamingo_small_cpu
from recipes.ladder import Family, adamw

FULL_ROWS = 8


def family() -> Family:
    full = flamingo_3b()

    def full_model(layers):
        if not layers:
            return Flamingo(full)
        vision = dataclasses.replace(full.vision, vision=dataclasses.replace(full.vision.vision, layers=layers))
        return Flamingo(dataclasses.replace(full, vision=vision, lm=dataclasses.replace(full.lm, layers=layers)))

    def full_batch():
        size = full.vision.image_size
        return {"pixel_values": torch.zeros(FULL_ROWS, 3, size, size),
                "input_ids": torch.zeros(FULL_ROWS, full.context_length + 1, dtype=torch.long)}

    return Family(
        name="flamingo", title="Flamingo",
        small_model=lambda: Flamingo(flamingo_small_cpu()),
        small_batches=ImageTextBatches(32).first,
        loss_fn=flamingo_loss, full_model=full_model, full_batch=full_batch,
        full_name=f"Flamingo-3B shape (frozen ViT-L/14 and 24 x 2048 LM, {FULL_ROWS} x 256 tokens per rank)",
        full_layers=full.lm.layers,
        make_optimizer=adamw(weight_decay=0.05, trainable_only=True),
        recompute="selective",
        plans_dir=Path(__file__).with_name("plans"))
