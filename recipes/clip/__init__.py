"""The CLIP recipe: ``python -m recipes.clip [--plan recipes/clip/plans/bf16.yaml] [--model hf]``.

``--model recipe`` trains :class:`recipes.clip.model.CLIP` (ViT + causal text transformer);
``--model hf`` trains transformers' ``CLIPModel`` built from a config of the same size.
Held-out metric: image->text and text->image top-1 retrieval among 64 pairs (chance 1/64).
"""
from __future__ import annotations

from pathlib import Path

from recipes.clip.hf import hf_clip, hf_clip_loss, hf_logits
from recipes.clip.model import CLIP, CLIPConfig, clip_loss, clip_small_cpu, clip_tiny, clip_vit_l14
from recipes.clip.retrieval import HELDOUT_PAIRS, retrieval_accuracy
from recipes.clip.train import Recipe

PLANS_DIR = Path(__file__).with_name("plans")


def _logits(model, batch):
    return model(batch["pixel_values"], batch["input_ids"])


def tiny_model():
    return CLIP(clip_tiny())


def evaluate(model):
    return retrieval_accuracy(model, hf_logits if hasattr(model, "get_text_features") else _logits)


RECIPE = Recipe(
    name="clip",
    models={"recipe": lambda: CLIP(clip_small_cpu()), "hf": hf_clip},
    loss_fns={"recipe": clip_loss, "hf": hf_clip_loss},
    evaluate=evaluate,
    plans_dir=PLANS_DIR,
    headline=f"image_to_text (chance {1 / HELDOUT_PAIRS:.3f})",
)

__all__ = ["CLIP", "CLIPConfig", "RECIPE", "clip_loss", "clip_small_cpu", "clip_tiny", "clip_vit_l14",
           "evaluate", "hf_clip", "hf_clip_loss", "tiny_model"]
