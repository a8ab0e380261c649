"""The Flamingo recipe: ``python -m recipes.flamingo [--plan recipes/flamingo/plans/bf16.yaml]``.

Trains the perceiver resampler, the gated cross-attention blocks and the small language model
to caption the procedural images; the vision tower stays frozen. Held-out metrics: the caption
loss with each picture's own image, with another picture's image and with a black image (the
gaps are what the image tells the language model through the cross-attention), and
teacher-forced next-token accuracy with the right and with another picture's image.

The gates start at 0 (Flamingo's rule: the LM begins exactly as itself) and learn at 10x the
base lr. With one lr for all, the small model sat for about 300 steps where the image did not
count (the captions' entropy without it, 0.96 nats) before its cross-attention started to read
it; with the faster gates it starts after about 200, and 400 steps leave it well clear.
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
    # (distinct_heldout: no two pictures share a caption, so the rolled image never fits)
        blank = model(torch.zeros_like(batch["pixel_values"]), ids)  # no image at all
    finally:
        model.train(was_training)
    real = targets != PAD

    def loss(lg):
        return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1), ignore_index=PAD).item()

    def accuracy(lg):
        return ((lg.argmax(-1) == targets) & real).sum().item() / real.sum().item()

    return {"caption_loss": loss(logits), "mismatched_image_loss": loss(wrong), "blank_image_loss": loss(blank),
            "token_accuracy": accuracy(logits), "mismatched_image_accuracy": accuracy(wrong)}


def reads_the_image(after: dict[str, float]) -> str:
    """Whether the captions come from the image: the held-out loss with each picture's own image
    against another picture's."""
    gap = after["mismatched_image_loss"] - after["caption_loss"]
    return (f"caption loss with its own image {after['caption_loss']:.3f}, with another picture's "
            f"{after['mismatched_image_loss']:.3f} ({gap:+.3f} nats), with a black one "
            f"{after['blank_image_loss']:.3f}; next-token accuracy {after['token_accuracy']:.1%} against "
            f"{after['mismatched_image_accuracy']:.1%}: "
            + ("the model reads the image" if gap > 0.1 else "the image does not count yet"))


def tiny_model():
    return Flamingo(flamingo_tiny())


RECIPE = Recipe(
    name="flamingo",
    models={"recipe": lambda: Flamingo(flamingo_small_cpu())},
    loss_fns={"recipe": flamingo_loss},
    evaluate=evaluate,
    plans_dir=PLANS_DIR,
    steps=400,
    lr_scale={"_gate": 10.0},
    headline="caption_loss",
    verdict=reads_the_image,
)

__all__ = ["Flamingo", "FlamingoConfig", "RECIPE", "evaluate", "flamingo_3b", "flamingo_loss",
           "flamingo_small_cpu", "flamingo_tiny", "reads_the_image", "tiny_model"]
