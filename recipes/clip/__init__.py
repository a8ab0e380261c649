"""The CLIP recipe: ``python -m recipes.clip [--plan recipes/clip/plans/bf16.yaml] [--model hf]``.

``--model recipe`` trains :class:`recipes.clip.model.CLIP` (ViT + causal text transformer);
``--model hf`` trains transformers' ``CLIPModel`` built from a config of the same size.
Held-out metric: image->text and text->image top-1 retrieval among 64 pairs (chance 1/64).
"""
from __future__ import annotations

from pathlib import Path

from recipes.clip.hf import hf_clip, hf_clip_loss, hf_logits
from recipes.clip.model import CLIP, CLIPConfig, clip_loss, clip_small_cpu, clip_tiny, clip_vit_l14
from recipes.clip.retrieval import contrastive_recipe

PLANS_DIR = Path(__file__).with_name("plans")


def tiny_model():
    return CLIP(clip_tiny())


RECIPE = contrastive_recipe("clip", recipe_model=lambda: CLIP(clip_small_cpu()), hf_model=hf_clip,
                            loss_fn=clip_loss, hf_loss_fn=hf_clip_loss, hf_logits=hf_logits,
                            plans_dir=PLANS_DIR)
evaluate = RECIPE.evaluate

__all__ = ["CLIP", "CLIPConfig", "RECIPE", "clip_loss", "clip_small_cpu", "clip_tiny", "clip_vit_l14",
           "evaluate", "hf_clip", "hf_clip_loss", "tiny_model"]
