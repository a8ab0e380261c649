"""The ALIGN recipe: ``python -m recipes.align [--plan recipes/align/plans/bf16.yaml] [--model hf]``.

``--model recipe`` trains :class:`recipes.align.model.ALIGN` (EfficientNet-style ConvNet +
BERT-style encoder); ``--model hf`` trains transformers' ``AlignModel`` from a tiny config.
Held-out metric: image->text and text->image top-1 retrieval among 64 pairs (chance 1/64).
"""
from __future__ import annotations

from pathlib import Path

from recipes.align.hf import hf_align, hf_align_loss, hf_logits
from recipes.align.model import ALIGN, ALIGNConfig, align_base, align_loss, align_small_cpu, align_tiny
from recipes.clip.retrieval import contrastive_recipe

PLANS_DIR = Path(__file__).with_name("plans")


def tiny_model():
    return ALIGN(align_tiny())


RECIPE = contrastive_recipe("align", recipe_model=lambda: ALIGN(align_small_cpu()), hf_model=hf_align,
                            loss_fn=align_loss, hf_loss_fn=hf_align_loss, hf_logits=hf_logits,
                            plans_dir=PLANS_DIR)
evaluate = RECIPE.evaluate

__all__ = ["ALIGN", "ALIGNConfig", "RECIPE", "align_base", "align_loss", "align_small_cpu", "align_tiny",
           "evaluate", "hf_align", "hf_align_loss", "tiny_model"]
