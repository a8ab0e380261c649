"""The Flamingo recipe: ``python -m recipes.flamingo [--plan recipes/flamingo/plans/bf16.yaml]``.

Trains the perceiver resampler, the gated cross-attention blocks and the small language model
to caption the procedural images; the vision tower stays frozen. Held-out metrics: the caption
loss with each picture's own image, with another picture's image and with a black image (the
gaps are what the image tells the language model through the cross-attention), and
teacher-forced next-token accuracy.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.clip.train import Recipe
from recipes.data.images import PAD, distinct_heldout
from recipes.flamingo.model import Flamingo, FlamingoConfig, flamingo_3b, flamingo_loss, flamingo_small_cpu, flamingo_tiny

PLANS_DIR = Path(__file__).with_name("plans")
HELDOUT_PAIRS = 64


@torch.no_grad()
def evaluate(model: torch.nn.Module, n: int = HELDOUT_PAIRS) -> dict[str, float]:
    batch = distinct_heldout(n)
    was_training = model.training
    model.eval()
    try:
        ids, targets = batch["input_ids"][:, :-1], batch["input_ids"][:, 1:]
        logits = model(batch["pixel_values"], ids)
        wrong = model(batch["pixel_values"].roll(1, dims=0), ids)   # every caption with another's image
        blank = model(torch.zeros_like(batch["pixel_values"]), ids)  # no image at all
    finally:
        model.train(was_training)
    real = targets != PAD

    def loss(lg):
        return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1), ignore_index=PAD).item()

    return {"caption_loss": loss(logits), "mismatched_image_loss": loss(wrong), "blank_image_loss": loss(blank),
            "token_accuracy": ((logits.argmax(-1) == targets) & real).sum().item() / real.sum().item()}


def tiny_model():
    return Flamingo(flamingo_tiny())


RECIPE = Recipe(
    name="flamingo",
    models={"recipe": lambda: Flamingo(flamingo_small_cpu())},
    loss_fns={"recipe": flamingo_loss},
    evaluate=evaluate,
    plans_dir=PLANS_DIR,
    headline="caption_loss",
)

__all__ = ["Flamingo", "FlamingoConfig", "RECIPE", "evaluate", "flamingo_3b", "flamingo_loss",
           "flamingo_small_cpu", "flamingo_tiny", "tiny_model"]
