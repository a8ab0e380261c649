"""The ALIGN family on the optimization ladder (``python -m recipes.ladder align``).

Full size: ALIGN-base's shape, EfficientNet-B7 + BERT-base (175M), at ALIGN's training
resolution of 289 px, 64-token captions, 16 pairs per rank. Depth is the text encoder's (12);
the ConvNet is kept whole at every captured depth, so the extrapolation carries it as a constant.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from recipes.align.model import ALIGN, align_base, align_loss, align_small_cpu
from recipes.data.images import ImageTextBatches
from recipes.ladder import Family, adamw

FULL_ROWS, FULL_PIXELS = 16, 289


def family() -> Family:
    full = align_base()

    def full_model(layers):
        cfg = dataclasses.replace(full, text=dataclasses.replace(full.text, layers=layers)) if layers else full
        return ALIGN(cfg)

    def full_batch():
        return {"pixel_values": torch.zeros(FULL_ROWS, 3, FULL_PIXELS, FULL_PIXELS),
                "input_ids": torch.zeros(FULL_ROWS, full.context_length, dtype=torch.long)}

    return Family(
        name="align", title="ALIGN",
        small_model=lambda: ALIGN(align_small_cpu()),
        small_batches=ImageTextBatches(32).first,
        loss_fn=align_loss, full_model=full_model, full_batch=full_batch,
        full_name=f"ALIGN-base shape: EfficientNet-B7 + BERT-base ({FULL_PIXELS} px, {FULL_ROWS} pairs per rank)",
        full_layers=full.text.layers,
        make_optimizer=adamw(weight_decay=0.05),
        recompute="selective",
        plans_dir=Path(__file__).with_name("plans"))
