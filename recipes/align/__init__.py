"""The ALIGN recipe: ``python -m recipes.align [--plan recipes/align/plans/bf16.yaml] [--model hf]``.

``--model recipe`` trains :class:`recipes.align.model.ALIGN` (EfficientNet-style ConvNet +
BERT-style encoder); ``--model hf`` trains transformers' ``AlignModel`` from a tiny config.
Held-out metric: image->text and text->image top-1 retrieval among 64 pairs (chance 1/64).
"""
from __future__ import annotations

from pathlib import Path

from recipes.align.hf import hf_align, hf_align_loss, hf_logits
from recipes.align.model import ALIGN, ALIGNConfig, align_base, align_loss, align_small_cpu, align_tiny
from recipes.clip.retrieval import HELDOUT_PAIRS, retrieval_accuracy
from recipes.clip.train import Recipe

PLANS_DIR = Path(__file__).with_name("plans")


def _logits(model, batch):
    return model(batch["pixel_values"], batch["input_ids"])


def evaluate(model):
    return retrieval_accuracy(model, hf_logits if hasattr(model, "get_text_features") else _logits)


def tiny_model():
    return ALIGN(align_tiny())


RECIPE = Recipe(
    name="align",
    models={"recipe": lambda: ALIGN(align_small_cpu()), "hf": hf_align},
    loss_fns={"recipe": align_loss, "hf": hf_align_loss},
    evaluate=evaluate,
    plans_dir=PLANS_DIR,
    headline=f"image_to_text (chance {1 / HELDOUT_PAIRS:.3f})",
)

__all__ = ["ALIGN", "ALIGNConfig", "RECIPE", "align_base", "align_loss", "align_small_cpu", "align_tiny",
           "evaluate", "hf_align", "hf_align_loss", "tiny_model"]
